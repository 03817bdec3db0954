"""det_exp16, the 16-lane exp of the CPU capture kernel's AVX-512 path (csrc/cpu/det_exp_avx512.h), gives
det_exp's bits (csrc/kernels/kernel_math.h) on every float in its domain: it is not a translation of the
scalar function's operations (one roundscale and one scalef replace five), so only an exhaustive check
shows it decides supports as the scalar, AVX2 and CUDA paths do."""
import subprocess

import pytest


@pytest.mark.slow  # seconds: kept out of the fast loop, run by make test
def test_det_exp16_matches_det_exp_on_every_float_in_its_domain(cpp_program):
    out = subprocess.run([cpp_program("det_exp16_check")], capture_output=True, text=True, timeout=300).stdout
    if out.strip() == "skip":
        pytest.skip("no AVX-512 on this CPU")
    words = out.split()
    assert words[-4:-2] == ["checked", words[-3]] and words[-2] == "mismatches", out
    assert int(words[-3]) > 0x42B00000, out  # every pattern from -0 to -88, and the edges
    assert words[-1] == "0", out
