"""mask-replay: record the support of truncated sampling and replay it in the trainer.

The public names load on first use (PEP 562), so `mask-replay --help` and other torch-free
paths do not pay for importing torch and the extension.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "build_info": "mask_replay._ext",
    "SamplingMask": "mask_replay.mask",
    "MaskFormatError": "mask_replay.mask",
    "capture": "mask_replay.capture_api",
    "capture_fixed": "mask_replay.capture_api",
    "OutsideSupportError": "mask_replay.capture_api",
    "replay_logprobs": "mask_replay.replay",
    "replay_logprobs_from_hidden": "mask_replay.replay",
    "full_logprobs": "mask_replay.replay",
    "kept_mass": "mask_replay.replay",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mask_replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
