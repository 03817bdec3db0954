"""Replay under verl's Ulysses sequence parallelism of size 2 (2 CPU ranks, gloo), run by
test_trainer.py::test_sequence_parallel_two_ranks:

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/integrations/verl/verl_sp_worker.py BUCKET

Both ranks hold the same micro-batches (one SP group); verl's prepare_model_inputs pads and slices the
packed sequence, each rank replays the rows of its own slice, verl's gather_outputs_and_unpad
all-gathers the log-probs. Checked on every rank: the gathered response log-probs against the float64
reference, and the parameter gradients summed over the ranks against the reference's, times 2 (verl's
Gather backward scales the gradient by the SP size).
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from verl.utils.ulysses import set_ulysses_sequence_parallel_group  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402

from mask_replay.integrations.verl import trainer  # noqa: E402
from tests.helpers import end_distributed_worker  # noqa: E402
from tests.integrations.verl import verl_helpers as h  # noqa: E402

T = 0.8


def main(bucket: int) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    trainer.install()
    # odd total lengths: verl pads the packed sequence to a multiple of the SP size
    data = h.make_batch(11, [3, 1, 4, 2, 5], [5, 2, 6, 1, 4], whole_rows={(2, 2)}, empty_rows={(0, 3)})
    td = h.to_engine_batch(data, T, use_dynamic_bsz=False, micro_batch_size_per_gpu=5)
    e, model = h.engine(sp_size=size, pad_to_length_bucket=bucket), h.ToyLM(12)
    for mb in prepare_micro_batches(td)[0]:
        mask = mb["attention_mask"][:, mb["prompts"].shape[1]:].bool()
        w = torch.randn(mb["responses"].shape, generator=torch.Generator().manual_seed(3)) * mask
        model.zero_grad()
        lp = h.response_logprobs(e, model, mb)
        (w * lp).sum().backward()
        grads = [model.E.grad.clone(), model.P.grad.clone()]
        for g in grads:
            dist.all_reduce(g)
        model.zero_grad()
        ref = h.reference(model, mb, T)
        (w.double() * ref).sum().backward()
        torch.testing.assert_close(lp.double(), ref.detach(), atol=2e-6, rtol=0)
        for g, r in zip(grads, [model.E.grad, model.P.grad]):
            torch.testing.assert_close(g, size * r, atol=4e-6, rtol=0)
        assert (ref - h.reference(model, mb, T, replay=False)).abs().max() > 0.1
    trainer.uninstall()
    print(f"rank {rank}: ok", flush=True)
    end_distributed_worker()


if __name__ == "__main__":
    main(int(sys.argv[1]))
