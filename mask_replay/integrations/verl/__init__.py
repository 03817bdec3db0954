"""verl 0.9.1 drop-in (see README, "verl"): replay in verl's FSDP and Megatron engines and vLLM rollout server.

support_rows.py (where each recorded row lands in verl's packed layout; pure torch, no verl import),
trainer.py (the FSDP engine's log-probs renormalised over the recorded supports; imports verl),
rollout.py (vLLMHttpServer: each completion's support into TokenOutput.extra_fields, the vLLM plugin on in
the engine it starts; LLMServerClient.generate: each turn's rows onto the sample's track; the start-up
checks of the rollout config; imports verl, and vllm for the default class),
support_track.py (one sample's rows across the turns of verl's continuous-token merge; pure numpy),
agent_loop.py (AgentLoopWorker and the continuous-token builder: one row per response token; imports verl),
megatron_engine.py (the Megatron engine's vocab-parallel log-probs, likewise; imports verl and megatron-core),
plugin.py (the ``verl.plugins`` entry point and the switch: with MASK_REPLAY_VERL=1 installs trainer.py, and
megatron_engine.py where verl's Megatron engine imported, at ``import verl``; the others by post-import hooks
in the processes that import the verl modules they patch).
"""
