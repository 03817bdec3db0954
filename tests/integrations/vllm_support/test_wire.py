"""The support blocks (integrations/vllm_support/wire.py) against a plain reference: each row's ids are the
True columns of the support, a greedy row the sampled id alone; every layout (id list, bitmask, whole
vocabulary) round-trips at the fixed width and narrowed to `payload_width`; the encode has no
data-dependent shape (traced under FakeTensorMode and on the meta device, where a host sync fails); and
every damaged block is refused with its row (issue 48 items 1-3: the old decoder returned shrunken rows or
died in numpy)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from mask_replay.errors import EngineOutputError
from mask_replay.integrations.vllm_support import wire


def reference_rows(support: torch.Tensor, sampled, greedy) -> list:
    rows = []
    for r in range(support.shape[0]):
        if greedy is not None and bool(greedy[r]):
            rows.append([int(sampled[r])])
        else:
            rows.append([j for j in range(support.shape[1]) if bool(support[r, j])])
    return rows


def decoded(blocks) -> list:
    blocks = blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks
    return [row.tolist() for row in wire.decode(blocks)]


def narrowed(blocks: torch.Tensor) -> np.ndarray:
    b = blocks.numpy()
    return b[:, :wire.HEADER + wire.payload_width(b[:, :wire.HEADER])]


def random_support(vocab, rows, density, seed, with_greedy):
    g = torch.Generator().manual_seed(seed)
    support = torch.rand(rows, vocab, generator=g) < density
    support[torch.rand(rows, generator=g) < 0.2] = True  # some whole rows
    support[torch.rand(rows, generator=g) < 0.1] = False  # some empty rows
    sampled = torch.randint(0, vocab, (rows,), generator=g)
    greedy = (torch.rand(rows, generator=g) < 0.5) if with_greedy else None
    return support, sampled, greedy


@settings(max_examples=150, deadline=None)
@given(vocab=st.integers(1, 200), rows=st.integers(0, 6), density=st.sampled_from([0.0, 0.02, 0.2, 0.6, 1.0]),
       seed=st.integers(0, 2**31 - 1), with_greedy=st.booleans())
def test_round_trip_equals_the_reference(vocab, rows, density, seed, with_greedy):
    support, sampled, greedy = random_support(vocab, rows, density, seed, with_greedy)
    blocks = wire.encode_on_device(support, sampled, greedy)
    assert blocks.dtype == torch.int32 and blocks.shape == (rows, wire.HEADER + wire.bitmask_words(vocab))
    expected = reference_rows(support, sampled, greedy)
    assert decoded(blocks) == expected
    assert decoded(narrowed(blocks)) == expected  # the host's column cut never loses an id
    assert torch.equal(wire.encode_on_host(support, sampled, greedy), blocks)  # the CPU path: the same tensor
    assert torch.equal(wire.encode(support, sampled, greedy), blocks)
    # MRV2's int64 ids: two words a column, the same rows, 4 bytes an id still (one -1 word for an odd width)
    packed = wire.as_columns(blocks, torch.int64)
    assert packed.dtype == torch.int64 and packed.shape == (rows, -(-blocks.shape[1] // 2))
    assert np.array_equal(wire.words_of(packed.numpy())[:, :blocks.shape[1]], blocks.numpy())
    assert decoded(packed) == expected


def test_each_row_takes_the_smaller_layout_and_the_width_is_fixed():
    vocab = 100  # 4 bitmask words
    support = torch.zeros(5, vocab, dtype=torch.bool)
    support[0, [3, 7, 50]] = True  # 3 ids: a list
    support[1, :4] = True  # 4 ids = 4 words: still a list
    support[2, :5] = True  # 5 ids > 4 words: the bitmask
    support[3] = True  # everything: no payload
    blocks = wire.encode(support, torch.zeros(5, dtype=torch.int64))
    assert blocks[:, 0].tolist() == [vocab] * 5
    assert blocks[:, 1].tolist() == [3, 4, wire.BITMASK, wire.WHOLE, 0]
    assert blocks.shape[1] == wire.HEADER + wire.bitmask_words(vocab)
    assert blocks[0, wire.HEADER:].tolist() == [3, 7, 50, -1] and blocks[3, wire.HEADER:].tolist() == [-1] * 4
    assert decoded(blocks) == reference_rows(support, None, None)


def test_payload_width_is_the_widest_row_of_the_step():
    support = torch.zeros(3, 49152, dtype=torch.bool)
    support[0, [1, 2]] = True
    support[1, [5]] = True
    support[2, [9, 10, 11]] = True
    blocks = wire.encode(support, torch.tensor([1, 5, 9])).numpy()
    assert wire.payload_width(blocks[:, :2]) == 3  # 20 bytes a token on the wire, not 49152 / 8
    assert [wire.payload_width(blocks[r:r + 1, :2]) for r in range(3)] == [2, 1, 3]  # a request's own row
    support[1] = True
    support[2, :2000] = True
    blocks = wire.encode(support, torch.tensor([1, 5, 9])).numpy()
    assert wire.payload_width(blocks[:, :2]) == 1536 and wire.payload_width(blocks[1:2, :2]) == 0
    assert wire.payload_width(blocks[:0, :2]) == 0


def test_large_steps_are_encoded_in_chunks_with_the_same_result(monkeypatch):
    support, sampled, greedy = random_support(300, 23, 0.05, 5, True)
    whole = wire.encode_on_device(support, sampled, greedy)
    monkeypatch.setattr(wire, "CHUNK_ELEMENTS", 1000)  # 3 rows a chunk
    assert torch.equal(wire.encode_on_device(support, sampled, greedy), whole)


def test_the_encode_has_no_data_dependent_shape():
    # under FakeTensorMode a host sync (.tolist(), .item(), torch.nonzero, boolean indexing) raises;
    # the encode must trace through it to its fixed shape, on the meta device too
    vocab, rows = 151936, 3
    with FakeTensorMode():  # (fake CPU tensors: the device path is called by name; encode sends real ones to numpy)
        support = torch.empty(rows, vocab, dtype=torch.bool)
        with pytest.raises(DataDependentOutputException):
            support.sum(1).max().tolist()  # what the old encode did: the mode does catch it
        with pytest.raises(DynamicOutputShapeException):
            torch.nonzero(support)
        blocks = wire.encode_on_device(support, torch.empty(rows, dtype=torch.int64),
                                       torch.empty(rows, dtype=torch.bool))
        assert blocks.shape == (rows, wire.HEADER + 4748) and blocks.dtype == torch.int32
    meta = torch.empty(rows, vocab, dtype=torch.bool, device="meta")
    blocks = wire.encode(meta, torch.empty(rows, dtype=torch.int64, device="meta"), None)  # not a CPU tensor:
    assert blocks.shape == (rows, wire.HEADER + 4748) and blocks.device.type == "meta"  # the device path
    assert wire.as_columns(blocks, torch.int64).shape == (rows, 2375)  # MRV2's columns: a static shape too


def test_bitmask_words_match_numpy_packbits():
    g = torch.Generator().manual_seed(3)
    bits = torch.rand(5, 77, generator=g) < 0.5
    bits[:, 31] = True  # the sign bit of word 0
    words = wire._pack_bits(bits, wire.bitmask_words(77)).numpy()
    padded = np.zeros((5, 96), dtype=bool)
    padded[:, :77] = bits.numpy()
    expected = np.packbits(padded, axis=1, bitorder="little").view("<i4")
    assert np.array_equal(words, expected)


@pytest.mark.parametrize("encode", [wire.encode_on_device, wire.encode_on_host])
def test_greedy_rows_are_the_sampled_token_even_outside_the_processed_support(encode):
    support = torch.zeros(2, 10, dtype=torch.bool)
    support[:, :3] = True
    greedy = torch.tensor([True, False])
    blocks = encode(support, torch.tensor([7, 1]), greedy)
    assert decoded(blocks) == [[7], [0, 1, 2]]
    assert support[:, :3].all() and not support[:, 3:].any()  # the caller's tensor is not written


def test_ties_at_the_cut_and_float32_rounding_rows_stay_exact():
    # a support is whatever the processed row left finite: equal logits, values a float32 ulp apart
    z = torch.tensor([[1.0, 1.0, 1.0, float("-inf"), 1.0 + 2**-23, float("-inf")]])
    assert decoded(wire.encode(z > float("-inf"), torch.tensor([0]))) == [[0, 1, 2, 4]]


def flat(blocks_per_step: list) -> tuple:
    values = np.concatenate([b.ravel() for b in blocks_per_step]).astype(np.int32)
    widths = np.concatenate([np.full(b.shape[0], b.shape[1], np.int64) for b in blocks_per_step])
    starts = np.cumsum(widths) - widths
    return values, starts, widths


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.03, 0.3, 1.0]), st.integers(0, 2**31 - 1)),
                      max_size=12), vocab=st.integers(1, 130))
def test_steps_of_mixed_widths_decode_in_one_pass(steps, vocab):
    # a request's blocks arrive one step at a time, each step narrowed to its own widest row
    blocks, expected = [], []
    for rows, density, seed in steps:
        support, sampled, greedy = random_support(vocab, rows, density, seed, True)
        blocks.append(narrowed(wire.encode(support, sampled, greedy)))
        expected.extend(reference_rows(support, sampled, greedy))
    got = wire.decode_flat(*flat(blocks)) if blocks else None
    if not expected:
        return
    assert got.vocab_size == vocab and got.num_rows == len(expected)
    assert [got.token_ids[a:b].tolist() for a, b in zip(got.offsets[:-1], got.offsets[1:])] == expected


V = 100  # 4 bitmask words


def bitmask_block(ids, vocab=V, words=None):
    bits = torch.zeros(1, max(vocab, 32 * wire.bitmask_words(vocab)), dtype=torch.bool)
    bits[0, ids] = True
    packed = wire._pack_bits(bits, wire.bitmask_words(bits.shape[1]))[0].tolist()
    return [vocab, wire.BITMASK] + packed[:wire.bitmask_words(vocab) if words is None else words]


@pytest.mark.parametrize("blocks, problem", [
    # issue 48 item 1: 4 words announced (V = 100), 2 present; the old decoder gave [1, 5]
    ([bitmask_block([1, 5, 70, 80, 90, 95], words=2)], "a bitmask of 2 words, its header announces 4"),
    # item 2: bits at ids >= V (a damaged V: 40 for a row drawn over 64); the old decoder dropped them
    ([bitmask_block([3, 45, 50], vocab=40)], "bits set at ids >= its vocabulary width 40"),
    # item 3: a block narrower than its 2-column header (the old decoder: a bare numpy IndexError)
    ([[7]], "1 columns, fewer than the 2 of the header"),
    ([[0, 1, 5]], "vocabulary width 0"),
    ([[10, 4, 1, 2]], "header 4 for 2 payload columns"),
    ([[10, -7, 1]], "header -7"),
    ([[10, 2, 3, 10]], r"id 10 is outside \[0, 10\)"),
    ([[10, 2, -1, 4]], r"id -1 is outside \[0, 10\)"),
    ([[10, 3, 2, 5, 5]], "not strictly ascending"),
    ([[10, 3, 2, 5, 4]], "not strictly ascending"),
])
def test_damaged_blocks_are_named(blocks, problem):
    with pytest.raises(EngineOutputError, match=f"support block 0: .*{problem}"):
        wire.decode(np.array(blocks, dtype=np.int32))


def test_the_damaged_row_is_the_one_named():
    good = wire.encode(torch.ones(2, 10, dtype=torch.bool), torch.zeros(2, dtype=torch.int64)).numpy()
    values, starts, widths = flat([good, np.array([[10, 2, 4, 1]], np.int32), good])
    with pytest.raises(wire.BlockError) as e:
        wire.decode_flat(values, starts, widths)
    assert e.value.row == 2 and "ascending" in e.value.problem
    values, starts, widths = flat([good, np.array([[12, wire.WHOLE]], np.int32)])
    with pytest.raises(wire.BlockError, match="vocabulary width 12 .* first row had 10") as e:
        wire.decode_flat(values, starts, widths)
    assert e.value.row == 2


def test_rows_cut_across_their_boundary_are_not_mistaken_for_a_descent():
    values, starts, widths = flat([np.array([[10, 2, 4, 9], [10, 2, 1, 2]], np.int32)])
    rows = wire.decode_flat(values, starts, widths)
    assert rows.token_ids.tolist() == [4, 9, 1, 2] and rows.offsets.tolist() == [0, 2, 4]


def test_join_gives_csr():
    rows = wire.join([np.array([1, 4], np.int32), np.array([], np.int32), np.array([0], np.int32)], 8)
    assert rows.offsets.tolist() == [0, 2, 2, 3] and rows.token_ids.tolist() == [1, 4, 0] and rows.vocab_size == 8
    assert wire.join([], 8).num_rows == 0


def test_block_columns_of_another_dtype_are_refused():
    with pytest.raises(TypeError, match="int32 or int64"):
        wire.as_columns(torch.zeros(1, 3, dtype=torch.int32), torch.int16)
    with pytest.raises(EngineOutputError, match="dtype float32"):
        wire.decode(np.zeros((1, 4), np.float32))


def test_int64_columns_split_into_their_two_words_little_end_first():
    packed = wire.as_columns(torch.tensor([[10, wire.WHOLE, -1]], dtype=torch.int32), torch.int64)
    assert packed.tolist() == [[(wire.WHOLE << 32) | 10, -1]]  # V in the low half, H in the high half, -1 padding
    assert wire.words_of(packed.numpy()).tolist() == [[10, wire.WHOLE, -1, -1]]
    assert decoded(packed) == [list(range(10))]
