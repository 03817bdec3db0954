"""Independent pure-PyTorch reference of the capture semantics (sort-based, fp64 masses).

It does not share code with the kernels: sorting instead of radix selection, torch.exp in fp64
instead of the kernels' fixed-point masses. Because the two mass computations differ by rounding,
the reference returns two supports per row: `strict` (top-p boundary moved in by `margin` of the
total mass) and `loose` (moved out). A correct kernel satisfies strict <= kernel <= loose, and
where the boundary is not within `margin` of a cumulative mass the two coincide (exact check).
"""
from __future__ import annotations

import math

import torch


def _expand(v, n, off):
    if v is None:
        return [off] * n
    if isinstance(v, torch.Tensor):
        return v.expand(n).tolist() if v.dim() == 0 else v.tolist()
    return [v] * n


def reference_row(z: torch.Tensor, t: float, k, p, mp, margin: float):
    v = z.numel()
    z = z.float()
    if t == 0.0:
        one = torch.zeros(v, dtype=torch.bool)
        one[int(torch.argmax(z))] = True  # torch.argmax returns the first maximal index
        return one, one.clone()
    x = z / torch.full_like(z, t)
    finite = torch.isfinite(x)
    m = x[finite].max()
    if mp is not None and mp > 0:
        thr = m + torch.tensor(math.log(mp), dtype=torch.float32)
    else:
        thr = torch.tensor(-3.4028234663852886e38, dtype=torch.float32)
    s = finite & (x >= thr)
    if k is not None and 0 < k < int(s.sum()):
        vk = torch.sort(x[s], descending=True).values[k - 1]
        s = s & (x >= vk)
    if p is None or p >= 1.0:
        return s, s.clone()
    idx = torch.nonzero(s).flatten()
    vals = x[idx]
    probs = torch.exp(vals.double() - float(m))
    probs = probs / probs.sum()
    order = torch.argsort(vals)
    asc, pasc = vals[order], probs[order]
    upto = torch.cumsum(pasc, 0)  # mass of elements <= value
    last = torch.searchsorted(asc, vals, right=True) - 1
    above = (1.0 - upto[last]).clamp_min(0.0)  # mass strictly greater than each element
    strict = torch.zeros(v, dtype=torch.bool)
    loose = torch.zeros(v, dtype=torch.bool)
    strict[idx] = above < p - margin
    loose[idx] = above < p + margin
    strict[idx[vals == vals.max()]] = True  # the top group is always kept (its mass above is 0)
    return strict, loose


def reference_support(logits, temperature=1.0, top_k=None, top_p=None, min_p=None, margin=1e-5):
    """(strict, loose) bool [N, V] supports for logits [N, V] (any float dtype) and parameters
    given as scalars, per-row tensors or None."""
    n, v = logits.shape
    ts, ks, ps, mps = (_expand(a, n, off) for a, off in
                       ((temperature, 1.0), (top_k, None), (top_p, None), (min_p, None)))
    strict = torch.zeros(n, v, dtype=torch.bool)
    loose = torch.zeros(n, v, dtype=torch.bool)
    for r in range(n):
        k = None if ks[r] is None else int(ks[r])
        strict[r], loose[r] = reference_row(logits[r].cpu(), float(ts[r]), k, ps[r], mps[r], margin)
    return strict, loose


def reference_logprob_and_mass(logits, support: torch.Tensor, sampled, temperature=1.0):
    """fp64 log-prob of sampled over the dense support and kept mass of the support."""
    n, v = logits.shape
    ts = _expand(temperature, n, 1.0)
    lp = torch.empty(n, dtype=torch.float64)
    km = torch.empty(n, dtype=torch.float64)
    for r in range(n):
        t = float(ts[r])
        x = logits[r].double() / (t if t > 0 else 1.0)
        full = torch.logsumexp(x, 0)
        sub = torch.logsumexp(x.masked_fill(~support[r], float("-inf")), 0)
        lp[r] = 0.0 if t == 0 else x[int(sampled[r])] - sub
        km[r] = 1.0 if t == 0 else torch.exp(sub - full)
    return lp, km
