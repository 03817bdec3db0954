"""SGLang outputs -> mask fields (SamplingMask.from_sglang); SGLang is not imported.

Two forms:
  - responses of `/generate` with `return_sampling_mask: true`, alone or in a list (a batch, and
    `n > 1` samples, come back as a flat list): `{"output_ids": [...], "meta_info": {"id",
    "output_token_sampling_mask": [[...], ...], "output_token_sampling_logprobs": [...]}}`, where
    the log-probs are per token (the sampled token's, renormalised over its mask) or, in the
    per-support mode, one list per token aligned with the mask ids; `/v1/chat/completions`
    responses carry the same `meta_info` per choice;
  - the fixed-capacity form: `token_ids` [N, C] with `lengths` (or `counts`) [N], only the first
    `lengths[r]` slots of row r read, plus optional `sampled` and `selected_logprobs` [N].
Field shapes and where they were read: docs/formats.md, "Engine outputs".
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from mask_replay.errors import EngineOutputError
from mask_replay.mask import adapter
from mask_replay.sampler.adapters.common import (
    Completion,
    as_list,
    build_mask,
    checked_logprobs,
    get,
    has,
    row_extras,
    single_id_rows_certain,
)
from mask_replay.sampler.adapters.padded import _int_tensor, mask_from_padded


@adapter("from_sglang")
def mask_from_sglang(outputs: Any, *, temperature: Optional[float] = None, step: Optional[int] = None,
                vocab_size: Optional[int] = None):
    """One mask row per generated token (responses in the order given, tokens in order), or one
    per row of the fixed-capacity form. Same extras and checks as `mask_from_vllm`."""
    if _is_fixed(outputs):
        return _from_fixed(outputs, temperature=temperature, step=step, vocab_size=vocab_size)
    items = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    completions = []
    for r, item in enumerate(items):
        if has(item, "choices"):  # chat completions: one meta_info per choice
            if get(item, "choices") is None:
                raise EngineOutputError(f"response {r}: choices is null, expected a list of completions")
            for j, ch in enumerate(as_list(get(item, "choices"), f"response {r}: choices")):
                completions.append(_completion(ch, r, get(ch, "index", j)))
        elif has(item, "meta_info"):
            completions.append(_completion(item, r, None))
        else:
            raise EngineOutputError(f"response {r}: not an SGLang response (no meta_info or choices): "
                                    f"{type(item).__name__}")
    return build_mask(completions, engine="sglang", temperature=temperature, step=step, vocab_size=vocab_size)


def _completion(item, r: int, choice) -> Completion:
    meta = get(item, "meta_info")
    rid = get(meta, "id") if meta is not None else None
    label = f"response {r}" + (f" (id {rid!r})" if rid is not None else "") + \
        (f" choice {choice}" if choice is not None else "")
    if meta is None:
        raise EngineOutputError(f"{label}: no meta_info")
    tokens = get(item, "output_ids")
    if tokens is None:
        tokens = get(item, "token_ids")
    if tokens is None and get(meta, "output_token_logprobs") is not None:
        # return_logprob entries are (logprob, token id, text)
        tokens = [_logprob_entry_id(e, label, t) for t, e in
                  enumerate(as_list(get(meta, "output_token_logprobs"), f"{label}: output_token_logprobs"))]
    rows = get(meta, "output_token_sampling_mask")
    if tokens is None:
        if rows:
            raise EngineOutputError(f"{label}: no output_ids to go with its sampling masks")
        tokens = []
    token_lp, entry_lp = None, get(meta, "output_token_sampling_mask_logprobs")
    lp = get(meta, "output_token_sampling_logprobs")
    if lp is not None:
        lp = as_list(lp, f"{label}: output_token_sampling_logprobs")
        if any(isinstance(x, (list, tuple)) for x in lp):  # per-support mode: aligned with the ids
            entry_lp = lp if entry_lp is None else entry_lp
        else:
            token_lp = lp
    return Completion(label, tokens, rows, token_lp, entry_lp,
                      [rid if rid is not None else r] + ([choice] if choice is not None else []))


def _logprob_entry_id(entry, label, t):
    if isinstance(entry, (list, tuple)) and len(entry) >= 2:
        return entry[1]
    raise EngineOutputError(f"{label} token {t}: output_token_logprobs entry {entry!r} is not (logprob, id, ...)")


def _is_fixed(obj) -> bool:
    return has(obj, "token_ids") and (has(obj, "lengths") or has(obj, "counts")) and not isinstance(obj, (list, tuple))


def _from_fixed(obj, *, temperature, step, vocab_size):
    counts = get(obj, "lengths") if has(obj, "lengths") else get(obj, "counts")
    source = "sglang fixed-capacity mask"
    extras = {}
    sampled = get(obj, "sampled")
    if sampled is not None:  # integers only: torch would truncate 2.5 to 2, and a string is a bare error
        extras["sampled"] = _int_tensor(sampled, "sampled", 1, source).to(torch.int64)
    lp = get(obj, "selected_logprobs")
    if lp is not None:  # checked as the JSON form's log-probs are (NaN, +inf, > 0, a string: named by row)
        values = checked_logprobs(lp, f"{source}:", "selected_logprobs", unit="row").astype(np.float32)
        extras["logprobs"] = torch.from_numpy(values).to(lp.device if isinstance(lp, torch.Tensor) else "cpu")
    # SGLang leaves the slots past a row's length unspecified: they are not read
    mask = mask_from_padded(get(obj, "token_ids"), counts, strict_padding=False, vocab_size=vocab_size,
                            source=source, **extras)
    single_id_rows_certain(mask)
    mask.extras.update(row_extras(mask.num_rows, step=step, temperature=temperature))
    mask.metadata.update({"engine": "sglang", "logprobs_source": "selected_logprobs" if lp is not None else "none"})
    return mask
