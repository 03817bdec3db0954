"""mask-replay's entry on verl's ``verl.plugins`` entry point (setup.py), the switch of the verl drop-in.

verl 0.9.1 imports every ``verl.plugins`` entry point at ``import verl``, in every process (driver, Ray
workers; verl/__init__.py, unless VERL_USE_EXTERNAL_PLUGINS=none). With ``MASK_REPLAY_VERL=1`` in the
environment this installs the trainer side now (trainer.install()) and registers post-import hooks
(wrapt's) that install the rest in whichever process imports the verl module it patches, right after
that module is imported:

- verl.workers.rollout.vllm_rollout.vllm_async_server (the vLLM rollout server's Ray actor, where
  ``ray.remote(vLLMHttpServer)`` brings the class by module reference): rollout.install(); its
  launch_server then switches mask-replay's vLLM plugin on for the engine it starts. vllm is imported
  only by that module itself, never from here: a trainer-only process never imports it.
- verl.workers.rollout.llm_server (agent-loop workers; the driver): rollout.install_client(), the
  client's support collection and the driver's start-up check of the rollout config.
- verl.experimental.agent_loop.agent_loop (agent-loop workers): agent_loop.install(), one support row
  per response token across the turns of a sample.
- verl.trainer.constants_ppo (main_ppo's own process) and verl.trainer.ppo.ray_trainer (the trainer's
  driver, verl's TaskRunner actor): driver.py, the switch forwarded to every Ray worker in main_ppo's
  runtime env, the rollout config checked before Ray starts, and each batch checked for a support row
  per response token before verl's first log-prob pass (a worker that did not record stops the run there).

Independent of the switch, ``VERL_PLATFORM=cpu`` (verl's own platform override) registers mask-replay's
CPU platform (cpu_platform.py) in verl's platform registry and verl's FSDP engines for device "cpu", so
that verl runs on a machine without an accelerator (make experiment-verl-e2e).

The Megatron engine's replay (megatron_engine.install()) installs with the trainer side where verl's
engine registry (imported by trainer.py) has imported verl's Megatron engine, i.e. where megatron-core
is installed; elsewhere megatron_engine.py is never imported.

Unset or "0", verl is left unchanged and nothing of verl (nor wrapt) is imported from here. verl swallows
a plugin's load errors (logged at debug level), so a failed install is logged here as an error as well; an
error in a hook is raised by the import that triggered it (a start-up error of that process).
"""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["SWITCH", "enabled"]

SWITCH = "MASK_REPLAY_VERL"
PLATFORM_SWITCH = "VERL_PLATFORM"  # verl's own; "cpu" selects cpu_platform.CpuPlatform
_ON, _OFF = ("1",), ("", "0")
VLLM_SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server"
LLM_SERVER = "verl.workers.rollout.llm_server"
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
MEGATRON_ENGINE = "verl.workers.engine.megatron.transformer_impl"
FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
CONSTANTS_PPO = "verl.trainer.constants_ppo"
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"


def cpu_platform_requested() -> bool:
    return os.environ.get(PLATFORM_SWITCH, "").strip().lower() == "cpu"


def enabled() -> bool:
    value = os.environ.get(SWITCH, "").strip()
    if value not in _ON + _OFF:
        raise ValueError(f"{SWITCH}={value!r}: expected 1 (replay on) or 0 / unset (off)")
    return value in _ON


_LOG = logging.getLogger(__name__)


if cpu_platform_requested():
    try:
        # wrapt (the [verl] extra): the engines register for "cpu" right after verl's FSDP engine module loads
        import wrapt

        import mask_replay.integrations.verl.cpu_platform as verl_cpu_platform

        wrapt.register_post_import_hook(verl_cpu_platform.register_engines, FSDP_ENGINE)
        wrapt.register_post_import_hook(verl_cpu_platform.install_distributed, verl_cpu_platform.DISTRIBUTED_MODULE)
        # only where vLLM itself is imported (the rollout server's processes): the hook never imports it
        wrapt.register_post_import_hook(verl_cpu_platform.install_vllm_live_weights,
                                        verl_cpu_platform.VLLM_LAYER_UTILS_MODULE)
    except Exception:
        _LOG.exception("mask_replay: %s=cpu but mask-replay's CPU platform for verl did not register", PLATFORM_SWITCH)
        raise


# Conditional on the switch: trainer.py imports verl's FSDP engine, which an off run must neither pay for
# nor be touched by (rollout.py and agent_loop.py import verl's modules only when their hooks hand them
# over). verl swallows a plugin's load errors, so a failed install is logged here as well.
if enabled():
    try:
        # wrapt (the [verl] extra) is needed only with the switch on: its post-import hooks
        import wrapt

        import mask_replay.integrations.verl.agent_loop as verl_agent_loop
        import mask_replay.integrations.verl.driver as verl_driver
        import mask_replay.integrations.verl.rollout as verl_rollout
        import mask_replay.integrations.verl.trainer as verl_trainer

        HOOKS = {VLLM_SERVER: lambda module: verl_rollout.install(module.vLLMHttpServer),
                 LLM_SERVER: verl_rollout.install_client,
                 AGENT_LOOP: verl_agent_loop.install,
                 CONSTANTS_PPO: lambda module: verl_driver.install_runtime_env(module, (SWITCH, PLATFORM_SWITCH)),
                 RAY_TRAINER: verl_driver.install_trainer_check}
        for _name, _hook in HOOKS.items():
            wrapt.register_post_import_hook(_hook, _name)
        verl_trainer.install()
        # trainer.py imported verl's engine registry, which imports verl's Megatron engine where megatron-core
        # is installed (verl/workers/engine/__init__.py); where it did, its replay installs too
        if MEGATRON_ENGINE in sys.modules:
            import mask_replay.integrations.verl.megatron_engine as verl_megatron

            verl_megatron.install()
    except Exception:
        _LOG.exception("mask_replay: %s=1 but the verl drop-in did not install", SWITCH)
        raise
