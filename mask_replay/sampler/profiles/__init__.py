"""Engine profiles: the support an inference engine actually sampled from, recomputed from saved logits.

`exact` is mask-replay's own definition (docs/semantics.md): ties kept whole, exact arithmetic, the
same bits on CPU and GPU, computed by the capture kernel. The other profiles reproduce one engine's
order of filters, its float32 arithmetic and its comparisons, so that a mask captured from the
logits equals the engine's support (see docs/semantics.md, "Engine profiles", for what cannot match).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mask_replay.mask import SEMANTICS
from mask_replay.sampler.profiles import hf, sglang, vllm
from mask_replay.sampler.profiles.common import (
    RowParams,
    batch_of,
    check_logits,
    greedy_keep,
    keep_to_csr,
    log_normaliser,
    row_params,
    scaled,
)
from mask_replay.sampler.profiles.mismatch import CAUSES, compare_logprobs, summarise  # noqa: F401

PROFILES = ("exact", "vllm", "sglang", "hf")


@dataclass(frozen=True)
class EngineProfile:
    name: str
    engine: str
    greedy_rows: Callable[[RowParams], torch.Tensor]
    keep: Callable[[torch.Tensor, RowParams, dict], torch.Tensor]
    switches: Callable[[RowParams, torch.Tensor, int], dict]  # per-row values of the batch-wide choices
    temperature: Callable[[RowParams], torch.Tensor] = lambda prm: prm.temperature
    divide_by_scalar: bool = False  # the engine divides by a Python float, not a tensor


_ENGINES = {
    "vllm": EngineProfile("vllm", vllm.ENGINE, vllm.greedy_rows, vllm.keep,
                          lambda prm, batch, vocab: vllm.batch_switches(prm, batch)),
    "sglang": EngineProfile("sglang", sglang.ENGINE, sglang.greedy_rows, sglang.keep, sglang.batch_switches,
                            sglang.temperature),
    "hf": EngineProfile("hf", hf.ENGINE, hf.greedy_rows, hf.keep,
                        lambda prm, batch, vocab: hf.batch_switches(prm, batch), divide_by_scalar=True),
}


# The engine profiles hold about 6-7 float32-sized copies of a chunk (upcast logits, sorted values,
# int64 sort indices, probabilities, the scattered result), the exact kernel none: chunks of saved
# logits are this many times smaller for them, to keep the working set near the exact profile's.
CHUNK_DIVISOR = {"exact": 1, "vllm": 8, "sglang": 8, "hf": 8}


def check_profile(profile) -> str:
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}; got {profile!r}")
    return profile


def semantics(profile: str) -> str:
    """The `semantics` string a mask captured with `profile` carries in its metadata."""
    check_profile(profile)
    return SEMANTICS if profile == "exact" else f"{SEMANTICS}+profile={profile}"


def engine_of(profile: str) -> str:
    check_profile(profile)
    return "mask-replay exact support" if profile == "exact" else _ENGINES[profile].engine


def batch_switches(profile: str, n: int, vocab: int, device="cpu", *, temperature=1.0, top_k=None, top_p=None,
                   min_p=None, batch: Optional[torch.Tensor] = None) -> dict:
    """The batch-wide choices an engine makes, as one value per row taken from the row's ENGINE BATCH
    (the rows it sampled in one step): `batch` [N] ids (rows with one id form one batch), or all N
    rows as one batch. Parameters as for engine_support, over all N rows. A caller that captures an
    engine batch in pieces (chunks, ranks) computes these once over the whole batch and passes each
    piece its slice (engine_support's `switches`), so the masks do not depend on the pieces."""
    if check_profile(profile) == "exact":
        return {}
    prm = row_params(n, device, temperature, top_k, top_p, min_p)
    return _ENGINES[profile].switches(prm, batch_of(n, batch, device), vocab)


def engine_support(logits: torch.Tensor, profile: str, *, temperature=1.0, top_k=None, top_p=None,
                   min_p=None, return_keep: bool = False, entry_logprobs: bool = False,
                   batch: Optional[torch.Tensor] = None, switches: Optional[dict] = None):
    """The support of each row under an engine profile (not "exact": that is the capture kernel).

    Returns (token_ids int32, offsets int64, logz float32 [N] = logsumexp of logits / T over the
    vocabulary, at T = 1 for greedy rows); with return_keep also the bool [N, V] support.
    Parameters are as for `mask_replay.capture`; None means the filter is off for the whole call.
    Where an engine switches a pass on for a whole batch (vLLM's top-p pass, SGLang's sort or topk),
    the batch is the engine's: `batch` [N] ids, else the rows of this call; or `switches`, the rows'
    slice of batch_switches(...) computed over whole engine batches elsewhere.
    With entry_logprobs, last comes float32 [nnz]: every support entry's log-prob by the engine's
    arithmetic, a float32 log_softmax of its processed logits (-inf off the support), as vLLM's
    processed log-probs are computed (the profile's float32 x, the engine's order of operations).
    """
    if check_profile(profile) == "exact":
        raise ValueError("engine_support computes engine profiles; the exact profile is the capture kernel")
    eng = _ENGINES[profile]
    check_logits(logits)
    n = logits.shape[0]
    prm = row_params(n, logits.device, temperature, top_k, top_p, min_p)
    if switches is None:
        switches = eng.switches(prm, batch_of(n, batch, logits.device), logits.shape[1])
    else:
        for key, value in switches.items():
            if not isinstance(value, torch.Tensor) or value.shape != (n,):
                raise ValueError(f"switches['{key}'] must be a tensor of shape [{n}] (one value per row)")
        switches = {key: value.to(logits.device) for key, value in switches.items()}
    greedy = eng.greedy_rows(prm)
    scalar = prm.temperature_scalar if eng.divide_by_scalar else None
    x = scaled(logits, eng.temperature(prm), greedy, scalar)
    keep = greedy_keep(logits, greedy, eng.keep(x, prm, switches))
    token_ids, offsets = keep_to_csr(keep)
    # at the temperature capture's log-probs are computed with (T = 1 only where T == 0)
    t = prm.temperature
    logz = log_normaliser(logits.to(torch.float32) / torch.where(t == 0, torch.ones_like(t), t).unsqueeze(1))
    out = (token_ids, offsets, logz) + ((keep,) if return_keep else ())
    if entry_logprobs:
        out += (torch.log_softmax(x.masked_fill(~keep, float("-inf")), dim=-1)[keep],)
    return out
