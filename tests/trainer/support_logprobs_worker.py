"""Run under torchrun (gloo): vocab-parallel replay_support_logprobs against the single-process one.

Every rank builds the same seeded cases; values must agree on every rank and with the single-process
op, and each rank's shard gradient with the matching columns of the single-process gradient. Any
mismatch raises (exit != 0); the last line is 'rank R: support log-probs ok'.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import mask_replay  # noqa: E402
from mask_replay import SamplingMask  # noqa: E402
from mask_replay.trainer.support_logprobs import replay_support_logprobs_from_hidden  # noqa: E402
from mask_replay.trainer.vocab_parallel import (  # noqa: E402
    replay_support_logprobs_vocab_parallel,
    replay_support_logprobs_vocab_parallel_from_hidden,
)
from tests.helpers import end_distributed_worker, grads  # noqa: E402


def close(name, got, want, atol):
    if got.shape != want.shape or not torch.allclose(got.double(), want.double(), atol=atol, rtol=1e-5,
                                                     equal_nan=True):
        raise AssertionError(f"{name}: max difference {float((got.double() - want.double()).abs().nan_to_num().max())}")


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(4321)
    vocab, n, d = 37, 9, 6
    lo = [0, 11][rank] if world == 2 else rank * (vocab // world)
    hi = [11, vocab][rank] if world == 2 else (vocab if rank == world - 1 else lo + vocab // world)
    rows = [[0, 5, 20, 36], [12], [], [3, 4], list(range(37)), [10, 11], [0], [30, 31, 35], [7, 15]]
    mask = SamplingMask.from_lists(rows)
    for dtype in (torch.float32, torch.float64):
        logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
        logits[3, 4] = float("-inf")
        temp = torch.rand(n, generator=gen) + 0.5
        want = mask_replay.replay_support_logprobs(logits, mask, temperature=temp)
        got = replay_support_logprobs_vocab_parallel(logits[:, lo:hi], mask, vocab_start=lo, temperature=temp)
        close(f"{dtype} values", got, want, 1e-6)
        fin = torch.isfinite(want)

        def single(z):
            return mask_replay.replay_support_logprobs(z, mask, temperature=temp)[fin]

        def parallel(z):
            return replay_support_logprobs_vocab_parallel(z, mask, vocab_start=lo, temperature=temp)[fin]

        (gw,) = grads(single, logits)
        (gp,) = grads(parallel, logits[:, lo:hi])
        close(f"{dtype} grad", gp, gw[:, lo:hi], 1e-6)

        hidden = torch.randn(n, d, generator=gen, dtype=dtype)
        weight = torch.randn(vocab, d, generator=gen, dtype=dtype)
        want = replay_support_logprobs_from_hidden(hidden, weight, mask, temperature=0.8)
        got = replay_support_logprobs_vocab_parallel_from_hidden(hidden, weight[lo:hi], mask, vocab_start=lo,
                                                                 temperature=0.8)
        close(f"{dtype} hidden values", got, want, 1e-5)
        gh, gwt = grads(lambda h, w: replay_support_logprobs_from_hidden(h, w, mask, temperature=0.8), hidden, weight)
        ph, pw = grads(lambda h, w: replay_support_logprobs_vocab_parallel_from_hidden(
            h, w, mask, vocab_start=lo, temperature=0.8), hidden, weight[lo:hi])
        close(f"{dtype} hidden grad (hidden)", ph, gh, 1e-5)
        close(f"{dtype} hidden grad (weight shard)", pw, gwt[lo:hi], 1e-5)
    # a shard layout that leaves an id to no rank is named, on every rank
    try:
        replay_support_logprobs_vocab_parallel(logits[:, lo:hi - 1] if rank == world - 1 else logits[:, lo:hi],
                                               mask, vocab_start=lo)
    except ValueError as exc:
        if "outside the ranks' shards" not in str(exc):
            raise
    else:
        raise AssertionError("a token held by no shard was not reported")
    print(f"rank {rank}: support log-probs ok", flush=True)
    end_distributed_worker()


if __name__ == "__main__":
    main()
