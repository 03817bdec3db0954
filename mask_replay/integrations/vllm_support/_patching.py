"""Class attributes replaced by wrappers and put back exactly: each patch remembers what the class itself
held (a function, or nothing when the attribute was inherited), so `undo()` leaves the classes as found."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

_MISSING = object()


@dataclass
class _Patch:
    owner: type
    name: str
    original: Any  # what owner.__dict__ held, or _MISSING


_installed: list[_Patch] = []


def wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """owner.name = make(current owner.name); idempotent per (owner, name)."""
    if is_wrapped(owner, name):
        return
    current = getattr(owner, name)
    wrapper = make(current)
    wrapper.__mask_replay_wraps__ = current
    _installed.append(_Patch(owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, wrapper)


def is_wrapped(owner: type, name: str) -> bool:
    return hasattr(owner.__dict__.get(name), "__mask_replay_wraps__")


def undo() -> None:
    """Every wrapper removed, newest first."""
    while _installed:
        p = _installed.pop()
        if p.original is _MISSING:
            delattr(p.owner, p.name)
        else:
            setattr(p.owner, p.name, p.original)


def installed() -> list[tuple[str, str]]:
    return [(f"{p.owner.__module__}.{p.owner.__qualname__}", p.name) for p in _installed]
