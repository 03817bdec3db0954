"""mask-replay: record the support of truncated sampling and replay it in the trainer.

Importing the package loads the extension, so `torch.ops.mask_replay.*` is available at once.
"""
from mask_replay import _startup  # noqa: F401,I001  (first: a Ctrl-C while torch loads is one line)
from mask_replay.version import __version__
from mask_replay._ops import build_info  # (loads the extension and registers every op)
from mask_replay.errors import MaskFormatError, OutsideSupportError
from mask_replay.mask import SamplingMask
from mask_replay.sampler.capture import capture, capture_fixed
from mask_replay.sampler import adapters  # noqa: F401  (registers SamplingMask.from_vllm & co.: mask.py doc)
from mask_replay.files import mask_file  # noqa: F401  (registers SamplingMask.save / load: mask.py doc)
from mask_replay.trainer.replay import full_logprobs, kept_mass, replay_logprobs, replay_logprobs_from_hidden
from mask_replay.trainer.losses import score_centered_pg
from mask_replay.trainer.support_logprobs import (
    replay_support_logprobs,
    replay_support_logprobs_from_hidden,
    support_logprobs_padded,
)
from mask_replay.trainer.support_stats import (
    support_entropy,
    support_entropy_from_hidden,
    support_kl,
    support_kl_from_hidden,
)
from mask_replay.sampler.adapters.vllm_logprobs import (
    mask_from_trl_vllm, mask_from_vllm_logprobs, vllm_logprobs_settings)
from mask_replay.tools.selftest import selftest

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
    "replay_support_logprobs",
    "replay_support_logprobs_from_hidden",
    "support_logprobs_padded",
    "score_centered_pg",
    "mask_from_vllm_logprobs",
    "mask_from_trl_vllm",
    "vllm_logprobs_settings",
]
