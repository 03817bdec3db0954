"""Library-side argument checks (issue 9 §3): one clear exception naming the argument."""
import re

import numpy as np
import pytest
import torch

import mask_replay
from mask_replay import MaskFormatError, SamplingMask


def small():
    torch.manual_seed(0)
    return torch.randn(3, 10), SamplingMask.from_lists([[1, 2], [3], [4, 5]]), torch.tensor([1, 3, 4])


def test_one_dimensional_logits_name_the_logits_shape():
    z, m, y = small()
    with pytest.raises(ValueError, match=r"logits must be a 2-D tensor of shape \[N, V\], got shape \(10,\)"):
        mask_replay.replay_logprobs(z[0], m, y)
    with pytest.raises(ValueError, match=r"logits must be a 2-D tensor of shape \[N, V\]"):
        mask_replay.full_logprobs(z[0], y)
    with pytest.raises(ValueError, match=r"logits must be a 2-D tensor of shape \[N, V\]"):
        mask_replay.kept_mass(z[0], m)
    with pytest.raises(ValueError, match=r"hidden must be a 2-D tensor of shape \[N, d\]"):
        mask_replay.replay_logprobs_from_hidden(torch.randn(4), torch.randn(10, 4), m, y)


@pytest.mark.parametrize("field", ["token_ids", "offsets"])
def test_mask_without_tensors_is_a_mask_format_error(field):
    args = {"token_ids": torch.tensor([1], dtype=torch.int32), "offsets": torch.tensor([0, 1])}
    args[field] = None
    with pytest.raises(MaskFormatError, match=f"{field} must be a tensor, got NoneType"):
        SamplingMask(**args)
    with pytest.raises(MaskFormatError, match="sampled must be a tensor or None, got list"):
        SamplingMask(torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1]), sampled=[1])


def test_bool_sampled_is_rejected():
    z, m, y = small()
    yb = torch.tensor([True, False, True])
    for call in (lambda: mask_replay.replay_logprobs(z, m, yb), lambda: mask_replay.full_logprobs(z, yb),
                 lambda: mask_replay.capture(z, top_k=2, sampled=yb)):
        with pytest.raises(ValueError, match="sampled must hold integer token ids, got torch.bool"):
            call()


def test_bool_top_k_tensor_is_rejected():
    z, _, _ = small()
    with pytest.raises(ValueError, match="top_k: expected a number or a tensor of numbers, got a torch.bool"):
        mask_replay.capture(z, top_k=torch.tensor([True, True, False]))
    with pytest.raises(TypeError, match="top_k: expected a number"):
        mask_replay.capture(z, top_k=True)


def test_numpy_scalars_are_numbers():
    z, _, _ = small()
    want = mask_replay.capture(z, top_k=2, top_p=0.9, temperature=0.7)
    for k, p, t in ((np.int64(2), np.float64(0.9), np.float32(0.7)), (np.int32(2), 0.9, np.float64(0.7)),
                    (np.float64(2.0), np.float32(0.9), 0.7)):
        got = mask_replay.capture(z, top_k=k, top_p=p, temperature=t)
        assert got == want, (k, p, t)
    with pytest.raises(ValueError, match="top_k: expected an integer, got 2.5"):
        mask_replay.capture(z, top_k=np.float64(2.5))
    with pytest.raises(TypeError, match="top_k: expected a number"):
        mask_replay.capture(z, top_k=np.bool_(True))
    # replay takes numpy temperatures too
    zz, m, y = small()
    assert torch.equal(mask_replay.replay_logprobs(zz, m, y, np.int64(2)), mask_replay.replay_logprobs(zz, m, y, 2.0))


def test_top_k_beyond_int64_is_named():
    z, _, _ = small()
    with pytest.raises(ValueError, match="top_k: 1180591620717411303424 does not fit in a 64-bit integer"):
        mask_replay.capture(z, top_k=2 ** 70)


def test_numbers_beyond_any_float_are_named_not_an_overflow():
    z, m, y = small()
    huge = 10 ** 400
    for call, name in ((lambda: mask_replay.capture(z, temperature=huge), "temperature"),
                       (lambda: mask_replay.capture(z, top_p=huge), "top_p"),
                       (lambda: mask_replay.replay_logprobs(z, m, y, temperature=huge), "temperature"),
                       (lambda: mask_replay.kept_mass(z, m, temperature=huge), "temperature")):
        with pytest.raises(ValueError, match=rf"{name}: an integer of 401 digits is beyond any floating-point value"):
            call()
    with pytest.raises(ValueError, match="top_k: an integer of 401 digits does not fit in a 64-bit integer"):
        mask_replay.capture(z, top_k=huge)


def test_to_dense_rejects_ids_outside_the_vocabulary():
    bad = SamplingMask(torch.tensor([0, -1], dtype=torch.int32), torch.tensor([0, 1, 2]))
    with pytest.raises(MaskFormatError, match=r"to_dense: token_ids of row 1 hold an id outside \[0, 5\)"):
        bad.to_dense(5)
    big = SamplingMask(torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 1, 2]))
    with pytest.raises(MaskFormatError, match=r"to_dense: token_ids of row 1 hold an id outside \[0, 5\)"):
        big.to_dense(5)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 0"):
        big.to_dense(-1)
    assert big.to_dense(np.int64(6)).sum() == 2


