"""ReplayGRPOTrainer's loss-side head under FSDP2 (fully_shard, 2 CPU ranks, gloo): the support
log-probs and the LM head's gradient against the same model unsharded, with the head in the root
(a plain Parameter at replay time: FSDP2 keeps the root unsharded after its forward) and with the
head sharded on its own (a DTensor at replay time). Run by test_trl_distributed.py:

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/integrations/trl_fsdp_worker.py root|head
"""
import os
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mask_replay import SamplingMask  # noqa: E402
from mask_replay.integrations.trl import ReplayGRPOTrainer  # noqa: E402
from tests.helpers import end_distributed_worker  # noqa: E402
from tests.integrations.trl_helpers import V, tiny_model  # noqa: E402

B, PROMPT, K, T = 2, 3, 4, 0.7


def batch(rank: int):
    """Each rank its own token ids and supports (every row holds its sampled token)."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, V, (B, PROMPT + K), generator=g)
    masks = {}
    for b in range(B):
        rows = [sorted(set(torch.randperm(V, generator=g)[:5].tolist()) | {int(y)}) for y in ids[b, PROMPT:]]
        masks[b] = SamplingMask.from_lists(rows, sampled=ids[b, PROMPT:].clone())
    return ids, masks


def replay_logps(model, ids, masks):
    """The trainer's _replay as _get_per_token_logps_and_entropies calls it: hidden states taken by a
    hook on the backbone during the model's forward, the head read after it."""
    trainer = types.SimpleNamespace(_replay_active=torch.arange(B), _replay_masks=masks, _replay_softcap=None,
                                    args=types.SimpleNamespace(cast_lm_head_to_fp32=False), temperature=T,
                                    _replay_scale=1.0)
    hidden = []
    hook = model.model.register_forward_hook(lambda module, inp, out: hidden.append(out.last_hidden_state))
    model(input_ids=ids, attention_mask=torch.ones_like(ids))
    hook.remove()
    sharded = hasattr(model.lm_head.weight, "full_tensor")
    lp = ReplayGRPOTrainer._replay(trainer, model, hidden[0], ids, torch.ones_like(ids), K, torch.zeros(B, K))
    return lp, sharded


def main() -> None:
    layout = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ref, model = tiny_model(), tiny_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if layout == "head":
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids, masks = batch(rank)

    lp, sharded = replay_logps(model, ids, masks)
    assert sharded == (layout == "head"), (layout, sharded)
    lp.sum().backward()
    want, _ = replay_logps(ref, ids, masks)
    want.sum().backward()
    torch.testing.assert_close(lp, want, rtol=1e-6, atol=1e-6)
    # FSDP2 averages gradients over the ranks: the unsharded model's gradients, averaged
    for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        got = dict(model.named_parameters())[name].grad
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        expect = dict(ref.named_parameters())[name].grad.clone()
        dist.all_reduce(expect)
        expect /= world
        assert expect.abs().sum() > 0
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    print(f"rank {rank}: ok ({layout})", flush=True)
    end_distributed_worker()


if __name__ == "__main__":
    main()
