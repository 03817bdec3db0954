"""vLLM outputs -> mask fields (SamplingMask.from_vllm). vLLM is not imported: its objects are
read by duck typing.

Accepted, alone or in a list (one entry per request, in order):
  - `RequestOutput`-like objects: `.request_id`, `.outputs` = `CompletionOutput`-like objects with
    `.index`, `.token_ids`, `.logprobs` (per position a dict token id -> Logprob or float) and
    `.sampling_mask` (a list of id lists, or an object whose `.token_ids` is one, optionally with
    `.logprobs`: the log-prob of every mask id, rows like the ids), or `.sampling_support` (mask_replay's
    vLLM plugin: adapters/vllm_support.py);
  - `CompletionOutput`-like objects on their own (one request each);
  - the JSON of vLLM's token-in/token-out `/inference/v1/generate` (and of the OpenAI-compatible
    endpoints that carry the same fields): `{"request_id", "choices": [{"index", "token_ids",
    "logprobs": {"content": [{"logprob": ...}, ...]}, "sampling_mask": [[...], ...],
    "sampling_mask_logprobs": [[...], ...]}]}`, or a choice's `sampling_support` (the plugin's JSON).
Field shapes and where they were read: docs/formats.md, "Engine outputs".
"""
from __future__ import annotations

from typing import Any, Optional

from mask_replay.errors import EngineOutputError
from mask_replay.mask import adapter
from mask_replay.sampler.adapters.common import Completion, as_list, build_mask, get, has
from mask_replay.sampler.adapters.vllm_support import FIELD as SUPPORT_FIELD
from mask_replay.sampler.adapters.vllm_support import support_rows


@adapter("from_vllm")
def mask_from_vllm(outputs: Any, *, temperature: Optional[float] = None, step: Optional[int] = None,
              vocab_size: Optional[int] = None):
    """One mask row per generated token: requests in the order given, completions by `index`,
    tokens in order. `logprobs` is the sampled token's log-prob over its mask (see
    adapters.common.build_mask); `temperature` and `step`, which vLLM does not echo, are recorded
    for every row when given; `vocab_size` checks the ids."""
    completions = []
    for r, request in enumerate(_requests(outputs)):
        completions.extend(_completions(request, r))
    return build_mask(completions, engine="vllm", temperature=temperature, step=step, vocab_size=vocab_size)


def _requests(outputs):
    if isinstance(outputs, (list, tuple)):
        return list(outputs)
    return [outputs]


def _is_completion(obj) -> bool:
    return has(obj, "token_ids") and not has(obj, "choices") and not has(obj, "outputs")


def _completions(request, r: int) -> list:
    rid = get(request, "request_id")
    name = f"request {r}" + (f" (id {rid!r})" if rid is not None else "")
    if _is_completion(request):
        choices = [request]
    elif has(request, "choices"):
        choices = get(request, "choices")
    elif has(request, "outputs"):
        choices = get(request, "outputs")
    else:
        raise EngineOutputError(f"{name}: neither a vLLM RequestOutput (outputs), a CompletionOutput "
                                f"(token_ids) nor a generate response (choices): {type(request).__name__}")
    if choices is None:  # a response without completions is not an empty one: rows would go missing silently
        raise EngineOutputError(f"{name}: choices is null, expected a list of completions")
    choices = as_list(choices, f"{name}: choices")
    indexed = []
    for j, ch in enumerate(choices):
        if ch is None or isinstance(ch, (bool, int, float, str, list, tuple)):
            raise EngineOutputError(f"{name} choice at position {j}: {ch!r} is not a completion (an object with "
                                    "token_ids)")
        idx = get(ch, "index", j)
        if type(idx) is not int:
            raise EngineOutputError(f"{name} choice at position {j}: index {idx!r} is not an integer")
        indexed.append((idx, ch))
    indexed.sort(key=lambda p: p[0])
    for (a, _), (b, _) in zip(indexed, indexed[1:]):
        if a == b:
            raise EngineOutputError(f"{name}: two choices have index {a}")
    return [_completion(ch, f"{name} choice {idx}", [rid if rid is not None else r, idx]) for idx, ch in indexed]


def _completion(ch, label: str, key: list) -> Completion:
    tokens = get(ch, "token_ids")
    if tokens is not None:
        tokens = as_list(tokens, f"{label}: token_ids")
    mask = get(ch, "sampling_mask")
    rows, entry_lp = None, get(ch, "sampling_mask_logprobs")
    support = get(ch, SUPPORT_FIELD)
    if support is not None and mask is None:  # mask_replay's vLLM plugin
        rows = support_rows(support, label)
    elif mask is not None:
        if isinstance(mask, (list, tuple)):
            rows = mask
        elif has(mask, "token_ids"):  # vllm.outputs.SamplingMask (or its JSON)
            rows = get(mask, "token_ids")
            if entry_lp is None:
                entry_lp = get(mask, "logprobs")
        else:
            raise EngineOutputError(f"{label}: sampling_mask is a {type(mask).__name__}, expected a list of id "
                                    "lists or an object with token_ids")
    return Completion(label, tokens, rows, _token_logprobs(get(ch, "logprobs"), tokens, label), entry_lp, key)


def _token_logprobs(lp, tokens, label: str):
    """The generated token's log-prob at each position, from either logprobs layout."""
    if lp is None:
        return None
    if isinstance(lp, dict):  # OpenAI-compatible JSON
        if lp.get("content") is not None:  # chat layout (the generate endpoint uses it too)
            content = as_list(lp["content"], f"{label}: logprobs.content")
            out = []
            for t, entry in enumerate(content):
                if not isinstance(entry, dict) or "logprob" not in entry:
                    raise EngineOutputError(f"{label} token {t}: logprobs.content entry has no 'logprob'")
                out.append(entry["logprob"])
            return out
        if lp.get("token_logprobs") is not None:  # completions layout
            return as_list(lp["token_logprobs"], f"{label}: logprobs.token_logprobs")
        raise EngineOutputError(f"{label}: logprobs has neither 'content' nor 'token_logprobs'")
    # offline API: per position a dict {token id: Logprob(logprob=...)} holding the sampled token
    if isinstance(lp, (bool, int, float, str, bytes)) or not hasattr(lp, "__iter__"):
        raise EngineOutputError(f"{label}: logprobs is {lp!r}, expected per-token log-probs (a list, or an object "
                                "with 'content' or 'token_logprobs')")
    positions = list(lp) if not isinstance(lp, list) else lp
    tokens = tokens or []
    if len(positions) != len(tokens):
        raise EngineOutputError(f"{label}: {len(positions)} logprobs positions for {len(tokens)} generated tokens")
    out = []
    for t, (pos, tok) in enumerate(zip(positions, tokens)):
        if not hasattr(pos, "get") or pos.get(tok) is None:
            raise EngineOutputError(f"{label} token {t}: logprobs hold no entry for the generated token {tok!r}")
        entry = pos.get(tok)
        out.append(entry if isinstance(entry, (int, float)) else getattr(entry, "logprob", entry))
    return out
