"""support_rows: where each recorded row lands in verl's packed, padded, sequence-parallel-sliced layout.
No verl import: the expected positions are worked out token by token from verl's layout rule (see the
module docstring), independently of the vectorised code."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given

from mask_replay.errors import InputError, OutsideSupportError
from mask_replay.integrations.verl.support_rows import local_support, sample_support
from mask_replay.mask import SamplingMask
from tests.helpers import arriving_support

V = 50


class Record:
    """The vLLM plugin's record shape: numpy token_ids int32 [nnz] and offsets int64 [rows + 1]."""

    def __init__(self, rows):
        self.token_ids = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else \
            np.zeros(0, np.int32)
        self.offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)


def batch(seed=0, prompts=(3, 1, 4), responses=(5, 2, 6)):
    """Packed input ids, cu_seqlens, response lengths and per-sample rows (each containing its token;
    some rows empty, one row the whole vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    ids, cu, rows = [], [0], []
    for p, r in zip(prompts, responses):
        seq = torch.randint(0, V, (p + r,), generator=g)
        ids.append(seq)
        cu.append(cu[-1] + p + r)
        sample_rows = []
        for j in range(r):
            k = int(torch.randint(1, 8, (1,), generator=g))
            row = set(torch.randint(0, V, (k,), generator=g).tolist()) | {int(seq[p + j])}
            sample_rows.append(sorted(row))
        rows.append(sample_rows)
    rows[0][1] = []  # nothing recorded: verl's own value
    rows[2][3] = list(range(V))  # the whole vocabulary: verl's own value
    return torch.cat(ids), torch.tensor(cu), torch.tensor(responses), rows


def expected(ids, cu, resp, rows, pad, sp_rank, sp_size):
    """(local position, row ids, label) of every replayed row, one token at a time."""
    chunk = (int(cu[-1]) + pad) // sp_size
    out = []
    for i, sample_rows in enumerate(rows):
        start = int(cu[i + 1]) - int(resp[i])
        for j, row in enumerate(sample_rows):
            if len(row) in (0, V):
                continue
            pos = start + j - 1  # the position whose rolled label is response token j
            if sp_rank * chunk <= pos < (sp_rank + 1) * chunk:
                out.append((pos - sp_rank * chunk, row, int(ids[start + j])))
    return out


def got(layout):
    m = layout.mask
    return [(int(p), m.row(k).tolist(), int(m.sampled[k])) for k, p in enumerate(layout.positions)]


@pytest.mark.parametrize("pad,sp_size", [(0, 1), (3, 1), (1, 2), (5, 2), (2, 4)])
def test_rows_land_at_verls_positions(pad, sp_size):
    ids, cu, resp, rows = batch()
    if (int(cu[-1]) + pad) % sp_size:
        pad += sp_size - (int(cu[-1]) + pad) % sp_size
    supports = [Record(r) for r in rows]
    seen = 0
    for rank in range(sp_size):
        layout = local_support(supports, ids, cu, resp, vocab_size=V, pad_size=pad, sp_rank=rank, sp_size=sp_size)
        assert layout.local_length == (int(cu[-1]) + pad) // sp_size
        assert got(layout) == expected(ids, cu, resp, rows, pad, rank, sp_size)
        seen += layout.positions.numel()
    assert seen == sum(len(r) not in (0, V) for s in rows for r in s)  # every recorded row on exactly one rank


def test_keep_marks_the_replayed_positions():
    ids, cu, resp, rows = batch(1)
    layout = local_support([Record(r) for r in rows], ids, cu, resp, vocab_size=V)
    keep = layout.keep("cpu")
    assert keep.shape == (int(cu[-1]),)
    assert torch.nonzero(keep).flatten().tolist() == [p for p, _, _ in expected(ids, cu, resp, rows, 0, 0, 1)]


def test_a_sample_without_record_keeps_verls_values():
    ids, cu, resp, rows = batch(2)
    layout = local_support([None, Record(rows[1]), None], ids, cu, resp, vocab_size=V)
    assert got(layout) == expected(ids, cu, resp, [[], rows[1], []], 0, 0, 1)


def test_accepts_samplingmask_and_dict():
    ids, cu, resp, rows = batch(3)
    recs = [Record(r) for r in rows]
    as_mask = SamplingMask(torch.from_numpy(recs[0].token_ids), torch.from_numpy(recs[0].offsets))
    as_dict = {"token_ids": recs[1].token_ids.tolist(), "offsets": recs[1].offsets.tolist()}
    layout = local_support([as_mask, as_dict, recs[2]], ids, cu, resp, vocab_size=V)
    assert got(layout) == expected(ids, cu, resp, rows, 0, 0, 1)


def test_row_count_mismatch_names_sample_and_position():
    ids, cu, resp, rows = batch()
    short = [Record(rows[0]), Record(rows[1][:1]), Record(rows[2])]
    with pytest.raises(InputError, match=r"sample 1: the support has 1 rows but the response has 2 tokens "
                                         r"\(response position 1"):
        local_support(short, ids, cu, resp, vocab_size=V)
    with pytest.raises(InputError, match="every response token needs its row, an empty one where nobody sampled it"):
        local_support(short, ids, cu, resp, vocab_size=V)


def test_token_outside_its_row_names_sample_and_position():
    ids, cu, resp, rows = batch()
    token = int(ids[int(cu[3]) - 6 + 4])
    rows[2][4] = [t for t in range(V) if t != token][:3]
    with pytest.raises(OutsideSupportError, match=f"sample 2, response position 4: token {token} is not in"):
        local_support([Record(r) for r in rows], ids, cu, resp, vocab_size=V)


def test_malformed_support_is_one_input_error():
    ids, cu, resp, rows = batch()
    rows[0][0] = rows[0][0][::-1] if len(rows[0][0]) > 1 else [7, 3]
    with pytest.raises(InputError, match="sample 0"):
        local_support([Record(r) for r in rows], ids, cu, resp, vocab_size=V)
    with pytest.raises(InputError, match="sample 0: sampling_support must hold token_ids and offsets"):
        sample_support(42, 0)
    with pytest.raises(InputError, match="1 supports for a micro-batch of 3 samples"):
        local_support([None], ids, cu, resp, vocab_size=V)


def test_uneven_padding_is_refused():
    ids, cu, resp, rows = batch()
    with pytest.raises(InputError, match="not divisible by sequence parallel size 2"):
        local_support([None] * 3, ids, cu, resp, vocab_size=V, pad_size=0 if int(cu[-1]) % 2 else 1, sp_size=2)


# ---- a support is input: checked on its values as sent, then cast (issue 48, items 5 and 6) ----------
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, "torch", "list"])
def test_an_id_that_int32_would_wrap_into_range_is_refused(dtype):
    ids = [2**32 + 5, 2**32 + 9]  # 5 and 9 once cast to int32
    ids = torch.tensor(ids) if dtype == "torch" else ids if dtype == "list" else np.array(ids, dtype=dtype)
    with pytest.raises(InputError, match=r"sample 3: token_ids of row 0 hold an id outside \[0, 100\) "
                                         r"\(id 4294967301\)"):
        sample_support({"token_ids": ids, "offsets": [0, 1, 2]}, 3, vocab_size=100)


@given(arriving_support(V))
def test_sample_support_refuses_every_damaged_support_and_keeps_every_valid_one(drawn):
    rows, ids, offsets, damage = drawn
    for support in ({"token_ids": ids, "offsets": offsets},
                    SimpleNamespace(token_ids=ids, offsets=offsets)):  # the plugin's record shape
        if damage != "none":
            with pytest.raises(InputError, match="sample 2"):
                sample_support(support, 2, vocab_size=V)
        else:
            mask = sample_support(support, 2, vocab_size=V)
            assert mask.to_lists() == rows and mask.token_ids.dtype == torch.int32


@pytest.mark.parametrize("offsets", [[0, 0, 0], [0]])
def test_an_empty_support_from_json_is_nothing_to_replay(offsets):
    # what a JSON round trip of numpy's empty int arrays gives: [] (read back as float64)
    ids, cu, resp, rows = batch(4, prompts=(3, 2, 2), responses=(4, len(offsets) - 1, 5))
    rows[1] = [[]] * (len(offsets) - 1)
    as_json = json.loads(json.dumps({"token_ids": [], "offsets": offsets}))
    as_numpy = Record(rows[1])
    assert sample_support(as_json, 1, V).to_lists() == sample_support(as_numpy, 1, V).to_lists() == rows[1]
    for second in (as_json, as_numpy):
        layout = local_support([Record(rows[0]), second, Record(rows[2])], ids, cu, resp, vocab_size=V)
        assert got(layout) == expected(ids, cu, resp, rows, 0, 0, 1)
