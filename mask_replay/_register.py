"""Fake (meta) kernels and autograd formulas of every mask_replay op, registered in one place.

Imported once by the package __init__, after the extension has defined the op schemas: the loader
(_ext) only loads, the Python API (capture_api, replay) only calls ops, and this module is the one
that teaches torch how to trace the ops (torch.compile) and how to differentiate them.
"""
import torch

from mask_replay._ext import ops


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ---- capture ----------------------------------------------------------------------------------
@torch.library.register_fake("mask_replay::capture")
def _capture_fake(logits, temperature, top_k, top_p, min_p, compute_logz):
    n = logits.shape[0]
    nnz = torch.library.get_ctx().new_dynamic_size()
    token_ids = logits.new_empty((nnz,), dtype=torch.int32)
    offsets = logits.new_empty((n + 1,), dtype=torch.int64)
    logz = logits.new_empty((n if compute_logz else 0,), dtype=torch.float32)
    return token_ids, offsets, logz


@torch.library.register_fake("mask_replay::capture_fixed")
def _capture_fixed_fake(logits, temperature, top_k, top_p, min_p, width):
    n = logits.shape[0]
    return (
        logits.new_empty((n, width), dtype=torch.int32),
        logits.new_empty((n,), dtype=torch.int64),
        logits.new_empty((n,), dtype=torch.bool),
    )


# ---- replay -----------------------------------------------------------------------------------
@torch.library.register_fake("mask_replay::replay_fwd")
def _replay_fwd_fake(logits, token_ids, offsets, sampled, temperature, fallback):
    n = logits.shape[0]
    out = _out_dtype(logits)
    return logits.new_empty((n,), dtype=out), logits.new_empty((n,), dtype=out), logits.new_empty((n,), dtype=torch.int8)


@torch.library.register_fake("mask_replay::replay_bwd")
def _replay_bwd_fake(grad, logits, token_ids, offsets, sampled, temperature, lse, status):
    return logits.new_empty(logits.shape)


@torch.library.register_fake("mask_replay::full_fwd")
def _full_fwd_fake(logits, sampled, temperature):
    n = logits.shape[0]
    out = _out_dtype(logits)
    return logits.new_empty((n,), dtype=out), logits.new_empty((n,), dtype=out)


@torch.library.register_fake("mask_replay::full_bwd")
def _full_bwd_fake(grad, logits, sampled, temperature, lse):
    return logits.new_empty(logits.shape)


@torch.library.register_fake("mask_replay::kept_mass")
def _kept_mass_fake(logits, token_ids, offsets, temperature):
    return logits.new_empty((logits.shape[0],), dtype=_out_dtype(logits))


@torch.library.register_fake("mask_replay::hidden_fwd")
def _hidden_fwd_fake(hidden, weight, bias, token_ids, offsets, sampled, temperature, fallback):
    n = hidden.shape[0]
    out = _out_dtype(hidden)
    return hidden.new_empty((n,), dtype=out), hidden.new_empty((n,), dtype=out), hidden.new_empty((n,), dtype=torch.int8)


@torch.library.register_fake("mask_replay::hidden_bwd")
def _hidden_bwd_fake(grad, hidden, weight, bias, token_ids, offsets, sampled, temperature, lse, status):
    gb = bias.new_empty((weight.shape[0],)) if bias.numel() > 0 else hidden.new_empty((0,))
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), gb


# ---- autograd: the backward of each op is another registered op --------------------------------
# lse and status are auxiliary outputs (saved for the backward, never differentiated): their
# incoming gradients are ignored.
def _replay_setup(ctx, inputs, output):
    logits, token_ids, offsets, sampled, temperature, _ = inputs
    _, lse, status = output
    ctx.save_for_backward(logits, token_ids, offsets, sampled, temperature, lse, status)


def _replay_backward(ctx, grad_logp, _grad_lse, _grad_status):
    logits, token_ids, offsets, sampled, temperature, lse, status = ctx.saved_tensors
    g = ops.replay_bwd(grad_logp.contiguous(), logits, token_ids, offsets, sampled, temperature, lse, status)
    return g, None, None, None, None, None


torch.library.register_autograd("mask_replay::replay_fwd", _replay_backward, setup_context=_replay_setup)


def _full_setup(ctx, inputs, output):
    logits, sampled, temperature = inputs
    ctx.save_for_backward(logits, sampled, temperature, output[1])


def _full_backward(ctx, grad_logp, _grad_lse):
    logits, sampled, temperature, lse = ctx.saved_tensors
    return ops.full_bwd(grad_logp.contiguous(), logits, sampled, temperature, lse), None, None


torch.library.register_autograd("mask_replay::full_fwd", _full_backward, setup_context=_full_setup)


def _hidden_setup(ctx, inputs, output):
    hidden, weight, bias, token_ids, offsets, sampled, temperature, _ = inputs
    _, lse, status = output
    ctx.save_for_backward(hidden, weight, bias, token_ids, offsets, sampled, temperature, lse, status)


def _hidden_backward(ctx, grad_logp, _grad_lse, _grad_status):
    hidden, weight, bias, token_ids, offsets, sampled, temperature, lse, status = ctx.saved_tensors
    gh, gw, gb = ops.hidden_bwd(grad_logp.contiguous(), hidden, weight, bias, token_ids, offsets, sampled,
                                temperature, lse, status)
    return gh, gw, (gb if bias.numel() > 0 else None), None, None, None, None, None


torch.library.register_autograd("mask_replay::hidden_fwd", _hidden_backward, setup_context=_hidden_setup)
