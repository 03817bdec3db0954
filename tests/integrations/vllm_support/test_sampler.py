"""The engine half (integrations/vllm_support/sampler.py) on a sampler shaped like vLLM 0.32's V1 Sampler
(fakes.py): the widened ids hold, after vLLM's own columns, blocks whose rows are exactly the finite
processed log-probs of each row (the greedy rows: the sampled id); steps vLLM answers without top-N
log-probs carry nothing; the start-up refusals; and the class is left as found by undo()."""
import math

import pytest
import torch

from mask_replay.integrations.vllm_support import _patching, sampler, wire
from tests.integrations.vllm_support.fakes import SAMPLING_EPS, SamplingMetadata, sampler_class


@pytest.fixture
def patched():
    cls = sampler_class()
    sampler.install_v1(cls, sampling_eps=SAMPLING_EPS, current_config=lambda: None)
    yield cls
    _patching.undo()


def run(cls, logits, md, mode="processed_logprobs"):
    return cls(logprobs_mode=mode).forward(logits, md)


def metadata(rows, *, temperature=None, top_k=None, top_p=None, n=0, greedy=None):
    t = torch.full((rows,), 0.8) if temperature is None else torch.tensor(temperature)
    all_greedy = bool((t < SAMPLING_EPS).all())
    all_random = bool((t >= SAMPLING_EPS).all())
    return SamplingMetadata(temperature=t, all_greedy=all_greedy, all_random=all_random,
                            top_k=None if top_k is None else torch.tensor(top_k),
                            top_p=None if top_p is None else torch.tensor(top_p), max_num_logprobs=n)


def expected_rows(cls, logits, md):
    """The reference: the fake's own processed log-probs, computed again without the plugin."""
    plain = cls.__dict__["sample"].__mask_replay_wraps__
    sampled, processed = plain(cls(logprobs_mode="processed_logprobs"), logits.float(), md)
    greedy = md.temperature < SAMPLING_EPS
    return [[int(sampled[r])] if greedy[r] else torch.nonzero(torch.isfinite(processed[r]))[:, 0].tolist()
            for r in range(len(sampled))], sampled


def test_blocks_follow_vllms_columns_and_equal_the_finite_entries(patched):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 3
    md = metadata(4, temperature=[0.8, 1.0, 0.0, 1.3], top_k=[5, 300, 300, 300], top_p=[1.0, 0.9, 1.0, 0.999], n=2)
    out = run(patched, logits, md)
    ids, lps = out.logprobs_tensors.logprob_token_ids, out.logprobs_tensors.logprobs
    assert ids.dtype == torch.int32 and lps.shape == (4, 3) and ids.shape[1] > 3
    assert torch.equal(ids[:, 0], out.sampled_token_ids[:, 0])  # vLLM's own columns untouched
    rows, sampled = expected_rows(patched, logits, md)
    assert [r.tolist() for r in wire.decode(ids[:, 3:].numpy())] == rows
    assert len(rows[0]) == 5 and rows[2] == [int(sampled[2])]


def test_all_greedy_batches_record_the_sampled_token(patched):
    logits = torch.randn(3, 50)
    out = run(patched, logits, metadata(3, temperature=[0.0, 0.0, 0.0]))
    blocks = out.logprobs_tensors.logprob_token_ids[:, 1:].numpy()
    assert [r.tolist() for r in wire.decode(blocks)] == [[int(i)] for i in logits.argmax(-1)]


@pytest.mark.parametrize("n, why", [(None, "no log-probs asked"), (-1, "the whole tensor returned")])
def test_steps_without_top_n_logprobs_carry_no_blocks(patched, n, why):
    md = metadata(2, n=0)
    md.max_num_logprobs = n
    out = run(patched, torch.randn(2, 40), md)
    plain = patched.__dict__["forward"].__mask_replay_wraps__(patched(logprobs_mode="processed_logprobs"),
                                                               torch.randn(2, 40), md)
    if n is None:
        assert out.logprobs_tensors is None and plain.logprobs_tensors is None
    else:
        assert out.logprobs_tensors.logprob_token_ids.numel() == 0, why


def test_scoring_requests_carry_no_blocks(patched):
    md = metadata(2, n=0)
    md.logprob_token_ids = {0: [1, 2]}
    assert run(patched, torch.randn(2, 40), md).logprobs_tensors.logprob_token_ids.shape == (2, 1)


def test_the_processed_tensor_is_not_kept_after_the_step(patched):
    s = patched(logprobs_mode="processed_logprobs")
    s.forward(torch.randn(2, 40), metadata(2))
    assert getattr(s, sampler._STEP) is None


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_modes_are_refused_at_construction(patched, mode):
    with pytest.raises(sampler.SupportRefused, match="logprobs_mode='processed_logprobs'"):
        patched(logprobs_mode=mode)


def test_processed_logits_mode_is_accepted(patched):
    out = run(patched, torch.randn(2, 30), metadata(2, top_k=[3, 3]), mode="processed_logits")
    assert all(len(r) == 3 for r in wire.decode(out.logprobs_tensors.logprob_token_ids[:, 1:].numpy()))


def test_speculative_decoding_is_refused_at_construction():
    cls = sampler_class()
    sampler.install_v1(cls, sampling_eps=SAMPLING_EPS,
                       current_config=lambda: type("Config", (), {"speculative_config": object()})())
    try:
        with pytest.raises(sampler.SupportRefused, match="speculative"):
            cls(logprobs_mode="processed_logprobs")
    finally:
        _patching.undo()


def test_model_runner_v2_is_refused_with_the_fix():
    class V2Sampler:
        def __init__(self, *args):
            pass

    sampler.refuse_v2(V2Sampler)
    try:
        with pytest.raises(sampler.SupportRefused, match="VLLM_USE_V2_MODEL_RUNNER=0"):
            V2Sampler()
    finally:
        _patching.undo()
    V2Sampler()  # undone


def test_undo_leaves_the_class_as_found():
    cls = sampler_class()
    before = dict(vars(cls))
    sampler.install_v1(cls, sampling_eps=SAMPLING_EPS, current_config=lambda: None)
    assert _patching.is_wrapped(cls, "forward")
    _patching.undo()
    assert dict(vars(cls)) == before
    out = cls(logprobs_mode="raw_logprobs").forward(torch.randn(2, 20), metadata(2, n=1))
    assert out.logprobs_tensors.logprob_token_ids.shape == (2, 2)


def test_mixed_batch_greedy_rows_use_vllms_epsilon():
    assert sampler.greedy_rows(metadata(3, temperature=[0.0, 1e-6, 0.5]), 3, SAMPLING_EPS).tolist() == \
        [True, True, False]
    assert sampler.greedy_rows(metadata(2, temperature=[0.7, 0.7]), 2, SAMPLING_EPS) is None
    assert not math.isnan(SAMPLING_EPS)
