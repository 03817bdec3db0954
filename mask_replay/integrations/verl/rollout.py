"""Rollout side of the verl drop-in: each completion's recorded support into ``TokenOutput.extra_fields``.

Follows the released verl 0.9.1 file verl/workers/rollout/vllm_rollout/vllm_async_server.py,
``vLLMHttpServer.generate``: it iterates ``self.engine.generate(prompt=..., sampling_params=...,
request_id=...)`` (vLLM's AsyncLLM) to the final RequestOutput and returns a ``TokenOutput`` (verl
workers/rollout/replica.py) built from ``outputs[0]``, whose ``extra_fields`` verl's agent loop turns
into one per-sample ``non_tensor_batch`` entry (experimental/agent_loop/agent_loop.py, _postprocess).

The wrapper puts a recording proxy in front of the server's engine (once per server): it keeps the
``sampling_support`` attribute that mask-replay's vLLM plugin attaches to each ``CompletionOutput``
(``.token_ids`` int32 [nnz], ``.offsets`` int64 [rows + 1], one row per generated token), by request
id; after verl's own generate returns, the support of that request goes into
``extra_fields[SUPPORT_KEY]`` as a dict of numpy arrays (what survives Ray and DataProto). A finished
completion without a record, or with a row count other than its token count, is one error naming the
request. An aborted request (no tokens) gets nothing.

Not built: multi-turn / tool agent loops (verl's tool_agent_loop keeps the first turn's extra_fields
only, so its samples reach the trainer with fewer rows than response tokens, and the trainer refuses
them naming the sample); the wiring to MASK_REPLAY_VERL (call ``install()`` in the rollout server's process;
the supports themselves come from mask-replay's vLLM plugin, integrations/vllm_support, with
MASK_REPLAY_VLLM_SUPPORT=1 in that process's environment).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

try:  # verl is an optional dependency: make venv-verl
    import verl
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mask_replay.integrations.verl.rollout needs verl 0.9.1: make venv-verl") from exc

from mask_replay.errors import EngineOutputError
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY

__all__ = ["install", "uninstall", "installed", "ATTRIBUTE"]

TESTED_VERL = "0.9.1"
ATTRIBUTE = "sampling_support"  # the vLLM plugin's attribute on each CompletionOutput
_ORIGINALS: dict[type, Any] = {}


def installed(server_cls: Optional[type] = None) -> bool:
    return (server_cls in _ORIGINALS) if server_cls is not None else bool(_ORIGINALS)


def _server_class() -> type:
    # vllm is only importable in verl's vLLM rollout environment (verl[vllm]); the trainer side never needs it
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    return vLLMHttpServer


def install(server_cls: Optional[type] = None) -> None:
    """Wrap ``server_cls.generate`` (default: verl's vLLMHttpServer; idempotent)."""
    if verl.__version__ != TESTED_VERL:
        raise ImportError(f"mask_replay.integrations.verl is built and tested against verl {TESTED_VERL}, found "
                          f"verl {verl.__version__}: pip install 'verl=={TESTED_VERL}'")
    cls = server_cls if server_cls is not None else _server_class()
    if cls in _ORIGINALS:
        return
    _ORIGINALS[cls] = cls.__dict__["generate"]
    cls.generate = _with_support(_ORIGINALS[cls])


def uninstall(server_cls: Optional[type] = None) -> None:
    for cls in [server_cls] if server_cls is not None else list(_ORIGINALS):
        if cls in _ORIGINALS:
            cls.generate = _ORIGINALS.pop(cls)


class _RecordingEngine:
    """In front of the server's AsyncLLM: passes everything through, keeps each request's last
    ``outputs[0].sampling_support`` (the final output's) by request id."""

    def __init__(self, engine):
        self._engine = engine
        self.records: dict[str, Any] = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, *args, request_id, **kwargs):
        async for output in self._engine.generate(*args, request_id=request_id, **kwargs):
            if output.outputs:
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
        if support is None:
            raise EngineOutputError(f"request {request_id}: the completion carries no '{ATTRIBUTE}' (is "
                                    "mask-replay's vLLM plugin loaded in the rollout server?)", key=SUPPORT_KEY)
        ids = np.asarray(support.token_ids, dtype=np.int32)
        offsets = np.asarray(support.offsets, dtype=np.int64)
        if offsets.ndim != 1 or offsets.shape[0] != n + 1:
            raise EngineOutputError(f"request {request_id}: the support has {max(offsets.shape[0] - 1, 0)} rows but "
                                    f"the completion has {n} tokens", key=SUPPORT_KEY)
        out.extra_fields[SUPPORT_KEY] = {"token_ids": ids, "offsets": offsets}
        return out

    return generate
