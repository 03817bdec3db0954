"""build_info's CPU fields say which path capture's CPU kernel runs now, not only what was compiled:
the AVX-512 loops are chosen at run time (csrc/cpu/capture_cpu_avx512.h) from the CPU and
MASK_REPLAY_NO_AVX512, which build_info reads on every call as the dispatch does."""
import pytest

import mask_replay
from tests.helpers import HAS_AVX512, run

BUILD_ISAS = {"avx2", "baseline"}


def _info(monkeypatch, no_avx512):
    if no_avx512 is None:
        monkeypatch.delenv("MASK_REPLAY_NO_AVX512", raising=False)
    else:
        monkeypatch.setenv("MASK_REPLAY_NO_AVX512", no_avx512)
    return mask_replay.build_info()


@pytest.mark.parametrize("no_avx512", [None, "", "0"])
def test_the_avx512_path_is_reported_where_capture_takes_it(monkeypatch, no_avx512):
    info = _info(monkeypatch, no_avx512)
    assert info["cpu_build_isa"] in BUILD_ISAS
    if HAS_AVX512:
        assert info["cpu_avx512"] == "used" and info["cpu_isa"] == "avx512", info
    else:  # the CPU lacks it (or the build has no x86 vector paths): the build's own loops run
        assert info["cpu_avx512"] in {"unsupported-cpu", "not-built"}, info
        assert info["cpu_isa"] == info["cpu_build_isa"], info


@pytest.mark.parametrize("no_avx512", ["1", "yes"])
def test_turning_avx512_off_is_reported(monkeypatch, no_avx512):
    info = _info(monkeypatch, no_avx512)
    assert info["cpu_isa"] == info["cpu_build_isa"] and info["cpu_isa"] in BUILD_ISAS, info
    assert info["cpu_avx512"] == ("disabled-by-env" if HAS_AVX512 else info["cpu_avx512"]), info
    assert info["cpu_avx512"] != "used"


def test_info_prints_the_path_that_runs(monkeypatch):
    monkeypatch.setenv("MASK_REPLAY_NO_AVX512", "1")
    off = run("info")
    assert off.exit_code == 0, off.output
    build = mask_replay.build_info()["cpu_build_isa"]
    assert f"build cpu_isa: {build}\n" in off.output and f"build cpu_build_isa: {build}\n" in off.output
    monkeypatch.delenv("MASK_REPLAY_NO_AVX512")
    on = run("info")
    assert on.exit_code == 0, on.output
    assert ("build cpu_isa: avx512\n" in on.output) == HAS_AVX512, on.output
