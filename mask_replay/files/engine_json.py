"""Reading engine responses saved as JSON: one document (a response or a list of them) or JSON
Lines (one response, or one list of responses, per line)."""
from __future__ import annotations

import json
import os
import sys

from mask_replay.errors import DumpError


def read_engine_json(path) -> list:
    """The responses in `path`, in file order; DumpError naming the file (and line) otherwise."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DumpError(f"{path}: is a folder, expected a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise DumpError(f"{path}: not UTF-8 text (is this a JSON file?)") from exc
    try:
        doc = json.loads(text)
        items = doc if isinstance(doc, list) else [doc]
    except RecursionError:  # no engine response nests this deep (Python's parser gives up first)
        raise DumpError(f"{path}: JSON nested too deeply to be an engine response") from None
    except ValueError as whole:  # JSONDecodeError, or an integer too long for int() (below)
        items = []
        lines = text.splitlines()
        if len([ln for ln in lines if ln.strip()]) < 2:  # not JSON Lines either: report the parse error
            raise DumpError(f"{path}: {_parse_problem(whole, with_line=True)}") from whole
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except RecursionError:
                raise DumpError(f"{path}: line {i}: JSON nested too deeply to be an engine response") from None
            except ValueError as exc:
                raise DumpError(f"{path}: line {i}: {_parse_problem(exc, with_line=False)}") from exc
            items.extend(doc if isinstance(doc, list) else [doc])
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise DumpError(f"{path}: response {i} is a JSON {type(item).__name__}, expected an object")
    return items


def _parse_problem(exc: ValueError, *, with_line: bool) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({f'line {exc.lineno}: ' if with_line else ''}{exc.msg})"
    # json reads integers with int(), which refuses more digits than sys.get_int_max_str_digits()
    return f"an integer of more than {sys.get_int_max_str_digits()} digits (not an engine response)"
