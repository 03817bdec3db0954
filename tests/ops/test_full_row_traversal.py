"""The CUDA replay kernels' full-row traversal (csrc/kernels/row_groups.h: a block per row, 16-byte
loads where the row allows), emulated on the host: every element once, and the same elements in
the same order per thread for every layout, so a row's sums do not depend on its layout."""
import subprocess

import pytest


@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
def test_every_element_once_in_a_layout_independent_order(cpp_program):
    out = subprocess.run([cpp_program("row_groups_emulation")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().startswith("0/")
