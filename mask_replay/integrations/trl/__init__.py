"""Replay inside TRL's GRPOTrainer (trl 1.16.x): `ReplayGRPOTrainer`, a drop-in subclass (docs/integrations/trl.md).

trainer.py (ReplayGRPOTrainer: recorded generation, log-probs renormalised over the recorded supports),
vllm_mode.py (its vLLM generation: the plugin's supports, or the processed log-probs that show them),
softcap.py (the soft-capped-head path, Gemma 2), shadow.py (instance attributes shadowed for one call).
Importing this package imports trl; without it, one ImportError naming the extra `[trl]`.
"""
from mask_replay.integrations.trl.trainer import INDEX_KEY, TESTED_TRL, ReplayGRPOTrainer

__all__ = ["ReplayGRPOTrainer", "INDEX_KEY", "TESTED_TRL"]
