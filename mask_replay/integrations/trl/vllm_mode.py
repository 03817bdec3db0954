"""ReplayGRPOTrainer's vLLM mode: the support of every completion token, from TRL's vLLM engine.

Checked against trl 1.16.0, generation/vllm_generation.py (`VLLMGeneration`) and vllm_client.py
(`VLLMClient.generate`: the server's `/v1/completions`, choices prompt-major). Where the supports come
from, chosen once at construction (`configure_engine`):

1. mask_replay's vLLM plugin (`integrations/vllm_support`, MASK_REPLAY_VLLM_SUPPORT=1 where vLLM starts):
   colocate mode when the plugin is installed in this process (the engine is built here), server mode
   when a one-token probe of the server comes back with `sampling_support`. TRL asks for what it asks
   anyway (logprobs=0); each completion's rows are read off the engine's outputs (colocate) or off the
   server's choices, which the main process broadcasts with TRL's own broadcast of the completions.
2. Otherwise, vLLM's processed log-probs with N = top_k + 1 (or `top_k_cap` + 1, that top_k added to the
   sampling): the finite entries are the support (`mask_from_trl_vllm`, whose guard refuses a row that
   may be cut off), TRL's sampling log-prob handed the sampled token's entry. Top-p / min-p alone would
   need N = V log-prob objects per token: refused at construction with the fix, as is an N above the
   engine's `max_logprobs`.
vLLM builds that return their own `sampling_mask` (Model Runner V2) are read from the same outputs.
Nothing is recomputed on the trainer side.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from accelerate.utils import broadcast_object_list

from mask_replay.errors import EngineOutputError, InputError
from mask_replay.integrations import vllm_support
from mask_replay.integrations.trl.shadow import shadowed
from mask_replay.mask import SamplingMask
from mask_replay.sampler.adapters.vllm import mask_from_vllm
from mask_replay.sampler.adapters.vllm_logprobs import VllmLogprobsSettings, mask_from_trl_vllm, vllm_logprobs_settings
from mask_replay.sampler.adapters.vllm_support import FIELD as SUPPORT_FIELD

__all__ = ["EngineSupport", "configure_engine", "recording", "sampled_first", "single_id_rows_zero", "PLUGIN",
           "LOGPROBS"]

PLUGIN, LOGPROBS = "plugin", "processed_logprobs"
_SET_BY_REPLAY = {"top_k", "top_p", "min_p", "logprobs", "logprobs_mode"}  # temperature: trainer.py's rule
_PLUGIN_FIX = (f"turn on mask_replay's vLLM plugin ({vllm_support.ENV}=1 in the environment that starts vLLM: this "
               "process for colocate mode, the server's for server mode)")


@dataclass
class EngineSupport:
    """Where replay reads the supports: PLUGIN, or LOGPROBS with the settings the engine was asked for."""

    source: str
    settings: Optional[VllmLogprobsSettings] = None


def configure_engine(engine, *, temperature: float, top_k: Optional[int], top_p: Optional[float],
                     min_p: Optional[float], vocab_size: int, top_k_cap: Optional[int]) -> EngineSupport:
    """Choose the support source for TRL's VLLMGeneration and set what the engine is asked for."""
    # colocate mode applies generation_kwargs over the sampling settings (and N): a support replay did not ask for
    clash = sorted(set(getattr(engine, "generation_kwargs", None) or {}) & _SET_BY_REPLAY)
    if clash:
        raise InputError(f"generation_kwargs {', '.join(clash)}: with replay these come from GRPOConfig "
                         "(temperature, top_k, top_p, min_p) and from replay (logprobs)")
    settings = vllm_logprobs_settings(temperature=temperature, top_k=top_k or None, top_p=top_p, min_p=min_p,
                                      vocab_size=vocab_size, top_k_cap=top_k_cap)
    if top_k_cap is not None and not top_k:
        engine.top_k = settings.sampling["top_k"]
    if _plugin_answers(engine):
        return EngineSupport(PLUGIN)
    if settings.logprobs >= vocab_size and temperature != 0 and not top_k and top_k_cap is None:
        raise InputError(f"top-p / min-p sampling without top_k: each token's support may be the whole vocabulary, "
                         f"which vLLM would send as {vocab_size} log-prob objects per token; {_PLUGIN_FIX}, or "
                         "pass replay_top_k_cap=K (adds top_k=K to the sampling)")
    limit = _max_logprobs(engine)
    too_small = limit is not None and limit != -1 and settings.logprobs > limit
    if too_small or not _server_allows(engine, settings.logprobs):
        which = f"vLLM's max_logprobs is {limit}" if too_small else "the vLLM server refuses that many log-probs"
        raise InputError(f"{which}: replay reads the support off {settings.logprobs} processed log-probs per token "
                         f"({settings.cost}); {_PLUGIN_FIX}, or start vLLM with max_logprobs >= {settings.logprobs} "
                         f"(server: --max-logprobs {settings.logprobs})")
    engine.logprobs = settings.logprobs
    return EngineSupport(LOGPROBS, settings)


