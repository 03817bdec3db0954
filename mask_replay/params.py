"""Expansion of sampling parameters (scalar, per-row tensor or None) into per-row tensors."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

Param = Union[None, int, float, torch.Tensor]


def _per_row(value, n: int, dtype, device, name: str, off) -> torch.Tensor:
    if value is None:
        return torch.full((n,), off, dtype=dtype, device=device)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(n)
        if value.dim() != 1 or value.numel() != n:
            raise ValueError(f"{name}: expected a scalar or a tensor of shape [{n}], got {tuple(value.shape)}")
        if value.is_floating_point() and dtype == torch.int64:
            raise ValueError(f"{name}: expected integers, got {value.dtype}")
        return value.to(device=device, dtype=dtype).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, a tensor or None, got {type(value).__name__}")
    if dtype == torch.int64 and not float(value).is_integer():
        raise ValueError(f"{name}: expected an integer, got {value}")
    return torch.full((n,), value, dtype=dtype, device=device)


def expand_params(n: int, device, temperature: Param, top_k: Param, top_p: Param, min_p: Param):
    """Per-row (temperature f32, top_k i64, top_p f64, min_p f64); scalars are checked here, tensor
    values row by row in the kernels (CPU) or before launch (CUDA)."""
    for name, v, ok, want in (
        ("temperature", temperature, lambda x: x >= 0 and math.isfinite(x), "finite and >= 0"),
        ("top_p", top_p, lambda x: 0 < x <= 1, "in (0, 1]"),
        ("min_p", min_p, lambda x: 0 <= x <= 1, "in [0, 1]"),
    ):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not ok(float(v)):
            raise ValueError(f"{name} must be {want}, got {v}")
    return (
        _per_row(temperature, n, torch.float32, device, "temperature", 1.0),
        _per_row(top_k, n, torch.int64, device, "top_k", 0),
        _per_row(top_p, n, torch.float64, device, "top_p", 1.0),
        _per_row(min_p, n, torch.float64, device, "min_p", 0.0),
    )


def describe(temperature: Param, top_k: Param, top_p: Param, min_p: Param) -> dict:
    """JSON-able summary of the parameters, for file metadata."""
    def d(v):
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else "per-row"
        return v
    return {"temperature": d(temperature), "top_k": d(top_k), "top_p": d(top_p), "min_p": d(min_p)}
