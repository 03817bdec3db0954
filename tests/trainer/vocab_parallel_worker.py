"""Run under torchrun (gloo): vocab-parallel replay against the single-process op on every rank.

Every rank builds the same seeded cases, runs the vocab-parallel op on its shard and compares
values with mask_replay.replay_logprobs on the full logits, and its shard's gradient with the
matching columns of the single-process gradient. Any mismatch raises (exit != 0); the last line
is 'rank R: C cases ok'.
"""
import os
import sys

import torch
import torch.distributed as dist

# the repository root, for tests.helpers (this file runs as a script under torchrun)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import mask_replay  # noqa: E402
from mask_replay import SamplingMask  # noqa: E402
from mask_replay.trainer.vocab_parallel import (  # noqa: E402
    replay_logprobs_vocab_parallel,
    replay_logprobs_vocab_parallel_from_hidden,
)
from tests.helpers import end_distributed_worker, grads, replay_ref  # noqa: E402


def shard_bounds(vocab, world, rank, sizes=None):
    sizes = sizes or [vocab // world + (r < vocab % world) for r in range(world)]
    return sum(sizes[:rank]), sizes[rank]


def make_case(gen, n, vocab, world, spread=True):
    """Rows of every kind: spanning shards, inside one shard, |K| = 1, empty, sampled outside K."""
    bounds = [shard_bounds(vocab, world, r) for r in range(world)]
    rows, sampled, kinds = [], [], []
    for i in range(n):
        kind = i % 6 if spread else 0
        if kind == 0:  # anywhere
            k = int(torch.randint(2, min(vocab, 40), (1,), generator=gen))
            ids = torch.randperm(vocab, generator=gen)[:k]
        elif kind == 1:  # entirely inside one shard
            lo, size = bounds[int(torch.randint(0, world, (1,), generator=gen))]
            ids = lo + torch.randperm(size, generator=gen)[: max(1, min(size, 7))]
        elif kind == 2:  # a single token
            ids = torch.randint(0, vocab, (1,), generator=gen)
        elif kind == 3:  # empty
            ids = torch.zeros(0, dtype=torch.int64)
        else:  # large
            ids = torch.randperm(vocab, generator=gen)[: vocab // 2]
        ids = ids.sort().values
        if kind == 3 or (kind == 5 and ids.numel() < vocab):  # outside: a token not in K
            free = torch.ones(vocab, dtype=torch.bool)
            free[ids] = False
            pick = torch.nonzero(free).flatten()
            y = int(pick[int(torch.randint(0, pick.numel(), (1,), generator=gen))])
        else:
            y = int(ids[int(torch.randint(0, ids.numel(), (1,), generator=gen))])
        rows.append(ids.tolist())
        sampled.append(y)
        kinds.append(kind)
    return SamplingMask.from_lists(rows), torch.tensor(sampled), kinds


def check(name, got, want, atol, rtol=0.0):
    if got.shape != want.shape or not torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol):
        if got.shape != want.shape:
            raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        err = (got.double() - want.double()).abs() - rtol * want.double().abs()
        i = int(err.flatten().argmax())
        raise AssertionError(f"{name}: mismatch at flat index {i}: {got.flatten()[i].item()} vs "
                             f"{want.flatten()[i].item()}")


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234)
    cases = 0
    for trial in range(8):
        vocab = int(torch.randint(world * 3, 300, (1,), generator=gen)) + (trial % 2)  # often uneven
        n = 24
        mask, y, kinds = make_case(gen, n, vocab, world)
        dtype = (torch.float32, torch.float64, torch.bfloat16)[trial % 3]
        logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
        temp = torch.rand(n, generator=gen) * 1.5 + 0.3 if trial % 2 else 0.7
        lo, size = shard_bounds(vocab, world, rank)
        atol = 1e-9 if dtype == torch.float64 else 1e-6
        for fb in (True, False):
            keep = [i for i in range(n) if fb or kinds[i] not in (3, 5)]
            sub = SamplingMask.from_lists([mask.row(i).tolist() for i in keep])
            ys, lg = y[keep], logits[keep]
            tt = temp[keep] if isinstance(temp, torch.Tensor) else temp

            def single(z):
                return mask_replay.replay_logprobs(z, sub, ys, tt, fallback=fb)

            def parallel(shard):
                return replay_logprobs_vocab_parallel(shard, sub, ys, vocab_start=lo, temperature=tt, fallback=fb)

            want = single(lg)
            got, status = replay_logprobs_vocab_parallel(lg[:, lo:lo + size], sub, ys, vocab_start=lo,
                                                         temperature=tt, fallback=fb, return_status=True)
            _, want_status = mask_replay.replay_logprobs(lg, sub, ys, tt, fallback=fb, return_status=True)
            check(f"trial {trial} fallback={fb} values", got, want, atol)
            if not torch.equal(status, want_status):
                raise AssertionError(f"trial {trial}: status differs")
            # the independent dense reference too (fp64)
            check(f"trial {trial} dense reference", got, replay_ref(lg, sub.to_dense(vocab), ys, tt, fallback=fb),
                  1e-5 if dtype != torch.float64 else 1e-9)
            (gw,) = grads(single, lg)
            (gp,) = grads(parallel, lg[:, lo:lo + size])
            # a bfloat16 gradient is rounded to bfloat16: a rounding or two apart (2^-7 relative
            # each); float32 gradients reach 1/T > 1, hence 1e-6 relative as well as absolute
            check(f"trial {trial} fallback={fb} grad", gp, gw[:, lo:lo + size], atol,
                  2.0 ** -6 if dtype == torch.bfloat16 else 0.0 if dtype == torch.float64 else 1e-6)
            cases += 1

        # the sparse LM head, with a bias
        d = 16
        hidden = torch.randn(n, d, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        weight = torch.randn(vocab, d, generator=gen, dtype=hidden.dtype) * 0.5
        bias = torch.randn(vocab, generator=gen, dtype=hidden.dtype)
        want = mask_replay.replay_logprobs_from_hidden(hidden, weight, mask, y, temp, bias, fallback=True)
        got = replay_logprobs_vocab_parallel_from_hidden(hidden, weight[lo:lo + size], mask, y, vocab_start=lo,
                                                         temperature=temp, bias_shard=bias[lo:lo + size],
                                                         fallback=True)
        hatol = 1e-9 if hidden.dtype == torch.float64 else 2e-6
        hrtol = 0.0 if hidden.dtype == torch.float64 else 1e-6  # weight gradients sum over rows: > 1
        check(f"trial {trial} hidden values", got, want, hatol)
        def single(h, w, b):
            return mask_replay.replay_logprobs_from_hidden(h, w, mask, y, temp, b, fallback=True)

        gh, gw, gb = grads(single, hidden, weight, bias)
        ph, pw, pb = grads(lambda h, w, b: replay_logprobs_vocab_parallel_from_hidden(
            h, w, mask, y, vocab_start=lo, temperature=temp, bias_shard=b, fallback=True),
            hidden, weight[lo:lo + size], bias[lo:lo + size])
        check(f"trial {trial} hidden grad (hidden, all-reduced)", ph, gh, hatol, hrtol)
        check(f"trial {trial} hidden grad (weight shard)", pw, gw[lo:lo + size], hatol, hrtol)
        check(f"trial {trial} hidden grad (bias shard)", pb, gb[lo:lo + size], hatol, hrtol)
        cases += 1

    cases += edge_cases(rank, world)
    errors(rank, world)
    print(f"rank {rank}: {cases} cases ok", flush=True)
    end_distributed_worker()


def edge_cases(rank, world):
    """No rows at all; very uneven shards (rank 0 holds one column, the last rank the most)."""
    empty = replay_logprobs_vocab_parallel(torch.zeros(0, 5), SamplingMask.from_lists([]),
                                           torch.zeros(0, dtype=torch.int64), vocab_start=5 * rank)
    if empty.shape != (0,):
        raise AssertionError(f"zero rows: got shape {tuple(empty.shape)}")
    vocab = 50
    sizes = [1] + [(vocab - 1) // (world - 1)] * (world - 1)
    sizes[-1] += vocab - sum(sizes)
    lo, size = shard_bounds(vocab, world, rank, sizes)
    gen = torch.Generator().manual_seed(99)
    logits = torch.randn(6, vocab, generator=gen) * 2
    mask = SamplingMask.from_lists([[0], [0, 1], [0, 49], [3, 4, 5], [1, 2, 30, 49], list(range(50))])
    y = torch.tensor([0, 0, 49, 4, 30, 17])
    want = mask_replay.replay_logprobs(logits, mask, y, 0.9)
    got = replay_logprobs_vocab_parallel(logits[:, lo:lo + size], mask, y, vocab_start=lo, temperature=0.9)
    check("uneven shards", got, want, 1e-6)
    (gw,) = grads(lambda z: mask_replay.replay_logprobs(z, mask, y, 0.9), logits)
    (gp,) = grads(lambda z: replay_logprobs_vocab_parallel(z, mask, y, vocab_start=lo, temperature=0.9),
                  logits[:, lo:lo + size])
    check("uneven shards grad", gp, gw[:, lo:lo + size], 1e-6, 1e-6)
    return 2


def expect_error(fn, needle):
    try:
        fn()
    except ValueError as exc:
        if needle not in str(exc):
            raise AssertionError(f"expected an error with {needle!r}, got {exc}")
        return
    raise AssertionError(f"expected an error with {needle!r}, got none")


def errors(rank, world):
    """Errors are raised identically on every rank (no rank is left waiting in a collective)."""
    vocab = 10 * world + 1
    lo, size = shard_bounds(vocab, world, rank)
    logits = torch.randn(3, vocab)
    mask = SamplingMask.from_lists([[0, vocab - 1], [], [1, 2]])
    y = torch.tensor([0, 3, 4])
    shard = logits[:, lo:lo + size]
    expect_error(lambda: replay_logprobs_vocab_parallel(shard, mask, y, vocab_start=lo), "row 1 has an empty support")
    mask2 = SamplingMask.from_lists([[0, vocab - 1], [5], [1, 2]])
    expect_error(lambda: replay_logprobs_vocab_parallel(shard, mask2, y, vocab_start=lo),
                 "sampled token 3 is outside the support of row 1")
    # shards that do not tile the vocabulary: the last id is held by no rank
    expect_error(lambda: replay_logprobs_vocab_parallel(shard[:, : size - 1] if rank == world - 1 else shard,
                                                        mask2, y, vocab_start=lo), "row 0 holds token ids outside")
    # a sampled token beyond the vocabulary
    expect_error(lambda: replay_logprobs_vocab_parallel(shard, mask2, torch.tensor([0, 5, vocab]), vocab_start=lo,
                                                        fallback=True), f"sampled token {vocab} of row 2 lies in 0")
    expect_error(lambda: replay_logprobs_vocab_parallel(shard, mask2, y, vocab_start=lo, temperature=torch.tensor(
        [1.0, 0.0, 1.0])), "row 1 has 0.0")


if __name__ == "__main__":
    main()
