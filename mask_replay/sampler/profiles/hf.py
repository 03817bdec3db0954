"""transformers' `generate` sampling warpers (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper, in the order `_get_logits_processor` appends them), as released
in transformers 5.x (checked against 5.24.0). Behaviour reproduced, operation by operation:

- scores in float32 (generate upcasts the last-position logits), divided by T (a Python float, so
  the division is the device's tensor-by-scalar division) unless T == 1; T == 0 is greedy;
- top-k by value (ties with the k-th largest kept), k = 0 off, k >= V capped at V;
- top-p: ascending sort (torch's default, unstable sort), float32 softmax and cumsum, drop while
  cumsum <= 1 - p where 1 - p is computed in double and compared as float32; the largest kept;
  skipped when p >= 1;
- min-p AFTER top-p, in probability space over the top-p survivors (renormalised):
  drop p_i < float32(min_p) * max_j p_j, the top token always kept;
- a row with no finite score keeps nothing.
"""
from __future__ import annotations

import torch

from mask_replay.sampler.profiles.common import NEG_INF, RowParams

ENGINE = "transformers 5.24 (generate: Temperature, TopK, TopP, MinP logits warpers)"


def greedy_rows(prm: RowParams) -> torch.Tensor:
    return prm.temperature == 0


def batch_switches(prm: RowParams, batch: torch.Tensor) -> dict:
    """transformers' warpers decide nothing for the batch as a whole: every filter is per row."""
    return {}


def keep(x: torch.Tensor, prm: RowParams, switches: dict) -> torch.Tensor:
    """x: float32 [N, V], already divided by T. Returns the support as bool [N, V]."""
    v = x.shape[1]
    x = x.clone()
    if prm.uses_top_k:
        on = prm.top_k > 0
        if bool(on.any()):
            k = torch.clamp(prm.top_k, 1, v)
            kth = x.topk(int(k[on].max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            kth.masked_fill_(~on.unsqueeze(1), NEG_INF)
            x.masked_fill_(x < kth, NEG_INF)
    if prm.uses_top_p:
        on = prm.top_p < 1
        if bool(on.any()):
            xs, idx = torch.sort(x, descending=False)
            cum = xs.softmax(dim=-1).cumsum(dim=-1)
            # generate compares with the Python float 1 - top_p: computed in double, rounded to
            # float32 by the comparison with a float32 tensor
            drop = cum <= (1 - prm.top_p).to(torch.float32).unsqueeze(1)
            drop[:, -1] = False
            drop &= on.unsqueeze(1)
            x.masked_fill_(drop.scatter(1, idx, drop), NEG_INF)
    if prm.uses_min_p:
        probs = torch.softmax(x, dim=-1)
        threshold = prm.min_p.to(torch.float32).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        drop = probs < threshold
        drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        x.masked_fill_(drop, NEG_INF)
    return x > NEG_INF
