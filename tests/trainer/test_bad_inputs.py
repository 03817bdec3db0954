"""The trainer's support ops (replay_support_logprobs*, support_logprobs_padded, support_entropy / kl
and their _from_hidden forms, score_centered_pg) under wrong shapes and dtypes (issue 30): each is
one ValueError / TypeError that starts with the op's name and names the argument, never a crash or a
bare torch error; and the inputs that are valid however odd (non-contiguous, empty) give the
contiguous / reference result."""
import pytest
import torch

import mask_replay as mr
from mask_replay import SamplingMask
from mask_replay import trainer as vp

M = SamplingMask.from_lists([[0, 2], [1, 3, 4], [5]], sampled=torch.tensor([2, 1, 5]))
E = SamplingMask.from_lists([], sampled=torch.zeros(0, dtype=torch.long))
G = torch.Generator().manual_seed(0)
Z = torch.randn(3, 8, generator=G)
H, W = torch.randn(3, 4, generator=G), torch.randn(8, 4, generator=G)
LP = mr.replay_support_logprobs(Z, M)

BAD = {
    # op name, call, words the message must hold (the argument, and what is wrong)
    "logits rank 1": ("replay_support_logprobs", lambda: mr.replay_support_logprobs(Z[0], M), "logits must be"),
    "logits rank 4": ("replay_support_logprobs", lambda: mr.replay_support_logprobs(Z[None, None], M),
                      "logits must be"),
    "int logits": ("replay_support_logprobs", lambda: mr.replay_support_logprobs(Z.long(), M), "logits must be float"),
    "row count": ("replay_support_logprobs", lambda: mr.replay_support_logprobs(Z[:2], M), "the mask has 3 rows"),
    "not a mask": ("replay_support_logprobs", lambda: mr.replay_support_logprobs(Z, "m"), "mask must be"),
    "temperature text": ("replay_support_logprobs", lambda: mr.replay_support_logprobs(Z, M, temperature="a"),
                         "temperature"),
    "hidden rank 1": ("replay_support_logprobs_from_hidden", lambda: mr.replay_support_logprobs_from_hidden(
        H[0], W, M), "hidden must be a 2-D"),
    "hidden a list": ("replay_support_logprobs_from_hidden", lambda: mr.replay_support_logprobs_from_hidden(
        [[1.0]], W, M), "hidden must be"),
    "int hidden": ("replay_support_logprobs_from_hidden", lambda: mr.replay_support_logprobs_from_hidden(
        H.long(), W.long(), M), "hidden must be float"),
    "fp16 weight, fp32 hidden": ("replay_support_logprobs_from_hidden", lambda: mr.replay_support_logprobs_from_hidden(
        H, W.half(), M), "weight is torch.float16 but hidden is torch.float32"),
    "hidden rows": ("replay_support_logprobs_from_hidden", lambda: mr.replay_support_logprobs_from_hidden(
        H[:2], W, M), "the mask has 3 rows"),
    "head width": ("replay_support_logprobs_from_hidden", lambda: mr.replay_support_logprobs_from_hidden(
        H, W[:, :3], M), "weight has d = 3"),
    "bias length": ("replay_support_logprobs_from_hidden", lambda: mr.replay_support_logprobs_from_hidden(
        H, W, M, bias=torch.zeros(7)), "bias must be [8]"),
    "padded values rank 2": ("support_logprobs_padded", lambda: mr.support_logprobs_padded(LP[None], M),
                             "values must be [nnz]"),
    "padded int values": ("support_logprobs_padded", lambda: mr.support_logprobs_padded(LP.long(), M),
                          "values must be a floating tensor"),
    "padded not a mask": ("support_logprobs_padded", lambda: mr.support_logprobs_padded(LP, "m"), "mask must be"),
    "entropy rank 1": ("support_entropy", lambda: mr.support_entropy(Z[0], M), "logits must be"),
    "entropy int": ("support_entropy", lambda: mr.support_entropy(Z.long(), M), "logits must be float"),
    "entropy rows": ("support_entropy", lambda: mr.support_entropy(Z[:2], M), "the mask has 3 rows"),
    "kl shapes": ("support_kl", lambda: mr.support_kl(Z, torch.randn(3, 9), M), "logits_q (3, 9)"),
    "kl int": ("support_kl", lambda: mr.support_kl(Z, Z.long(), M), "logits_q must be float"),
    "entropy head fp16": ("support_entropy_from_hidden", lambda: mr.support_entropy_from_hidden(H, W.half(), M),
                          "weight is torch.float16"),
    "kl head width": ("support_kl_from_hidden", lambda: mr.support_kl_from_hidden(H, W, H[:, :3], W, M),
                      "has d = "),
    "pg trainer rank 2": ("score_centered_pg", lambda: mr.score_centered_pg(LP[None], LP, M, 1.0),
                          "trainer_logprobs must be a floating tensor [nnz]"),
    "pg int trainer": ("score_centered_pg", lambda: mr.score_centered_pg(LP.long(), LP, M, 1.0),
                       "trainer_logprobs must be a floating tensor"),
    "pg rollout a list": ("score_centered_pg", lambda: mr.score_centered_pg(LP, [0.0] * 6, M, 1.0),
                          "rollout_logprobs must be"),
    "pg float sampled": ("score_centered_pg", lambda: mr.score_centered_pg(
        LP, LP, M, 1.0, sampled=torch.tensor([2.0, 1.0, 5.0])), "sampled must hold integer"),
    "pg advantages text": ("score_centered_pg", lambda: mr.score_centered_pg(LP, LP, M, "a"),
                           "advantages must be a number or a tensor"),
    "pg bool advantages": ("score_centered_pg", lambda: mr.score_centered_pg(
        LP, LP, M, torch.ones(3, dtype=torch.bool)), "advantages must hold numbers"),
    "pg advantages shape": ("score_centered_pg", lambda: mr.score_centered_pg(LP, LP, M, torch.ones(2, 2)),
                            "advantages must be a scalar or [3]"),
    "pg labels a list": ("score_centered_pg", lambda: mr.score_centered_pg(LP, LP, M, 1.0, labels=[1, 2, 3]),
                         "labels must be a tensor"),
    "pg float labels": ("score_centered_pg", lambda: mr.score_centered_pg(
        LP, LP, M, 1.0, labels=torch.tensor([1.0, 2.0, 3.0])), "labels must hold integer"),
    "pg labels count": ("score_centered_pg", lambda: mr.score_centered_pg(LP, LP, M, 1.0, labels=torch.tensor([1, 2])),
                        "the mask has 3 rows but the batch has 2"),
    "pg not a mask": ("score_centered_pg", lambda: mr.score_centered_pg(LP, LP, "m", 1.0), "mask must be"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_wrong_shape_or_dtype_is_one_error_naming_the_argument(case):
    op, call, words = BAD[case]
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    text = str(info.value)
    assert text.startswith(op) and words in text, text
    assert "\n" not in text


def test_non_contiguous_inputs_give_the_contiguous_result():
    zt = torch.randn(8, 3, generator=G).T  # a transposed view: strides (1, 3)
    torch.testing.assert_close(mr.replay_support_logprobs(zt, M), mr.replay_support_logprobs(zt.contiguous(), M))
    ht, wt = torch.randn(4, 3, generator=G).T, torch.randn(4, 8, generator=G).T
    torch.testing.assert_close(mr.replay_support_logprobs_from_hidden(ht, wt, M),
                               mr.replay_support_logprobs(ht @ wt.T, M))
    torch.testing.assert_close(mr.support_entropy(zt, M), mr.support_entropy(zt.contiguous(), M))
    strided = torch.stack([LP, LP * 0], 1)[:, 0]
    torch.testing.assert_close(mr.score_centered_pg(strided, LP, M, 1.0)[0], mr.score_centered_pg(LP, LP, M, 1.0)[0])


def test_empty_batches_give_empty_results():
    assert mr.replay_support_logprobs(torch.randn(0, 8), E).shape == (0,)
    assert mr.replay_support_logprobs_from_hidden(torch.randn(0, 4), W, E).shape == (0,)
    assert mr.support_entropy(torch.randn(0, 8), E).shape == (0,)
    loss, metrics = mr.score_centered_pg(torch.zeros(0), torch.zeros(0), E, 1.0)
    assert loss.shape == (0,) and all(float(v) == 0.0 for v in metrics.values())


# ---- a malformed mask, whichever op it reaches: one MaskFormatError naming the array (issue 30) -------
# Before, the compiled ops' wrappers raised a bare RuntimeError or NotImplementedError (a meta mask),
# the torch-op ones accepted int64 / float ids silently (float ids truncated) or failed inside torch
# ("stack expects each tensor to be equal size" for 2-D offsets), and score_centered_pg /
# support_logprobs_padded and the vocab-parallel ops, which checked no CSR (only ascending ids), failed
# with "repeats can not be negative".
def _ops_taking(m):
    lp = torch.zeros(max(m.token_ids.numel(), 0))
    return {
        "replay_logprobs": lambda: mr.replay_logprobs(Z, m, M.sampled),
        "replay_logprobs [B, T, V]": lambda: mr.replay_logprobs(Z[None], m, M.sampled[None]),
        "replay_logprobs_from_hidden": lambda: mr.replay_logprobs_from_hidden(H, W, m, M.sampled),
        "replay_logprobs_from_hidden sparse": lambda: mr.replay_logprobs_from_hidden(H, W, m, M.sampled,
                                                                                     sparse_grad=True),
        "kept_mass": lambda: mr.kept_mass(Z, m),
        "replay_support_logprobs": lambda: mr.replay_support_logprobs(Z, m),
        "replay_support_logprobs [B, T, V]": lambda: mr.replay_support_logprobs(
            Z[None], m, labels=torch.ones(1, 3, dtype=torch.long)),
        "replay_support_logprobs_from_hidden": lambda: mr.replay_support_logprobs_from_hidden(H, W, m),
        "support_logprobs_padded": lambda: mr.support_logprobs_padded(lp, m),
        "support_entropy": lambda: mr.support_entropy(Z, m),
        "support_kl": lambda: mr.support_kl(Z, Z, m),
        "support_entropy_from_hidden": lambda: mr.support_entropy_from_hidden(H, W, m),
        "support_kl_from_hidden": lambda: mr.support_kl_from_hidden(H, W, H, W, m),
        "score_centered_pg": lambda: mr.score_centered_pg(lp, lp, m, 1.0, sampled=M.sampled),
        # checked on each rank before the one collective: no process group is needed to see them
        "replay_logprobs_vocab_parallel": lambda: vp.replay_logprobs_vocab_parallel(Z, m, M.sampled, vocab_start=0),
        "replay_logprobs_vocab_parallel_from_hidden": lambda: vp.replay_logprobs_vocab_parallel_from_hidden(
            H, W, m, M.sampled, vocab_start=0),
        "replay_support_logprobs_vocab_parallel": lambda: vp.replay_support_logprobs_vocab_parallel(
            Z, m, vocab_start=0),
        "replay_support_logprobs_vocab_parallel_from_hidden": lambda: (
            vp.replay_support_logprobs_vocab_parallel_from_hidden(H, W, m, vocab_start=0)),
    }


MALFORMED = {
    "int64 ids": (lambda: SamplingMask(M.token_ids.long(), M.offsets), "token_ids must be a 1-D int32 tensor"),
    "int16 ids": (lambda: SamplingMask(M.token_ids.short(), M.offsets), "token_ids must be a 1-D int32 tensor"),
    "float ids": (lambda: SamplingMask(M.token_ids.float(), M.offsets), "token_ids must be a 1-D int32 tensor"),
    "2-D ids": (lambda: SamplingMask(M.token_ids[None], M.offsets), "token_ids must be a 1-D int32 tensor"),
    "int32 offsets": (lambda: SamplingMask(M.token_ids, M.offsets.int()), "offsets must be a 1-D int64 tensor"),
    "2-D offsets": (lambda: SamplingMask(M.token_ids, M.offsets[None]), "offsets must be a 1-D int64 tensor"),
    "no offsets": (lambda: SamplingMask(M.token_ids, M.offsets[:0]), "offsets must be a 1-D int64 tensor"),
    "meta mask": (lambda: M.to("meta"), "token_ids is a meta tensor"),
}


@pytest.mark.parametrize("defect", sorted(MALFORMED))
@pytest.mark.parametrize("op", sorted(_ops_taking(M)))
def test_a_malformed_mask_is_one_error_naming_the_array_in_every_op(op, defect):
    make, words = MALFORMED[defect]
    with pytest.raises(mr.MaskFormatError) as info:
        _ops_taking(make())[op]()
    text = str(info.value)
    assert text.startswith(op.split(" ")[0] + ": ") and words in text and "\n" not in text, text


@pytest.mark.parametrize("offsets, words", [
    ([0, -2, 5, 6], "offsets decrease at row 0 (0 -> -2)"),
    ([0, 4, 2, 6], "offsets decrease at row 1 (4 -> 2)"),
    ([1, 2, 5, 6], "offsets[0] must be 0, got 1"),
    ([0, 2, 5, 2 ** 62], "offsets[-1] = 4611686018427387904 but token_ids has 6 entries"),
])
@pytest.mark.parametrize("op", ["support_logprobs_padded", "score_centered_pg", "replay_logprobs_vocab_parallel",
                                "replay_support_logprobs_vocab_parallel_from_hidden"])
def test_the_ops_without_the_whole_vocabulary_check_the_csr_too(op, offsets, words):
    m = SamplingMask(M.token_ids, torch.tensor(offsets))
    with pytest.raises(mr.MaskFormatError, match=f"^{op}: " + words.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        _ops_taking(m)[op]()
    neg = SamplingMask(torch.tensor([0, 2, -1, 3, 4, 5], dtype=torch.int32), M.offsets)  # no vocabulary here
    with pytest.raises(mr.MaskFormatError, match=f"^{op}: token_ids of row 1 hold a negative id"):
        _ops_taking(neg)[op]()


@pytest.mark.parametrize("case", ["logits", "hidden", "values", "trainer_logprobs", "rollout_logprobs", "advantages"])
def test_meta_inputs_are_refused_by_the_ops_that_read_values(case):
    meta = lambda t: t.to("meta")  # noqa: E731
    call = {
        "logits": lambda: mr.replay_support_logprobs(meta(Z), M),
        "hidden": lambda: mr.support_entropy_from_hidden(meta(H), meta(W), M),
        "values": lambda: mr.support_logprobs_padded(meta(LP), M),
        "trainer_logprobs": lambda: mr.score_centered_pg(meta(LP), LP, M, 1.0),
        "rollout_logprobs": lambda: mr.score_centered_pg(LP, meta(LP), M, 1.0),
        "advantages": lambda: mr.score_centered_pg(LP, LP, M, meta(torch.ones(3))),
    }[case]
    with pytest.raises(ValueError, match="meta tensor"):
        call()


@pytest.mark.parametrize("call, error, words", [
    (lambda: mr.replay_logprobs_from_hidden(H, W, M, bias=[0.0] * 8), TypeError, "bias must be a tensor"),
    (lambda: mr.replay_logprobs_from_hidden(H, W, M, bias=[0.0] * 8, sparse_grad=True), TypeError,
     "replay_logprobs_from_hidden: bias must be a tensor"),
    (lambda: mr.replay_support_logprobs_from_hidden(H, W, M, bias=[0.0] * 8), TypeError,
     "replay_support_logprobs_from_hidden: bias must be a tensor"),
    (lambda: mr.support_entropy_from_hidden(H, W, M, bias=[0.0] * 8), TypeError, "bias must be a tensor"),
    (lambda: mr.support_kl_from_hidden(H, W, H, [[0.0]], M), ValueError,
     "support_kl_from_hidden (reference): weight must be a 2-D tensor"),
    (lambda: mr.support_kl_from_hidden([[0.0]], W, H, W, M), ValueError,
     "support_kl_from_hidden (policy): hidden must be a 2-D tensor"),
    (lambda: mr.support_logprobs_padded(LP, M, labels=[1, 2, 3]), TypeError,
     "support_logprobs_padded: labels must be a tensor, got list"),
    (lambda: mr.support_logprobs_padded(LP, M, loss_mask=[1, 1, 1]), TypeError,
     "support_logprobs_padded: loss_mask must be a tensor, got list"),
    (lambda: mr.support_logprobs_padded(LP, M, fill="x"), TypeError, "support_logprobs_padded: fill must be a number"),
    (lambda: mr.support_logprobs_padded(LP, M, width=2 ** 40), ValueError,
     "support_logprobs_padded: width 1099511627776 needs a [3, 1099511627776] output"),
    (lambda: mr.support_logprobs_padded(LP, M, labels=torch.tensor([[2, 1, 5]]), ignore_index="x"), ValueError,
     "ignore_index must be an integer label id, got 'x'"),
    (lambda: mr.replay_logprobs(Z[None], M, torch.tensor([[2, 1, 5]]), ignore_index="x"), ValueError,
     "ignore_index must be an integer label id, got 'x'"),
    (lambda: mr.score_centered_pg(LP, LP, M, torch.ones(3), labels=torch.tensor([[2, 1, 5]]), ignore_index=1.5),
     ValueError, "score_centered_pg: ignore_index must be an integer label id, got 1.5"),
    # the mask's own sampled is short: named as the mask's defect, not as "3 rows but 3 rows of logits"
    (lambda: mr.replay_logprobs(Z, SamplingMask(M.token_ids, M.offsets, M.sampled[:2])), ValueError,
     "mask.sampled has shape (2,) but the mask has 3 rows"),
    (lambda: mr.replay_logprobs_from_hidden(H, W, SamplingMask(M.token_ids, M.offsets, M.sampled[:2])), ValueError,
     "mask.sampled has shape (2,) but the mask has 3 rows"),
])
def test_arguments_of_the_wrong_type_are_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value), str(info.value)


def test_int32_sampled_ids_give_the_int64_result():
    s32 = M.sampled.int()
    torch.testing.assert_close(mr.replay_logprobs(Z, M, s32), mr.replay_logprobs(Z, M, M.sampled))
    torch.testing.assert_close(mr.replay_logprobs_from_hidden(H, W, M, s32, sparse_grad=True),
                               mr.replay_logprobs_from_hidden(H, W, M, M.sampled))
    torch.testing.assert_close(mr.score_centered_pg(LP, LP * 0.5, M, 1.0, sampled=s32)[0],
                               mr.score_centered_pg(LP, LP * 0.5, M, 1.0)[0])
