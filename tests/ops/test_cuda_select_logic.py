"""The CUDA kernel's selection logic, emulated on the host (tests/cpp/cuda_select_emulation.cpp),
against a brute-force transcription of the semantics. Runs without a GPU."""
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(__file__)
CSRC = os.path.join(HERE, "..", "..", "csrc")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path_factory.mktemp("emu") / "emu")
    # -ffp-contract=off: the same rounding as the kernels' shared math
    subprocess.run([cxx, "-O2", "-std=c++20", "-ffp-contract=off", "-I", CSRC,
                    os.path.join(HERE, "..", "cpp", "cuda_select_emulation.cpp"), "-o", exe], check=True)
    return exe


@pytest.mark.parametrize("capacity", [0, 1, 3, 16, 256, 100000])
def test_selection_matches_semantics(emulator, capacity):
    out = subprocess.run([emulator, str(capacity)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().startswith("0/")
