"""det_log (csrc/kernels/det_log.h), the min-p threshold's log on every device, pinned to the
correctly rounded float32 of ln(x) (mpmath at 200 bits) and to glibc's log (what the kernels
used before) wherever that one is right; then capture's min-p threshold on each device is it."""
import math
import struct
import subprocess

import mpmath  # installed with torch (through sympy)
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay as mr
from tests.helpers import DEVICES

# min_p values users set, and the edges of (0, 1]
COMMON_MIN_P = [1.0, 0.5, 0.3, 0.25, 0.2, 0.15, 0.1, 0.075, 0.05, 0.03, 0.02, 0.01, 0.005, 0.001, 1e-4, 1e-6,
                math.nextafter(1.0, 0.0), 2.0 ** -1022, 5e-324]


def bits32(value):
    return struct.unpack("<I", struct.pack("<f", value))[0]


@pytest.fixture(scope="module")
def det_log(cpp_program):
    exe = cpp_program("det_log_eval")

    def run(xs):
        out = subprocess.run([exe], input="\n".join(float(x).hex() for x in xs) + "\n", capture_output=True,
                             text=True, check=True).stdout.split()
        assert len(out) == len(xs)
        return [int(b, 16) for b in out]  # float32 bit patterns

    return run


def correctly_rounded_log(x):
    """The float32 nearest to ln(x), as a numpy float32 (ln of a double other than 1 is irrational:
    no ties)."""
    with mpmath.workprec(200):
        exact = mpmath.log(mpmath.mpf(x))
        guess = np.float32(float(exact))
        candidates = (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf)))
        return min(candidates, key=lambda c: abs(mpmath.mpf(float(c)) - exact))


def glibc_rounded_twice(x):
    """float32(std::log(x)): the old threshold log (Python's math.log is the C library's log)."""
    return np.float32(math.log(x))


def double_log_near_float32_boundary(x):
    """True where the double log lies within one double ulp of a float32 rounding boundary, the
    only places where rounding it again to float32 may miss the correctly rounded float32."""
    d = math.log(x)
    f = np.float32(d)
    mids = [(float(f) + float(np.nextafter(f, np.float32(s)))) / 2 for s in (-np.inf, np.inf)]
    return min(abs(d - m) for m in mids) <= math.ulp(d)


def boundary_input(y, toward_zero, steps):
    """A double x whose ln lies within a few double ulps of the float32 midpoint next to y."""
    y = np.float32(y)
    mid = (float(y) + float(np.nextafter(y, np.float32(0.0 if toward_zero else -np.inf)))) / 2
    x = math.exp(mid)
    for _ in range(abs(steps)):
        x = math.nextafter(x, 2.0 if steps > 0 else 0.0)
    return x


def double_rounding_cases(count):
    """min_p values whose glibc log, rounded to float32, misses the correctly rounded one."""
    found = []
    for i in range(5000):
        x = boundary_input(-0.5 - 0.0137 * i, i % 2 == 0, 0)
        if bits32(glibc_rounded_twice(x)) != bits32(correctly_rounded_log(x)):
            found.append(x)
            if len(found) == count:
                return found
    raise AssertionError(f"found only {len(found)} double-rounding cases")


def test_common_min_p_values(det_log):
    got = det_log(COMMON_MIN_P)
    for x, b in zip(COMMON_MIN_P, got):
        assert b == bits32(correctly_rounded_log(x)), x
        assert b == bits32(glibc_rounded_twice(x)), x


def test_special_values(det_log):
    got = det_log([0.0, -0.0, -1.0, float("nan"), float("inf"), 1.0])
    assert got[0] == got[1] == bits32(-math.inf)
    assert all(math.isnan(struct.unpack("<f", struct.pack("<I", b))[0]) for b in got[2:4])
    assert got[4] == bits32(math.inf)
    assert got[5] == 0  # +0.0: min_p = 1 keeps exactly the maxima


@given(st.lists(st.floats(min_value=0.0, max_value=1.0, exclude_min=True), min_size=1, max_size=64))
def test_random_min_p_pinned(det_log, xs):
    for x, b in zip(xs, det_log(xs)):
        assert b == bits32(correctly_rounded_log(x)), x.hex()
        if not double_log_near_float32_boundary(x):
            assert b == bits32(glibc_rounded_twice(x)), x.hex()


@given(st.lists(st.builds(boundary_input, st.floats(-700.0, -2.0 ** -10, width=32), st.booleans(), st.integers(-3, 3)),
                min_size=1, max_size=64))
def test_min_p_on_float32_rounding_boundaries(det_log, xs):
    for x, b in zip(xs, det_log(xs)):
        assert b == bits32(correctly_rounded_log(x)), x.hex()


def test_double_rounding_cases_are_rounded_once(det_log):
    # The cases C1 is about: float32(std::log(x)) is one ulp off there, det_log is not.
    xs = double_rounding_cases(20)
    for x, b in zip(xs, det_log(xs)):
        assert b == bits32(correctly_rounded_log(x)), x.hex()
        assert b != bits32(glibc_rounded_twice(x)), x.hex()


@pytest.mark.parametrize("device", DEVICES)
def test_capture_threshold_is_the_correctly_rounded_log(device):
    # Tokens at the threshold m + ln(min_p) (m = 0) and one float32 step either side: the one at
    # it is kept, the one below dropped. A threshold one ulp off (the old float32(std::log), or a
    # device log) keeps the one below or drops the one at it.
    for min_p in double_rounding_cases(4):
        at = correctly_rounded_log(min_p)
        row = [0.0, float(at), float(np.nextafter(at, np.float32(-np.inf))), float(np.nextafter(at, np.float32(0)))]
        logits = torch.tensor([row, row[:1] + row[1:][::-1]], dtype=torch.float32, device=device)
        mask = mr.capture(logits, min_p=min_p)
        assert mask.to_lists() == [[0, 1, 3], [0, 1, 3]], min_p.hex()
        ids, counts, overflow = mr.capture_fixed(logits, 4, min_p=min_p)
        assert counts.tolist() == [3, 3] and not overflow.any()
        assert ids[:, :3].tolist() == [[0, 1, 3], [0, 1, 3]]
