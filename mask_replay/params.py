"""Every parameter normalisation: sampling parameters (scalar, per-row tensor or None) into per-row
tensors, temperatures, and the dtypes the ops take and return.

The one place where a Python or numpy number, or a tensor, becomes a parameter of the kernels:
capture, replay (every layout), the sparse head, the support statistics and vocab-parallel replay all
go through it, so a value is accepted or refused the same way, with the same words, everywhere.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Union

import torch

Param = Union[None, int, float, torch.Tensor]

_INT64 = (-(2 ** 63), 2 ** 63 - 1)

# Logits the kernels read (float64 too on the replay side: gradcheck), integer tensors the files
# may hold for integer keys.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for fp32/bf16/fp16, fp64 kept (gradcheck); also the ops' default output."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def output_dtype(out_dtype: Optional[torch.dtype], input_dtype: torch.dtype, op: str) -> torch.dtype:
    """The documented output choices: float32 by default (float64 for float64 input), or the
    input's own dtype, or float64."""
    default = compute_dtype(input_dtype)
    if out_dtype is None:
        return default
    if out_dtype not in (torch.float32, torch.float64, input_dtype):
        raise ValueError(f"{op}: out_dtype must be None, torch.float32, torch.float64 or the input dtype "
                         f"({input_dtype}), got {out_dtype}")
    return out_dtype


def is_number(value) -> bool:
    # numbers.Real covers int, float and the numpy scalars (np.int64, np.float32, ...); bool (and
    # numpy's bool_, which is no Real) is a flag, never a sampling parameter.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# float32 rounds a positive value to 0 at or below 2^-150 (half the smallest subnormal, a tie that
# goes to the even 0) and to inf at or above FLT_MAX + half an ulp.
_F32_TO_ZERO = 2.0 ** -150
_F32_TO_INF = 3.4028235677973366e38


# Below the smallest normal float32 a value is subnormal: it keeps few significant bits, and a
# temperature there makes every logit / T overflow to inf (a capture or score of nothing but NaN).
_F32_SMALLEST_NORMAL = 2.0 ** -126


def _float32_problem(v: float) -> Optional[str]:
    if 0 < abs(v) <= _F32_TO_ZERO:
        return "rounds to 0"
    if 0 < abs(v) < _F32_SMALLEST_NORMAL:
        return f"is subnormal (below {_F32_SMALLEST_NORMAL:.3g})"
    if math.isfinite(v) and abs(v) >= _F32_TO_INF:
        return "overflows"
    return None


def _check_float32(name: str, value, dtype: torch.dtype, converted: Optional[torch.Tensor] = None) -> None:
    """A value that float32 cannot hold would silently change meaning (T = 1e-46 turns greedy, 1e39
    becomes inf): name it (and its row). Scalars are checked in plain Python (free, and traceable by
    torch.compile); tensors only outside tracing, where a data-dependent check is possible."""
    if isinstance(value, torch.Tensor):
        if (value.dtype == torch.float32 or not value.is_floating_point() or dtype != torch.float32
                or torch.compiler.is_compiling()):
            return
        o = value.detach().to("cpu", torch.float64)
        c = converted.detach().cpu()
        bad = torch.nonzero(((o != 0) & (c.abs() < _F32_SMALLEST_NORMAL)) | (torch.isfinite(o) & torch.isinf(c)))
        if bad.numel():
            r = int(bad[0])
            raise ValueError(f"{name} {float(o[r]):g} (row {r}) {_float32_problem(float(o[r]))} in float32")
    elif dtype == torch.float32:
        problem = _float32_problem(float(value))
        if problem:
            raise ValueError(f"{name} {float(value):g} {problem} in float32")


def as_float(name: str, value) -> float:
    """float(value) of a number, or a ValueError naming it where no float holds it (an int of 400
    digits: Python's float() would raise a bare OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        digits = len(str(abs(int(value))))
        raise ValueError(f"{name}: an integer of {digits} digits is beyond any floating-point value") from None


def ignore_index_value(value, op: str = "") -> int:
    """The label id that marks a position without a mask row: an integer (a string or a float would
    compare unequal to every label and silently keep every position)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{op + ': ' if op else ''}ignore_index must be an integer label id, got {value!r}")
    return int(value)


def check_numeric_tensor(name: str, value: torch.Tensor) -> None:
    """A bool or complex tensor is no parameter (True would silently become 1.0): one message for
    every path that takes per-row parameters (here, layouts.py, segments.py)."""
    if value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{name}: expected a number or a tensor of numbers, got a {value.dtype} tensor")


