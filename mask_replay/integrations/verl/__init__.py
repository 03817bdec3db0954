"""verl 0.9.1 drop-in (see README, "verl"): replay in verl's FSDP engine and vLLM rollout server.

support_rows.py (where each recorded row lands in verl's packed layout; pure torch, no verl import),
trainer.py (the FSDP engine's log-probs renormalised over the recorded supports; imports verl),
rollout.py (vLLMHttpServer.generate: each completion's support into TokenOutput.extra_fields; imports verl,
and vllm for the default class; not wired to the switch yet),
plugin.py (the ``verl.plugins`` entry point and the switch: installs trainer.py when MASK_REPLAY_VERL=1).
"""
