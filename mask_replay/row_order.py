"""Row order of a SamplingMask for the trainer: SamplingMask.align and the row gather behind it.

It names no SamplingMask import (the class calls in here; `type(mask)` builds the result), so
mask.py and this module form no import circle.
"""
from __future__ import annotations

import torch

from mask_replay import csr


def take_rows(mask, order: torch.Tensor):
    """A new mask made of the rows `order` (int64 [M], each in [0, N)), in that order."""
    order = order.to(device=mask.device, dtype=torch.int64)
    src, offsets = csr.take_row_entries(mask.offsets, order)
    pick = lambda v: None if v is None else v[order.to(v.device)]  # noqa: E731
    entries = None if mask.entry_logprobs is None else mask.entry_logprobs[src.to(mask.entry_logprobs.device)]
    return type(mask)(mask.token_ids[src], offsets, pick(mask.sampled), pick(mask.logprobs),
                      pick(mask.kept_mass), {k: pick(v) for k, v in mask.extras.items()}, dict(mask.metadata),
                      entries)


def align_mask(mask, order=None, *, sequences=None, key: str = "sequence"):
    """See SamplingMask.align."""
    if (order is None) == (sequences is None):
        raise ValueError("align: pass exactly one of order (mask row per trainer row) or sequences")
    n = mask.num_rows
    if order is not None:
        if not isinstance(order, torch.Tensor) or order.is_floating_point() or order.dtype == torch.bool:
            raise ValueError("align: order must be an integer tensor of mask row indices (-1 for no row)")
        flat = order.reshape(-1).to(torch.int64).cpu()
        flat = flat[flat >= 0]
        if flat.numel() and int(flat.max()) >= n:
            at = int(torch.nonzero(flat >= n)[0])
            raise ValueError(f"align: order names mask row {int(flat[at])} (entry {at} of the kept entries) "
                             f"but the mask has {n} rows")
        return take_rows(mask, flat)
    if key not in mask.extras:
        raise ValueError(f"align: the mask has no '{key}' extra to find sequences by (extras: {sorted(mask.extras)})")
    seq = mask.extras[key].to(torch.int64).cpu()
    want = torch.as_tensor(sequences).reshape(-1).to(torch.int64).cpu()
    # Rows of each sequence in token order: extras['position'] (the token's index among the
    # generated ones, as the engine adapters and the transformers recorder write it) when present,
    # else mask order. Not 'step': that is the training step in mask files.
    pos = mask.extras["position"].to(torch.int64).cpu() if "position" in mask.extras else torch.arange(n)
    by_pos = torch.argsort(pos, stable=True)
    by_seq = by_pos[torch.argsort(seq[by_pos], stable=True)]
    sorted_seq = seq[by_seq]
    lo = torch.searchsorted(sorted_seq, want, right=False)
    hi = torch.searchsorted(sorted_seq, want, right=True)
    missing = torch.nonzero(hi == lo)
    if missing.numel():
        i = int(missing[0])
        raise ValueError(f"align: sequence {int(want[i])} (entry {i} of sequences) has no row in the mask")
    parts = [by_seq[int(a):int(b)] for a, b in zip(lo.tolist(), hi.tolist())]
    return take_rows(mask, torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