def _per_row(value, n: int, dtype, device, name: str, off) -> torch.Tensor:
    if value is None:
        return torch.full((n,), off, dtype=dtype, device=device)
    if isinstance(value, torch.Tensor):
        check_numeric_tensor(name, value)
        if value.dim() == 0:
            value = value.reshape(1).expand(n)
        if value.dim() != 1 or value.numel() != n:
            raise ValueError(f"{name}: expected a scalar or a tensor of shape [{n}], got {tuple(value.shape)}")
        if value.is_floating_point() and dtype == torch.int64:
            raise ValueError(f"{name}: expected integers, got {value.dtype}")
        out = value.to(device=device, dtype=dtype).contiguous()
        _check_float32(name, value, dtype, out)
        return out
    if not is_number(value):
        raise TypeError(f"{name}: expected a number, a tensor or None, got {type(value).__name__}")
    if dtype == torch.int64:
        if not isinstance(value, numbers.Integral) and not as_float(name, value).is_integer():
            raise ValueError(f"{name}: expected an integer, got {value}")
        value = int(value)
        if not _INT64[0] <= value <= _INT64[1]:
            shown = value if abs(value) < 10 ** 30 else f"an integer of {len(str(abs(value)))} digits"
            raise ValueError(f"{name}: {shown} does not fit in a 64-bit integer")
    else:
        value = as_float(name, value)
    _check_float32(name, value, dtype)
    return torch.full((n,), value, dtype=dtype, device=device)


def temperature_value(temperature, op: str = ""):
    """A temperature as given: a float (a Python or numpy number) or a detached tensor of numbers.
    The first step of every path that takes one, so all refuse the same things the same way."""
    name = f"{op}: temperature" if op else "temperature"
    if isinstance(temperature, torch.Tensor):
        check_numeric_tensor(name, temperature)
        return temperature.detach()
    if not is_number(temperature):
        raise TypeError(f"{name}: expected a number or a tensor, got {type(temperature).__name__}")
    return as_float(name, temperature)


def temperature_per_row(temperature, n: int, device, *, allow_zero: bool, op: str = "",
                        check_values: bool = False) -> torch.Tensor:
    """Per-row float32 temperatures [N]. A scalar is checked here (finite, > 0, or >= 0 where 0 means
    greedy). Tensor values are checked row by row by the kernels, or here with check_values (one host
    synchronisation: the paths composed of torch ops, which have no kernel to check them)."""
    t = temperature_value(temperature, op)
    name = f"{op}: temperature" if op else "temperature"
    want = ">=" if allow_zero else ">"
    if isinstance(t, float) and not (math.isfinite(t) and (t > 0 or (allow_zero and t == 0))):
        raise ValueError(f"{name} must be finite and {want} 0, got {temperature}")
    out = _per_row(t, n, torch.float32, device, name, 1.0)
    if check_values and isinstance(t, torch.Tensor):
        bad = ~(torch.isfinite(out) & ((out >= 0) if allow_zero else (out > 0)))
        if bool(bad.any()):
            r = int(torch.nonzero(bad)[0])
            raise ValueError(f"{name} must be finite and {want} 0, row {r} has {float(out[r])}")
    return out


def expand_params(n: int, device, temperature: Param, top_k: Param, top_p: Param, min_p: Param):
    """Per-row (temperature f32, top_k i64, top_p f64, min_p f64); scalars are checked here, tensor
    values row by row in the kernels (CPU) or before launch (CUDA)."""
    for name, v, ok, want in (
        ("top_p", top_p, lambda x: 0 < x <= 1, "in (0, 1]"),
        ("min_p", min_p, lambda x: 0 <= x <= 1, "in [0, 1]"),
    ):
        if is_number(v) and not ok(as_float(name, v)):
            raise ValueError(f"{name} must be {want}, got {v}")
    return (
        temperature_per_row(temperature, n, device, allow_zero=True),
        _per_row(top_k, n, torch.int64, device, "top_k", 0),
        _per_row(top_p, n, torch.float64, device, "top_p", 1.0),
        _per_row(min_p, n, torch.float64, device, "min_p", 0.0),
    )


def describe(temperature: Param, top_k: Param, top_p: Param, min_p: Param) -> dict:
    """JSON-able summary of the parameters, for file metadata."""
    def d(v):
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else "per-row"
        if is_number(v):  # numpy scalars are not JSON-able
            return int(v) if isinstance(v, numbers.Integral) else float(v)
        return v
    return {"temperature": d(temperature), "top_k": d(top_k), "top_p": d(top_p), "min_p": d(min_p)}
