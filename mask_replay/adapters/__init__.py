"""Engine output adapters: masks in from vLLM and SGLang responses, padded layouts out to trainers.

Use them through SamplingMask.from_vllm / from_sglang / from_padded / to_padded; padded files
through mask_replay.adapters.files. The modules here build MaskParts (mask.py imports them).
"""
from mask_replay.adapters.common import EngineOutputError  # noqa: F401
