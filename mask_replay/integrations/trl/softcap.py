"""Replay for models whose logits TRL's fused head soft-caps (Gemma 2: `final_logit_softcapping`).

TRL's transform is x = c * tanh(z * s / c) / T with z = h @ W.T + b: not linear in z, so it cannot be
folded into the temperature of `replay_logprobs_from_hidden`. This computes the same log pi_K(y) from
the support's logits only, O(nnz x d) per chunk of rows and never [tokens, V]; each chunk is
recomputed in the backward (activation checkpointing), so no gathered weight rows are kept.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from mask_replay.csr import segment_logsumexp
from mask_replay.errors import OutsideSupportError
from mask_replay.mask import SamplingMask

__all__ = ["softcapped_support_logprobs"]


def _transform(z, scale: float, cap: float, temperature: float):
    return cap * torch.tanh(z * scale / cap) / temperature


def _chunk(h, weight, bias, ids, rows, sampled, scale, cap, temperature):
    z = (h[rows] * weight[ids]).sum(-1)
    zy = (h * weight[sampled]).sum(-1)
    if bias is not None:
        z, zy = z + bias[ids], zy + bias[sampled]
    x, xy = _transform(z, scale, cap, temperature), _transform(zy, scale, cap, temperature)
    return xy - segment_logsumexp(x, rows, h.shape[0])


def softcapped_support_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, mask: SamplingMask,
                                sampled: torch.Tensor, *, logit_scale: float, softcap: float,
                                temperature: float, chunk_rows: int = 256) -> torch.Tensor:
    """log pi_K(sampled) per row of `hidden` [N, d] under x = softcap * tanh(z * logit_scale / softcap) / T,
    with gradients to hidden, weight and bias. The sampled token must be in its row's support."""
    ids, offsets = mask.token_ids.to(hidden.device).long(), mask.offsets.to(hidden.device)
    sampled = sampled.to(hidden.device).long()
    n = hidden.shape[0]
    if mask.num_rows != n:
        raise ValueError(f"the mask has {mask.num_rows} rows but there are {n} rows of hidden states")
    row_of = torch.repeat_interleave(torch.arange(n, device=hidden.device), offsets.diff())
    inside = torch.zeros(n, dtype=torch.bool, device=hidden.device).index_put(
        (row_of,), ids == sampled[row_of], accumulate=True)
    if n and not bool(inside.all()):
        r = int(torch.nonzero(~inside)[0])
        raise OutsideSupportError(f"row {r}: the sampled token {int(sampled[r])} is not in its support", row=r)
    out = []
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        e0, e1 = int(offsets[start]), int(offsets[stop])
        args = (hidden[start:stop], weight, bias, ids[e0:e1], row_of[e0:e1] - start, sampled[start:stop],
                logit_scale, softcap, temperature)
        out.append(checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args))
    return torch.cat(out) if out else hidden.new_zeros(0)
