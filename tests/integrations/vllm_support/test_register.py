"""The plugin's switch and start-up checks (integrations/vllm_support/__init__.py), without vLLM: off means
nothing is imported or patched; a vLLM outside the read releases, or the Rust front end, is one error."""
import sys

import pytest

from mask_replay.integrations import vllm_support


def test_off_by_default_touches_nothing(monkeypatch):
    monkeypatch.delenv(vllm_support.ENV, raising=False)
    vllm_support.register()
    assert vllm_support.installed() == [] and not vllm_support.active()
    assert "vllm" not in sys.modules  # not even imported


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False), ("off", False)])
def test_switch_values(value, on):
    assert vllm_support.enabled({vllm_support.ENV: value}) is on


def test_a_switch_value_that_is_neither_is_named():
    with pytest.raises(RuntimeError, match="MASK_REPLAY_VLLM_SUPPORT='maybe': expected 1"):
        vllm_support.enabled({vllm_support.ENV: "maybe"})


@pytest.mark.parametrize("version", ["0.24.0", "0.32.0", "0.33.1"])
def test_read_versions_pass(version):
    vllm_support.check_version(version, environ={})


@pytest.mark.parametrize("version", ["0.23.0", "0.34.0", "0.3.2", "1.0.0"])
def test_other_versions_are_refused_at_start_up(version):
    with pytest.raises(RuntimeError, match=f"this is vLLM {version}"):
        vllm_support.check_version(version, environ={})


def test_the_rust_front_end_is_refused():
    with pytest.raises(RuntimeError, match="VLLM_USE_RUST_FRONTEND"):
        vllm_support.check_version("0.32.0", environ={"VLLM_USE_RUST_FRONTEND": "1"})