@pytest.mark.parametrize("value, what", [(1e-46, "rounds to 0"), (1e39, "overflows")])
def test_temperature_float32_cannot_hold_is_named(value, what):
    z, m, y = small()
    scalar = re.escape(f"temperature {value:g} {what} in float32")
    row = re.escape(f"temperature {value:g} (row 1) {what} in float32")
    with pytest.raises(ValueError, match=scalar):
        mask_replay.capture(z, temperature=value)
    with pytest.raises(ValueError, match=scalar):
        mask_replay.replay_logprobs(z, m, y, value)
    per_row = torch.tensor([1.0, value, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=row):
        mask_replay.capture(z, temperature=per_row)
    with pytest.raises(ValueError, match=row):
        mask_replay.full_logprobs(z, y, per_row)


def test_smallest_float32_temperatures_still_work():
    """Only values float32 cannot hold are refused: a tiny positive temperature stays positive."""
    z, _, y = small()
    t = 1e-30
    m = mask_replay.capture(z, temperature=t)  # greedy in effect, but not silently T = 0
    assert m.num_rows == 3
    assert mask_replay.capture(z, temperature=0.0).lengths().tolist() == [1, 1, 1]


def test_non_tensor_logits_or_hidden_name_the_argument():
    """Regression: the layout dispatch (logits.dim()) and out_dtype (hidden.dtype) ran before the
    argument checks, so a list gave an AttributeError instead of naming the argument."""
    _, m, y = small()
    for kwargs in ({}, {"loss_mask": torch.ones(3)}, {"cu_seqlens": torch.tensor([0, 3])}):
        with pytest.raises(TypeError, match=r"logits must be a tensor of shape \[N, V\] or \[B, T, V\], got list"):
            mask_replay.replay_logprobs([[0.0] * 10] * 3, m, y, **kwargs)
    with pytest.raises(TypeError, match="hidden must be a tensor of shape \\[N, d\\], got list"):
        mask_replay.replay_logprobs_from_hidden([[0.0] * 4] * 3, torch.randn(10, 4), m, y)


def test_numpy_temperatures_in_trainer_layouts_and_the_sparse_head():
    """Regression: the [B, T, V] / packed layouts and the sparse-gradient head had their own scalar
    check (int/float only) and refused the numpy temperatures the [N, V] path takes."""
    z, m, y = small()
    want = mask_replay.replay_logprobs(z, m, y, 0.5)
    for t in (np.float32(0.5), np.float64(0.5)):
        assert torch.equal(mask_replay.replay_logprobs(z[None], m, y[None], t)[0], want)
        assert torch.equal(mask_replay.replay_logprobs(z, m, y, t, cu_seqlens=torch.tensor([0, 3])), want)
    h, w = torch.randn(3, 4), torch.randn(10, 4)
    dense = mask_replay.replay_logprobs_from_hidden(h, w, m, y, 2.0)
    sparse = mask_replay.replay_logprobs_from_hidden(h, w, m, y, np.int64(2), sparse_grad=True)
    torch.testing.assert_close(sparse, dense)
    with pytest.raises(TypeError, match="temperature: expected a number or a tensor, got bool"):
        mask_replay.replay_logprobs(z[None], m, y[None], np.bool_(True))


def test_mask_with_other_rows_is_named_when_sampled_comes_from_it():
    """sampled=None takes mask.sampled: a mask of another row count is the mask's fault, not a
    'sampled' the caller never passed."""
    z, _, _ = small()
    m = SamplingMask.from_lists([[1], [2]], sampled=torch.tensor([1, 2]))
    for call in (lambda: mask_replay.replay_logprobs(z, m),
                 lambda: mask_replay.replay_logprobs_from_hidden(torch.randn(3, 4), torch.randn(10, 4), m)):
        with pytest.raises(ValueError, match=r"the mask has 2 rows but there are 3 rows of logits"):
            call()


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_bool_or_complex_temperature_tensors_are_refused_on_every_path(dtype):
    """Regression: the packed layout, the sparse-gradient head and the support statistics cast a
    bool (or complex) temperature tensor to float, where the [N, V] path refuses it."""
    z, m, y = small()
    t = torch.ones(3, dtype=dtype)
    h, w = torch.randn(3, 4), torch.randn(10, 4)
    for call in (lambda: mask_replay.replay_logprobs(z, m, y, t),
                 lambda: mask_replay.replay_logprobs(z, m, y, t, cu_seqlens=torch.tensor([0, 3])),
                 lambda: mask_replay.replay_logprobs(z[None], m, y[None], t[None]),
                 lambda: mask_replay.replay_logprobs_from_hidden(h, w, m, y, t, sparse_grad=True),
                 lambda: mask_replay.support_entropy(z, m, t)):
        with pytest.raises(ValueError, match=f"temperature: expected a number or a tensor of numbers, got a {dtype}"):
            call()
