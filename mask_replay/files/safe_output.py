"""Safe outputs: files written atomically that never destroy what they were not asked to replace.

Output rules (as coreutils and git follow them):
- a symlink is resolved and the file it points to is replaced, atomically (temp file + rename in
  the real file's folder), so the link survives and never goes stale;
- a target that is not a regular file (character or block device, FIFO, socket, /dev/stdout) is
  written to directly, as a stream, and never replaced by a regular file;
- `-` is standard output (JSON reports);
- an output that is one of the command's inputs, or another of its outputs, is refused
  (check_distinct) before anything is read.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile

from mask_replay.errors import DumpError

STDOUT = "-"



def _real_target(path: str) -> tuple[str, bool]:
    """(the path writes go to, whether it is a stream that must be written in place)."""
    real = os.path.realpath(path)  # follows every link, also a dangling one to its would-be target
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return real, False
    except OSError as exc:
        raise DumpError(f"{path}: cannot inspect the output ({exc.strerror})") from exc
    if stat.S_ISDIR(st.st_mode):
        raise DumpError(f"{path}: is a folder, expected an output file name")
    return real, not stat.S_ISREG(st.st_mode)


def is_stream(path) -> bool:
    """True for `-` and for outputs that exist and are not regular files (devices, FIFOs, sockets)."""
    path = os.fspath(path)
    return path == STDOUT or _real_target(path)[1]


@contextlib.contextmanager
def _named_errors(path):
    """OSErrors while writing (a full disk, a lost mount) become one DumpError naming the output."""
    try:
        yield
    except OSError as exc:
        raise DumpError(f"{path}: cannot write ({exc.strerror or exc})") from exc


@contextlib.contextmanager
def atomic_output(path):
    """Yield the path to write: a temp file beside the real target, renamed onto it only if the body
    succeeds; or, for a stream target (device, FIFO, ...), the target itself."""
    path = os.fspath(path)
    real, stream = _real_target(path)
    if stream:
        with _named_errors(path):
            yield real
        return
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise DumpError(f"{path}: output folder {folder} does not exist")
    tmp = _temp_beside(path, real)
    try:
        with _named_errors(path):
            yield tmp
            os.chmod(tmp, _mode_for(real))
            os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(real: str) -> int:
    """Keep a replaced file's permissions; a new one gets those a plain open() would give
    (mkstemp creates 0600)."""
    try:
        return stat.S_IMODE(os.stat(real).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_file(path):
    """Like atomic_output, but yields a seekable binary file object (for writers that fill in a
    header last). A stream target gets the finished bytes copied to it at the end."""
    path = os.fspath(path)
    if is_stream(path):
        with tempfile.TemporaryFile() as f, _named_errors(path):
            yield f
            f.flush()
            f.seek(0)
            if path == STDOUT:
                shutil.copyfileobj(f, sys.stdout.buffer)
                sys.stdout.buffer.flush()
            else:
                with open(_real_target(path)[0], "wb") as out:
                    shutil.copyfileobj(f, out)
        return
    with atomic_output(path) as tmp, open(tmp, "w+b") as f:
        yield f


def write_text(path, text: str) -> None:
    """Write a small text file (JSON report) atomically; `-` writes it to standard output."""
    if os.fspath(path) == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with atomic_output(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


# mkstemp's random part and our suffix: ".<name>.XXXXXXXX.tmp"
_TEMP_EXTRA = len(".") + len(".") + 8 + len(".tmp")


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _temp_beside(path: str, real: str) -> str:
    """A new empty temp file in the target's folder, hidden and named after the target; the name is
    shortened so that a target whose own name is legal (up to NAME_MAX bytes) always gets one."""
    folder, name = os.path.split(real)
    room = _name_max(folder) - _TEMP_EXTRA
    stem = os.fsencode(name)[:max(room, 1)].decode(errors="ignore") or "out"
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + stem + ".", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise DumpError(f"{path}: cannot write here ({exc.strerror})") from exc
    os.close(fd)
    return tmp


def check_writable(path) -> None:
    """Fail early (before hours of work) when `path` cannot be created: no folder, no permission,
    or a folder in its place. atomic_output still guards the final write."""
    path = os.fspath(path)
    if path == STDOUT:
        return
    real, stream = _real_target(path)
    if stream:
        if not os.access(real, os.W_OK):
            raise DumpError(f"{path}: cannot write to it (permission denied)")
        return
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise DumpError(f"{path}: output folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DumpError(f"{path}: cannot write in {folder} (permission denied)")
    name = os.path.basename(real)
    if len(os.fsencode(name)) > _name_max(folder):
        raise DumpError(f"{path}: the file name is longer than {_name_max(folder)} bytes, the most this file system "
                        "allows")
    # the one sure test (read-only mount, quota, a name the file system refuses): create the temp
    # file the write will use, and remove it
    os.unlink(_temp_beside(path, real))


def check_distinct(inputs: list, outputs: list) -> None:
    """Refuse an output that is one of the inputs (same file, through links too) or the same file
    as another output. inputs/outputs: (label, path) pairs; a path of None is skipped. Stream
    outputs (/dev/null, a FIFO, `-`) replace nothing and may repeat."""
    inputs = [(label, os.fspath(p)) for label, p in inputs if p is not None]
    outputs = [(label, os.fspath(p)) for label, p in outputs if p is not None]
    for i, (label, out) in enumerate(outputs):
        if out == STDOUT:
            continue
        for in_label, src in inputs:
            if _same_file(out, src):
                raise DumpError(f"{out}: {label} would overwrite the input {in_label} {src}")
        if is_stream(out):
            continue
        for other_label, other in outputs[:i]:
            if other != STDOUT and _same_file(out, other):
                raise DumpError(f"{out}: {label} and {other_label} name the same file")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): the same file only if both resolve to one name
        return os.path.realpath(a) == os.path.realpath(b)
