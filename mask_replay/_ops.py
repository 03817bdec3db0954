"""The compiled operators: loads the extension (which defines torch.ops.mask_replay.*), then, per op
in csrc/ops.cpp's schema order, its fake kernel (shapes for torch.compile / meta tensors) and its
autograd formula (the backward of each differentiable op is another registered op).

Every other module calls the ops through `ops`; this is the only module that teaches torch how to
trace and differentiate them."""
import importlib.util
import json
import os
import sys

import torch
import torch.autograd.forward_ad as forward_ad

from mask_replay.params import compute_dtype


def _load_override(path: str):
    """MASK_REPLAY_EXTENSION=/path/to/_C.so loads another build of the same extension (the
    AddressSanitizer copy of `make asan`) without replacing the in-place one."""
    spec = importlib.util.spec_from_file_location("mask_replay._C", path)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"MASK_REPLAY_EXTENSION={path}: no such extension file")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mask_replay._C"] = module
    spec.loader.exec_module(module)
    return module


try:
    if os.environ.get("MASK_REPLAY_EXTENSION"):
        _C = _load_override(os.environ["MASK_REPLAY_EXTENSION"])
    else:
        from mask_replay import _C  # noqa: F401  (importing it registers the ops; only where no override is asked for)
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "mask_replay._C is not built. Run `make build` (or `pip install -e . --no-build-isolation`) "
        f"in the repository first. Original error: {exc}"
    ) from exc

ops = torch.ops.mask_replay


def build_info() -> dict:
    """Which kernels were compiled: {'cpu': True, 'cuda': bool, 'cuda_arch_list': str, ...}."""
    info = json.loads(ops.build_info())
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    return info


# Row status of replay_fwd / hidden_fwd (int8 [N]): replayed over the support, fell back to the full
# vocabulary because the sampled token is outside it, fell back because it is empty.
REPLAYED, FELL_BACK_OUTSIDE, FELL_BACK_EMPTY = 0, 1, 2


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return compute_dtype(t.dtype)


# ---- derivatives the ops do not have ------------------------------------------------------------------
# The ops have first derivatives only. Without the registrations below, torch would differentiate a
# backward op as a constant (a Hessian-vector product of exactly 0) and give a forward-mode AD output no
# tangent: silent wrong answers. Both are refused by name instead.
def higher_order_error(op: str, api: str) -> NotImplementedError:
    """The error of a derivative `op` does not have: kind "double backward" or "forward-mode AD"."""
    if api == "double backward":
        what = ("double backward (differentiating the gradient it returns, e.g. a Hessian-vector product after "
                "create_graph=True) is not supported")
    else:
        what = "forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not supported"
    return NotImplementedError(f"{op}: {what}; only first-order reverse-mode gradients are defined")


