"""File helpers: atomic outputs and tensor files read with errors that name the file."""
from __future__ import annotations

import contextlib
import os
import tempfile


class DumpError(ValueError):
    """A dump or mask file is unreadable or breaks its format; the message names file/key/row."""


@contextlib.contextmanager
def atomic_output(path):
    """Yield a temp path in the destination folder; rename onto `path` only if the body succeeds."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise DumpError(f"{path}: output folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise DumpError(f"{path}: cannot write here ({exc.strerror})") from exc
    os.close(fd)
    try:
        yield tmp
        # mkstemp creates 0600; give the result the permissions a plain open() would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_safetensors(path):
    """All tensors and the metadata of a safetensors file; DumpError on a bad or truncated file."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except DumpError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt headers/data
        raise DumpError(f"{path}: not a readable safetensors file ({exc})") from exc
    return tensors, meta


def check_writable(path) -> None:
    """Fail early (before hours of work) when `path` cannot be created: no folder, no permission,
    or a folder in its place. atomic_output still guards the final write."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise DumpError(f"{path}: output folder {folder} does not exist")
    if os.path.isdir(path):
        raise DumpError(f"{path}: is a folder, expected an output file name")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DumpError(f"{path}: cannot write in {folder} (permission denied)")


def write_text(path, text: str) -> None:
    """Write a small text file (JSON report) atomically."""
    with atomic_output(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
