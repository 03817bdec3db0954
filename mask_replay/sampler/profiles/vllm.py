"""vLLM's V1 sampler, PyTorch path (`apply_top_k_top_p_pytorch`, the CPU backend's path, and the
min-p logits processor), as released in vLLM 0.32. Behaviour reproduced, operation by operation:

- logits upcast to float32, divided by the float32 temperature; T < 1e-5 is greedy (argmax);
- min-p in probability space: softmax in float32, drop p_i < float32(min_p) * max_j p_j;
- top-k by value (every token tied with the k-th largest stays), k <= 0 or >= V is off;
- top-p on the survivors: ascending sort (torch's default, unstable sort), float32 softmax and
  float32 cumsum, drop while cumsum <= 1 - p with p held as float32 and 1 - p computed in float32,
  the largest token always kept;
- the top-p pass runs for every row once some row of the engine batch has p < 1, so a row with
  p = 1 in such a batch still loses the tokens whose float32 probability underflows to 0
  (cumsum == 0 <= 1 - 1); a batch where every p is 1 has no top-p pass at all. The switch is decided
  per engine batch (`batch_switches`), never per chunk or rank of a capture;
- a row with no finite logit keeps nothing (softmax gives NaN, and NaN compares false).
"""
from __future__ import annotations

import torch

from mask_replay.sampler.profiles.common import NEG_INF, RowParams, by_group, effective_k, per_batch_any

ENGINE = "vllm 0.32 (v1 sampler, apply_top_k_top_p_pytorch + MinPLogitsProcessor)"
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: smaller temperatures sample greedily


def greedy_rows(prm: RowParams) -> torch.Tensor:
    return prm.temperature < GREEDY_BELOW


def batch_switches(prm: RowParams, batch: torch.Tensor) -> dict:
    """Per row: whether its engine batch runs the top-p pass (vLLM passes p = None when no row of
    the batch has p < 1)."""
    return {"top_p_pass": per_batch_any(prm.top_p < 1, batch) if prm.uses_top_p
            else torch.zeros_like(batch, dtype=torch.bool)}


def keep(x: torch.Tensor, prm: RowParams, switches: dict) -> torch.Tensor:
    """x: float32 [N, V], already divided by T. Returns the support as bool [N, V]."""
    v = x.shape[1]
    x = x.clone()
    if prm.uses_min_p:
        probs = torch.softmax(x, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * prm.min_p.to(torch.float32).unsqueeze(1)
        x.masked_fill_(probs < threshold, NEG_INF)
    k = torch.clamp(effective_k(prm.top_k, v, v), max=v) if prm.uses_top_k else None
    p32 = prm.top_p.to(torch.float32)

    def run(xg, rows, top_p_pass):
        kg = k[rows] if k is not None else None
        if top_p_pass:
            return _sorted_top_k_top_p(xg, kg, p32[rows]) > NEG_INF
        return (_top_k_only(xg, kg) if kg is not None else xg) > NEG_INF

    return by_group(x, switches["top_p_pass"].to(torch.int64), run)


def _top_k_only(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # The k-th largest value by torch.topk; rows with k == V compare against -inf (keep all).
    off = k == x.shape[1]
    k = k.masked_fill(off, 1)
    kth = x.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(off.unsqueeze(1), NEG_INF)
    return x.masked_fill(x < kth, NEG_INF)


def _sorted_top_k_top_p(x: torch.Tensor, k, p32: torch.Tensor) -> torch.Tensor:
    # torch's default (unstable) sort, as vLLM calls it: which member of a tie group sits where
    # is whatever that sort does, so it is reproduced only by the same call on the same build.
    xs, idx = x.sort(dim=-1, descending=False)
    if k is not None:
        kth = xs.gather(1, (x.shape[1] - k).unsqueeze(1))
        xs.masked_fill_(xs < kth, NEG_INF)
    probs = xs.softmax(dim=-1)
    cum = torch.cumsum(probs, dim=-1, out=probs)  # in place, as vLLM does it
    drop = cum <= (1 - p32).unsqueeze(1)
    drop[:, -1] = False
    xs.masked_fill_(drop, NEG_INF)
    return torch.empty_like(x).scatter_(1, idx, xs)
