"""The support blocks (integrations/vllm_support/wire.py) against a plain reference: each row's ids are the
True columns of the support, a greedy row the sampled id alone; every layout (id list, bitmask, whole
vocabulary) round-trips, and a row costs what the module docstring says."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def decoded(blocks: torch.Tensor) -> list:
    return [row.tolist() for row in wire.decode(blocks.numpy())]


@settings(max_examples=150, deadline=None)
@given(vocab=st.integers(1, 200), rows=st.integers(1, 6), density=st.sampled_from([0.0, 0.02, 0.2, 0.6, 1.0]),
       seed=st.integers(0, 2**31 - 1), with_greedy=st.booleans())
def test_round_trip_equals_the_reference(vocab, rows, density, seed, with_greedy):
    g = torch.Generator().manual_seed(seed)
    support = torch.rand(rows, vocab, generator=g) < density
    support[torch.rand(rows, generator=g) < 0.2] = True  # some whole rows
    sampled = torch.randint(0, vocab, (rows,), generator=g)
    greedy = (torch.rand(rows, generator=g) < 0.5) if with_greedy else None
    blocks = wire.encode(support, sampled, greedy)
    assert blocks.dtype == torch.int32 and blocks.shape[0] == rows
    assert decoded(blocks) == reference_rows(support, sampled, greedy)


def test_each_row_takes_the_smaller_layout():
    vocab = 100  # 4 bitmask words
    support = torch.zeros(4, vocab, dtype=torch.bool)
    support[0, [3, 7, 50]] = True  # 3 ids: a list
    support[1, :4] = True  # 4 ids = 4 words: still a list
    support[2, :5] = True  # 5 ids > 4 words: the bitmask
    support[3] = True  # everything: no payload
    blocks = wire.encode(support, torch.zeros(4, dtype=torch.int64))
    assert blocks[:, 0].tolist() == [vocab] * 4
    assert blocks[:, 1].tolist() == [3, 4, wire.BITMASK, wire.WHOLE]
    assert blocks.shape[1] == wire.HEADER + wire.bitmask_words(vocab)  # the widest payload sets the width
    assert decoded(blocks) == reference_rows(support, None, None)


def test_narrow_steps_cost_their_widest_list():
    support = torch.zeros(3, 49152, dtype=torch.bool)
    support[0, [1, 2]] = True
    support[1, [5]] = True
    support[2, [9, 10, 11]] = True
    blocks = wire.encode(support, torch.tensor([1, 5, 9]))
    assert blocks.shape == (3, wire.HEADER + 3)  # 20 bytes a token, not 49152 / 8
    assert blocks[0, wire.HEADER:].tolist() == [1, 2, -1]


def test_bitmask_words_match_numpy_packbits():
    g = torch.Generator().manual_seed(3)
    bits = torch.rand(5, 77, generator=g) < 0.5
    bits[:, 31] = True  # the sign bit of word 0
    words = wire._pack_bits(bits, wire.bitmask_words(77)).numpy()
    padded = np.zeros((5, 96), dtype=bool)
    padded[:, :77] = bits.numpy()
    expected = np.packbits(padded, axis=1, bitorder="little").view("<i4")
    assert np.array_equal(words, expected)


def test_greedy_rows_are_the_sampled_token_even_outside_the_processed_support():
    support = torch.zeros(2, 10, dtype=torch.bool)
    support[:, :3] = True
    blocks = wire.encode(support, torch.tensor([7, 1]), torch.tensor([True, False]))
    assert decoded(blocks) == [[7], [0, 1, 2]]


@pytest.mark.parametrize("block, problem", [
    ([0, 1, 5], "vocabulary width 0"),
    ([10, 4, 1, 2], "header 4 for 2 payload columns"),
    ([10, -7], "header -7"),
])
def test_damaged_blocks_are_named(block, problem):
    with pytest.raises(EngineOutputError, match=problem):
        wire.decode(np.array([block], dtype=np.int32))


def test_join_gives_csr():
    rows = wire.join([np.array([1, 4], np.int32), np.array([], np.int32), np.array([0], np.int32)], 8)
    assert rows.offsets.tolist() == [0, 2, 2, 3] and rows.token_ids.tolist() == [1, 4, 0] and rows.vocab_size == 8
    assert wire.join([], 8).num_rows == 0


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 150), max_size=4), max_size=40), seed=st.integers(0, 2**31 - 1),
       cut=st.integers(0, 200))
def test_row_buffer_hands_out_what_join_builds(steps, seed, cut):
    # rows of random sizes (some wider than the first allocation) appended step by step; every view handed
    # out along the way must still show its rows after later appends and growth
    rng = np.random.default_rng(seed)
    buffer, everything, handed = wire.RowBuffer(300), [], []
    for sizes in steps:
        rows = [np.sort(rng.choice(300, size, replace=False)).astype(np.int32) for size in sizes]
        buffer.extend(rows)
        everything.extend(rows)
        handed.append((buffer.rows(), len(everything)))
    for view, n in handed:
        expected = wire.join(everything[:n], 300)
        assert view.offsets.tolist() == expected.offsets.tolist()
        assert view.token_ids.tolist() == expected.token_ids.tolist() and view.vocab_size == 300
    start = min(cut, buffer.num_rows)
    tail = buffer.rows(start)
    expected = wire.join(everything[start:], 300)
    assert tail.offsets.tolist() == expected.offsets.tolist() and tail.token_ids.tolist() == expected.token_ids.tolist()


def test_row_buffer_views_are_not_copies():
    # the point of the buffer: a streamed request's outputs share memory instead of re-joining all rows
    buffer = wire.RowBuffer(8)
    buffer.extend([np.array([1, 2], np.int32)])
    first = buffer.rows()
    buffer.extend([np.array([3], np.int32)])
    second = buffer.rows()
    assert np.shares_memory(first.token_ids, second.token_ids) and first.token_ids.tolist() == [1, 2]
