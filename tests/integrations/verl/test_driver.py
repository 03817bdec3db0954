"""The driver side (driver.py) and the CPU platform (cpu_platform.py) against verl 0.9.1 (skipped without verl):
the switch forwarded in main_ppo's runtime env, a rollout that is not vLLM refused before Ray starts, a batch
without supports refused before verl's first log-prob pass, and VERL_PLATFORM=cpu selecting the CPU platform."""
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 is installed by `make venv-verl` / `make venv-verl-e2e`")

from omegaconf import OmegaConf  # noqa: E402  (verl's dependency)

from mask_replay.errors import InputError  # noqa: E402
from mask_replay.integrations.verl import driver  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402


def rollout_config(name="vllm"):
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": name, "logprobs_mode": "processed_logprobs",
                                                               "mtp": None}}})


@pytest.fixture
def constants_ppo():
    module = SimpleNamespace(get_ppo_ray_runtime_env=lambda config=None: {"env_vars": {"NCCL_DEBUG": "WARN"}})
    driver.install_runtime_env(module, ("MASK_REPLAY_VERL", "VERL_PLATFORM"))
    yield module
    driver.uninstall()


def test_the_switch_and_the_platform_reach_every_ray_worker(constants_ppo, monkeypatch):
    monkeypatch.setenv("MASK_REPLAY_VERL", "1")
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    env = constants_ppo.get_ppo_ray_runtime_env(rollout_config())
    assert env["env_vars"] == {"NCCL_DEBUG": "WARN", "MASK_REPLAY_VERL": "1", "VERL_PLATFORM": "cpu"}


def test_a_rollout_that_is_not_vllm_is_refused_before_ray_starts(constants_ppo, monkeypatch):
    monkeypatch.setenv("MASK_REPLAY_VERL", "1")
    with pytest.raises(InputError, match="this run uses 'sglang'") as e:
        constants_ppo.get_ppo_ray_runtime_env(rollout_config("sglang"))
    assert e.value.key == "actor_rollout_ref.rollout.name"


def test_workers_overridden_to_another_setting_are_refused(constants_ppo, monkeypatch):
    monkeypatch.setenv("MASK_REPLAY_VERL", "1")
    config = rollout_config()
    config.ray_kwargs = {"ray_init": {"runtime_env": {"env_vars": {"MASK_REPLAY_VERL": "0"}}}}
    with pytest.raises(InputError, match="MASK_REPLAY_VERL=1 in main_ppo's environment but '0' for the Ray") as e:
        constants_ppo.get_ppo_ray_runtime_env(config)
    assert e.value.key == "ray_kwargs.ray_init.runtime_env.env_vars.MASK_REPLAY_VERL"


def test_uninstall_puts_verls_function_back(constants_ppo):
    wrapped = constants_ppo.get_ppo_ray_runtime_env
    driver.uninstall()
    assert constants_ppo.get_ppo_ray_runtime_env is not wrapped
    assert constants_ppo.get_ppo_ray_runtime_env() == {"env_vars": {"NCCL_DEBUG": "WARN"}}


class FakeTrainer:
    def _compute_old_log_prob(self, batch):
        return "verl's pass"


def fake_batch(supports):
    attention = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # prompt 2 columns: responses of 2 and 3 tokens
    return SimpleNamespace(batch={"prompts": torch.zeros(2, 2), "attention_mask": attention},
                           non_tensor_batch=supports)


@pytest.fixture
def ray_trainer():
    module = SimpleNamespace(RayPPOTrainer=type("RayPPOTrainer", (FakeTrainer,), {
        "_compute_old_log_prob": FakeTrainer._compute_old_log_prob}))
    driver.install_trainer_check(module)
    yield module
    driver.uninstall()


def rows(n):
    return {"token_ids": np.zeros(n, np.int32), "offsets": np.arange(n + 1, dtype=np.int64)}


def test_a_batch_with_supports_goes_on_to_verls_log_prob_pass(ray_trainer):
    batch = fake_batch({SUPPORT_KEY: np.array([rows(2), rows(3)], dtype=object)})
    assert ray_trainer.RayPPOTrainer()._compute_old_log_prob(batch) == "verl's pass"


def test_a_batch_without_supports_stops_the_run_naming_the_setting(ray_trainer):
    with pytest.raises(InputError, match="MASK_REPLAY_VERL=1 but the rollout batch carries no") as e:
        ray_trainer.RayPPOTrainer()._compute_old_log_prob(fake_batch({}))
    assert e.value.key == "MASK_REPLAY_VERL"


def test_a_sample_short_of_rows_stops_the_run(ray_trainer):
    batch = fake_batch({SUPPORT_KEY: np.array([rows(2), rows(2)], dtype=object)})
    with pytest.raises(InputError, match="sample 1 has 3 response tokens but 2 support rows"):
        ray_trainer.RayPPOTrainer()._compute_old_log_prob(batch)


# a fresh interpreter, as each Ray worker is: `import verl` loads the plugin, VERL_PLATFORM=cpu picks the CPU
# platform, the engines register for "cpu", verl's distributed default is gloo only, the driver hooks are on
PROBE = """
import verl
from verl.plugin.platform.platform_manager import get_platform
import verl.trainer.constants_ppo as constants_ppo, verl.trainer.ppo.ray_trainer as ray_trainer
import verl.utils.distributed as distributed
from verl.workers.engine.base import EngineRegistry
hooked = ["mask_replay" in f.__code__.co_filename for f in (constants_ppo.get_ppo_ray_runtime_env,
          ray_trainer.RayPPOTrainer._compute_old_log_prob)]
print(type(get_platform()).__name__, get_platform().ray_resource_name(),
      EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__,
      "mask_replay" in distributed.initialize_global_process_group_ray.__code__.co_filename, all(hooked), any(hooked))
"""


@pytest.mark.slow  # fresh interpreters importing verl (~15 s each)
@pytest.mark.parametrize("replay,expected", [("1", "CpuPlatform GPU FSDPEngineWithLMHead True True True"),
                                             ("0", "CpuPlatform GPU FSDPEngineWithLMHead True False False")])
def test_import_verl_with_the_cpu_platform(replay, expected):
    env = {**os.environ, "VERL_PLATFORM": "cpu", "MASK_REPLAY_VERL": replay}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == expected
