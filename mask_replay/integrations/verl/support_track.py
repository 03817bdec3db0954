"""One sample's support rows while verl's agent loop builds its response turn by turn (pure numpy, no verl
import; agent_loop.py and rollout.py feed it).

A response holds each turn's generated tokens (response_mask 1) and, between them, tokens nobody sampled
(tool output, the chat template's boundary tokens: mask 0). ``receive`` holds a generation's rows until
``merge`` applies the token edits of verl's continuous-token merge (verl 0.9.1,
utils/tokenizer/continuous_token.py, ContinuousTokenBuilder.align_response_metadata) to the rows, the
way verl applies them to response_mask and response_logprobs; ``finish`` cuts the rows to the response
verl keeps and checks them against its tokens and mask. ``TRACK`` holds the track of the sample whose
agent loop runs in the current asyncio task.
"""
from __future__ import annotations

import contextvars
from typing import Optional

import numpy as np

from mask_replay import csr
from mask_replay.errors import EngineOutputError, MaskFormatError
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY

__all__ = ["SupportTrack", "TRACK"]


class SupportTrack:
    """One sample's rows so far (CSR: ids int32, one length per response token) and the generations'
    rows not merged yet."""

    def __init__(self, label: str):
        self.label = label
        self.ids = np.zeros(0, dtype=np.int32)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.closed = False

    @property
    def num_rows(self) -> int:
        return int(self.lengths.size)

    def receive(self, support, num_tokens: int, request_id) -> None:
        """One generation's rows (extra_fields[SUPPORT_KEY] as rollout.py sets it, or None)."""
        if num_tokens == 0:
            return
        if support is None:
            raise EngineOutputError(f"{self.label}: request {request_id} returned {num_tokens} tokens without "
                                    f"'{SUPPORT_KEY}' (is MASK_REPLAY_VERL=1 set in the rollout server's process?)",
                                    key=SUPPORT_KEY)
        where = f"{self.label}: request {request_id}"
        if not isinstance(support, dict) or "token_ids" not in support or "offsets" not in support:
            raise EngineOutputError(f"'{SUPPORT_KEY}' is a {type(support).__name__}, expected a dict of token_ids "
                                    "and offsets", file=where)
        try:  # the CSR contract on the values as sent (offsets from 0, never decreasing; int32 ids), then cast
            ids, offsets = csr.checked_csr(support["token_ids"], support["offsets"], source=where)
        except MaskFormatError as exc:
            raise exc.at(key=SUPPORT_KEY, cls=EngineOutputError) from None
        if offsets.numel() != num_tokens + 1:
            raise EngineOutputError(f"returned {num_tokens} tokens but {offsets.numel() - 1} support rows",
                                    file=where, key=SUPPORT_KEY)
        self.pending.append((ids.numpy(), offsets.diff().numpy()))

    def merge(self, merge_result, rows_before: int, rows_after: int) -> None:
        """verl's align_response_metadata edits (continuous_token.py), on the rows."""
        if self.num_rows != rows_before:
            raise EngineOutputError(f"{self.label}: the response had {rows_before} tokens before this merge but "
                                    f"{self.num_rows} support rows: the agent loop edited its response outside "
                                    "verl's continuous-token merge", key=SUPPORT_KEY)
        if merge_result.removed_prefix_token_count:
            self._keep(max(self.num_rows - merge_result.removed_prefix_token_count, 0))
        self._append_empty(len(merge_result.inserted_token_ids))
        n = merge_result.appended_token_count
        if merge_result.kind == "assistant":
            ids = [i for i, _ in self.pending]
            lengths = [rows for _, rows in self.pending]
            got = sum(rows.size for rows in lengths)
            if got != n:
                raise EngineOutputError(f"{self.label}: an assistant merge of {n} tokens, but the generations since "
                                        f"the last one recorded {got} support rows", key=SUPPORT_KEY)
            self.pending = []
            self.ids = np.concatenate([self.ids, *ids])
            self.lengths = np.concatenate([self.lengths, *lengths])
        else:
            self._unmerged_refused("before a context merge")
            self._append_empty(n)
        if self.num_rows != rows_after:
            raise EngineOutputError(f"{self.label}: verl's response mask has {rows_after} tokens after the merge, "
                                    f"the supports {self.num_rows} rows", key=SUPPORT_KEY)

    def finish(self, response_ids, response_mask) -> dict:
        """The sample's support (CSR dict) for the response verl keeps, checked; the track takes no more."""
        self.closed = True
        self._unmerged_refused("when the agent loop finished")
        tokens = np.asarray(response_ids, dtype=np.int64).reshape(-1)
        mask = np.asarray(response_mask, dtype=np.int64).reshape(-1)
        n = tokens.size
        if mask.size != n or self.num_rows < n:
            raise EngineOutputError(f"{self.label}: the response has {n} tokens and {mask.size} mask entries but "
                                    f"{self.num_rows} support rows", key=SUPPORT_KEY)
        lengths = self.lengths[:n]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = self.ids[:offsets[-1]]
        recorded = lengths > 0
        wrong = np.flatnonzero(recorded != (mask != 0))
        if wrong.size:
            j = int(wrong[0])
            raise EngineOutputError(f"{self.label}, response position {j}: response_mask is {int(mask[j])} but "
                                    f"{'a' if recorded[j] else 'no'} support was recorded", key=SUPPORT_KEY)
        row_of = np.repeat(np.arange(n), lengths)
        hit = np.zeros(n, dtype=bool)
        hit[row_of[ids == tokens[row_of]]] = True
        outside = np.flatnonzero(recorded & ~hit)
        if outside.size:
            j = int(outside[0])
            raise EngineOutputError(f"{self.label}, response position {j}: token {int(tokens[j])} is not in its "
                                    f"recorded support ({int(lengths[j])} ids)", key=SUPPORT_KEY)
        return {"token_ids": ids, "offsets": offsets}

    def _keep(self, rows: int) -> None:
        self.ids = self.ids[:int(self.lengths[:rows].sum())]
        self.lengths = self.lengths[:rows]

    def _append_empty(self, rows: int) -> None:
        if rows:
            self.lengths = np.concatenate([self.lengths, np.zeros(rows, dtype=np.int64)])

    def _unmerged_refused(self, when: str) -> None:
        if self.pending:
            raise EngineOutputError(f"{self.label}: {len(self.pending)} generation(s) not merged into the response "
                                    f"{when}: replay supports agent loops that build their response through "
                                    "verl's continuous-token merge (AgentLoopBase.ct_merge_assistant_token)",
                                    key=SUPPORT_KEY)


TRACK: contextvars.ContextVar[Optional[SupportTrack]] = contextvars.ContextVar("mask_replay_verl_track", default=None)
