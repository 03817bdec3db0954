"""mask-replay's entry on verl's ``verl.plugins`` entry point (setup.py), the switch of the verl drop-in.

verl 0.9.1 imports every ``verl.plugins`` entry point at ``import verl``, in every process (driver, Ray
workers; verl/__init__.py, unless VERL_USE_EXTERNAL_PLUGINS=none). With ``MASK_REPLAY_VERL=1`` in the
environment this installs the trainer side (trainer.install(), and megatron_engine.install() where
megatron-core is importable); unset or "0", verl is left unchanged and
nothing of verl is imported from here. verl swallows a plugin's load errors (logged at debug level), so
a failed install is logged here as an error as well.
"""
from __future__ import annotations

import importlib.util
import logging
import os

__all__ = ["SWITCH", "enabled"]

SWITCH = "MASK_REPLAY_VERL"
_ON, _OFF = ("1",), ("", "0")


def enabled() -> bool:
    value = os.environ.get(SWITCH, "").strip()
    if value not in _ON + _OFF:
        raise ValueError(f"{SWITCH}={value!r}: expected 1 (replay on) or 0 / unset (off)")
    return value in _ON


_LOG = logging.getLogger(__name__)

# Conditional on the switch: trainer.py imports verl's FSDP engine, which an off run must neither pay for
# nor be touched by. verl swallows a plugin's load errors, so a failed install is logged here as well.
if enabled():
    try:
        import mask_replay.integrations.verl.trainer as verl_trainer

        verl_trainer.install()
        # verl's Megatron engine needs megatron-core (verl[megatron]); without it only the FSDP side installs
        if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
            import mask_replay.integrations.verl.megatron_engine as verl_megatron

            verl_megatron.install()
    except Exception:
        _LOG.exception("mask_replay: %s=1 but the verl drop-in did not install", SWITCH)
        raise
