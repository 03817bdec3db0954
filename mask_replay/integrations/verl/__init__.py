"""verl 0.9.1 drop-in (see README, "verl"): replay in verl's FSDP and Megatron engines and vLLM rollout server.

support_rows.py (where each recorded row lands in verl's packed layout; pure torch, no verl import),
trainer.py (the FSDP engine's log-probs renormalised over the recorded supports; imports verl),
megatron_engine.py (the Megatron engine's vocab-parallel log-probs, likewise; imports verl and megatron-core),
rollout.py (vLLMHttpServer.generate: each completion's support into TokenOutput.extra_fields; imports verl,
and vllm for the default class; not wired to the switch yet),
plugin.py (the ``verl.plugins`` entry point and the switch: installs trainer.py, and megatron_engine.py where
megatron-core is importable, when MASK_REPLAY_VERL=1).
"""
