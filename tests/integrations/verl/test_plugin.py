"""The switch: MASK_REPLAY_VERL read by the verl.plugins entry point. The parsing runs in the main suite
(plugin.py imports nothing of verl when off); the entry point itself, loaded by the real `import verl`
in a fresh interpreter, runs where verl is installed (`make check-verl`)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from mask_replay.integrations.verl import plugin

HAS_VERL = importlib.util.find_spec("verl") is not None


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_switch_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(plugin.SWITCH, raising=False)
    else:
        monkeypatch.setenv(plugin.SWITCH, value)
    assert plugin.enabled() is on


def test_unknown_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv(plugin.SWITCH, "yes")
    with pytest.raises(ValueError, match="MASK_REPLAY_VERL='yes': expected 1"):
        plugin.enabled()


# the trainer side at `import verl`; the agent-loop side by the post-import hooks when verl's modules are
# imported afterwards (as in an agent-loop worker); vllm never imported (the rollout server's hook needs it:
# test_rollout_vllm.py)
PROBE = """
import sys, verl
from verl.workers.engine.fsdp import transformer_impl
from verl.utils import torch_functional
patched = transformer_impl.logprobs_from_logits is not torch_functional.logprobs_from_logits
from verl.experimental.agent_loop import agent_loop
from verl.utils.tokenizer import continuous_token
from verl.workers.rollout import llm_server
hooked = ["mask_replay" in f.__code__.co_filename for f in (agent_loop.AgentLoopWorker._run_agent_loop,
          agent_loop.AgentLoopWorker._agent_loop_postprocess, llm_server.LLMServerClient.generate,
          llm_server.LLMServerManager.__init__, continuous_token.ContinuousTokenBuilder.align_response_metadata)]
print(patched, "mask_replay.integrations.verl.trainer" in sys.modules, all(hooked), any(hooked),
      "vllm" in sys.modules, "wrapt" in sys.modules)
"""


@pytest.mark.skipif(not HAS_VERL, reason="verl 0.9.1 is installed by `make venv-verl`")
@pytest.mark.slow  # two fresh interpreters importing verl (~10 s each)
@pytest.mark.parametrize("value,expected", [("1", "True True True True False True"),
                                            ("0", "False False False False False False")])
def test_import_verl_installs_replay_only_when_switched_on(value, expected):
    env = {**os.environ, plugin.SWITCH: value}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
