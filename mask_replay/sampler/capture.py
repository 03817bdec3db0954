"""capture(): the support of the truncated sampling distribution of every row, as a SamplingMask."""
from __future__ import annotations

import torch

from mask_replay import csr
from mask_replay._ops import ops
from mask_replay.errors import InputError, OutsideSupportError
from mask_replay.mask import SamplingMask
from mask_replay.params import Param, describe, expand_params
from mask_replay.sampler import profiles


def capture(
    logits: torch.Tensor,
    *,
    temperature: Param = 1.0,
    top_k: Param = None,
    top_p: Param = None,
    min_p: Param = None,
    sampled: torch.Tensor | None = None,
    outside: str = "error",
    profile: str = "exact",
    entry_logprobs: bool = False,
    batch: torch.Tensor | None = None,
    switches: dict | None = None,
) -> SamplingMask:
    """Support of softmax(logits / T) after min-p, top-k and top-p, one CSR row per row of logits.

    `profile` chooses whose support: "exact" (default; mask-replay's order-independent definition,
    computed by the capture kernel) or an engine's ("vllm", "sglang", "hf": that engine's filter
    order, float32 arithmetic and tie order; see mask_replay.sampler.profiles). The mask's metadata
    `semantics` names the profile.

    With `sampled` ([N] int) the mask also carries `sampled`, `logprobs` (log-prob of the sampled
    token over the support) and `kept_mass`. A sampled token outside its support raises
    OutsideSupportError naming the row, or with outside="flag" is recorded in
    extras["outside_support"] (its logprob is -inf).

    With `entry_logprobs` the mask also carries the log-prob of every support entry (float32 [nnz],
    CSR-aligned): x_v - logsumexp_{j in S} x_j with x = float32(z) / T; under the "exact" profile the
    reduction is in float64 (csr.support_log_softmax, the trainer's replay_support_logprobs), under an
    engine profile it is the engine's own float32 log_softmax of its processed logits. `logprobs` is
    then read from these entries (the sampled one, bit for bit); it differs from the kernel's value
    that capture gives without entry_logprobs by float32 rounding only (< 1e-6).

    Engine batches (engine profiles only): where an engine makes a choice for a whole batch (vLLM runs
    its top-p pass for every row once one row uses top-p; SGLang sorts or calls topk depending on all
    rows' top-k), the batch is the rows the engine sampled in one step: `batch` [N] ids (rows with one
    id form one batch), else every row of this call. `switches` instead gives each row's batch-wide
    choices precomputed over whole batches (profiles.batch_switches), for callers that capture a
    batch in pieces: the mask of a row never depends on which rows share its call.
    """
    if outside not in ("error", "flag"):
        raise ValueError(f"outside must be 'error' or 'flag', got {outside!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    profiles.check_profile(profile)
    t, k, p, mp = expand_params(n, logits.device, temperature, top_k, top_p, min_p)
    entries = None
    if profile == "exact":
        token_ids, offsets, _ = ops.capture(logits, t, k, p, mp, False)
        if entry_logprobs:
            entries = _exact_entries(logits, token_ids, offsets, t)
    else:
        token_ids, offsets, _, *rest = profiles.engine_support(
            logits, profile, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            entry_logprobs=entry_logprobs, batch=batch, switches=switches)
        entries = rest[0] if entry_logprobs else None
    meta = {"semantics": profiles.semantics(profile), "vocab_size": v,
            "params": describe(temperature, top_k, top_p, min_p)}
    mask = SamplingMask(token_ids, offsets, metadata=meta, entry_logprobs=entries)
    if sampled is not None:
        _attach_sampled(mask, logits, sampled, t, outside)
    return mask


def _exact_entries(logits, token_ids, offsets, t):
    """float32 [nnz]: x = float32(z) / T gathered at the support (T = 1 for greedy rows, whose one
    entry is 0 whatever T), reduced in float64 and rounded once."""
    n = logits.shape[0]
    rows = torch.repeat_interleave(torch.arange(n, device=logits.device), offsets[1:] - offsets[:-1],
                                   output_size=token_ids.numel())
    t1 = torch.where(t == 0, torch.ones_like(t), t)
    x = logits[rows, token_ids.long()].to(torch.float32) / t1[rows]
    return csr.support_log_softmax(x, rows, n)


def _attach_sampled(mask, logits, sampled, t, outside):
    n, v = logits.shape
    if not isinstance(sampled, torch.Tensor) or sampled.dim() != 1 or sampled.numel() != n:
        shape = tuple(sampled.shape) if isinstance(sampled, torch.Tensor) else type(sampled).__name__
        raise ValueError(f"sampled must be a tensor of shape [{n}], got {shape}")
    if sampled.is_floating_point() or sampled.is_complex() or sampled.dtype == torch.bool:
        raise ValueError(f"sampled must hold integer token ids, got {sampled.dtype}")
    sampled = sampled.to(device=logits.device, dtype=torch.int64)
    if n:
        bad = torch.nonzero((sampled < 0) | (sampled >= v))
        if bad.numel():
            r = int(bad[0])
            raise InputError(f"sampled token {int(sampled[r])} out of range [0, {v}) in row {{row}}", key="sampled",
                             row=r)
    greedy = t == 0
    # Greedy rows have a single-token support: log-prob 0 and all the (limit) mass, when the
    # sampled token is that token. Replay them at T = 1, which gives the same support answer.
    t_replay = torch.where(greedy, torch.ones_like(t), t)
    logp, _, status = ops.replay_fwd(logits, mask.token_ids, mask.offsets, sampled, t_replay, True)
    outside_rows = status != 0
    if outside == "error" and n and bool(outside_rows.any()):
        r = int(torch.nonzero(outside_rows)[0])
        raise OutsideSupportError(
            f"sampled token {int(sampled[r])} is outside the support of row {{row}} ({int(mask.lengths()[r])} tokens)",
            key="sampled", row=r, hint="pass outside='flag' to record such rows instead")
    # The mass the support keeps, by the one definition of logZ that full_logprobs shares (the
    # capture kernel's own normaliser is a fixed-point sum made for the top-p decision, which
    # drops masses below 2^-40 of the max).
    kept = ops.kept_mass(logits, mask.token_ids, mask.offsets, t_replay)
    if bool(outside_rows.any()):
        logp = logp.masked_fill(outside_rows, float("-inf"))
        mask.extras["outside_support"] = outside_rows.clone()
    mask.sampled = sampled
    mask.logprobs = torch.where(greedy & ~outside_rows, torch.zeros_like(logp), logp).float()
    if mask.entry_logprobs is not None and mask.nnz:
        # the sampled entry, so that logprobs and entry_logprobs are the same float32 numbers
        rows = mask.row_ids()
        hit = torch.nonzero(mask.token_ids.long() == sampled[rows])[:, 0]
        mask.logprobs = mask.logprobs.index_put((rows[hit],), mask.entry_logprobs[hit])
    mask.kept_mass = torch.where(greedy, torch.ones_like(kept), kept).float()


def capture_fixed(
    logits: torch.Tensor,
    width: int,
    *,
    temperature: Param = 1.0,
    top_k: Param = None,
    top_p: Param = None,
    min_p: Param = None,
):
    """Fixed-capacity capture for use inside an engine step or a CUDA graph: returns
    (token_ids [N, width] int32 padded with -1, counts [N] int64 = true support sizes,
    overflow [N] bool = rows whose support did not fit). No host synchronisation on CUDA when the
    parameters are tensors already on the device."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if int(width) < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    n = logits.shape[0]
    t, k, p, mp = expand_params(n, logits.device, temperature, top_k, top_p, min_p)
    return ops.capture_fixed(logits, t, k, p, mp, int(width))
