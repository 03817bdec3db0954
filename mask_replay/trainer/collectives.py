"""The two autograd-aware collectives of vocab-parallel replay, under the tensor-parallel contract.

Contract (Megatron's): every rank of the group computes the same replicated loss from the
replicated output and calls backward on it. Each rank then owns exactly its own slice of the
gradient, so the gather's backward is a plain slice (no communication). The reduce-scatter
backward of torch.distributed.nn.functional.all_gather would add up P identical copies and scale
the gradient by the group size, which is why these two small Functions exist.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherRows(torch.autograd.Function):
    """[N, C] per rank -> [P, N, C] on every rank (rank order); backward: this rank's slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group):
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward on a replicated input; backward sums the ranks' partial gradients, so a
    replicated input (the hidden states feeding a vocab-sharded LM head) gets its full gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_rows(local: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherRows.apply(local, group)


def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)
