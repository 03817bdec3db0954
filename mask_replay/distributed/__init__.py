"""Scale-out with torch.distributed: vocab-parallel replay (replay.py) and the CLI under torchrun
(launch.py, cli.py)."""
from mask_replay.distributed.replay import (  # noqa: F401
    replay_logprobs_vocab_parallel,
    replay_logprobs_vocab_parallel_from_hidden,
)

__all__ = ["replay_logprobs_vocab_parallel", "replay_logprobs_vocab_parallel_from_hidden"]
