"""Deprecated import path, kept for one release: the CPU colocate workaround moved to
`mask_replay.integrations.vllm_support.cpu_colocate` (the vLLM plugin's folder). Importing this module
warns once (Python imports a module once per process) and hands out the same objects."""
import warnings

from mask_replay.integrations.vllm_support.cpu_colocate import (
    ENGINE_DEFAULTS,
    engine_defaults,
    live_weight_dispatch,
    patch_cpu_gemm,
    prepare_colocate,
    single_process_env,
    with_defaults,
)

__all__ = ["ENGINE_DEFAULTS", "engine_defaults", "live_weight_dispatch", "patch_cpu_gemm", "prepare_colocate",
           "single_process_env", "with_defaults"]

warnings.warn("mask_replay.integrations.vllm_cpu is deprecated and goes in the next release: import "
              "mask_replay.integrations.vllm_support.cpu_colocate", DeprecationWarning, stacklevel=2)
