"""Agent-loop side of the verl drop-in: one support row per response token, across every turn of a sample.

A generated token gets the row its turn recorded (rollout.py), every other response token (tool output,
the chat template's boundary tokens: response_mask 0) an empty row, where the trainer keeps verl's own
log-prob. Follows the released verl 0.9.1 files:
- verl/experimental/agent_loop/agent_loop.py, ``AgentLoopWorker._run_agent_loop`` (wrapped): one
  support_track.SupportTrack per sample (a ContextVar: each sample runs in its own asyncio task), which
  rollout.py's wrapper of ``LLMServerClient.generate`` fills with each generation's rows;
  ``AgentLoopWorker._agent_loop_postprocess`` (wrapped): the rows cut to the response verl keeps
  (single_turn_agent_loop and tool_agent_loop cut response_ids to rollout.response_length, not
  extra_fields), checked against response_mask (a row exactly where the mask is 1) and the response
  tokens (each in its row), into ``output.extra_fields[SUPPORT_KEY]``, which verl's _postprocess turns
  into the sample's ``non_tensor_batch`` entry; a mismatch is one error naming the sample and the position.
- verl/utils/tokenizer/continuous_token.py, ``ContinuousTokenBuilder.align_response_metadata``
  (wrapped): where verl applies each merge's token edits to response_mask and response_logprobs (through
  AgentLoopBase.ct_merge_assistant_token / ct_merge_context_msg, which single_turn_agent_loop and
  tool_agent_loop use); the same edits applied to the rows (SupportTrack.merge).
An agent loop that builds its response without verl's continuous-token merge leaves rows unmerged and
is refused at its first sample, naming the loop.
"""
from __future__ import annotations

import functools
from typing import Any

from mask_replay.integrations.verl.rollout import check_version
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY
from mask_replay.integrations.verl.support_track import TRACK, SupportTrack

__all__ = ["install", "uninstall", "installed"]

_PATCHES: list[tuple[type, str, Any]] = []


def installed() -> bool:
    return bool(_PATCHES)


def install(verl_agent_loop=None) -> None:
    """Patch verl's AgentLoopWorker (of ``verl_agent_loop``, verl's agent_loop module: imported here when not
    given) and ContinuousTokenBuilder (idempotent)."""
    check_version()
    if verl_agent_loop is None:
        # verl's agent loop pulls hydra, transformers and its tokenizer stack: only imported where it runs
        from verl.experimental.agent_loop import agent_loop as verl_agent_loop
    # the agent loop module imported it: no import cost here
    from verl.utils.tokenizer import continuous_token

    _patch(verl_agent_loop.AgentLoopWorker, "_run_agent_loop", _tracked_run)
    _patch(verl_agent_loop.AgentLoopWorker, "_agent_loop_postprocess", _finished_postprocess)
    _patch(continuous_token.ContinuousTokenBuilder, "align_response_metadata", _mirrored_align)


def uninstall() -> None:
    while _PATCHES:
        owner, name, original = _PATCHES.pop()
        setattr(owner, name, original)


def _patch(owner: type, name: str, make) -> None:
    if any(o is owner and n == name for o, n, _ in _PATCHES):
        return
    original = owner.__dict__[name]
    _PATCHES.append((owner, name, original))
    setattr(owner, name, functools.wraps(original)(make(original)))


def _tracked_run(original):
    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, **kwargs):
        label = (f"sample {trajectory.get('sample_index')} (rollout {trajectory.get('rollout_n')}, agent loop "
                 f"'{agent_name}')")
        token = TRACK.set(SupportTrack(label))
        try:
            return await original(self, sampling_params, trajectory, agent_name=agent_name, **kwargs)
        finally:
            TRACK.reset(token)
    return _run_agent_loop


def _finished_postprocess(original):
    async def _agent_loop_postprocess(self, output, *args, **kwargs):
        track = TRACK.get()
        if track is not None and not track.closed:
            # before verl's own postprocess: a teacher's generate calls (distillation) are not collected
            output.extra_fields[SUPPORT_KEY] = track.finish(output.response_ids, output.response_mask)
        return await original(self, output, *args, **kwargs)
    return _agent_loop_postprocess


def _mirrored_align(original):
    def align_response_metadata(self, merge_result, response_mask, *args, **kwargs):
        aligned_mask, aligned_logprobs = original(self, merge_result, response_mask, *args, **kwargs)
        track = TRACK.get()
        if track is not None and not track.closed:
            track.merge(merge_result, len(response_mask), len(aligned_mask))
        return aligned_mask, aligned_logprobs
    return align_response_metadata
