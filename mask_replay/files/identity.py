"""What identifies an input file's content cheaply: its resolved path, size, modification time and a
hash of its first and last bytes (a safetensors header and the start and end of its data).

`--resume` and a mask file's metadata key inputs by this, not by their base name: two rollout files
named alike in different folders (step1/rollout.safetensors, step2/rollout.safetensors) are not the
same input, and a file rewritten in place is not either. Reading 2 MiB per file keeps it cheap for
dumps of any size."""
from __future__ import annotations

import hashlib
import os

SAMPLE_BYTES = 1 << 20  # hashed at each end of the file


def file_identity(path) -> dict:
    """{'path': resolved path, 'bytes', 'mtime_ns', 'sha256': of the first and last SAMPLE_BYTES}."""
    real = os.path.realpath(os.fspath(path))
    st = os.stat(real)
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        if st.st_size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, st.st_size - SAMPLE_BYTES))
            digest.update(f.read(SAMPLE_BYTES))
    return {"path": real, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}


def source_names(paths) -> list:
    """How a mask's metadata names its inputs (the keys of its `params`): base names, or the
    resolved paths when two inputs share a base name."""
    names = [os.path.basename(os.fspath(p)) for p in paths]
    if len(set(names)) == len(names):
        return names
    return [os.path.realpath(os.fspath(p)) for p in paths]
