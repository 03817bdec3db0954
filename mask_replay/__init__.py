"""mask-replay: record the support of truncated sampling and replay it in the trainer."""
__version__ = "0.1.0"

from mask_replay._ext import build_info
from mask_replay import _fake  # noqa: F401  (fake kernels for torch.compile)
from mask_replay.mask import SamplingMask, MaskFormatError
from mask_replay.capture import capture, capture_fixed
from mask_replay.replay import (
    full_logprobs,
    kept_mass,
    replay_logprobs,
    replay_logprobs_from_hidden,
)

__all__ = [
    "__version__",
    "build_info",
    "SamplingMask",
    "MaskFormatError",
    "capture",
    "capture_fixed",
    "replay_logprobs",
    "replay_logprobs_from_hidden",
    "full_logprobs",
    "kept_mass",
]
