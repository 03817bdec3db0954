"""Replay in verl 0.9.1's Megatron engine, with the real verl and megatron-core (skipped without them;
`make check-verl` runs it).

Here, in one process: install / uninstall, the start-up refusals through verl's EngineRegistry.new,
and the switch loading the Megatron side at `import verl`. The numbers (log-probs, gradients, metrics,
bit-identity of the rows replay leaves alone, bad input) are checked with tensor parallelism 2 on two
CPU ranks by verl_megatron_worker.py, whose docstring lists what is verl's own code and what stands in.
"""
import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is installed by `make venv-verl`")
pytest.importorskip("megatron.core", reason="megatron-core is installed by `make venv-verl`")

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from verl.models.mcore import registry  # noqa: E402
from verl.utils.megatron import tensor_parallel  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.megatron import transformer_impl  # noqa: E402

from mask_replay.integrations.verl import megatron_engine, plugin, trainer  # noqa: E402
from tests.helpers import torchrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "verl_megatron_worker.py")
KEY = "actor_rollout_ref.actor.megatron"


@pytest.fixture
def replay():
    megatron_engine.install()
    yield
    megatron_engine.uninstall()
    trainer.uninstall()


@pytest.fixture
def built(monkeypatch):
    """EngineRegistry.new's engine class replaced by one that records its kwargs (no Megatron model)."""
    made = []
    monkeypatch.setattr(EngineRegistry, "get_engine_cls", classmethod(lambda cls, m, b: lambda **kw: made.append(kw)))
    return made


def megatron_config(**overrides):
    cfg = dict(context_parallel_size=1, dynamic_context_parallel=False, pipeline_model_parallel_size=1,
               virtual_pipeline_model_parallel_size=None, use_fused_kernels=False)
    return SimpleNamespace(**{**cfg, **overrides})


@pytest.mark.parametrize("key,value,what", [("dynamic_context_parallel", True, "dynamic context parallelism"),
                                            ("pipeline_model_parallel_size", 2, "pipeline stages"),
                                            ("virtual_pipeline_model_parallel_size", 2, "virtual pipeline stages")])
def test_megatron_layouts_not_built_are_refused_at_start_up(replay, built, key, value, what):
    with pytest.raises(NotImplementedError, match=f"{what} in the Megatron engine is not supported yet "
                                                  rf"\({KEY}.{key}={value!r}\)"):
        EngineRegistry.new(model_type="language_model", backend="megatron",
                           engine_config=megatron_config(**{key: value}))
    assert built == []


def test_megatron_backend_passes_start_up_once_installed(built):
    new = dict(model_type="language_model", backend="megatron", engine_config=megatron_config())
    trainer.install()
    try:
        with pytest.raises(NotImplementedError, match="engine backend 'megatron' is not supported yet"):
            EngineRegistry.new(**new)
        megatron_engine.install()
        EngineRegistry.new(**new)
        EngineRegistry.new(**{**new, "engine_config": megatron_config(context_parallel_size=2)})
        assert [kw["engine_config"].context_parallel_size for kw in built] == [1, 2]
        with pytest.raises(NotImplementedError, match="use_fused_kernels=True is not supported yet"):
            EngineRegistry.new(**{**new, "engine_config": megatron_config(use_fused_kernels=True)})
        megatron_engine.uninstall()
        with pytest.raises(NotImplementedError, match="engine backend 'megatron' is not supported yet"):
            EngineRegistry.new(**new)
    finally:
        megatron_engine.uninstall()
        trainer.uninstall()


def test_uninstall_puts_verls_functions_back():
    cls = transformer_impl.MegatronEngineWithLMHead
    before = (registry.gptmodel_forward_model_engine, transformer_impl.vocab_parallel_log_probs_from_logits,
              cls.__dict__["_lm_head_logits_processor"], cls.__dict__["postprocess_micro_batch_func"])
    assert before[1] is tensor_parallel.vocab_parallel_log_probs_from_logits
    megatron_engine.install()
    assert megatron_engine.installed() and trainer.installed()
    assert registry.gptmodel_forward_model_engine is not before[0]
    megatron_engine.uninstall()
    trainer.uninstall()
    after = (registry.gptmodel_forward_model_engine, transformer_impl.vocab_parallel_log_probs_from_logits,
             cls.__dict__["_lm_head_logits_processor"], cls.__dict__["postprocess_micro_batch_func"])
    assert all(a is b for a, b in zip(before, after))
    assert "megatron" not in trainer.MORE_BACKENDS


PROBE = """
import sys, verl
from verl.workers.engine.megatron import transformer_impl
from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits as verls
patched = transformer_impl.vocab_parallel_log_probs_from_logits is not verls
print(patched, "mask_replay.integrations.verl.megatron_engine" in sys.modules)
"""


@pytest.mark.slow  # a fresh interpreter importing verl and megatron-core (switched off: test_plugin.py)
def test_import_verl_installs_the_megatron_side_when_switched_on():
    env = {**os.environ, plugin.SWITCH: "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True True"


@pytest.mark.slow  # torchrun, two ranks importing verl and megatron-core
def test_tensor_parallel_two_ranks(tmp_path):
    proc = torchrun(2, WORKER, "tp", timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        for layout in ("thd", "thd-bucket", "bshd", "bfloat16", ""):
            assert f"rank {rank}: {layout} ok".replace("  ", " ") in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow  # torchrun, four ranks importing verl and megatron-core
def test_tensor_and_context_parallel_four_ranks(tmp_path):
    proc = torchrun(4, WORKER, "tp-cp", timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(4):
        for layout in ("thd", "thd-bucket"):
            assert f"rank {rank}: tp=2 cp=2 {layout} ok" in proc.stdout, proc.stdout[-3000:]
