"""Description of a dump or mask file from its header; only a mask's offsets are read."""
from __future__ import annotations

import torch

from mask_replay.csr import check_offsets, check_row_values
from mask_replay.errors import DumpError
from mask_replay.files.dumps import Dump, _dtname
from mask_replay.files.mask_file import check_mask_header, check_unique_keys, header_entries

# A compressed .npz member declaring more than this is refused unless asked for (--force): a few
# MB can inflate to GBs. Only the .npy headers are read either way.
INFLATE_LIMIT = 1 << 30


def inspect_file(path, *, force: bool = False) -> dict:
    """describe() of the file at `path`; .npz members that inflate past INFLATE_LIMIT are refused
    unless `force`."""
    with Dump(path, inflate_limit=None if force else INFLATE_LIMIT) as d:
        check_unique_keys(d.path)  # a .pt or .npz holds no such header: nothing to check there
        return describe(d)


def describe(d: Dump) -> dict:
    """{'kind', 'keys': [{key, shape, dtype, bytes}], 'summary': {...}, 'metadata': {...}, 'problem'}"""
    keys = [{"key": k, "shape": list(d.shape(k)), "dtype": _dtname(d.dtype(k)), "bytes": d.nbytes(k)}
            for k in sorted(d.keys())]
    summary, problem = {}, None
    if "token_ids" in d or "offsets" in d:  # one without the other: a mask file missing a key, named below
        kind = "mask file"
        try:  # the checks score makes: no statistics of a mask it would refuse
            check_mask_header(d.path, header_entries(d))  # before reading: the shapes bound what is read
            offsets = d.get("offsets")  # [N+1] int64: small, unlike the logits of a dump
            nnz = int(d.shape("token_ids")[0])
            check_offsets(offsets, nnz, source=d.path)
            check_row_values({k: d.get(k) for k in ("logprobs", "kept_mass", "capture_logprobs") if k in d},
                             source=d.path)
        except DumpError as exc:
            return {"kind": kind, "keys": keys, "summary": summary, "metadata": dict(d.metadata), "problem": str(exc)}
        lengths = (offsets[1:] - offsets[:-1]).double()
        summary["rows"] = int(lengths.numel())
        summary["nnz"] = nnz
        if lengths.numel():
            summary.update({
                "support size mean": float(lengths.mean()), "support size median": float(lengths.median()),
                "support size p99": float(torch.quantile(lengths, 0.99)), "support size max": int(lengths.max()),
                "singleton share": float((lengths == 1).double().mean()),
            })
        if "entry_logprobs" in d:  # shape checked above; its values are checked where rows are read (score, load)
            summary["entry log-probs"] = "one per support entry"
    else:
        try:
            if "sampled" in d:
                kind = "rollout dump"
                n, v = d.require_rollout()
            else:
                kind = "training dump" if "logits" in d else "unknown"
                n, v = d.require_logits()
            summary.update({"rows": n, "vocab": v})
        except DumpError as exc:
            problem = str(exc)
    return {"kind": kind, "keys": keys, "summary": summary, "metadata": dict(d.metadata), "problem": problem}
