"""Engine output adapters: masks in from vLLM and SGLang responses, padded layouts out to trainers.

Use them through SamplingMask.from_vllm / from_sglang / from_padded / to_padded; padded files
through mask_replay.files.padded_file. Importing this package imports every adapter, which registers
the functions those SamplingMask methods call (mask_replay/mask.py, module doc): list a new adapter
module here.
"""
from mask_replay.sampler.adapters import padded, sglang, vllm  # noqa: F401  (registers the adapters)
