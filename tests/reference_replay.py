"""Independent dense reference of replay: materialise the [N, V] mask, fill -inf, log_softmax,
gather. This is what trainers do today; the kernels must agree with it."""
import torch


def _x(logits, temperature, dtype):
    # Temperature is a float32 parameter (as in sampling engines): round it there first.
    n = logits.shape[0]
    t = torch.as_tensor(temperature).to(torch.float32).reshape(-1).expand(n) if n else torch.ones(0)
    return logits.to(dtype) / t.to(device=logits.device, dtype=dtype)[:, None]


def replay_ref(logits, dense_mask, sampled, temperature=1.0, *, fallback=False, dtype=torch.float64):
    """Log-prob of sampled over the support; rows whose sampled token is outside the support (or
    whose support is empty) use the full vocabulary when fallback, else give nan."""
    x = _x(logits, temperature, dtype)
    y = sampled.long()[:, None]
    inside = dense_mask.gather(1, y)[:, 0] & dense_mask.any(1)
    lp = torch.log_softmax(x.masked_fill(~dense_mask, float("-inf")), dim=1).gather(1, y)[:, 0]
    if fallback:
        full = torch.log_softmax(x, dim=1).gather(1, y)[:, 0]
        lp = torch.where(inside, lp, full)
    return lp


def full_ref(logits, sampled, temperature=1.0, *, dtype=torch.float64):
    return torch.log_softmax(_x(logits, temperature, dtype), dim=1).gather(1, sampled.long()[:, None])[:, 0]


def kept_mass_ref(logits, dense_mask, temperature=1.0, *, dtype=torch.float64):
    x = _x(logits, temperature, dtype)
    return torch.exp(torch.logsumexp(x.masked_fill(~dense_mask, float("-inf")), 1) - torch.logsumexp(x, 1))


def hidden_ref(hidden, weight, bias, dense_mask, sampled, temperature=1.0, *, fallback=False, dtype=torch.float64):
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    return replay_ref(logits, dense_mask, sampled, temperature, fallback=fallback, dtype=dtype)


def grads(fn, *tensors):
    """Gradients of fn(*tensors).sum() w.r.t. each tensor (leaf copies, so inputs are untouched)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype, device=out.device) if out.numel() else out
    return torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
