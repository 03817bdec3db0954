"""Per-step recording of sampling supports during generation, assembled into one SamplingMask.

Generation calls a logits processor once per step with scores [B, V]. What the support was is known
then; which token was sampled is known only at the next step (the last column of input_ids) or from
the final sequences. So each step keeps device tensors only (no host sync), and the log keeps the
previous step's processed scores just long enough to gather the sampled token's log-prob from them.
"""
from __future__ import annotations

from typing import Optional

import torch

from mask_replay.csr import take_row_entries
from mask_replay.mask import SamplingMask


class StepLog:
    """Supports, processed log-prob normalisers and kept masses of every generation step."""

    def __init__(self, flush_every: int = 16, entry_logprobs: bool = False):
        if int(flush_every) < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.flush_every = int(flush_every)
        # every support entry's processed log-prob, by the arithmetic of the sampled one (_gather)
        self.entry_logprobs = bool(entry_logprobs)
        self.reset()

    def reset(self) -> None:
        self.prompt_len: Optional[int] = None
        self.batch = self.vocab = 0
        self.steps = 0
        self._dense: list[torch.Tensor] = []  # bool [B, V] per step, not yet compacted
        self._dense_lp: list[torch.Tensor] = []  # float32 [B, V] per step (entry_logprobs only)
        self._entries: list[torch.Tensor] = []  # float32 per entry, like _ids (entry_logprobs only)
        self._ids: list[torch.Tensor] = []  # int32 token ids, step-major rows
        self._counts: list[torch.Tensor] = []  # int64 [B] per step
        self._logprobs: list[torch.Tensor] = []  # float32 [B] per finished step
        self._kept: list[Optional[torch.Tensor]] = []
        self._prev: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (processed scores, logsumexp)
        self._stopped: list[tuple[int, torch.Tensor]] = []  # (step, bool [B]) from the watched stopping criteria

    # ---- during generation --------------------------------------------------------------------
    def begin(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Check the call fits the running generation; gather the previous step's sampled log-prob."""
        if scores.dim() != 2:
            raise ValueError(f"scores must be [batch, vocab], got shape {tuple(scores.shape)}")
        if self.prompt_len is None:
            self.prompt_len, (self.batch, self.vocab) = int(input_ids.shape[1]), scores.shape
        elif (input_ids.shape[1] != self.prompt_len + self.steps or tuple(scores.shape) != (self.batch, self.vocab)):
            raise RuntimeError(
                f"recorder called with input_ids {tuple(input_ids.shape)} and scores {tuple(scores.shape)} after "
                f"{self.steps} steps of a generation with prompt length {self.prompt_len} and batch {self.batch}: "
                "call reset() before reusing it for another generate call")
        if self._prev is not None:
            self._logprobs.append(self._gather(input_ids[:, -1]))

    def add_dense(self, support: torch.Tensor, logprobs: Optional[torch.Tensor] = None) -> None:
        """support bool [B, V]; with entry_logprobs, logprobs float32 [B, V] (read on the support only)."""
        self._dense.append(support)
        if self.entry_logprobs:
            self._dense_lp.append(logprobs)
        if len(self._dense) >= self.flush_every:
            self._flush()

    def add_csr(self, token_ids: torch.Tensor, counts: torch.Tensor, entries: Optional[torch.Tensor] = None) -> None:
        self._flush()  # keep step order
        self._ids.append(token_ids.to(torch.int32))
        self._counts.append(counts.to(torch.int64))
        if self.entry_logprobs:
            self._entries.append(entries.to(torch.float32))

    def end(self, processed: torch.Tensor, lse: torch.Tensor, kept: Optional[torch.Tensor]) -> None:
        self._prev = (processed, lse)
        self._kept.append(kept)
        self.steps += 1

    def stopped(self, input_ids: torch.Tensor, done) -> None:
        """A watched stopping criterion's verdict after the token of step input_ids.shape[1] - prompt - 1
        was appended: rows it stops are finished there (generate pads them from then on)."""
        if self.prompt_len is None:
            return
        step = int(input_ids.shape[1]) - self.prompt_len - 1
        done = torch.as_tensor(done, dtype=torch.bool).reshape(-1).expand(self.batch)
        self._stopped.append((step, done.detach()))

    def _stop_steps(self, device) -> Optional[torch.Tensor]:
        """The step at which each row was stopped by a watched criterion (int64 [B]; steps when never)."""
        if not self._stopped:
            return None
        first = torch.full((self.batch,), self.steps, dtype=torch.int64, device=device)
        for step, done in self._stopped:
            hit = done.to(device)
            first = torch.where(hit, torch.minimum(first, torch.full_like(first, step)), first)
        return first

    # ---- after generation -------------------------------------------------------------------------
    def _gather(self, tokens: torch.Tensor) -> torch.Tensor:
        scores, lse = self._prev
        # finished rows carry the pad id, which may lie outside the vocabulary: clamp, they are dropped
        idx = tokens.to(device=scores.device, dtype=torch.int64).clamp(0, self.vocab - 1).unsqueeze(1)
        return (scores.gather(1, idx).squeeze(1).float() - lse.float())

    def _flush(self) -> None:
        """Compact the pending dense supports into CSR: one host sync per flush_every steps."""
        if not self._dense:
            return
        dense = torch.stack(self._dense).reshape(-1, self.vocab)
        self._dense = []
        self._ids.append(torch.nonzero(dense)[:, 1].to(torch.int32))
        self._counts.append(dense.sum(1))
        if self.entry_logprobs:
            self._entries.append(torch.stack(self._dense_lp).reshape(-1, self.vocab)[dense].float())
            self._dense_lp = []

    def build(self, sequences: torch.Tensor, eos_token_id=None, metadata=None, extras=None) -> SamplingMask:
        """One row per generated token (sequence-major), rows after a sequence's first EOS dropped."""
        if self.prompt_len is None or self.steps == 0:
            raise RuntimeError("nothing recorded: was the recorder in the logits_processor list of generate?")
        if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2:
            raise ValueError("expected generate's output (or its sequences [batch, length])")
        if tuple(sequences.shape) != (self.batch, self.prompt_len + self.steps):
            raise ValueError(
                f"sequences have shape {tuple(sequences.shape)} but the recorder saw batch {self.batch}, prompt length "
                f"{self.prompt_len} and {self.steps} steps (is this the output of the generation it recorded?)")
        self._flush()
        generated = sequences[:, self.prompt_len:].to(torch.int64)  # [B, S]
        dev = self._counts[0].device
        logprobs = torch.stack(self._logprobs + [self._gather(generated[:, -1])]).to(dev)  # [S, B]
        counts = torch.cat(self._counts)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=offsets[1:])

        valid = torch.ones_like(generated, dtype=torch.bool)
        if eos_token_id is not None:
            eos = torch.as_tensor(eos_token_id, device=generated.device).reshape(-1)
            is_eos = torch.isin(generated, eos).long()
            valid = (torch.cumsum(is_eos, 1) - is_eos) == 0  # up to and including the first EOS
        stop = self._stop_steps(generated.device)
        if stop is not None:
            # A row stopped by a stopping criterion ends there too: generate pads it afterwards (or goes on
            # sampling tokens no one trains on); its stopping token itself is kept, as an EOS is.
            valid &= torch.arange(generated.shape[1], device=generated.device)[None, :] <= stop[:, None]
        seq, pos = torch.nonzero(valid, as_tuple=True)  # sequence-major, positions ascending
        seq, pos = seq.to(dev), pos.to(dev)
        rows = pos * self.batch + seq  # index into the step-major log
        src, new_offsets = take_row_entries(offsets, rows)
        token_ids = torch.cat(self._ids)[src]
        entries = torch.cat(self._entries)[src] if self.entry_logprobs else None
        lp = logprobs[pos, seq]
        kept = None
        if all(k is not None for k in self._kept):
            kept = torch.stack(self._kept).to(dev)[pos, seq].float()
        sampled = generated.to(dev)[seq, pos]
        bad = torch.nonzero(~torch.isfinite(lp))
        if bad.numel():
            r = int(bad[0])
            raise RuntimeError(
                f"sampled token {int(sampled[r])} (sequence {int(seq[r])}, position {int(pos[r])}) is outside the "
                "recorded support: a processor after the recorder changed the scores; put the recorder last")
        row_extras = {"sequence": seq, "position": pos}
        for name, value in (extras or {}).items():
            row_extras[name] = torch.full_like(lp, float(value))
        meta = {"vocab_size": self.vocab, **(metadata or {})}
        return SamplingMask(token_ids, new_offsets, sampled=sampled, logprobs=lp, kept_mass=kept,
                            extras=row_extras, metadata=meta, entry_logprobs=entries)
