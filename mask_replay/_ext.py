"""Loads the compiled extension, which defines the torch.ops.mask_replay operators.

It only loads: fake kernels and autograd live in _register.py, imported by the package __init__."""
import torch  # noqa: F401  (the extension links against torch's libraries)

try:
    from mask_replay import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "mask_replay._C is not built. Run `make build` (or `pip install -e . --no-build-isolation`) "
        f"in the repository first. Original error: {exc}"
    ) from exc

ops = torch.ops.mask_replay


def build_info() -> dict:
    """Which kernels were compiled: {'cpu': True, 'cuda': bool, 'cuda_arch_list': str, ...}."""
    info = dict(_C.build_info())
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    return info
