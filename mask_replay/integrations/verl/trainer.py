"""Replay in verl's FSDP engine (verl 0.9.1): old, current and reference log-probs over the recorded supports.

Follows the released verl 0.9.1 file verl/workers/engine/fsdp/transformer_impl.py:
- ``FSDPEngineWithLMHead.prepare_model_outputs`` (wrapped): it scales the logits by the temperature
  and calls the module-level ``logprobs_from_logits(logits, labels, inplace_backward)`` once per
  micro-batch, on this rank's slice of the packed labels (rmpad layout, tail pad, Ulysses slice) or,
  without remove-padding, on the unpadded packed labels. The wrapper works out where each sample's
  recorded rows land in that slice (support_rows.local_support) and holds them for the call.
- ``transformer_impl.logprobs_from_logits`` (replaced, module global): verl's own function runs on
  every row without a graph (so a row with nothing recorded, or the whole vocabulary, keeps verl's value
  bit for bit), and the recorded rows are replaced by log-probs renormalised over their support
  (mask_replay's ``replay_where``: one backward, the support's gradient on recorded rows, the full
  softmax gradient on the others). verl's entropy and its SP gather and nesting are untouched.
- ``FSDPEngineWithLMHead.forward_step`` (wrapped): adds the micro-batch's replay metrics,
  ``replay/kept_mass/mean`` (exp(log pi_V - log pi_K) of the sampled token, i.e. the support's share of
  the full softmax) and ``replay/support_size/mean``, over this rank's replayed rows, to the metrics dict
  verl collects per micro-batch (postprocess_batch_func, then reduce_metrics: the mean over micro-batches
  and DP ranks). verl logs the update_actor pass's metrics; those of compute_log_prob are not logged by
  verl (ray_trainer reads only its mfu).
- ``EngineRegistry.new`` (verl/workers/engine/base.py, wrapped): start-up refusal of what is not built
  (another engine backend than fsdp / fsdp2 for the actor and reference, fused kernels); a backend in
  ``MORE_BACKENDS`` (megatron, added by megatron_engine.install()) passes with its own check.

The supports travel per sample in ``non_tensor_batch[SUPPORT_KEY]`` through verl's own DataProto
split / shuffle / micro-batching. ``install()`` / ``uninstall()`` put and take the patches back.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Optional

import torch

try:  # verl is an optional dependency: make venv-verl
    import verl
    from verl.utils import tensordict_utils as tu
    from verl.utils.ulysses import get_ulysses_sequence_parallel_rank, get_ulysses_sequence_parallel_world_size
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mask_replay.integrations.verl.trainer needs verl 0.9.1: make venv-verl") from exc

from mask_replay.errors import InputError
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY, LocalSupport, local_support
from mask_replay.trainer.replay_where import replay_where

__all__ = ["install", "uninstall", "installed", "TESTED_VERL", "SUPPORT_KEY"]

TESTED_VERL = "0.9.1"
_BACKENDS = ("fsdp", "fsdp2")
# more engine backends, each with its start-up check of EngineRegistry.new's kwargs: megatron_engine.install()
MORE_BACKENDS: dict[str, Callable[[dict], None]] = {}
_ACTIVE: contextvars.ContextVar[Optional[LocalSupport]] = contextvars.ContextVar("mask_replay_verl_support",
                                                                                  default=None)
_STATS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("mask_replay_verl_stats", default=None)
_ORIGINALS: dict[str, Any] = {}
KEPT_MASS, SUPPORT_SIZE = "replay/kept_mass/mean", "replay/support_size/mean"


def installed() -> bool:
    return bool(_ORIGINALS)


def install() -> None:
    """Patch verl's FSDP engine (idempotent). Raises ImportError for any verl other than 0.9.1."""
    if verl.__version__ != TESTED_VERL:
        raise ImportError(f"mask_replay.integrations.verl is built and tested against verl {TESTED_VERL}, found "
                          f"verl {verl.__version__}: pip install 'verl=={TESTED_VERL}'")
    if installed():
        return
    cls = transformer_impl.FSDPEngineWithLMHead
    _ORIGINALS["logprobs_from_logits"] = transformer_impl.logprobs_from_logits
    _ORIGINALS["prepare_model_outputs"] = cls.__dict__["prepare_model_outputs"]
    _ORIGINALS["forward_step"] = cls.__dict__["forward_step"]
    _ORIGINALS["new"] = EngineRegistry.__dict__["new"]
    transformer_impl.logprobs_from_logits = _replayed_logprobs_from_logits
    cls.prepare_model_outputs = _prepare_model_outputs
    cls.forward_step = _forward_step
    EngineRegistry.new = classmethod(_checked_new)


def uninstall() -> None:
    """Put verl's own functions back."""
    if not installed():
        return
    transformer_impl.logprobs_from_logits = _ORIGINALS.pop("logprobs_from_logits")
    transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs = _ORIGINALS.pop("prepare_model_outputs")
    transformer_impl.FSDPEngineWithLMHead.forward_step = _ORIGINALS.pop("forward_step")
    EngineRegistry.new = _ORIGINALS.pop("new")


