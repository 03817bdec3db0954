"""csr: a support entering from outside is checked on its values as given, then cast (checked_csr,
exact_int64), and the host check of a mask the device refused names its defect (device_csr)."""
import numpy as np
import pytest
import torch
from hypothesis import given

from mask_replay import csr
from mask_replay.errors import MaskFormatError
from tests.helpers import arriving_support

V = 100


@given(arriving_support(V))
def test_checked_csr_accepts_exactly_the_valid_supports(drawn):
    rows, ids, offsets, damage = drawn
    if damage != "none":
        with pytest.raises(MaskFormatError):
            csr.checked_csr(ids, offsets, source="s", vocab_size=V)
        return
    tok, off = csr.checked_csr(ids, offsets, source="s", vocab_size=V)
    assert tok.dtype == torch.int32 and off.dtype == torch.int64
    assert [tok[a:b].tolist() for a, b in zip(off[:-1].tolist(), off[1:].tolist())] == rows


@pytest.mark.parametrize("ids", [np.array([5, 2**32 + 9], np.int64), np.array([5, 2**32 + 9], np.uint64),
                                 torch.tensor([5, 2**32 + 9]), [5, 2**32 + 9]])
def test_an_id_that_int32_would_wrap_into_range_is_named(ids):
    with pytest.raises(MaskFormatError, match=r"s: token_ids of row 1 hold an id outside \[0, 100\) \(id 4294967305\)"):
        csr.checked_csr(ids, [0, 1, 2], source="s", vocab_size=V)
    with pytest.raises(MaskFormatError, match=r"outside \[0, 2\^31\) \(id 4294967305\)"):  # no vocabulary: int32
        csr.checked_csr(ids, [0, 1, 2], source="s")


@pytest.mark.parametrize("values, problem", [
    (np.array([2**63 + 1], np.uint64), "token_ids hold 9223372036854775809, beyond a 64-bit integer"),
    ([2**70], "beyond a 64-bit integer"),
    ([1.0, 2.0], "must be a 1-D integer array, got float64"),
    (torch.tensor([1.5]), "must be a 1-D integer array, got torch.float32"),
    ([[1], [2]], "must be a 1-D integer array"),
    ([True], "must be a 1-D integer array, got bool"),
    ("12", "must be an array, got str"),
])
def test_what_is_not_an_integer_array_is_refused_by_name(values, problem):
    with pytest.raises(MaskFormatError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        csr.exact_int64(values, name="token_ids", source="s")


@pytest.mark.parametrize("empty", [[], np.zeros(0), torch.zeros(0), np.zeros(0, np.uint64)])
def test_an_empty_array_of_any_dtype_is_no_ids(empty):  # JSON's [] reads back as float64
    tok, off = csr.checked_csr(empty, [0, 0, 0], source="s", vocab_size=V)
    assert tok.dtype == torch.int32 and tok.numel() == 0 and off.tolist() == [0, 0, 0]


def test_device_refusal_names_an_id_that_int32_would_wrap():
    # device_csr sees ids as int64 on the device and refuses 2^32 + 5; its host message used to come from
    # the ids cast to int32 (5: in range), found nothing and said only "not a valid CSR"
    ids = torch.tensor([1, 2**32 + 5])
    with pytest.raises(MaskFormatError, match=r"op: token_ids of row 1 hold an id outside \[0, 10\) \(id 4294967301\)"):
        csr.device_csr(ids, torch.tensor([0, 1, 2]), 2, 10, "cpu", "op")
