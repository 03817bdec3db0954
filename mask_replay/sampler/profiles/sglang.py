"""SGLang's torch-native sampler (`top_k_top_p_min_p_sampling_from_probs_torch`, sampling backend
"pytorch"), as released in SGLang 0.5.23. Behaviour reproduced, operation by operation:

- logits upcast to float32, divided by the float32 temperature, softmax in float32;
  T < 1e-6 becomes T = 1 with top_k = 1 (SGLang's own greedy rewrite);
- one descending sort of the probabilities (torch's default, unstable sort; or torch.topk with
  sorted=True over the largest k when every row of the batch has 1 <= k < 2^30) and ONE float32
  cumsum over the full distribution, before any filter;
- top-k keeps exactly the first k ranks (a tie at the k-th value is split by the sort order);
- top-p ("joint"): rank r is dropped when cumsum_r - p_r > p, p as float32, with p_r already zeroed
  by top-k, so top-p measures the untruncated distribution;
- min-p: drop p_i < p_max * float32(min_p) (the untruncated probabilities again), applied last;
- the support is the positive filtered probabilities (tokens whose float32 probability underflows
  to 0 cannot be drawn); when no row of the batch uses a filter, SGLang samples from the plain
  softmax, whose support is again the positive probabilities;
- greedy rows (T < 1e-6, and rows with top_k = 1): when EVERY row of the batch has top_k <= 1
  (SamplingBatchInfo.is_all_greedy), Sampler.forward skips the sampler and takes torch.argmax of the
  logits, the first index of the maximum; in a mixed batch they go through the sort (or topk) above
  with k = 1, which keeps whichever tied id comes first in the sort's order.
The batch-wide choices (the plain-softmax branch; topk over the batch's largest k instead of a full
sort, which decides which member of a tie at the cut or at the top survives) are decided per engine
batch (`batch_switches`), never per chunk or rank of a capture.
"""
from __future__ import annotations

import torch

from mask_replay.sampler.profiles.common import (
    RowParams,
    by_group,
    effective_k,
    per_batch_all,
    per_batch_any,
    per_batch_max,
)

ENGINE = "sglang 0.5.23 (srt/layers/sampler.py, top_k_top_p_min_p_sampling_from_probs_torch)"
GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS
TOP_K_ALL = 1 << 30


def greedy_rows(prm: RowParams) -> torch.Tensor:
    # SGLang has no separate greedy branch: it rewrites the row to top_k = 1 at T = 1 (see keep).
    return torch.zeros_like(prm.temperature, dtype=torch.bool)


def temperature(prm: RowParams) -> torch.Tensor:
    return torch.where(prm.temperature < GREEDY_BELOW, torch.ones_like(prm.temperature), prm.temperature)


def _row_filters(prm: RowParams, n: int, v: int, device):
    greedy = prm.temperature < GREEDY_BELOW
    k = effective_k(prm.top_k, v, TOP_K_ALL) if prm.uses_top_k else torch.full_like(prm.top_k, TOP_K_ALL)
    k = torch.where(greedy, torch.ones_like(k), k)
    p32 = prm.top_p.to(torch.float32) if prm.uses_top_p else torch.ones(n, dtype=torch.float32, device=device)
    mp32 = prm.min_p.to(torch.float32) if prm.uses_min_p else torch.zeros(n, dtype=torch.float32, device=device)
    return k, p32, mp32


def batch_switches(prm: RowParams, batch: torch.Tensor, vocab: int) -> dict:
    """Per row, from its engine batch: `mode` -2 the all-greedy branch (every row has k <= 1: argmax),
    -1 the plain-softmax branch (no row filters), 0 the full sort, m > 0 torch.topk over the batch's
    largest k = m (every row has 1 <= k < 2^30, m < V)."""
    n = batch.numel()
    k, p32, mp32 = _row_filters(prm, n, vocab, batch.device)
    filtered = per_batch_any((k != TOP_K_ALL) | (p32 != 1) | (mp32 > 0), batch)
    all_k = per_batch_all((k >= 1) & (k < TOP_K_ALL), batch)
    k_max = per_batch_max(k, batch)
    mode = torch.where(all_k & (k_max < vocab), k_max, torch.zeros_like(k_max))
    mode = torch.where(filtered, mode, torch.full_like(mode, -1))
    return {"mode": torch.where(per_batch_all(k <= 1, batch), torch.full_like(mode, -2), mode)}


def keep(x: torch.Tensor, prm: RowParams, switches: dict) -> torch.Tensor:
    """x: float32 [N, V], already divided by `temperature(prm)`. Returns the support as bool [N, V]."""
    n, v = x.shape
    k, p32, mp32 = _row_filters(prm, n, v, x.device)
    probs = torch.softmax(x, dim=-1)

    def run(pg, rows, mode):
        if mode == -2:  # torch.argmax of the logits: the first index of the maximum (x only rescales them)
            top = x[rows].argmax(dim=-1, keepdim=True)
            out = torch.zeros(pg.shape, dtype=torch.bool, device=pg.device)
            return out.scatter_(1, top, x[rows].gather(1, top) > float("-inf"))
        if mode < 0:
            return pg > 0  # the "simple sampling" branch: multinomial over the plain softmax
        if mode > 0:
            ps, idx = torch.topk(pg, k=mode, dim=-1, sorted=True)
        else:
            ps, idx = pg.sort(dim=-1, descending=True)
        cum = torch.cumsum(ps, dim=-1)
        ranks = torch.arange(ps.shape[1], device=pg.device).view(1, -1)
        ps[ranks >= k[rows].view(-1, 1)] = 0.0
        ps[(cum - ps) > p32[rows].view(-1, 1)] = 0.0
        ps[ps < (ps[:, 0] * mp32[rows]).view(-1, 1)] = 0.0  # min-p 0 drops nothing
        out = torch.zeros(pg.shape, dtype=torch.bool, device=pg.device)
        return out.scatter_(1, idx, ps > 0)

    return by_group(probs, switches["mode"], run)
