"""A CPU platform for verl 0.9.1 (stand-in: verl ships CUDA, NPU and ROCm platforms only, and falls back to CUDA).

verl reads the device from its platform singleton (verl/plugin/platform/platform_manager.py: get_platform);
`use_cpu_platform()` sets this one before verl's engine modules are imported, so that verl's own
FSDPEngineWithLMHead code (forward_step's `micro_batch.to(get_device_id())`, autocast's device type, the
gloo backend) runs on the CPU. Nothing else of verl is changed. Used by benchmarks/experiment_verl.py (and
bench_verl_actor.py through it) only.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import set_platform


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
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def use_cpu_platform() -> None:
    set_platform(CpuPlatform())