def _server_probe(engine, logprobs: int, answer):
    """Server mode: the main process asks the server for one token with ``logprobs`` log-probs and returns
    ``answer(choices)`` (``answer(None)`` when the server refuses that many log-probs: vLLM names
    max_logprobs in its 400 answer); every process gets the main process's result."""
    result = [None]
    client = getattr(engine, "vllm_client", None)
    if client is not None:  # the main process only
        try:
            choices = client._post(f"{client.base_url}/v1/completions",
                                   json={"model": client.model, "prompt": [[0]], "max_tokens": 1, "logprobs": logprobs,
                                         "return_token_ids": True})["choices"]
        except Exception as exc:  # TRL's client raises a bare Exception carrying the server's answer
            if "logprobs" not in str(exc):
                raise
            choices = None
        result = [answer(choices)]
    broadcast_object_list(result, from_process=0)
    return result[0]


def _plugin_answers(engine) -> bool:
    """Colocate: the plugin is installed in this process (which built the engine). Server: a one-token
    answer carries the field."""
    if getattr(engine, "mode", "colocate") != "server":
        return vllm_support.active()
    return bool(_server_probe(engine, 0, lambda choices: bool(choices) and choices[0].get(SUPPORT_FIELD) is not None))


def _server_allows(engine, n: int) -> bool:
    """Server mode: the server answers a one-token request with n log-probs. Other modes: True."""
    if getattr(engine, "mode", "colocate") != "server":
        return True
    return bool(_server_probe(engine, n, lambda choices: choices is not None))


def _max_logprobs(engine) -> Optional[int]:
    """The colocated engine's max_logprobs (None where it cannot be read: server mode)."""
    llm = getattr(engine, "llm", None)
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "model_config", None)
    value = getattr(config, "max_logprobs", None)
    return value if isinstance(value, int) else None


def sampled_first(completion_ids, logprobs, token_ids) -> list:
    """Per sequence, per token, [log-prob of the sampled token] (what GRPOTrainer reads as lp[0])."""
    out = []
    for s, (tokens, lps, ids) in enumerate(zip(completion_ids, logprobs, token_ids)):
        seq = []
        for t, (tok, lp, tid) in enumerate(zip(tokens, lps, ids)):
            if tok not in tid:
                raise EngineOutputError(f"completion {s} token {t}: the sampled token {tok} is not among the "
                                        f"{len(tid)} log-probs vLLM returned")
            seq.append([lp[list(tid).index(tok)]])
        out.append(seq)
    return out


def single_id_rows_zero(logprobs, mask: SamplingMask):
    """TRL's per-token sampling log-probs ([seq][token][entry], entry 0 the one GRPOTrainer reads) with
    entry 0 at 0 wherever the token's support is one id: the log-prob over that support, which the mask
    holds and replay computes (adapters.common.single_id_rows_certain), where vLLM reports a greedy
    token's log-prob over the whole vocabulary. Rows are the mask's, sequence-major like the completions."""
    if logprobs is None:
        return None
    one = torch.nonzero(mask.lengths() == 1).flatten()
    if not one.numel():
        return logprobs
    out = [list(seq) for seq in logprobs]
    for s, t in zip(mask.extras["sequence"][one].tolist(), mask.extras["position"][one].tolist()):
        out[s][t] = [0.0, *out[s][t][1:]]
    return out


def _engine_masks(outputs) -> Optional[SamplingMask]:
    """The supports the engine's outputs carry (the plugin's, or vLLM's own masks) where every completion
    carries one, else None."""
    choices = [c for o in outputs for c in (o["choices"] if isinstance(o, dict) else getattr(o, "outputs", []))]
    carried = [(c.get(SUPPORT_FIELD) if isinstance(c, dict) else getattr(c, SUPPORT_FIELD, None))
               or (c.get("sampling_mask") if isinstance(c, dict) else getattr(c, "sampling_mask", None))
               for c in choices]
    if not choices or any(x is None for x in carried):
        return None
    return mask_from_vllm(outputs)


