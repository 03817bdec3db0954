import os
import shutil
import subprocess

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(TESTS, "..", "csrc")


@pytest.fixture(scope="session")
def cpp_program(tmp_path_factory):
    """build(name) compiles tests/cpp/<name>.cpp against csrc/ once per session and returns the
    executable's path. The flags are the kernels' (-ffp-contract=off: the shared math must round
    exactly as in the extension)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    built = {}

    def build(name):
        if cxx is None:
            pytest.skip("no C++ compiler")
        if name not in built:
            exe = str(tmp_path_factory.mktemp("cpp") / name)
            flags = ["-O2", "-std=c++20", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas"]
            subprocess.run([cxx, *flags, "-I", CSRC, os.path.join(TESTS, "cpp", name + ".cpp"), "-o", exe], check=True)
            built[name] = exe
        return built[name]

    return build
