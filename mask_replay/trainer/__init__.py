"""The trainer side: everything that consumes a mask.

replay.py (log-probs over the recorded support, from logits or hidden states), layouts.py (the
trainers' [B, T, V] + labels and packed layouts), sparse_head.py (the LM head over the support only),
support_stats.py (entropy and KL over the support), vocab_parallel.py (vocabulary-sharded replay,
Megatron layout), metrics.py (importance-ratio metrics of training against rollout log-probs),
support_logprobs.py (every support entry's replayed log-prob), losses.py (score-centered policy gradient).
"""
from mask_replay.trainer.vocab_parallel import (
    replay_logprobs_vocab_parallel,
    replay_logprobs_vocab_parallel_from_hidden,
    replay_support_logprobs_vocab_parallel,
    replay_support_logprobs_vocab_parallel_from_hidden,
)

__all__ = ["replay_logprobs_vocab_parallel", "replay_logprobs_vocab_parallel_from_hidden",
           "replay_support_logprobs_vocab_parallel", "replay_support_logprobs_vocab_parallel_from_hidden"]
