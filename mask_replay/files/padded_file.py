"""Padded mask files: a safetensors file with `ids` [N, W] int32 (-1 padding) and `counts` [N]
int32, plus the mask's per-row keys (sampled, logprobs, kept_mass, step, sequence, ...) as they are and,
when the mask has them, `entry_logprobs` [N, W] float32 padded with -inf (docs/formats.md, "Padded mask
file")."""
from __future__ import annotations

import os
from typing import Optional

from mask_replay.errors import DumpError
from mask_replay.files.safetensors_stream import read_all, save
from mask_replay.mask import SamplingMask
from mask_replay.sampler.adapters.padded import mask_from_padded, to_padded

# Names a padded file's other tensors cannot have: the mask file's CSR keys, and mask_from_padded's own
# arguments (a tensor named `source` or `vocab_size` would be taken as one).
RESERVED_KEYS = ("token_ids", "offsets", "ids", "counts", "strict_padding", "vocab_size", "source", "metadata")


def save_padded(mask: SamplingMask, path, width: Optional[int] = None) -> None:
    """Atomic write; a row wider than `width` is a ValueError naming the row."""
    ids, counts, *entries = to_padded(mask, width)
    tensors = {k: v for k, v in mask.tensors().items() if k not in ("token_ids", "offsets")}
    tensors.update({"ids": ids.cpu().contiguous(), "counts": counts.cpu().contiguous()})
    if entries:
        tensors["entry_logprobs"] = entries[0].cpu().contiguous()
    meta = mask.file_metadata()
    meta["layout"] = "padded"
    save(path, tensors, meta)


def load_padded(path) -> SamplingMask:
    path = os.fspath(path)
    tensors, meta = read_all(path)
    for key in ("ids", "counts"):
        if key not in tensors:
            raise DumpError(f"{path}: missing key '{key}' (is this a padded mask file?)")
    ids, counts = tensors.pop("ids"), tensors.pop("counts")
    meta.pop("layout", None)
    for key in tensors:
        if key in RESERVED_KEYS:  # would pass as an argument, or write a mask whose CSR keys clash
            raise DumpError(f"key '{key}' is not a per-row tensor a padded mask file may hold (reserved name)",
                            file=path)
    mask = mask_from_padded(ids, counts, source=path, metadata=meta, **tensors)
    return mask.validate(source=path)
