"""Every error class of mask-replay, and the fields they carry.

An error names where the problem is (file, key, row, argument) as fields, not only as text: a caller
that reads rows a..b of a file re-raises `err.at(file=..., row_offset=a)` instead of editing the
message. The message is rendered from the fields each time they change.
"""
from __future__ import annotations

import copy
import re
from typing import Optional

_UNSET = object()


class InputError(ValueError):
    """Something passed in (a tensor, a file, a flag) is wrong; the error says what and where.

    `problem` may hold "{row}", filled from the `row` field, so that a row can be shifted from a
    chunk's numbering to the file's. `hint` says how to get past it, in the words of the caller
    (a Python argument, a command-line flag). Rendered as "file: key 'k': problem; hint".
    """

    def __init__(self, problem: str, *, file: Optional[str] = None, key: Optional[str] = None,
                 row: Optional[int] = None, hint: Optional[str] = None):
        self.problem, self.file, self.key, self.row, self.hint = problem, file, key, row, hint
        super().__init__(self._render())

    def _render(self) -> str:
        text = self.problem.replace("{row}", str(self.row)) if self.row is not None else self.problem
        if self.hint:
            text = f"{text}; {self.hint}"
        if self.key is not None:
            text = f"key '{self.key}': {text}"
        if self.file is not None:
            text = f"{self.file}: {text}"
        return text

    def at(self, *, file: Optional[str] = None, key: Optional[str] = None, row_offset: int = 0, hint=_UNSET,
           cls: Optional[type] = None):
        """A copy located in a file (fields not yet set are filled), its row shifted by row_offset,
        its hint replaced when one is given, as another error class when `cls` is given."""
        located = copy.copy(self)
        if cls is not None:
            located.__class__ = cls
        located.file = self.file if self.file is not None else file
        located.key = self.key if self.key is not None else key
        located.row = None if self.row is None else self.row + row_offset
        if hint is not _UNSET:
            located.hint = hint
        located.args = (located._render(),)
        return located

    def __str__(self) -> str:
        return self.args[0] if self.args else self._render()

    def __reduce__(self):  # picklable with its fields (multiprocessing, torchrun ranks)
        return (_rebuild, (type(self), self.problem, self.file, self.key, self.row, self.hint))


def _rebuild(cls, problem, file, key, row, hint):
    return cls(problem, file=file, key=key, row=row, hint=hint)


class DumpError(InputError):
    """A dump, mask file or engine response is unreadable or breaks its format."""


class MaskFormatError(DumpError):
    """A mask (in memory or on disk) breaks the CSR contract."""


class EngineOutputError(DumpError):
    """An engine response is malformed; the message names the request, choice and token."""


class OutsideSupportError(InputError):
    """A sampled token is not in its row's support."""


# The compiled ops report as text ("capture: temperature must be ..., row 5 has -1"; "replay_fwd:
# row 3 has an empty support; pass fallback=True ..."): the one place where such a text becomes fields.
_OP_TEXT = re.compile(r"^(?:mask_replay::)?(?P<op>\w+): (?P<rest>.*)$", re.S)
_ROW = re.compile(r"\brow (\d+)\b")


def from_op_error(exc: BaseException, *, keys=(), default_key: Optional[str] = None) -> InputError:
    """The fields of an op's error: its row, the argument it names (one of `keys`, else default_key)
    and its advice after '; ' as the hint. An InputError is returned as it is."""
    if isinstance(exc, InputError):
        return exc
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    m = _OP_TEXT.match(text)
    rest = m.group("rest") if m else text
    problem, _, hint = rest.partition("; ")
    key = next((k for k in keys if problem.startswith(f"{k} ") or f" {k} " in f" {problem} "), default_key)
    row = _ROW.search(problem)
    if row is not None:
        problem = problem[:row.start(1)] + "{row}" + problem[row.end(1):]
    return InputError(problem, key=key, row=int(row.group(1)) if row else None, hint=hint or None)


class ExampleUnavailable(DumpError):
    """The real-model example's optional dependencies are missing; the message says what to install."""
