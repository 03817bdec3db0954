"""Engine output adapters: masks in from vLLM and SGLang responses, padded layouts out to trainers.

Use them through SamplingMask.from_vllm / from_sglang / from_padded / to_padded; padded files
through mask_replay.files.padded_file. Any vLLM build without `sampling_mask` (V1 runner, CPU,
top-p-only requests): mask_from_vllm_logprobs / mask_from_trl_vllm on processed log-probs.
Importing this package imports every adapter, which registers the functions those SamplingMask
methods call (mask_replay/mask.py, module doc): list a new adapter module here.
"""
from mask_replay.sampler.adapters import padded, sglang, vllm  # noqa: F401  (registers the adapters)
from mask_replay.sampler.adapters.vllm_logprobs import (
    mask_from_trl_vllm,
    mask_from_vllm_logprobs,
    vllm_logprobs_settings,
)

__all__ = ["mask_from_trl_vllm", "mask_from_vllm_logprobs", "vllm_logprobs_settings"]
