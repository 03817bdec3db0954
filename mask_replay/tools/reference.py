"""Pure-PyTorch float64 references of every op the self-test checks on the CPU.

Written from docs/semantics.md, sharing nothing with the kernels: sorting and unique values instead
of radix selection, torch.exp in float64 instead of the kernels' det_exp and fixed-point masses,
dense [N, V] masks instead of CSR walks. Inputs are on the CPU; results are float64 (bool for
supports).

Because the reference's top-p masses are float64 and the kernels' are fixed-point integers, the
support reference returns two answers per row: `strict` (the top-p boundary moved in by `margin` of
the mass) and `loose` (moved out). A correct kernel lies between them; where no cumulative mass is
within `margin` of p the two coincide and the check is exact.
"""
from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def per_row(value, n: int, off) -> list:
    """A scalar, a per-row tensor [N] or None, as a Python list of N values (None stays None)."""
    if value is None:
        return [off] * n
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).expand(n).tolist() if value.numel() == 1 else value.tolist()
    return [value] * n


def scaled(z: torch.Tensor, temperature) -> torch.Tensor:
    """x = float32(z) / float32(T), one IEEE float32 division (semantics step 1), as float64 [N, V].
    Greedy rows (T == 0) are returned unscaled."""
    n = z.shape[0]
    t = torch.tensor(per_row(temperature, n, 1.0), dtype=torch.float32)
    t = torch.where(t == 0, torch.ones_like(t), t)
    return (z.float() / t[:, None]).double()


def _top_p_keep(x: torch.Tensor, keep: torch.Tensor, p: float, margin: float):
    """(strict, loose) subsets of `keep` for top-p over the survivors (float64 masses): a token stays
    iff the mass of the survivors strictly greater than it is < p; tie groups go together."""
    vals = x[keep]
    values, group = torch.unique(vals, sorted=True, return_inverse=True)  # ascending distinct values
    probs = torch.exp(vals - values[-1])
    mass = torch.zeros(values.numel(), dtype=torch.float64).index_add_(0, group, probs)
    mass = mass / mass.sum()
    # Mass strictly above each distinct value: an exclusive cumulative sum from the top.
    from_top = torch.cumsum(mass.flip(0), 0).flip(0)
    above = (from_top - mass).clamp_min(0.0)[group]
    top = group == values.numel() - 1  # the top group has nothing above it and is always kept
    idx = torch.nonzero(keep)[:, 0]
    strict, loose = torch.zeros_like(keep), torch.zeros_like(keep)
    strict[idx] = (above < p - margin) | top
    loose[idx] = (above < p + margin) | top
    return strict, loose


def support_row(z: torch.Tensor, t: float, k, p, mp, margin: float):
    """(strict, loose) bool [V] for one row of logits z (any float dtype) and its parameters."""
    v = z.numel()
    if t == 0.0:  # greedy: the first index of the maximum of float32(z)
        one = torch.zeros(v, dtype=torch.bool)
        one[int(torch.argmax(z.float()))] = True
        return one, one.clone()
    x32 = z.float() / torch.tensor(t, dtype=torch.float32)
    finite = torch.isfinite(x32)
    if not bool(finite.any()):
        raise ValueError("reference: a row with no finite logit has no support (the kernels raise)")
    m = x32[finite].max()
    keep = finite
    if mp is not None and mp > 0:
        # float32 addition of the max and the float32-rounded double log (semantics step 3)
        keep = keep & (x32 >= m + torch.tensor(math.log(mp), dtype=torch.float32))
    if k is not None and 0 < int(k) < int(keep.sum()):
        kth = torch.sort(x32[keep], descending=True).values[int(k) - 1]
        keep = keep & (x32 >= kth)  # every token tied with the k-th value stays
    if p is None or p >= 1.0:
        return keep, keep.clone()
    return _top_p_keep(x32.double(), keep, float(p), margin)


def support(z: torch.Tensor, temperature=1.0, top_k=None, top_p=None, min_p=None, *, margin: float = 1e-5):
    """(strict, loose) bool [N, V] supports of logits z [N, V]; parameters as scalars, per-row
    tensors or None (off)."""
    n, v = z.shape
    ts, ks, ps, mps = (per_row(a, n, off) for a, off in
                       ((temperature, 1.0), (top_k, None), (top_p, None), (min_p, None)))
    strict = torch.zeros(n, v, dtype=torch.bool)
    loose = torch.zeros(n, v, dtype=torch.bool)
    for r in range(n):
        strict[r], loose[r] = support_row(z[r], float(ts[r]), ks[r], ps[r], mps[r], margin)
    return strict, loose


