"""`shadowed(obj, name, value)`: an instance attribute set for the duration of a `with` block, then
exactly what was there before put back: the instance's own attribute (a wrapper a user or another
library installed on it) restored as it was, or, where there was none, the attribute removed so that
the class's method shows through again. The integrations' recording wrappers of `generate` use it."""
from __future__ import annotations

from contextlib import contextmanager

__all__ = ["shadowed"]

_ABSENT = object()


@contextmanager
def shadowed(obj, name: str, value):
    before = vars(obj).get(name, _ABSENT)  # the instance's own attribute only, never the class's
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is _ABSENT:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, before)
