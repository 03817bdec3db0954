"""The trainer's support ops (replay_support_logprobs*, support_logprobs_padded, support_entropy / kl
and their _from_hidden forms, score_centered_pg) under wrong shapes and dtypes (issue 30): each is
one ValueError / TypeError that starts with the op's name and names the argument, never a crash or a
bare torch error; and the inputs that are valid however odd (non-contiguous, empty) give the
contiguous / reference result."""
import pytest
import torch

import mask_replay as mr
from mask_replay import SamplingMask

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
