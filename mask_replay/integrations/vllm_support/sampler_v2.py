"""The engine half on Model Runner V2: each sampled token's support, read inside MRV2's sampler.

Follows vLLM 0.34.0's `vllm/v1/worker/gpu/sample/sampler.py` (class `Sampler`) and its CPU twin
`vllm/v1/worker/cpu/sampler.py` (class `CPUSampler`, the standalone no-Triton runner's), read also in 0.30.0,
0.31.0, 0.32.0 and 0.33.0 (`Sampler`; `CPUSampler` is new in 0.34):
- `Sampler.sample(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, ...)` returns
  `(sampled, processed_logits)`: the [B, V] tensor after the built-in logits processors (bias, penalties,
  bad words), thinking-budget forcing, temperature, min-p and top-k / top-p, -inf outside the support. The
  one exception is the fused FlashInfer / XPU draw, which skips top-k / top-p on the returned tensor; vLLM
  takes it only when no request of the step asks for log-probs in a processed mode (`fused_sampler_eligible`
  / `use_flashinfer` in `sample`), and then the step has no `LogprobsTensors` to carry blocks: nothing is
  recorded from it. The wrapper keeps `processed_logits` (no copy) and the rows sampled greedily (temperature
  exactly 0: vLLM's own rule, `any_greedy`; those rows take the plain argmax).
- `Sampler.__call__(logits, input_batch)` builds the `SamplerOutput`; its `logprobs_tensors` (from
  `compute_topk_scores`, one row per request) gets the blocks of `wire.encode` appended to
  `logprob_token_ids` (int64 in MRV2: two int32 words a column, `wire.as_columns`, so a row costs what it
  costs on V1), the columns past the log-probs' width, as in the V1 patch (`sampler.py`). Rows of requests
  still in chunked prefill are sampled and dropped by vLLM (`num_sampled` 0) with their log-probs, so rows
  stay one per generated token.
- `Sampler.__init__` refuses, at engine start-up, what the support cannot describe: a raw log-prob mode,
  speculative decoding (`sampler.check_engine`), custom logits processors (`custom_logits_processors`, from
  `--logits-processors` or the `vllm.logits_processors` entry points: a processor may change relative
  probabilities, which replay over the support cannot reproduce), watermarking (the watermark sampler draws
  through its own `_sample_random`) and trace replay (it overwrites sampled tokens after the draw).
A model whose `ModelState.custom_sampler` replaces the sampler bypasses these wrappers: its steps carry no
blocks, and its completions get no support (never a wrong one).
"""
from __future__ import annotations

import numpy as np
import torch

from mask_replay.integrations.vllm_support import _patching, sampler, wire

# vLLM releases whose MRV2 Sampler.__init__ / sample / __call__ were read (0.34: also CPUSampler)
READ_MRV2 = ("0.30", "0.31", "0.32", "0.33", "0.34")
_STEP = "_mask_replay_step"  # instance attribute: (processed [B, V], greedy rows [B] or None) of this step


def reads(version: str) -> bool:
    return any(version == v or version.startswith(v + ".") for v in READ_MRV2)


def install(sampler_cls, *, current_config) -> None:
    """Wrap an MRV2 sampler class's __init__, sample and __call__ (see the module docstring)."""
    _patching.wrap(sampler_cls, "__init__", lambda original: _checked_init(original, current_config))
    _patching.wrap(sampler_cls, "sample", _keeping_sample)
    _patching.wrap(sampler_cls, "__call__", _widening_call)


def _checked_init(original, current_config):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        check_engine(self, vllm_config if vllm_config is not None else current_config(),
                     kwargs.get("custom_logits_processors", ()))
    return __init__


def check_engine(sampler_obj, vllm_config, custom_processors) -> None:
    """The start-up refusals of an MRV2 engine: one line naming the setting and the fix."""
    sampler.check_engine(sampler_obj.logprobs_mode, vllm_config, custom_processors)
    if vllm_config is not None and getattr(vllm_config, "watermark_config", None) is not None:
        raise sampler.SupportRefused(
            "mask_replay vLLM support: watermarking draws tokens in the watermark sampler, which this plugin "
            "does not record; start the engine without watermark_config")
    if getattr(sampler_obj, "trace_replay_state", None) is not None:
        raise sampler.SupportRefused(
            "mask_replay vLLM support: enable_trace_replay overwrites sampled tokens after the draw; start the "
            "engine with enable_trace_replay=False")


def greedy_rows(sampling_states, expanded_idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray):
    """bool [rows] of the rows sampled greedily (temperature 0), or None when none is (a host-side check:
    MRV2 keeps the temperatures on the host too). GPU `SamplingStates` holds a `UvaBackedTensor` (.np, .gpu),
    `CPUSamplingStates` a tensor and `temperature_np`."""
    temperature = sampling_states.temperature
    host = getattr(temperature, "np", None)
    if host is None:
        host = sampling_states.temperature_np
    if not np.any(host[idx_mapping_np] == 0.0):
        return None
    device_side = getattr(temperature, "gpu", temperature)
    return device_side[expanded_idx_mapping] == 0.0


def _keeping_sample(original):
    def sample(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kwargs):
        sampled, processed = original(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np,
                                      *args, **kwargs)
        greedy = greedy_rows(self.sampling_states, expanded_idx_mapping, idx_mapping_np)
        setattr(self, _STEP, (processed, None if greedy is None else greedy.to(processed.device)))
        return sampled, processed
    return sample


def _widening_call(original):
    def __call__(self, logits, input_batch, *args, **kwargs):
        setattr(self, _STEP, None)
        out = original(self, logits, input_batch, *args, **kwargs)
        step = getattr(self, _STEP)
        setattr(self, _STEP, None)  # the [B, V] tensor is not kept past the step
        tensors = out.logprobs_tensors
        if step is None or tensors is None:
            return out
        processed, greedy = step
        ids = tensors.logprob_token_ids
        if processed.shape[0] != ids.shape[0]:
            return out
        blocks = wire.encode(processed > float("-inf"), out.sampled_token_ids[:, 0], greedy)
        widened = torch.cat([ids, wire.as_columns(blocks.to(ids.device), ids.dtype)], dim=1)
        out.logprobs_tensors = tensors._replace(logprob_token_ids=widened)
        return out
    return __call__
