"""Driver side of the verl drop-in: the switch reaches every Ray worker, and a run without supports stops at start-up.

Follows the released verl 0.9.1 files:
- verl/trainer/constants_ppo.py ``get_ppo_ray_runtime_env(config)`` (wrapped): main_ppo's ``run_ppo`` calls it
  once, in the user's process, before ``ray.init`` and merges the result under ``ray_kwargs.ray_init.runtime_env``.
  The wrapper first runs the rollout config's start-up checks (rollout.check_rollout_config: a rollout other
  than vLLM is refused here, before Ray starts), then adds ``MASK_REPLAY_VERL`` (and ``VERL_PLATFORM`` where set)
  to the runtime env's ``env_vars``: Ray sets those in every worker of the job on every node, where a variable of
  the launching shell reaches only the workers of a cluster this process starts itself. An explicit
  ``MASK_REPLAY_VERL`` in ``ray_kwargs.ray_init.runtime_env.env_vars`` would win (verl merges the user's on
  top): one that differs from the driver's is refused here; the batch check below catches a worker that
  ends up without the switch anyway (another cluster's raylet environment, a node without mask-replay).
- verl/trainer/ppo/ray_trainer.py ``RayPPOTrainer._compute_old_log_prob(batch)`` (wrapped): ``fit`` calls it on
  each step's batch (rollout, rewards united) before verl's own log-prob pass. The wrapper checks that every
  response token has a recorded support row (batch_check.check_batch_supports) and raises one InputError naming
  MASK_REPLAY_VERL otherwise, so a run whose rollout workers did not record (variable missing, plugin not loaded
  in the rollout actor, a rollout that is not verl's vLLM server) stops at its first step, before any update.

plugin.py installs these with ``MASK_REPLAY_VERL=1`` by post-import hooks. Only verl's legacy trainer
(``trainer.use_v1=False``, RayPPOTrainer) is covered: verl 0.9.1's default v1 trainer needs TransferQueue.
"""
from __future__ import annotations

import functools
import os
from typing import Any

try:  # verl is an optional dependency: make venv-verl
    import verl  # noqa: F401
    from omegaconf import OmegaConf  # verl's config library
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mask_replay.integrations.verl.driver needs verl 0.9.1: make venv-verl") from exc

from mask_replay.errors import InputError
from mask_replay.integrations.verl import rollout as verl_rollout
from mask_replay.integrations.verl.batch_check import check_batch_supports, response_lengths

__all__ = ["install_runtime_env", "install_trainer_check", "uninstall"]

_ORIGINALS: list[tuple[Any, str, Any]] = []  # (owner, attribute, verl's own value), in install order


def _installed(owner, name: str) -> bool:
    return any(o is owner and n == name for o, n, _ in _ORIGINALS)


def install_runtime_env(constants_ppo, forward=()) -> None:
    """Wrap ``constants_ppo.get_ppo_ray_runtime_env`` (idempotent); ``forward``: the variables that, set in the
    driver, go to every Ray worker (plugin.py passes its switches: plugin.py imports this module, not back)."""
    verl_rollout.check_version()
    if _installed(constants_ppo, "get_ppo_ray_runtime_env"):
        return
    original = constants_ppo.get_ppo_ray_runtime_env
    _ORIGINALS.append((constants_ppo, "get_ppo_ray_runtime_env", original))

    @functools.wraps(original)
    def get_ppo_ray_runtime_env(config=None):
        if config is not None:
            verl_rollout.check_rollout_config(config.actor_rollout_ref.rollout)
            _check_user_env_vars(config, forward)
        runtime_env = original(config)
        env_vars = runtime_env.setdefault("env_vars", {})
        for name in forward:
            if os.environ.get(name) is not None:
                env_vars[name] = os.environ[name]
        return runtime_env

    constants_ppo.get_ppo_ray_runtime_env = get_ppo_ray_runtime_env


def _check_user_env_vars(config, forward) -> None:
    """verl merges ``ray_kwargs.ray_init.runtime_env`` over the runtime env built here: a forwarded variable set
    there to another value than the driver's would reach the workers instead (workers without replay)."""
    env_vars = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars", default=None) or {}
    for name in forward:
        if name in env_vars and os.environ.get(name) is not None and str(env_vars[name]) != os.environ[name]:
            raise InputError(f"{name}={os.environ[name]} in main_ppo's environment but {env_vars[name]!r} for the "
                             "Ray workers: the workers would not run what the driver does",
                             key=f"ray_kwargs.ray_init.runtime_env.env_vars.{name}",
                             hint=f"drop that override (main_ppo forwards {name} to every worker)")


def install_trainer_check(ray_trainer) -> None:
    """Wrap ``ray_trainer.RayPPOTrainer._compute_old_log_prob`` (idempotent)."""
    verl_rollout.check_version()
    cls = ray_trainer.RayPPOTrainer
    if _installed(cls, "_compute_old_log_prob"):
        return
    original = cls.__dict__["_compute_old_log_prob"]
    _ORIGINALS.append((cls, "_compute_old_log_prob", original))

    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        prompt_length = batch.batch["prompts"].shape[-1]
        check_batch_supports(batch.non_tensor_batch,
                             response_lengths(batch.batch["attention_mask"].cpu().numpy(), prompt_length))
        return original(self, batch, *args, **kwargs)

    cls._compute_old_log_prob = _compute_old_log_prob


def uninstall() -> None:
    """Put verl's own functions back."""
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        setattr(owner, name, original)
