"""mask_replay's vLLM plugin: every generated token's support, straight out of vLLM's sampler.

Turned on by the environment, in the process that starts vLLM (its engine and worker processes inherit it):

    MASK_REPLAY_VLLM_SUPPORT=1

vLLM calls `register` (entry point `vllm.general_plugins`: mask_replay_support) in every process it starts
(the `LLM` / API server process, the engine core, the workers) before the engine is built; with the
variable unset it returns at once and vLLM runs unchanged. With it set, it checks the vLLM version and
installs three patches (each follows the released file named in its module's docstring):

- `sampler.py`, engine core / workers: the support each token was drawn from, read off the processed
  log-probs inside the V1 sampler, appended as int32 columns to the sampled-token log-prob ids;
- `outputs.py`, `LLM` / API process: the columns split off again, `CompletionOutput.sampling_support`;
- `serving.py`, OpenAI-compatible server: a `sampling_support` field in each completion / chat choice.

The engine needs `logprobs_mode="processed_logprobs"` and requests with `logprobs >= 0` (0: what TRL and
verl ask anyway); the engine refuses, at start-up, raw log-prob modes, speculative decoding and Model
Runner V2. `SamplingMask.from_vllm(outputs)` reads the supports (offline outputs or the server's JSON).
"""
from __future__ import annotations

import os
import sys

from mask_replay.integrations.vllm_support import _patching

ENV = "MASK_REPLAY_VLLM_SUPPORT"
# vLLM releases whose patched functions were read and whose run here passed the exactness check
# (docs/integrations.md lists what ran and what was read only)
TESTED_VLLM = ("0.32",)
_SERVING_MODULES = ("vllm.entrypoints.openai.completion.serving", "vllm.entrypoints.openai.chat_completion.serving")


def enabled(environ=os.environ) -> bool:
    value = environ.get(ENV, "")
    if value.lower() in ("", "0", "false", "no", "off"):
        return False
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    raise RuntimeError(f"{ENV}={value!r}: expected 1 (on) or 0 (off)")


def check_version(version: str) -> None:
    if not any(version == v or version.startswith(v + ".") for v in TESTED_VLLM):
        raise RuntimeError(f"mask_replay vLLM support is built and tested for vLLM {', '.join(TESTED_VLLM)}.x; "
                           f"this is vLLM {version}: install a tested vLLM or unset {ENV}")


def register() -> None:
    """The `vllm.general_plugins` entry point: install the patches when ENV asks for them."""
    if not enabled():
        return
    install()


def install() -> None:
    """Every patch this process needs (idempotent). The serving patch only where vLLM's server is loaded."""
    # vllm is an optional, heavy dependency: imported only when the plugin is switched on
    import vllm
    from vllm.config import get_current_vllm_config_or_none
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.engine.output_processor import RequestState
    from vllm.v1.sample import sampler as v1_sampler
    from vllm.v1.worker.gpu.sample import sampler as v2_sampler

    from mask_replay.integrations.vllm_support import outputs, sampler, serving

    check_version(vllm.__version__)
    sampler.install_v1(v1_sampler.Sampler, sampling_eps=v1_sampler._SAMPLING_EPS,
                       current_config=get_current_vllm_config_or_none)
    sampler.refuse_v2(v2_sampler.Sampler)
    outputs.install(LogprobsProcessor, RequestState, RequestOutputKind.DELTA)
    if all(name in sys.modules for name in _SERVING_MODULES):
        completion, chat = (sys.modules[name] for name in _SERVING_MODULES)
        serving.install(completion.OpenAIServingCompletion, chat.OpenAIServingChat)


def uninstall() -> None:
    """Every patch undone: vLLM's classes as they were before `install`."""
    _patching.undo()


def installed() -> list[tuple[str, str]]:
    return _patching.installed()


def active() -> bool:
    """Switched on, and its output patch is in this process (vLLM loaded the plugin here)."""
    return enabled() and any(name == "_new_completion_output" for _, name in installed())
