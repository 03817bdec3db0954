"""Rollout server side of the verl drop-in: each completion's recorded support into ``TokenOutput.extra_fields``.

Follows the released verl 0.9.1 file verl/workers/rollout/vllm_rollout/vllm_async_server.py:
- ``vLLMHttpServer.generate`` (wrapped): it turns verl's ``logprobs`` flag into ``SamplingParams(logprobs=0
  or None)``, iterates ``self.engine.generate(prompt=..., sampling_params=..., request_id=...)`` (vLLM's
  AsyncLLM, CUMULATIVE outputs) to the final RequestOutput and returns a ``TokenOutput`` built from
  ``outputs[0]``. The wrapper puts a recording proxy in front of the server's engine (once per server):
  it hands the engine ``logprobs=0`` where verl asked for none (``rollout.calculate_log_probs=False``:
  mask-replay's vLLM plugin records a token's support only when its request asks for log-probs; verl's
  own local SamplingParams keeps None, so verl returns ``log_probs=None`` exactly as without replay),
  and keeps the ``sampling_support`` that the plugin attaches to each ``CompletionOutput`` (``.token_ids``
  int32 [nnz], ``.offsets`` int64 [rows + 1], one row per generated token) by request id. After verl's
  own generate returns, that support goes into ``extra_fields[SUPPORT_KEY]`` as a dict of numpy arrays.
  A finished completion without a record, or with a row count other than its token count, is one error
  naming the request; an aborted request (no tokens) gets nothing.
- ``vLLMHttpServer.launch_server`` (wrapped): before the engine starts, the rollout config is checked
  (``check_rollout_config``) and mask-replay's vLLM plugin is switched on in this process and in the
  engine processes it starts (``MASK_REPLAY_VLLM_SUPPORT=1`` in the environment, the plugin's patches
  installed here); an explicit ``MASK_REPLAY_VLLM_SUPPORT=0`` is refused.

And verl/workers/rollout/llm_server.py (``install_client``), in the agent-loop worker and the driver:
- ``LLMServerClient.generate`` (wrapped): the client every agent loop calls once per turn
  (FullyAsyncLLMServerClient: once per resumed piece). Inside an agent loop run, the TokenOutput's
  ``extra_fields[SUPPORT_KEY]`` is taken out and held on the sample's support_track.SupportTrack until
  verl merges the turn (agent_loop.py), so tool_agent_loop, which keeps the first turn's extra_fields
  only, never hands one turn's rows on as the sample's. Tokens without rows: one error naming the request.
- ``LLMServerManager.__init__`` (wrapped): ``check_rollout_config`` at the trainer's start-up.

plugin.py installs these patches, when ``MASK_REPLAY_VERL=1``, in whichever process imports the module.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import numpy as np

try:  # verl is an optional dependency: make venv-verl
    import verl
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mask_replay.integrations.verl.rollout needs verl 0.9.1: make venv-verl") from exc

from mask_replay.errors import EngineOutputError, InputError
from mask_replay.integrations import vllm_support
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY
from mask_replay.integrations.verl.support_track import TRACK
from mask_replay.integrations.vllm_support.sampler import PROCESSED_MODES

__all__ = ["install", "uninstall", "installed", "install_client", "check_rollout_config", "enable_vllm_support",
           "ATTRIBUTE", "VLLM_SWITCH", "TESTED_VERL"]

TESTED_VERL = "0.9.1"
ATTRIBUTE = "sampling_support"  # the vLLM plugin's attribute on each CompletionOutput
VLLM_SWITCH = "MASK_REPLAY_VLLM_SUPPORT"  # the vLLM plugin's switch (integrations/vllm_support)
ROLLOUT_KEY = "actor_rollout_ref.rollout"
_ORIGINALS: dict[type, dict[str, Any]] = {}


def check_version() -> None:
    if verl.__version__ != TESTED_VERL:
        raise ImportError(f"mask_replay.integrations.verl is built and tested against verl {TESTED_VERL}, found "
                          f"verl {verl.__version__}: pip install 'verl=={TESTED_VERL}'")


def check_rollout_config(rollout, environ=os.environ) -> None:
    """The start-up refusals of the rollout side (rollout: verl's RolloutConfig or its DictConfig), one line
    each naming the config key: a backend other than vLLM, a log-prob mode that hides the support, MTP
    speculative decoding, and the vLLM plugin switched off explicitly."""
    name = _get(rollout, "name")
    if name != "vllm":
        raise InputError(f"replay (MASK_REPLAY_VERL=1) records supports in verl's vLLM rollout server only, "
                         f"this run uses '{name}'", key=f"{ROLLOUT_KEY}.name",
                         hint="set actor_rollout_ref.rollout.name=vllm or unset MASK_REPLAY_VERL")
    mode = _get(rollout, "logprobs_mode")
    if mode not in PROCESSED_MODES:
        raise InputError(f"{mode!r} hides the support each token was drawn from", key=f"{ROLLOUT_KEY}.logprobs_mode",
                         hint="set it to processed_logprobs (verl's default) or unset MASK_REPLAY_VERL")
    mtp = _get(rollout, "mtp")
    if mtp is not None and _get(mtp, "enable") and _get(mtp, "enable_rollout"):
        raise InputError("speculative decoding draws tokens outside the sampler the vLLM plugin records",
                         key=f"{ROLLOUT_KEY}.mtp.enable_rollout", hint="set it to False or unset MASK_REPLAY_VERL")
    value = environ.get(VLLM_SWITCH)
    if value is not None and value.strip().lower() in ("0", "false", "no", "off"):
        raise InputError(f"MASK_REPLAY_VERL=1 needs mask-replay's vLLM plugin in the rollout server, but "
                         f"{VLLM_SWITCH}={value!r} switches it off", key=VLLM_SWITCH,
                         hint=f"unset {VLLM_SWITCH} (MASK_REPLAY_VERL=1 turns it on) or unset MASK_REPLAY_VERL")


def _get(config, key):
    return config.get(key) if hasattr(config, "get") else getattr(config, key, None)


def enable_vllm_support(environ=os.environ) -> None:
    """The vLLM plugin on in this process (its patches installed now, whether or not vLLM loaded its plugins
    here already) and in every process it starts from now on (the switch in the environment they inherit).
    vllm_support.install imports vllm: only ever called in the rollout server's process, which imported it."""
    environ[VLLM_SWITCH] = "1"
    vllm_support.install()


def installed(server_cls: Optional[type] = None) -> bool:
    return (server_cls in _ORIGINALS) if server_cls is not None else bool(_ORIGINALS)


def _server_class() -> type:
    # vllm is only importable in verl's vLLM rollout environment (verl[vllm]); the trainer side never needs it
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    return vLLMHttpServer


def install(server_cls: Optional[type] = None) -> None:
    """Wrap ``server_cls.generate`` and ``launch_server`` (default: verl's vLLMHttpServer; idempotent)."""
    check_version()
    cls = server_cls if server_cls is not None else _server_class()
    if cls in _ORIGINALS:
        return
    _ORIGINALS[cls] = {name: cls.__dict__[name] for name in ("generate", "launch_server") if name in cls.__dict__}
    cls.generate = _with_support(_ORIGINALS[cls]["generate"])
    if "launch_server" in _ORIGINALS[cls]:
        cls.launch_server = _checked_launch(_ORIGINALS[cls]["launch_server"])


def uninstall(server_cls: Optional[type] = None) -> None:
    for cls in [server_cls] if server_cls is not None else list(_ORIGINALS):
        for name, original in _ORIGINALS.pop(cls, {}).items():
            setattr(cls, name, original)


def _checked_launch(original):
    @functools.wraps(original)
    async def launch_server(self, *args, **kwargs):
        check_rollout_config(self.config)
        enable_vllm_support()
        return await original(self, *args, **kwargs)

    return launch_server


class _RecordingEngine:
    """In front of the server's AsyncLLM: passes everything through, asks for ``logprobs=0`` where the
    request asks for none, keeps each request's last ``outputs[0].sampling_support`` by request id."""

    def __init__(self, engine):
        self._engine = engine
        self.records: dict[str, Any] = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, *args, request_id, sampling_params, **kwargs):
        if sampling_params.logprobs is None:
            sampling_params = sampling_params.clone()  # the caller's own object keeps None
            sampling_params.logprobs = 0
        async for output in self._engine.generate(*args, request_id=request_id, sampling_params=sampling_params,
                                                  **kwargs):
            if output.outputs:
                # a reference per output (CUMULATIVE: the plugin builds the whole support each time)
                self.records[request_id] = getattr(output.outputs[0], ATTRIBUTE, None)
            yield output


