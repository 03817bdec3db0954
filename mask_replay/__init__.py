"""mask-replay: record the support of truncated sampling and replay it in the trainer.

Importing the package loads the extension, so `torch.ops.mask_replay.*` is available at once.
"""
__version__ = "0.1.0"

from mask_replay import _startup  # noqa: E402,F401  (first: a Ctrl-C while torch loads is one line)

from mask_replay._ext import build_info  # noqa: E402  (loads the ops)
from mask_replay import _register  # noqa: E402,F401  (fake kernels and autograd of every op)
from mask_replay.capture_api import OutsideSupportError, capture, capture_fixed  # noqa: E402
from mask_replay.mask import MaskFormatError, SamplingMask  # noqa: E402
from mask_replay.replay import (  # noqa: E402
    full_logprobs,
    kept_mass,
    replay_logprobs,
    replay_logprobs_from_hidden,
)
from mask_replay.support_stats import (  # noqa: E402
    support_entropy,
    support_entropy_from_hidden,
    support_kl,
    support_kl_from_hidden,
)
from mask_replay.tools.selftest import selftest  # noqa: E402

__all__ = [
    "__version__",
    "build_info",
    "SamplingMask",
    "MaskFormatError",
    "OutsideSupportError",
    "capture",
    "capture_fixed",
    "replay_logprobs",
    "replay_logprobs_from_hidden",
    "full_logprobs",
    "kept_mass",
    "support_entropy",
    "support_kl",
    "support_entropy_from_hidden",
    "support_kl_from_hidden",
    "selftest",
]
