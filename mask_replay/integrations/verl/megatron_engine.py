"""Replay in verl's Megatron engine (verl 0.9.1): old, current and reference log-probs over the recorded
supports, on vocab-parallel logits (each tensor-parallel rank holds V / TP columns).

Follows the released verl 0.9.1 files verl/workers/engine/megatron/transformer_impl.py and
verl/models/mcore/model_forward.py:
- ``registry.gptmodel_forward_model_engine`` (wrapped; the function ``get_mcore_engine_forward_fn``
  returns, i.e. what ``MegatronEngineWithLMHead.forward_step`` calls): when replay is on it adds one more
  entry to ``logits_processor_args``, each token's index in the unpadded packed micro-batch (plus one).
  verl's forward function lays every entry of that dict out exactly as it lays out the labels (THD
  packing with per-sample alignment to TP x CP, the static bucket pad, context parallelism's zigzag
  chunks, or BSHD padding; the labels alone are rolled), so the logits processor receives, at each
  logits row, the index of the input token there (0 on padding): where each response token's row
  lands is read off verl's own layout.
- ``MegatronEngineWithLMHead._lm_head_logits_processor`` (wrapped): takes that entry off, works out
  this rank's replayed rows from the micro-batch's supports (``non_tensor_batch[SUPPORT_KEY]``, one
  CSR per sample; support_rows.recorded_rows) and holds them for verl's log-prob call.
- ``transformer_impl.vocab_parallel_log_probs_from_logits`` (replaced, module global): on the logits
  verl has already divided by the temperature, first mask_replay's
  ``replay_logprobs_vocab_parallel`` over the tensor-parallel group (every logits row: a replayed row
  over its support, any other row over the singleton of its label, which costs one entry and gives an
  exact 0), then verl's own function on every row (megatron-core's vocab_parallel_cross_entropy, which
  overwrites float32 logits in place: hence replay reads them first). A row with nothing recorded, or
  the whole vocabulary (``hf_config.vocab_size`` ids; Megatron pads its vocabulary beyond that), keeps
  verl's value bit for bit; the replayed rows get the replayed value, with gradients.
- ``MegatronEngineWithLMHead.postprocess_micro_batch_func`` (wrapped): adds ``replay/kept_mass/mean``
  and ``replay/support_size/mean`` over the micro-batch's replayed rows to its metrics, as trainer.py
  does on the FSDP side (identical on every TP rank).
- start-up (trainer.py's ``EngineRegistry.new`` check, backend "megatron"): refuses, naming the config
  key, what is not built: dynamic context parallelism, pipeline stages (and virtual ones); fused
  kernels are refused by trainer.py for every backend.

Sequence parallelism needs nothing here: Megatron's output layer gathers the sequence before the
vocab-parallel logits, so every TP rank holds all rows of its columns. Static context parallelism
needs nothing more either: each CP rank replays the rows it holds, verl's postprocess_thd_engine
all-gathers the log-probs (the other ranks' detached, as for verl's own), and the metrics of a CP rank
cover its own rows.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Any, Optional

import torch

try:  # verl and megatron-core are optional dependencies: make venv-verl
    from megatron.core import parallel_state as mpu
    from verl.models.mcore import registry
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron import transformer_impl
except ImportError as exc:  # pragma: no cover - exercised only without verl / megatron-core
    raise ImportError("mask_replay.integrations.verl.megatron_engine needs verl 0.9.1 and megatron-core: "
                      "make venv-verl") from exc

from mask_replay.errors import InputError
from mask_replay.integrations.verl import trainer as verl_trainer
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY, LocalSupport, recorded_rows
from mask_replay.mask import SamplingMask
from mask_replay.trainer.vocab_parallel import replay_logprobs_vocab_parallel

__all__ = ["install", "uninstall", "installed", "BACKEND", "POSITIONS_KEY"]

BACKEND = "megatron"
POSITIONS_KEY = "mask_replay_token_index"  # the extra logits_processor_args entry (1 + packed token index)
_STATS_KEY = "mask_replay_stats"  # non-tensor of the micro-batch: (rows, kept mass sum, support size sum)
_ACTIVE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("mask_replay_megatron", default=None)
_ORIGINALS: dict[str, Any] = {}
_CLS = transformer_impl.MegatronEngineWithLMHead
_CONFIG = "actor_rollout_ref.actor.megatron"  # and actor_rollout_ref.ref.megatron for the reference model


def installed() -> bool:
    return bool(_ORIGINALS)


def install() -> None:
    """Patch verl's Megatron engine (idempotent; installs trainer.py's patches too, whose start-up check
    lets the megatron backend through once this is installed). ImportError for any verl but 0.9.1."""
    verl_trainer.install()  # the version check, and EngineRegistry.new's start-up check
    if installed():
        return
    _ORIGINALS["forward_fn"] = registry.gptmodel_forward_model_engine
    _ORIGINALS["log_probs"] = transformer_impl.vocab_parallel_log_probs_from_logits
    _ORIGINALS["processor"] = _CLS.__dict__["_lm_head_logits_processor"]
    _ORIGINALS["postprocess"] = _CLS.__dict__["postprocess_micro_batch_func"]
    registry.gptmodel_forward_model_engine = _forward_fn
    transformer_impl.vocab_parallel_log_probs_from_logits = _replayed_log_probs
    _CLS._lm_head_logits_processor = _logits_processor
    _CLS.postprocess_micro_batch_func = _postprocess_micro_batch_func
    verl_trainer.MORE_BACKENDS[BACKEND] = _check_config


def uninstall() -> None:
    """Put verl's own Megatron functions back (trainer.py's patches stay: trainer.uninstall())."""
    if not installed():
        return
    registry.gptmodel_forward_model_engine = _ORIGINALS.pop("forward_fn")
    transformer_impl.vocab_parallel_log_probs_from_logits = _ORIGINALS.pop("log_probs")
    _CLS._lm_head_logits_processor = _ORIGINALS.pop("processor")
    _CLS.postprocess_micro_batch_func = _ORIGINALS.pop("postprocess")
    verl_trainer.MORE_BACKENDS.pop(BACKEND, None)


def _check_config(kwargs: dict) -> None:
    """Start-up refusal of the Megatron layouts replay is not built for (EngineRegistry.new's kwargs)."""
    cfg = kwargs.get("engine_config")
    if cfg is None:
        return
    refused = [("dynamic_context_parallel", bool(getattr(cfg, "dynamic_context_parallel", False)),
                "dynamic context parallelism"),
               ("pipeline_model_parallel_size", getattr(cfg, "pipeline_model_parallel_size", 1) not in (None, 1),
                "pipeline stages"),
               ("virtual_pipeline_model_parallel_size",
                getattr(cfg, "virtual_pipeline_model_parallel_size", None) not in (None, 1), "virtual pipeline stages")]
    for key, on, what in refused:
        if on:
            raise NotImplementedError(f"mask_replay verl replay: {what} in the Megatron engine is not supported yet "
                                      f"({_CONFIG}.{key}={getattr(cfg, key)!r}); set it to its default or unset "
                                      "MASK_REPLAY_VERL")


def _is_replay_processor(logits_processor) -> bool:
    return getattr(getattr(logits_processor, "func", None), "__func__", None) is _logits_processor


@functools.wraps(registry.gptmodel_forward_model_engine)
def _forward_fn(model, input_ids, multi_modal_inputs, logits_processor=None, logits_processor_args=None, **kwargs):
    if _is_replay_processor(logits_processor) and logits_processor_args is not None:
        index = torch.arange(1, input_ids.values().shape[0] + 1, device=input_ids.device)
        nested = torch.nested.nested_tensor_from_jagged(index, offsets=input_ids.offsets())
        logits_processor_args[POSITIONS_KEY] = nested
    return _ORIGINALS["forward_fn"](model, input_ids, multi_modal_inputs, logits_processor=logits_processor,
                                    logits_processor_args=logits_processor_args, **kwargs)


@functools.wraps(transformer_impl.MegatronEngineWithLMHead._lm_head_logits_processor)
def _logits_processor(self, logits, label, temperature, *, batch, **kwargs):
    token_index = kwargs.pop(POSITIONS_KEY, None)
    if token_index is None:
        raise InputError("mask_replay verl replay: verl's Megatron forward function did not lay out the token "
                         f"index (is {__name__} installed whole?)")
    vocab = int(getattr(getattr(self.model_config, "hf_config", None), "vocab_size", 0) or 0)
    padded = logits.shape[-1] * mpu.get_tensor_model_parallel_world_size()
    layout = _local_rows(verl_trainer.micro_batch_supports(batch), batch, token_index,
                         vocab_size=vocab if 0 < vocab <= padded else padded)
    state = {"layout": layout, "rows": 0, "kept_mass": 0.0, "support_size": 0}
    token = _ACTIVE.set(state)
    try:
        out = _ORIGINALS["processor"](self, logits, label, temperature, batch=batch, **kwargs)
    finally:
        _ACTIVE.reset(token)
    tu.assign_non_tensor(batch, **{_STATS_KEY: (state["rows"], state["kept_mass"], state["support_size"])})
    return out


def _local_rows(supports: list, batch, token_index: torch.Tensor, *, vocab_size: int) -> LocalSupport:
    """This rank's replayed logits rows (flattened [B * S] or [1 * S] positions) and their supports."""
    input_ids = batch["input_ids"]
    cu = input_ids.offsets().detach().cpu().to(torch.int64)
    ids = input_ids.values().detach().cpu().to(torch.int64)
    if len(supports) != cu.numel() - 1:
        raise InputError(f"{len(supports)} supports for a micro-batch of {cu.numel() - 1} samples", key=SUPPORT_KEY)
    resp = verl_trainer._response_lengths(batch).detach().cpu().to(torch.int64)
    index = token_index.reshape(-1).detach().cpu().to(torch.int64)
    where = torch.nonzero(index > 0).flatten()
    row_of_token = torch.full((ids.numel() + 1,), -1, dtype=torch.int64)
    row_of_token[index[where]] = where
    positions, masks = [], []
    for i, support in enumerate(supports):
        found = recorded_rows(support, i, ids, cu, resp, vocab_size)
        if found is None:
            continue
        # response token j is predicted at the row whose input is token start - 1 + j (index start + j)
        rows = row_of_token[found.start + found.rows]
        here = rows >= 0
        if bool(here.any()):
            masks.append(found.select(here))
            positions.append(rows[here])
    if not masks:
        empty = SamplingMask(torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                             sampled=torch.zeros(0, dtype=torch.int64))
        return LocalSupport(torch.zeros(0, dtype=torch.int64), empty, index.numel())
    mask = SamplingMask.concat(masks)
    mask.sampled = torch.cat([m.sampled for m in masks])
    return LocalSupport(torch.cat(positions), mask, index.numel())


def _all_rows(layout: LocalSupport, labels: torch.Tensor) -> SamplingMask:
    """A CSR over every logits row: the replayed rows' supports, the singleton {label} elsewhere."""
    n, pos, sub = layout.local_length, layout.positions, layout.mask
    lengths = torch.ones(n, dtype=torch.int64)
    lengths[pos] = sub.lengths()
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    token_ids = torch.empty(int(offsets[-1]), dtype=torch.int32)
    single = torch.ones(n, dtype=torch.bool)
    single[pos] = False
    token_ids[offsets[:-1][single]] = labels[single].to(torch.int32)
    sub_lengths = sub.lengths()
    row_of = torch.repeat_interleave(torch.arange(pos.numel()), sub_lengths, output_size=sub.nnz)
    dest = offsets[:-1][pos][row_of] + torch.arange(sub.nnz) - sub.offsets[:-1][row_of]
    token_ids[dest] = sub.token_ids
    return SamplingMask(token_ids, offsets)


def _replayed_log_probs(logits, labels):
    """verl's vocab_parallel_log_probs_from_logits, with the recorded rows renormalised over their support."""
    state = _ACTIVE.get()
    layout = state["layout"] if state is not None else None
    if layout is None or layout.positions.numel() == 0:
        return _ORIGINALS["log_probs"](logits, labels)
    if labels.numel() != layout.local_length:
        raise InputError(f"replay layout has {layout.local_length} rows but verl computes {labels.numel()} "
                         "log-probs on this rank")
    flat_labels = labels.reshape(-1).to(torch.int64)
    cpu_labels = flat_labels.cpu()
    if not torch.equal(cpu_labels[layout.positions], layout.mask.sampled):
        raise InputError("replay layout: the recorded rows do not line up with verl's labels on this rank")
    vp = logits.shape[-1]
    # before verl's function: megatron-core's cross entropy overwrites float32 logits in place
    replayed = replay_logprobs_vocab_parallel(
        logits.reshape(-1, vp), _all_rows(layout, cpu_labels).to(logits.device), flat_labels,
        vocab_start=mpu.get_tensor_model_parallel_rank() * vp, group=mpu.get_tensor_model_parallel_group())
    verl_lp = _ORIGINALS["log_probs"](logits, labels)
    keep = layout.keep(logits.device)
    flat = verl_lp.reshape(-1)
    with torch.no_grad():
        state["rows"] += int(layout.positions.numel())
        state["kept_mass"] += float(torch.exp(flat.double()[keep] - replayed.double()[keep]).sum())
        state["support_size"] += int(layout.mask.nnz)
    return torch.where(keep, replayed.to(flat.dtype), flat).reshape(verl_lp.shape)


@functools.wraps(transformer_impl.MegatronEngineWithLMHead.postprocess_micro_batch_func)
def _postprocess_micro_batch_func(self, output, data, forward_only, loss_function, **kwargs):
    result = _ORIGINALS["postprocess"](self, output, data, forward_only, loss_function, **kwargs)
    rows, kept, size = tu.get_non_tensor_data(data=data, key=_STATS_KEY, default=(0, 0.0, 0))
    if rows:
        result[-1]["metrics"][verl_trainer.KEPT_MASS] = kept / rows
        result[-1]["metrics"][verl_trainer.SUPPORT_SIZE] = size / rows
    return result