def _checked_new(cls, model_type, backend, *args, **kwargs):
    if model_type == "language_model":
        if backend not in _BACKENDS + tuple(MORE_BACKENDS):
            raise NotImplementedError(f"mask_replay verl replay: engine backend '{backend}' is not supported yet "
                                      f"(built: {', '.join(_BACKENDS + tuple(MORE_BACKENDS))}); unset "
                                      "MASK_REPLAY_VERL or use actor_rollout_ref.actor.strategy=fsdp2")
        configs = (kwargs.get("model_config"), kwargs.get("engine_config"))
        if any(getattr(c, "use_fused_kernels", False) for c in configs if c is not None):
            raise NotImplementedError("mask_replay verl replay: actor_rollout_ref.model.use_fused_kernels=True is not "
                                      "supported yet (the fused head never materialises the logits replay needs); "
                                      "set it to False or unset MASK_REPLAY_VERL")
        if backend in MORE_BACKENDS:
            MORE_BACKENDS[backend](kwargs)
    return _ORIGINALS["new"].__func__(cls, model_type, backend, *args, **kwargs)


def micro_batch_supports(micro_batch) -> list:
    """The per-sample supports of a micro-batch TensorDict, in its sample order."""
    if SUPPORT_KEY not in micro_batch.keys():
        raise InputError(f"replay is on (MASK_REPLAY_VERL=1) but the batch carries no '{SUPPORT_KEY}': the rollout "
                         "did not record supports", key=SUPPORT_KEY)
    return list(tu.get(micro_batch, SUPPORT_KEY))


def _response_lengths(micro_batch) -> torch.Tensor:
    """Each sample's response length, by verl's own rule (workers/utils/padding.py, no_padding_2_padding)."""
    responses = micro_batch["responses"]
    if responses.is_nested:
        return responses.offsets().diff()
    prompts = micro_batch["prompts"]
    return micro_batch["attention_mask"][:, prompts.shape[1]:].sum(dim=1)


@functools.wraps(transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs)
def _prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    use_remove_padding = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
        raise NotImplementedError("mask_replay verl replay: use_fused_kernels=True is not supported yet")
    input_ids = micro_batch["input_ids"]
    sp_size = get_ulysses_sequence_parallel_world_size() if self.use_ulysses_sp else 1
    sp_rank = get_ulysses_sequence_parallel_rank() if self.use_ulysses_sp else 0
    layout = local_support(micro_batch_supports(micro_batch), input_ids.values(), input_ids.offsets(),
                           _response_lengths(micro_batch), vocab_size=_vocab_size(output),
                           pad_size=int(output_args.get("pad_size", 0)) if use_remove_padding else 0,
                           sp_rank=sp_rank, sp_size=sp_size)
    token = _ACTIVE.set(layout)
    try:
        return _ORIGINALS["prepare_model_outputs"](self, output, output_args, micro_batch, logits_processor_func)
    finally:
        _ACTIVE.reset(token)


@functools.wraps(transformer_impl.FSDPEngineWithLMHead.forward_step)
def _forward_step(self, micro_batch, loss_function, forward_only):
    stats = {"rows": 0, "kept_mass": 0.0, "support_size": 0}
    token = _STATS.set(stats)
    try:
        loss, output = _ORIGINALS["forward_step"](self, micro_batch, loss_function, forward_only)
    finally:
        _STATS.reset(token)
    if stats["rows"]:
        output["metrics"][KEPT_MASS] = stats["kept_mass"] / stats["rows"]
        output["metrics"][SUPPORT_SIZE] = stats["support_size"] / stats["rows"]
    return loss, output


def _vocab_size(output) -> int:
    return int(output.logits.shape[-1])


def _replayed_logprobs_from_logits(logits, labels, inplace_backward=True):
    """verl's logprobs_from_logits, with the recorded rows renormalised over their support."""
    layout = _ACTIVE.get()
    if layout is None or layout.positions.numel() == 0:
        return _ORIGINALS["logprobs_from_logits"](logits, labels, inplace_backward=inplace_backward)
    if logits.shape[0] != layout.local_length:
        raise InputError(f"replay layout has {layout.local_length} rows but verl computes {logits.shape[0]} "
                         "log-probs on this rank")
    expected = labels[layout.positions.to(labels.device)].to(torch.int64).cpu()
    if not torch.equal(expected, layout.mask.sampled):
        raise InputError("replay layout: the recorded rows do not line up with verl's labels on this rank")
    # verl's own values on every row without a graph (unrecorded and whole rows keep them bit for bit);
    # replay_where's one backward gives their rows the full softmax gradient and the recorded rows the
    # support's: one dense gradient write, as verl alone pays (inplace_backward off: no graph here)
    with torch.no_grad():
        verl_lp = _ORIGINALS["logprobs_from_logits"](logits, labels, inplace_backward=False)
    keep = layout.keep(logits.device)
    out = replay_where(keep, logits, layout.mask.to(logits.device), labels.to(torch.int64), verl_lp)
    stats = _STATS.get()
    if stats is not None:
        with torch.no_grad():
            stats["rows"] += int(layout.positions.numel())
            stats["kept_mass"] += float(torch.exp(verl_lp.float()[keep] - out.float()[keep]).sum())
            stats["support_size"] += int(layout.mask.nnz)
    return out