def log_normaliser(z: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """logsumexp over the whole vocabulary of x = z / T (capture's logz), float64 [N]."""
    return torch.logsumexp(scaled(z, temperature), dim=1)


def dense_from_csr(token_ids: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    n = offsets.numel() - 1
    rows = torch.repeat_interleave(torch.arange(n), offsets.diff())
    out = torch.zeros(n, vocab, dtype=torch.bool)
    out[rows, token_ids.long()] = True
    return out


def fixed_from_dense(dense: torch.Tensor, width: int):
    """capture_fixed's layout of a dense support: (ids [N, width] int32, ascending, padded with -1;
    counts [N] int64; overflow [N] bool)."""
    n, v = dense.shape
    counts = dense.sum(1)
    # Ascending ids first: kept tokens get their own id as key, the others V (sorted to the end).
    keys = torch.where(dense, torch.arange(v).expand(n, v), torch.full((n, v), v))
    first = torch.sort(keys, dim=1).values[:, :width]
    ids = torch.where(first < v, first, torch.full_like(first, -1)).to(torch.int32)
    if ids.shape[1] < width:
        ids = torch.cat([ids, torch.full((n, width - ids.shape[1]), -1, dtype=torch.int32)], dim=1)
    return ids, counts, counts > width


def _masked(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~dense, NEG_INF)


def replay_status(dense: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """0 replayed over K, 1 sampled token outside K, 2 empty K (the fallback codes), int8 [N]."""
    inside = dense.gather(1, sampled.long()[:, None])[:, 0]
    empty = ~dense.any(1)
    return torch.where(empty, 2, torch.where(inside, 0, 1)).to(torch.int8)


def replay(x: torch.Tensor, dense: torch.Tensor, sampled: torch.Tensor):
    """(logp, lse, status) over the support of already-scaled logits x (float64): rows that are not
    replayed (status != 0) use the whole vocabulary, as the ops do with fallback=True."""
    status = replay_status(dense, sampled)
    over = torch.where((status == 0)[:, None], _masked(x, dense), x)
    lse = torch.logsumexp(over, dim=1)
    logp = x.gather(1, sampled.long()[:, None])[:, 0] - lse
    return logp, lse, status


def replay_grad(x: torch.Tensor, dense: torch.Tensor, sampled: torch.Tensor, temperature, grad: torch.Tensor):
    """d(sum_r grad_r logp_r)/dz = (grad / T)(1[j = y] - q_j), q the softmax over the row's set
    (K, or V where the row falls back), float64 [N, V]."""
    n, v = x.shape
    status = replay_status(dense, sampled)
    over = torch.where((status == 0)[:, None], _masked(x, dense), x)
    q = torch.softmax(over, dim=1)
    onehot = torch.zeros(n, v, dtype=torch.float64)
    onehot[torch.arange(n), sampled.long()] = 1.0
    t = torch.tensor(per_row(temperature, n, 1.0), dtype=torch.float64)
    return (grad.double() / t)[:, None] * (onehot - q)


def full(x: torch.Tensor, sampled: torch.Tensor):
    """(logp, lse) over the whole vocabulary, float64 [N]."""
    lse = torch.logsumexp(x, dim=1)
    return x.gather(1, sampled.long()[:, None])[:, 0] - lse, lse


def full_grad(x: torch.Tensor, sampled: torch.Tensor, temperature, grad: torch.Tensor):
    everything = torch.ones_like(x, dtype=torch.bool)
    return replay_grad(x, everything, sampled, temperature, grad)


def kept_mass(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """exp(logsumexp_K x - logsumexp_V x), 0 for an empty support, float64 [N]."""
    return torch.exp(torch.logsumexp(_masked(x, dense), 1) - torch.logsumexp(x, 1))


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """hidden @ weight.T + bias in float64 [N, V] (the LM head the hidden-state ops fuse)."""
    z = hidden.double() @ weight.double().T
    return z + bias.double() if bias is not None else z


def head_scaled(hidden, weight, bias, temperature) -> torch.Tensor:
    n = hidden.shape[0]
    t = torch.tensor(per_row(temperature, n, 1.0), dtype=torch.float32).double()
    return head_logits(hidden, weight, bias) / t[:, None]


def head_grads(hidden, weight, bias, dense, sampled, temperature, grad):
    """Gradients (hidden, weight, bias) of sum_r grad_r logp_r for the hidden-state replay
    (float64): the chain rule through z = hidden @ weight.T + bias."""
    gz = replay_grad(head_scaled(hidden, weight, bias, temperature), dense, sampled, temperature, grad)
    return gz @ weight.double(), gz.T @ hidden.double(), (gz.sum(0) if bias is not None else None)
