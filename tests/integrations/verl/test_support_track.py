"""support_track: one sample's rows under verl's continuous-token merge edits (main suite: no verl import;
the merges are MergeResult-shaped records with the fields verl 0.9.1's align_response_metadata reads).
Expected rows are written out by hand per case."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given

from mask_replay.errors import EngineOutputError
from mask_replay.integrations.verl.support_track import SupportTrack
from tests.helpers import arriving_support


def support(rows):
    return {"token_ids": np.array([t for r in rows for t in r], dtype=np.int32),
            "offsets": np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)}


def merge(kind, appended, inserted=0, removed=0):
    return SimpleNamespace(kind=kind, appended_token_count=appended, inserted_token_ids=[99] * inserted,
                           removed_prefix_token_count=removed)


def rows_of(csr):
    return [csr["token_ids"][a:b].tolist() for a, b in zip(csr["offsets"][:-1], csr["offsets"][1:])]


def test_turns_tool_tokens_boundaries_and_removed_tokens():
    t = SupportTrack("sample 3")
    t.receive(support([[1, 5], [2], [7, 8]]), 3, "r0")
    t.merge(merge("assistant", 3), 0, 3)
    t.merge(merge("context", 4, inserted=1, removed=1), 3, 3 - 1 + 1 + 4)  # stop token dropped, newline added
    t.receive(support([[4, 9]]), 1, "r1")  # one turn in two pieces (a resumed generation)
    t.receive(support([[3]]), 1, "r2")
    t.merge(merge("assistant", 2), 7, 9)
    out = t.finish([5, 2, 0, 0, 0, 0, 0, 9, 3], [1, 1, 0, 0, 0, 0, 0, 1, 1])
    assert rows_of(out) == [[1, 5], [2], [], [], [], [], [], [4, 9], [3]]
    assert out["token_ids"].dtype == np.int32 and out["offsets"].dtype == np.int64


def test_finish_cuts_to_the_response_verl_keeps():
    t = SupportTrack("sample 0")
    t.receive(support([[1], [2], [3], [4]]), 4, "r")
    t.merge(merge("assistant", 4), 0, 4)
    assert rows_of(t.finish([1, 2], [1, 1])) == [[1], [2]]
    assert t.closed


def test_a_token_outside_its_row_names_sample_and_position():
    t = SupportTrack("sample 2 (rollout 1)")
    t.receive(support([[1], [2, 6]]), 2, "r")
    t.merge(merge("assistant", 2), 0, 2)
    with pytest.raises(EngineOutputError, match=r"sample 2 \(rollout 1\), response position 1: token 5 is not in "
                                                r"its recorded support \(2 ids\)"):
        t.finish([1, 5], [1, 1])


def test_a_row_where_the_mask_says_nobody_sampled_names_the_position():
    t = SupportTrack("sample 4")
    t.receive(support([[1], [2]]), 2, "r")
    t.merge(merge("assistant", 2), 0, 2)
    with pytest.raises(EngineOutputError, match="sample 4, response position 1: response_mask is 0 but a support"):
        t.finish([1, 2], [1, 0])


@pytest.mark.parametrize("case", ["rows_vs_tokens", "merge_count", "unmerged", "edited", "missing"])
def test_inconsistent_turns_are_one_error_naming_the_sample(case):
    t = SupportTrack("sample 7")
    with pytest.raises(EngineOutputError, match="sample 7"):
        if case == "rows_vs_tokens":
            t.receive(support([[1]]), 2, "r")
        elif case == "missing":
            t.receive(None, 2, "r")
        elif case == "merge_count":
            t.receive(support([[1]]), 1, "r")
            t.merge(merge("assistant", 2), 0, 2)
        elif case == "unmerged":
            t.receive(support([[1]]), 1, "r")
            t.finish([1], [1])
        else:
            t.merge(merge("context", 2), 1, 3)  # the loop's mask grew without a merge


# ---- a generation's support is input: the CSR contract at receive() (issue 48, item 7) -------------
@pytest.mark.parametrize("sent, tokens, problem", [
    ({"token_ids": [9, 9, 4, 3, 8], "offsets": [2, 3, 5]}, 2, r"offsets\[0\] must be 0, got 2"),  # a slice not rebased
    ({"token_ids": [4, 3, 8], "offsets": [0, 3, 1, 3]}, 3, r"offsets decrease at row 1 \(3 -> 1\)"),
    ({"token_ids": np.array([2**32 + 7]), "offsets": [0, 1]}, 1, r"outside \[0, 2\^31\) \(id 4294967303\)"),
    ({"token_ids": [7], "offsets": [0, 1, 1]}, 1, "returned 1 tokens but 2 support rows"),
    ({"token_ids": [7]}, 1, "expected a dict of token_ids and offsets"),
])
def test_a_damaged_support_is_refused_at_receive_naming_sample_and_request(sent, tokens, problem):
    t = SupportTrack("sample 5")
    with pytest.raises(EngineOutputError, match=r"^sample 5: request r9: .*" + problem):
        t.receive(sent, tokens, "r9")
    assert t.pending == []


@given(arriving_support(50))
def test_receive_refuses_every_damaged_support_and_keeps_every_valid_one(drawn):
    rows, ids, offsets, damage = drawn
    t = SupportTrack("sample 1")
    if damage != "none":
        with pytest.raises(EngineOutputError, match="^sample 1: request r: "):
            t.receive({"token_ids": ids, "offsets": offsets}, len(offsets) - 1, "r")
        return
    t.receive({"token_ids": ids, "offsets": offsets}, len(rows), "r")
    t.merge(merge("assistant", len(rows)), 0, len(rows))
    out = t.finish([r[0] if r else 0 for r in rows], [int(bool(r)) for r in rows])
    assert rows_of(out) == rows and out["token_ids"].dtype == np.int32
