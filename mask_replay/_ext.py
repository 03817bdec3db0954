"""Loads the compiled extension, which defines the torch.ops.mask_replay operators.

It only loads: fake kernels and autograd live in _register.py, imported by the package __init__."""
import importlib.util
import json
import os
import sys

import torch  # noqa: F401  (the extension links against torch's libraries)


def _load_override(path: str):
    """MASK_REPLAY_EXTENSION=/path/to/_C.so loads another build of the same extension (the
    AddressSanitizer copy of `make asan`) without replacing the in-place one."""
    spec = importlib.util.spec_from_file_location("mask_replay._C", path)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"MASK_REPLAY_EXTENSION={path}: no such extension file")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mask_replay._C"] = module
    spec.loader.exec_module(module)
    return module


try:
    if os.environ.get("MASK_REPLAY_EXTENSION"):
        _C = _load_override(os.environ["MASK_REPLAY_EXTENSION"])
    else:
        from mask_replay import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "mask_replay._C is not built. Run `make build` (or `pip install -e . --no-build-isolation`) "
        f"in the repository first. Original error: {exc}"
    ) from exc

ops = torch.ops.mask_replay


def build_info() -> dict:
    """Which kernels were compiled: {'cpu': True, 'cuda': bool, 'cuda_arch_list': str, ...}."""
    info = json.loads(ops.build_info())
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    return info
