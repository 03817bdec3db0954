"""Engine output adapters: masks in from vLLM and SGLang responses, padded layouts out to trainers.

Use them through SamplingMask.from_vllm / from_sglang / from_padded / to_padded; padded files
through mask_replay.files.padded_file. Any vLLM build without `sampling_mask` (V1 runner, CPU,
top-p-only requests): mask_from_vllm_logprobs / mask_from_trl_vllm on processed log-probs.
"""
from mask_replay.sampler.adapters.vllm_logprobs import (
    mask_from_trl_vllm,
    mask_from_vllm_logprobs,
    vllm_logprobs_settings,
)

__all__ = ["mask_from_trl_vllm", "mask_from_vllm_logprobs", "vllm_logprobs_settings"]
