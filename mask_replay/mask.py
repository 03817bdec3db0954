"""SamplingMask: the recorded support of each sampled token, as CSR over rows.

Engine adapters (SamplingMask.from_vllm / from_sglang / from_padded / to_padded) and the mask file
(SamplingMask.save / load): the code lives in mask_replay/sampler/adapters/ and
mask_replay/files/mask_file.py, a layer above this one, and imports SamplingMask; this module never
imports it. Each adapter registers its function under the method's name with ``@adapter("from_x")``
when its module is imported (mask_replay/__init__ imports mask_replay.sampler.adapters, which imports
every adapter), and the method here, which keeps its signature and doc, calls ``_adapter("from_x")``.
So the imports point one way (adapters -> mask), with no function-level import. A new adapter that
should also be a SamplingMask method: decorate its function, add the module to
sampler/adapters/__init__.py, and add a two-line method here; one that is a plain function needs
neither.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from mask_replay import csr
from mask_replay.errors import MaskFormatError
from mask_replay.row_order import align_mask

SEMANTICS = "mask-replay/support-v1"
_ROW_EXTRAS = ("sampled", "logprobs", "kept_mass")
_EXTRA_DTYPES = {"sampled": torch.int64, "logprobs": torch.float32, "kept_mass": torch.float32}
ENTRY_KEY = "entry_logprobs"  # the one per-entry column: float32 [nnz], aligned with token_ids

_ADAPTERS: dict[str, Callable] = {}


def adapter(method: str) -> Callable:
    """Decorator of an engine adapter (sampler/adapters/): the function SamplingMask.<method> calls."""
    def register(fn: Callable) -> Callable:
        if _ADAPTERS.get(method, fn) is not fn:
            raise RuntimeError(f"SamplingMask.{method} already has an adapter: {_ADAPTERS[method].__module__}")
        _ADAPTERS[method] = fn
        return fn
    return register


def _adapter(method: str) -> Callable:
    try:
        return _ADAPTERS[method]
    except KeyError:  # only when mask_replay.mask is loaded without the package's __init__ having run
        raise ImportError(f"SamplingMask.{method}: its adapter is not registered; import mask_replay.sampler.adapters "
                          "and mask_replay.files.mask_file (importing mask_replay does)") from None




@dataclass(eq=False)
class SamplingMask:
    token_ids: torch.Tensor  # int32 [nnz], strictly ascending within a row
    offsets: torch.Tensor  # int64 [N + 1]
    sampled: Optional[torch.Tensor] = None  # int64 [N]
    logprobs: Optional[torch.Tensor] = None  # float32 [N], processed log-prob over the support
    kept_mass: Optional[torch.Tensor] = None  # float32 [N], mass of the support under softmax(z/T)
    extras: dict = field(default_factory=dict)  # other per-row tensors [N] (step, sequence, ...)
    metadata: dict = field(default_factory=dict)  # str -> str
    # float32 [nnz], aligned with token_ids: the processed log-prob of every support entry,
    # x_v - logsumexp_{j in S} x_j with x = z / T (the sampled entry is `logprobs`)
    entry_logprobs: Optional[torch.Tensor] = None

    def __post_init__(self):
        # Only types here (O(1)): the values are checked by validate() and by the ops.
        for name in ("token_ids", "offsets"):
            if not isinstance(getattr(self, name), torch.Tensor):
                got = type(getattr(self, name)).__name__
                raise MaskFormatError(f"SamplingMask: {name} must be a tensor, got {got}")
        for name in _ROW_EXTRAS + (ENTRY_KEY,):
            v = getattr(self, name)
            if v is not None and not isinstance(v, torch.Tensor):
                raise MaskFormatError(f"SamplingMask: {name} must be a tensor or None, got {type(v).__name__}")
        if not isinstance(self.extras, dict) or not all(isinstance(v, torch.Tensor) for v in self.extras.values()):
            raise MaskFormatError("SamplingMask: extras must be a dict of per-row tensors")

    # ---- shape -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def nnz(self) -> int:
        return int(self.token_ids.numel())

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def __len__(self) -> int:
        return self.num_rows

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, i: int) -> torch.Tensor:
        n = self.num_rows
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for a mask of {n} rows")
        i %= n
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.token_ids[lo:hi]

    def row_ids(self) -> torch.Tensor:
        """Row index of every entry of token_ids (int64 [nnz])."""
        return torch.repeat_interleave(
            torch.arange(self.num_rows, device=self.device), self.lengths(), output_size=self.nnz
        )

    # ---- checks ------------------------------------------------------------------------------
    def validate(self, vocab_size: Optional[int] = None, *, source: str = "mask") -> "SamplingMask":
        """Check the CSR contract; raises MaskFormatError naming the defect and the first bad row."""
        csr.check_csr(self.token_ids, self.offsets, source=source, vocab_size=vocab_size)
        n = self.num_rows
        for name in _ROW_EXTRAS:
            v = getattr(self, name)
            if v is not None and (v.dim() != 1 or v.numel() != n):
                raise MaskFormatError(f"{name} must have shape [{n}], got {tuple(v.shape)}", file=source)
        for name, v in self.extras.items():
            if v.dim() != 1 or v.numel() != n:
                raise MaskFormatError(f"{name} must have shape [{n}], got {tuple(v.shape)}", file=source)
        csr.check_row_values({"logprobs": self.logprobs, "kept_mass": self.kept_mass}, source=source)
        if self.sampled is not None and self.sampled.numel() and vocab_size is not None:
            s = self.sampled.cpu()
            bad = torch.nonzero((s < 0) | (s >= vocab_size))
            if bad.numel():
                raise MaskFormatError(f"sampled token out of range [0, {vocab_size}) in row {{row}}", file=source,
                                      row=int(bad[0]))
        if self.entry_logprobs is not None:
            csr.check_entry_logprobs(self.entry_logprobs, self.offsets, source=source)
        return self

    # ---- conversions -------------------------------------------------------------------------
    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """[N, vocab_size] bool. The mask is validated first: an id outside [0, vocab_size) would
        otherwise wrap (a negative index) or fail deep inside indexing."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 0:
            raise ValueError(f"to_dense: vocab_size must be an integer >= 0, got {vocab_size!r}")
        vocab_size = int(vocab_size)
        self.validate(vocab_size, source="to_dense")
        dense = torch.zeros(self.num_rows, vocab_size, dtype=torch.bool, device=self.device)
        if self.nnz:
            dense[self.row_ids(), self.token_ids.long()] = True
        return dense

    @classmethod
    def from_dense(cls, mask: torch.Tensor, **extras) -> "SamplingMask":
        if mask.dim() != 2 or mask.dtype != torch.bool:
            raise ValueError(f"from_dense: expects a 2-D bool tensor, got {mask.dtype} {tuple(mask.shape)}")
        rows, cols = torch.nonzero(mask, as_tuple=True)  # row-major: ascending ids within a row
        counts = mask.sum(dim=1)
        offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        return cls._with_extras(cols.to(torch.int32), offsets, extras)

    def to_lists(self) -> list[list[int]]:
        ids = self.token_ids.cpu().tolist()
        off = self.offsets.cpu().tolist()
        return [ids[off[i]: off[i + 1]] for i in range(self.num_rows)]

    @classmethod
    def from_lists(cls, rows: Iterable[Iterable[int]], **extras) -> "SamplingMask":
        rows = [sorted(set(int(t) for t in r)) for r in rows]
        flat = [t for r in rows for t in r]
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + len(r))
        # checked as given, then cast: torch.tensor(..., dtype=int32) would end in a bare overflow error
        return cls._with_extras(*csr.checked_csr(flat, offsets, source="from_lists"), extras)

    @classmethod
    def _with_extras(cls, token_ids, offsets, extras) -> "SamplingMask":
        named = {k: extras.pop(k) for k in _ROW_EXTRAS + (ENTRY_KEY,) if k in extras}
        meta = extras.pop("metadata", {})
        return cls(token_ids, offsets, extras=extras, metadata=meta, **named)

    def to(self, device) -> "SamplingMask":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return SamplingMask(
            mv(self.token_ids), mv(self.offsets), mv(self.sampled), mv(self.logprobs), mv(self.kept_mass),
            {k: mv(v) for k, v in self.extras.items()}, dict(self.metadata), mv(self.entry_logprobs),
        )

    def select_rows(self, start: int, stop: int) -> "SamplingMask":
        """Rows [start, stop) as a new mask (views where possible)."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        sl = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return SamplingMask(
            self.token_ids[lo:hi], self.offsets[start: stop + 1] - lo, sl(self.sampled), sl(self.logprobs),
            sl(self.kept_mass), {k: v[start:stop] for k, v in self.extras.items()}, dict(self.metadata),
            None if self.entry_logprobs is None else self.entry_logprobs[lo:hi],
        )

    @classmethod
    def concat(cls, masks: list["SamplingMask"]) -> "SamplingMask":
        """Rows of several masks one after another (extras kept where every part has them)."""
        if not masks:
            return cls(torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
        shifts = [0]
        for m in masks[:-1]:
            shifts.append(shifts[-1] + m.nnz)
        offsets = torch.cat([masks[0].offsets[:1]] + [m.offsets[1:] + s for m, s in zip(masks, shifts)])
        cat = lambda name: (torch.cat([getattr(m, name) for m in masks])  # noqa: E731
                            if all(getattr(m, name) is not None for m in masks) else None)
        keys = set.intersection(*(set(m.extras) for m in masks))
        return cls(
            torch.cat([m.token_ids for m in masks]), offsets, cat("sampled"), cat("logprobs"), cat("kept_mass"),
            {k: torch.cat([m.extras[k] for m in masks]) for k in sorted(keys)}, dict(masks[0].metadata),
            cat(ENTRY_KEY),
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, SamplingMask):
            return NotImplemented
        if not (torch.equal(self.offsets.cpu(), other.offsets.cpu())
                and torch.equal(self.token_ids.cpu(), other.token_ids.cpu())):
            return False
        for name in _ROW_EXTRAS + (ENTRY_KEY,):
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None) or (a is not None and not torch.equal(a.cpu(), b.cpu())):
                return False
        return self.extras.keys() == other.extras.keys() and all(
            torch.equal(v.cpu(), other.extras[k].cpu()) for k, v in self.extras.items())

    def __repr__(self) -> str:
        have = [n for n in _ROW_EXTRAS + (ENTRY_KEY,) if getattr(self, n) is not None] + sorted(self.extras)
        return f"SamplingMask(rows={self.num_rows}, nnz={self.nnz}, device={self.device}, extras={have})"

    # ---- files (files.mask_file reads and writes them; registered: module doc) ------------------
    def tensors(self) -> dict:
        out = {"token_ids": self.token_ids, "offsets": self.offsets}
        for name in _ROW_EXTRAS + (ENTRY_KEY,):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(self.extras)
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    def save(self, path) -> None:
        """Write a safetensors file atomically (temp file in the same folder, then rename), in a
        stable layout with sorted metadata: the same mask always gives the same bytes. See
        files.mask_file (registered: module doc)."""
        _adapter("save")(self, path)

    @classmethod
    def load(cls, path, device="cpu", *, validate: bool = True) -> "SamplingMask":
        """A mask file read whole, its header checked before any tensor is read (validate=False skips
        the checks). See files.mask_file (registered: module doc)."""
        return _adapter("load")(path, device=device, validate=validate)

    # ---- engine outputs and padded layouts (sampler/adapters, registered: module doc) ----------------------------
    @classmethod
    def from_vllm(cls, outputs, **kwargs) -> "SamplingMask":
        """vLLM RequestOutputs / CompletionOutputs or /inference/v1/generate JSON, one row per
        generated token; kwargs temperature, step, vocab_size. See adapters.vllm."""
        return _adapter("from_vllm")(outputs, **kwargs)

    @classmethod
    def from_sglang(cls, outputs, **kwargs) -> "SamplingMask":
        """SGLang /generate responses or its fixed-capacity form; see adapters.sglang."""
        return _adapter("from_sglang")(outputs, **kwargs)

    def to_padded(self, width: Optional[int] = None):
        """(ids [N, width] int32 padded with -1, counts [N] int32), and with entry_logprobs a third
        tensor, logprobs [N, width] float32 padded with -inf; see adapters.padded."""
        return _adapter("to_padded")(self, width)

    @classmethod
    def from_padded(cls, ids, counts, **kwargs) -> "SamplingMask":
        """Inverse of to_padded, with checks; kwargs strict_padding, vocab_size, metadata and
        per-row tensors (sampled, logprobs, ...), entry_logprobs [N, W] (padded like ids). See
        adapters.padded.mask_from_padded."""
        return _adapter("from_padded")(ids, counts, **kwargs)

    # ---- trainer order -----------------------------------------------------------------------
    def align(self, order: Optional[torch.Tensor] = None, *, sequences=None, key: str = "sequence") -> "SamplingMask":
        """The rows reordered to a trainer's order, for replay over a batch laid out differently.

        order: integer tensor, any shape, read row-major: for each trainer position the mask row
        it replays, or -1 for a position without one (ignored); the result has one row per entry
        >= 0, in that order. sequences: the trainer's sequences by their id (``extras[key]``,
        e.g. 'sequence' as the engine adapters write it); the result holds each one's rows in token
        order (``extras['position']`` when present, else mask order), sequence after sequence.
        """
        return align_mask(self, order, sequences=sequences, key=key)