def local_completions(mask: SamplingMask, start: int, count: int) -> SamplingMask:
    """The rows of completions [start, start + count) (rows sequence-major), renumbered from 0."""
    sequence = mask.extras["sequence"]
    lo = int(torch.searchsorted(sequence, torch.tensor(start, dtype=sequence.dtype)))
    hi = int(torch.searchsorted(sequence, torch.tensor(start + count, dtype=sequence.dtype)))
    out = mask.select_rows(lo, hi)
    out.extras["sequence"] = out.extras["sequence"] - start
    return out


@contextmanager
def recording(engine, *, temperature: float, vocab_size: int, support: EngineSupport, accelerator):
    """For the duration, `engine.generate` records; yields a function giving the mask of this process's
    completions (rows sequence-major, extras['sequence'] numbering them)."""
    generate, captured = engine.generate, {}
    llm = getattr(engine, "llm", None)
    raw_generate = getattr(llm, "generate", None) if llm is not None else None
    client = getattr(engine, "vllm_client", None)
    raw_post = getattr(client, "_post", None) if client is not None else None

    def llm_generate(*args, **kwargs):  # colocate: the engine's outputs
        captured["raw"] = raw_generate(*args, **kwargs)
        return captured["raw"]

    def client_post(url, **kwargs):  # server, main process: the /v1/completions JSON
        response = raw_post(url, **kwargs)
        if url.endswith("/v1/completions"):
            captured["raw"] = [response]
        return response

    def recording_generate(prompts, *args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = generate(prompts, *args, **kwargs)
        raw = captured.pop("raw", None)
        if support.source == PLUGIN:
            captured["mask"] = _plugin_mask(engine, raw, len(completion_ids), accelerator)
            return prompt_ids, completion_ids, single_id_rows_zero(logprobs, captured["mask"]), token_ids
        masks = _engine_masks(raw) if raw is not None and getattr(engine, "tensor_parallel_size", 1) == 1 else None
        if masks is not None:
            captured["mask"] = masks
            if logprobs is None or token_ids is None:
                return prompt_ids, completion_ids, logprobs, token_ids
            sampling = sampled_first(completion_ids, logprobs, token_ids)
            return prompt_ids, completion_ids, single_id_rows_zero(sampling, masks), token_ids
        if token_ids is None or logprobs is None:
            raise EngineOutputError("the vLLM generation returned neither sampling masks nor processed log-probs "
                                    "with their token ids: replay cannot know the support (vLLM with "
                                    "logprobs_mode='processed_logprobs' and logprobs >= 1 is needed)")
        captured["mask"] = mask_from_trl_vllm(completion_ids, logprobs, token_ids, requested=engine.logprobs,
                                              temperature=temperature, vocab_size=vocab_size,
                                              top_k=getattr(engine, "top_k", None))
        sampling = sampled_first(completion_ids, logprobs, token_ids)
        return prompt_ids, completion_ids, single_id_rows_zero(sampling, captured["mask"]), token_ids

    with ExitStack() as stack:  # instance attributes shadow the methods for this call only
        stack.enter_context(shadowed(engine, generate=recording_generate))
        if raw_generate is not None:
            stack.enter_context(shadowed(llm, generate=llm_generate))
        if raw_post is not None:
            stack.enter_context(shadowed(client, _post=client_post))
        yield lambda: captured.get("mask")


def _plugin_mask(engine, raw, local_count: int, accelerator) -> SamplingMask:
    """This process's rows: colocate reads its engine's outputs (its tensor-parallel group's share of them);
    server mode reads the main process's copy of the choices, sent to every process."""
    if getattr(engine, "mode", "colocate") == "server":
        payload = [_whole_mask(raw)] if raw is not None else [None]
        broadcast_object_list(payload, from_process=0)
        start = accelerator.process_index * local_count
        return local_completions(payload[0], start, local_count)
    mask = _whole_mask(raw)
    if getattr(engine, "tensor_parallel_size", 1) > 1:
        rank = torch.distributed.get_rank(group=engine.tp_group)
        return local_completions(mask, rank * local_count, local_count)
    return mask


def _whole_mask(raw) -> SamplingMask:
    mask = _engine_masks(raw) if raw is not None else None
    if mask is None:
        raise EngineOutputError(f"vLLM returned completions without {SUPPORT_FIELD}: the plugin answered at start-up "
                                "but not now (was the engine restarted without it, or a request sent with "
                                "logprobs=None?)")
    return mask