def reject_forward_ad(op: str, *tensors) -> None:
    """Raise when an input carries a forward-mode tangent (a dual tensor): the op has no JVP formula."""
    if torch.compiler.is_compiling():  # forward AD is not traced by torch.compile; nothing to look at
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None:
            raise higher_order_error(op, "forward-mode AD")


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on the gradients a Python backward computed, made to depend on the tensors they were
    computed from; differentiating them raises. (once_differentiable's error node has no edges to the
    inputs, so torch.autograd.grad(..., allow_unused=True) returns None there instead of raising.)"""

    @staticmethod
    def forward(ctx, op, count, *tensors):
        ctx.op = op
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise higher_order_error(ctx.op, "double backward")


def refuse_double_backward(op: str, grads: tuple, *depends_on) -> tuple:
    """A Python backward's results, unchanged when it runs without create_graph; under create_graph=True
    the same values, whose own gradient raises naming `op`."""
    if not torch.is_grad_enabled():
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    inputs = [t for t in depends_on if isinstance(t, torch.Tensor)]
    wrapped = _NoDoubleBackward.apply(op, len(present), *(grads[i] for i in present), *inputs)
    out = list(grads)
    for i, g in zip(present, wrapped):
        out[i] = g
    return tuple(out)


def _refuse_double_backward(backward_op: str, op: str) -> None:
    """The backward op gets an autograd formula that raises, naming the forward op it differentiates."""
    def backward(ctx, *grads):
        raise higher_order_error(f"mask_replay::{op}", "double backward")

    def setup_context(ctx, inputs, output):
        pass

    torch.library.register_autograd(f"mask_replay::{backward_op}", backward, setup_context=setup_context)


# ---- capture --------------------------------------------------------------------------------------
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


# ---- replay over the support ----------------------------------------------------------------------
# lse and status are auxiliary outputs (saved for the backward, never differentiated): their
# incoming gradients are ignored.
@torch.library.register_fake("mask_replay::replay_fwd")
def _replay_fwd_fake(logits, token_ids, offsets, sampled, temperature, fallback):
    n = logits.shape[0]
    out = _out_dtype(logits)
    status = logits.new_empty((n,), dtype=torch.int8)
    return logits.new_empty((n,), dtype=out), logits.new_empty((n,), dtype=out), status


def _replay_setup(ctx, inputs, output):
    logits, token_ids, offsets, sampled, temperature, _ = inputs
    _, lse, status = output
    ctx.save_for_backward(logits, token_ids, offsets, sampled, temperature, lse, status)


def _replay_backward(ctx, grad_logp, _grad_lse, _grad_status):
    logits, token_ids, offsets, sampled, temperature, lse, status = ctx.saved_tensors
    g = ops.replay_bwd(grad_logp.contiguous(), logits, token_ids, offsets, sampled, temperature, lse, status)
    return g, None, None, None, None, None


torch.library.register_autograd("mask_replay::replay_fwd", _replay_backward, setup_context=_replay_setup)


_refuse_double_backward("replay_bwd", "replay_fwd")


@torch.library.register_fake("mask_replay::replay_bwd")
def _replay_bwd_fake(grad, logits, token_ids, offsets, sampled, temperature, lse, status):
    return logits.new_empty(logits.shape)


# ---- full vocabulary ------------------------------------------------------------------------------
@torch.library.register_fake("mask_replay::full_fwd")
def _full_fwd_fake(logits, sampled, temperature):
    n = logits.shape[0]
    out = _out_dtype(logits)
    return logits.new_empty((n,), dtype=out), logits.new_empty((n,), dtype=out)


def _full_setup(ctx, inputs, output):
    logits, sampled, temperature = inputs
    ctx.save_for_backward(logits, sampled, temperature, output[1])


def _full_backward(ctx, grad_logp, _grad_lse):
    logits, sampled, temperature, lse = ctx.saved_tensors
    return ops.full_bwd(grad_logp.contiguous(), logits, sampled, temperature, lse), None, None


torch.library.register_autograd("mask_replay::full_fwd", _full_backward, setup_context=_full_setup)


_refuse_double_backward("full_bwd", "full_fwd")


@torch.library.register_fake("mask_replay::full_bwd")
def _full_bwd_fake(grad, logits, sampled, temperature, lse):
    return logits.new_empty(logits.shape)


@torch.library.register_fake("mask_replay::kept_mass")
def _kept_mass_fake(logits, token_ids, offsets, temperature):
    return logits.new_empty((logits.shape[0],), dtype=_out_dtype(logits))


# ---- sparse LM head -------------------------------------------------------------------------------
@torch.library.register_fake("mask_replay::hidden_fwd")
def _hidden_fwd_fake(hidden, weight, bias, token_ids, offsets, sampled, temperature, fallback):
    n = hidden.shape[0]
    out = _out_dtype(hidden)
    status = hidden.new_empty((n,), dtype=torch.int8)
    return hidden.new_empty((n,), dtype=out), hidden.new_empty((n,), dtype=out), status


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


_refuse_double_backward("hidden_bwd", "hidden_fwd")


@torch.library.register_fake("mask_replay::hidden_bwd")
def _hidden_bwd_fake(grad, hidden, weight, bias, token_ids, offsets, sampled, temperature, lse, status):
    gb = bias.new_empty((weight.shape[0],)) if bias.numel() > 0 else hidden.new_empty((0,))
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), gb
