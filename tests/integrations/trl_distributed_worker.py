"""ReplayGRPOTrainer under torchrun (2 CPU ranks, gloo, as accelerate sets up for a multi-process CPU
run): every rank generates its own completions, so its supports must stay with its own batch, and the
replay metrics TRL logs must be the mean over all ranks' tokens. Run by test_trl_distributed.py:

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/integrations/trl_distributed_worker.py OUT
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer  # noqa: E402
from tests.helpers import end_distributed_worker, hidden_ref  # noqa: E402
from tests.integrations.trl_helpers import V, grpo_args, prompts, replayed_batch, reward_len, tiny_model, tiny_tokenizer  # noqa: E402

T = 0.9


def check_batch(trainer, rank: int) -> None:
    """This rank's log-probs against a float64 dense reference over this rank's own supports."""
    model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
    lp, batch, input_ids, hidden, k = replayed_batch(trainer, model)
    masks = [trainer._replay_masks[i] for i in batch[INDEX_KEY].tolist()]
    assert all(int(m.lengths().max()) < V for m in masks), "nothing was cut: the check would be vacuous"
    ref = torch.zeros(lp.shape, dtype=torch.float64)
    for b, m in enumerate(masks):
        n = m.num_rows
        y = input_ids[b, -k:][:n]
        assert torch.equal(m.sampled.cpu(), y), f"rank {rank} sample {b}: a support of another completion"
        ref[b, :n] = hidden_ref(hidden[b, :n], model.lm_head.weight, None, m.to_dense(V), y, T)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)

    # the logged kept mass / support size: the mean over both ranks' tokens, not this rank's
    generation = [trainer._replay_masks[i] for i in trainer._replay_owned["train"]]
    kept = torch.cat([m.kept_mass.double() for m in generation])
    size = torch.cat([m.lengths().double() for m in generation])
    mine = torch.stack([kept.sum(), size.sum(), torch.tensor(float(kept.numel()), dtype=torch.float64)])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    total = torch.stack(every).sum(0)
    logged = trainer._metrics["train"]
    assert abs(logged["replay/kept_mass/mean"][-1] - (total[0] / total[2]).item()) < 1e-12
    assert abs(logged["replay/support_size/mean"][-1] - (total[1] / total[2]).item()) < 1e-12
    assert not torch.equal(every[0], every[1]), "both ranks generated the same completions"


def main() -> None:
    out = sys.argv[1]
    trainer = ReplayGRPOTrainer(
        model=tiny_model(), reward_funcs=reward_len, processing_class=tiny_tokenizer(), train_dataset=prompts(16),
        args=grpo_args(out, temperature=T, top_p=0.8, top_k=0, per_device_train_batch_size=4, num_generations=4,
                       max_steps=8, max_completion_length=8, num_iterations=2, steps_per_generation=2))
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    assert world == 2 and dist.is_initialized(), (world, trainer.accelerator.distributed_type)
    check_batch(trainer, rank)
    trainer.train()
    # DDP kept the replicas equal: replay's loss is differentiable the same way on every rank
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    every = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    assert torch.equal(every[0], every[1]), "the ranks' weights differ after training"
    # one generation per 4 steps (steps_per_generation 2 x num_iterations 2), logged at the step that made it
    steps = [h for h in trainer.state.log_history if "replay/kept_mass/mean" in h]
    assert [h["step"] for h in steps] == [1, 5], trainer.state.log_history
    assert all(0 < h["replay/kept_mass/mean"] < 1 for h in steps), steps
    print(f"rank {rank}: ok, kept mass {[round(h['replay/kept_mass/mean'], 4) for h in steps]}", flush=True)
    end_distributed_worker()


if __name__ == "__main__":
    main()
