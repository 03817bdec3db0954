"""Instance attributes replaced for the duration of a call and put back exactly: what the instance itself
held before (a user's or a library's wrapper included) is restored, and an attribute it did not hold is
removed, so the class's own method shows through again."""
from __future__ import annotations

from contextlib import contextmanager

_MISSING = object()


@contextmanager
def shadowed(obj, **attributes):
    saved = {name: vars(obj).get(name, _MISSING) for name in attributes}
    for name, value in attributes.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is _MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, old)
