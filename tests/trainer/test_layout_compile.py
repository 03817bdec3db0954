"""replay_logprobs over [B, T, V] with labels, and packed logits with cu_seqlens, trace whole under
torch.compile(fullgraph=True), forward and backward, and give eager's values and gradients. The layout
step (which positions are kept: data-dependent sizes) is one custom op, mask_replay::layout_csr."""
import pytest
import torch

import mask_replay as mr
from tests.helpers import grads

B, T, V = 3, 6, 13


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = logits.argmax(-1)
    labels[0, :2] = -100  # a prompt
    labels[2, 4:] = -100  # padding
    keep = labels != -100
    mask = mr.capture(logits[keep], top_k=5)
    return logits, labels, mask


def _losses():
    logits, labels, mask = _case()
    cu = torch.tensor([0, 4, 11, B * T])
    temps = torch.tensor([0.7, 1.0, 1.3])

    def btv(x):
        return (mr.replay_logprobs(x, mask, labels) * 1.5).sum()

    def btv_strided(x):  # logits[:, :-1] of a longer tensor (the same values): the strided-view path
        full = torch.cat([x, x[:, :1]], dim=1)
        return mr.replay_logprobs(full[:, :-1], mask, labels).sum()

    def packed(x):
        return mr.replay_logprobs(x.reshape(B * T, V), mask, labels.reshape(-1), cu_seqlens=cu).sum()

    def packed_per_sequence_temperature(x):
        return mr.replay_logprobs(x.reshape(B * T, V), mask, labels.reshape(-1), temps, cu_seqlens=cu,
                                  fallback=True).sum()

    with_labels = mr.SamplingMask(mask.token_ids, mask.offsets, sampled=labels[labels != -100])

    def loss_mask_only(x):  # labels from the mask itself
        return mr.replay_logprobs(x, with_labels, None, loss_mask=labels != -100).sum()

    return logits, {"btv": btv, "btv_strided": btv_strided, "packed": packed,
                    "packed_per_sequence_temperature": packed_per_sequence_temperature,
                    "loss_mask_only": loss_mask_only}


CASES = list(_losses()[1])


def _check(case, backend):
    torch._dynamo.reset()
    logits, fns = _losses()
    fn = fns[case]
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(logits), fn(logits))
    (got,), (want,) = grads(compiled, logits), grads(fn, logits)
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0


@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
@pytest.mark.parametrize("case", CASES)
def test_layouts_compile_fullgraph_aot_eager(case):
    _check(case, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["btv", "packed"])
def test_layouts_compile_fullgraph_inductor(case):
    _check(case, "inductor")


def test_compiled_layout_still_names_a_row_count_mismatch():
    torch._dynamo.reset()
    logits, labels, mask = _case()
    wrong = labels.clone()
    wrong[1, 0] = -100
    compiled = torch.compile(lambda x: mr.replay_logprobs(x, mask, wrong).sum(), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="the mask has 14 rows but the batch has 13 positions"):
        compiled(logits)


def test_layout_op_passes_opcheck():
    logits, labels, mask = _case()
    keep = (labels != -100).reshape(-1)
    args = (keep, torch.arange(B * T), B * T, mask.token_ids, mask.offsets, labels.reshape(-1).clamp_min(0),
            torch.zeros(0, dtype=torch.int64), False, torch.ones(B * T), torch.zeros(0, dtype=torch.int64), B * T)
    torch.library.opcheck(torch.ops.mask_replay.layout_csr.default, args)
