"""Engine output adapters: masks in from vLLM and SGLang responses, padded layouts out to trainers.

Use them through SamplingMask.from_vllm / from_sglang / from_padded / to_padded; padded files
through mask_replay.files.padded_file.
"""
