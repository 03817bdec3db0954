"""Engine output adapters: masks in from vLLM and SGLang responses, padded layouts out to trainers.

The same functions are reachable as SamplingMask.from_vllm / from_sglang / from_padded / to_padded.
"""
from mask_replay.adapters.common import EngineOutputError
from mask_replay.adapters.padded import from_padded, load_padded, save_padded, to_padded
from mask_replay.adapters.sglang import from_sglang
from mask_replay.adapters.vllm import from_vllm

__all__ = ["EngineOutputError", "from_vllm", "from_sglang", "from_padded", "to_padded", "save_padded",
           "load_padded"]
