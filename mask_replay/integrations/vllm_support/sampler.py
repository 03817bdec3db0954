"""The engine half: each sampled token's support, read inside vLLM's sampler, rides on the log-prob ids.

Follows vLLM 0.32.0's V1 runner sampler, `vllm/v1/sample/sampler.py`:
- `Sampler.sample(logits, sampling_metadata)` returns `(sampled, processed)`; with
  `logprobs_mode="processed_logprobs"` (or "processed_logits") and log-probs asked for, `processed` is the
  [B, V] tensor the token was drawn from: after penalties, temperature, min-p, top-k and top-p, -inf
  outside the support. The wrapper keeps it (no copy) with the rows that were sampled greedily.
- `Sampler.forward(...)` gathers the top-N log-probs into a `LogprobsTensors`; the wrapper appends the
  support blocks of `wire.encode` to its `logprob_token_ids` (int32), one fixed-width block per row, on
  the sampler's device without a host sync (narrowing.py cuts the width after the copy). Steps where
  vLLM returns no such tensor, the whole [B, V] (`logprobs=-1`) or scoring ids (`logprob_token_ids`)
  carry no blocks: the API half then attaches no support to those completions (never a wrong one).
- `Sampler.__init__` refuses, at engine start-up, a raw log-prob mode and speculative decoding (the
  rejection sampler draws its tokens outside `sample`).
Model Runner V2's sampler is patched in `sampler_v2.py` (vLLM 0.30-0.34); `refuse_v2` refuses it on the
releases before, whose MRV2 sampler was not read (set VLLM_USE_V2_MODEL_RUNNER=0).
"""
from __future__ import annotations

import torch

from mask_replay.integrations.vllm_support import _patching, wire

PROCESSED_MODES = ("processed_logprobs", "processed_logits")
_STEP = "_mask_replay_step"  # instance attribute: (processed [B, V], greedy rows [B] or None) of this step


class SupportRefused(RuntimeError):
    """The engine is configured in a way whose supports the plugin cannot record."""


def install_v1(sampler_cls, *, sampling_eps: float, current_config) -> None:
    """Wrap the V1 `Sampler`'s __init__, sample and forward (see the module docstring)."""
    _patching.wrap(sampler_cls, "__init__", lambda original: _checked_init(original, current_config))
    _patching.wrap(sampler_cls, "sample", lambda original: _keeping_sample(original, sampling_eps))
    _patching.wrap(sampler_cls, "forward", _widening_forward)


def refuse_v2(sampler_cls) -> None:
    def make(original):
        def __init__(self, *args, **kwargs):
            raise SupportRefused(
                "mask_replay vLLM support: Model Runner V2's sampler is supported from vLLM 0.30; set "
                "VLLM_USE_V2_MODEL_RUNNER=0 to run the V1 runner, whose sampler it records")
        return __init__
    _patching.wrap(sampler_cls, "__init__", make)


def _checked_init(original, current_config):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        check_engine(self.logprobs_mode, current_config())
    return __init__


def check_engine(logprobs_mode: str, vllm_config, custom_processors=()) -> None:
    """The start-up refusals: one line naming the setting and the fix. `custom_processors`: the instances
    an MRV2 sampler was given (config and entry points); V1 reads the config's `logits_processors`."""
    if logprobs_mode not in PROCESSED_MODES:
        raise SupportRefused(
            f"mask_replay vLLM support: logprobs_mode={logprobs_mode!r} hides the support the sampler drew "
            "from; start the engine with logprobs_mode='processed_logprobs' (LLM(..., logprobs_mode=...) or "
            "--logprobs-mode processed_logprobs)")
    if vllm_config is not None and getattr(vllm_config, "speculative_config", None) is not None:
        raise SupportRefused(
            "mask_replay vLLM support: speculative decoding draws tokens in the rejection sampler, which "
            "this plugin does not record; run without speculative_config")
    model_config = getattr(vllm_config, "model_config", None)
    names = [type(p).__name__ for p in custom_processors] + [
        p if isinstance(p, str) else getattr(p, "__name__", repr(p))
        for p in (getattr(model_config, "logits_processors", None) or ())]
    if names:
        raise SupportRefused(
            f"mask_replay vLLM support: custom logits processors ({', '.join(sorted(set(names)))}) may change "
            "relative probabilities, which replay over the support cannot reproduce; start the engine without "
            "logits_processors (--logits-processors) and without vllm.logits_processors plugins")


def greedy_rows(sampling_metadata, rows: int, sampling_eps: float):
    """bool [rows] of the greedily sampled rows, or None when every row is random (vLLM's own rule:
    all_greedy, else temperature below its epsilon)."""
    if sampling_metadata.all_random:
        return None
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return torch.ones(rows, dtype=torch.bool)
    return sampling_metadata.temperature < sampling_eps


def _keeping_sample(original, sampling_eps):
    def sample(self, logits, sampling_metadata, *args, **kwargs):
        sampled, processed = original(self, logits, sampling_metadata, *args, **kwargs)
        if processed is not None:
            greedy = greedy_rows(sampling_metadata, processed.shape[0], sampling_eps)
            setattr(self, _STEP, (processed, None if greedy is None else greedy.to(processed.device)))
        return sampled, processed
    return sample


def _widening_forward(original):
    def forward(self, logits, sampling_metadata, *args, **kwargs):
        setattr(self, _STEP, None)
        out = original(self, logits, sampling_metadata, *args, **kwargs)
        step = getattr(self, _STEP)
        setattr(self, _STEP, None)  # the [B, V] tensor is not kept past the step
        tensors = out.logprobs_tensors
        n = sampling_metadata.max_num_logprobs
        if step is None or tensors is None or n is None or n < 0 or sampling_metadata.logprob_token_ids:
            return out
        processed, greedy = step
        if processed.shape[0] != tensors.logprob_token_ids.shape[0]:
            return out
        blocks = wire.encode(processed > float("-inf"), out.sampled_token_ids[:, 0], greedy)
        widened = torch.cat([tensors.logprob_token_ids, blocks.to(tensors.logprob_token_ids.device)], dim=1)
        out.logprobs_tensors = tensors._replace(logprob_token_ids=widened)
        return out
    return forward
