"""Fake (meta) kernels of the capture ops, so torch.compile can trace them without running them."""
import torch

from mask_replay import _C  # noqa: F401  (registers the op schemas)


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