def _with_support(original):
    @functools.wraps(original)
    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        if not isinstance(self.engine, _RecordingEngine):
            self.engine = _RecordingEngine(self.engine)
        engine = self.engine
        try:
            out = await original(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            support = engine.records.pop(request_id, None)
        n = len(out.token_ids)
        if n == 0:
            return out
        if support is None and SUPPORT_KEY in out.extra_fields:
            return out  # a PD prefill server: the decode server's generate attached it already
        if support is None:
            raise EngineOutputError(f"request {request_id}: the completion carries no '{ATTRIBUTE}' (is "
                                    "mask-replay's vLLM plugin loaded in the rollout server?)", key=SUPPORT_KEY)
        # as recorded, not cast: SupportTrack.receive checks the values and only then narrows them
        ids, offsets = np.asarray(support.token_ids), np.asarray(support.offsets)
        if offsets.ndim != 1 or offsets.shape[0] != n + 1:
            raise EngineOutputError(f"request {request_id}: the support has {max(offsets.shape[0] - 1, 0)} rows but "
                                    f"the completion has {n} tokens", key=SUPPORT_KEY)
        out.extra_fields[SUPPORT_KEY] = {"token_ids": ids, "offsets": offsets}
        return out

    return generate


def install_client(llm_server=None) -> None:
    """Wrap ``LLMServerClient.generate`` and ``LLMServerManager.__init__`` of verl's llm_server module
    (default: imported here; idempotent)."""
    check_version()
    if llm_server is None:
        from verl.workers.rollout import llm_server  # its own imports are heavy: only where it is wanted
    for cls, name, make in ((llm_server.LLMServerClient, "generate", _collecting_generate),
                            (llm_server.LLMServerManager, "__init__", _checked_manager_init)):
        originals = _ORIGINALS.setdefault(cls, {})
        if name not in originals:
            originals[name] = cls.__dict__[name]
            setattr(cls, name, functools.wraps(originals[name])(make(originals[name])))


def _collecting_generate(original):
    async def generate(self, request_id, *args, **kwargs):
        out = await original(self, request_id, *args, **kwargs)
        track = TRACK.get()
        if track is not None and not track.closed:
            track.receive(out.extra_fields.pop(SUPPORT_KEY, None), len(out.token_ids), request_id)
        return out
    return generate


def _checked_manager_init(original):
    def __init__(self, config, *args, **kwargs):
        check_rollout_config(config.actor_rollout_ref.rollout)
        original(self, config, *args, **kwargs)
    return __init__
