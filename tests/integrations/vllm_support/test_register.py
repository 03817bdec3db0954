"""The plugin's switch and start-up checks (integrations/vllm_support/__init__.py), without vLLM: off means
nothing is imported or patched; a vLLM outside the read releases, or the Rust front end, is one error."""
import sys

import pytest

from mask_replay.integrations import vllm_support
from tests.integrations.vllm_support.fakes import LogprobsLists, LogprobsTensors


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


@pytest.mark.parametrize("version", ["0.24.0", "0.32.0", "0.33.1", "0.34.0"])
def test_read_versions_pass(version):
    vllm_support.check_version(version, environ={})


@pytest.mark.parametrize("version", ["0.23.0", "0.35.0", "0.3.2", "1.0.0"])
def test_other_versions_are_refused_at_start_up(version):
    with pytest.raises(RuntimeError, match=f"this is vLLM {version}"):
        vllm_support.check_version(version, environ={})


def test_the_rust_front_end_is_refused():
    with pytest.raises(RuntimeError, match="VLLM_USE_RUST_FRONTEND"):
        vllm_support.check_version("0.32.0", environ={"VLLM_USE_RUST_FRONTEND": "1"})


def fake_vllm(monkeypatch, version, *, v1=True, cpu_sampler=False):
    """The modules install() imports, as stand-ins (fakes.py's classes): which patches go where."""
    import types

    from tests.integrations.vllm_support.fakes import OutputKind, output_classes, sampler_class, v2_sampler_class

    def module(name, package=False, **attrs):
        m = types.ModuleType(name)
        if package:
            m.__path__ = []
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    for name in ("vllm.v1", "vllm.v1.engine", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample",
                 "vllm.v1.sample", "vllm.v1.worker.cpu"):
        module(name, package=True)
    module("vllm", package=True, __version__=version)
    module("vllm.config", get_current_vllm_config_or_none=lambda: None)
    module("vllm.sampling_params", RequestOutputKind=OutputKind)
    processor, state = output_classes()
    module("vllm.v1.engine.logprobs", LogprobsProcessor=processor)
    module("vllm.v1.engine.output_processor", RequestState=state)
    module("vllm.v1.outputs", LogprobsLists=LogprobsLists, LogprobsTensors=LogprobsTensors)
    module("vllm.v1.worker.gpu.sample.sampler", Sampler=v2_sampler_class())
    if v1:
        module("vllm.v1.sample.sampler", Sampler=sampler_class(), _SAMPLING_EPS=1e-5)
    else:
        monkeypatch.delitem(sys.modules, "vllm.v1.sample")
    if cpu_sampler:
        module("vllm.v1.worker.cpu.sampler", CPUSampler=v2_sampler_class(cpu=True))


@pytest.mark.parametrize("version, v1, cpu, v2_recorded", [
    ("0.34.0", False, True, True),  # no V1 runner; MRV2's CUDA and CPU samplers
    ("0.32.0", True, False, True),
    ("0.29.0", True, False, False),  # MRV2 before 0.30: refused at construction, not recorded
])
def test_install_patches_the_runners_of_each_release(monkeypatch, version, v1, cpu, v2_recorded):
    from mask_replay.integrations.vllm_support import _patching

    fake_vllm(monkeypatch, version, v1=v1, cpu_sampler=cpu)
    v2 = sys.modules["vllm.v1.worker.gpu.sample.sampler"].Sampler
    try:
        vllm_support.install()
        if v1:
            assert _patching.is_wrapped(sys.modules["vllm.v1.sample.sampler"].Sampler, "forward")
        assert _patching.is_wrapped(v2, "__call__") is v2_recorded
        assert _patching.is_wrapped(v2, "__init__")  # the refusal or the checks
        if cpu:
            assert _patching.is_wrapped(sys.modules["vllm.v1.worker.cpu.sampler"].CPUSampler, "__call__")
        assert _patching.is_wrapped(LogprobsTensors, "tolists") and _patching.is_wrapped(LogprobsLists, "slice_request")
        # + narrowing's two, + outputs' two
        assert len(vllm_support.installed()) == 3 * v1 + (3 if v2_recorded else 1) + 3 * cpu + 2 + 2
    finally:
        vllm_support.uninstall()
    assert vllm_support.installed() == [] and not _patching.is_wrapped(v2, "__init__")
    assert not _patching.is_wrapped(LogprobsTensors, "tolists")
