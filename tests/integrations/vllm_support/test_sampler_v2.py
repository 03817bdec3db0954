"""The engine half on Model Runner V2 (integrations/vllm_support/sampler_v2.py) on samplers shaped like vLLM
0.34's `Sampler` and `CPUSampler` (fakes.py): per-request mixed settings in one batch give one block row per
request, each exactly the finite entries of the processed logits the token was drawn from (greedy rows: the
sampled id); vLLM's own columns, tokens and log-probs are untouched; steps without log-probs (and the fused
draw, which vLLM takes only then) carry nothing; the start-up refusals; undo() leaves the classes as found."""
import numpy as np
import pytest
import torch

from mask_replay.integrations.vllm_support import _patching, sampler, sampler_v2, wire
from tests.integrations.vllm_support.fakes import InputBatch, SamplingParams, v2_sampler_class

VOCAB = 40
MIXED = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.6, seed=7),
    SamplingParams(temperature=1.3, min_p=0.2, presence_penalty=1.5),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05, logprobs=3),
    SamplingParams(temperature=1.0),
]


@pytest.fixture(params=[False, True], ids=["Sampler", "CPUSampler"])
def patched(request):
    cls = v2_sampler_class(cpu=request.param)
    sampler_v2.install(cls, current_config=lambda: None)
    yield cls
    _patching.undo()


def engine(cls, params, mode="processed_logprobs", **kwargs):
    s = cls(None, 16, VOCAB, "cpu", None, logprobs_mode=mode, **kwargs)
    slots = np.arange(len(params)) * 2 + 1  # slots are not batch rows
    for slot, p in zip(slots, params):
        s.add_request(int(slot), p)
    return s, InputBatch(slots, [[3, 4, 4]] * len(params))


def plain_step(cls, s, logits, batch):
    """The sampler without the plugin: vLLM's own output and processed logits of the same step (the fake
    draws with per-row seeded generators, so the same step again draws the same tokens)."""
    out = cls.__dict__["__call__"].__mask_replay_wraps__(s, logits, batch)
    _, processed = cls.__dict__["sample"].__mask_replay_wraps__(
        s, logits, batch.expanded_idx_mapping, batch.idx_mapping, batch.idx_mapping_np, None, None, None, None,
        return_logprobs=True)
    return out, processed


def test_each_row_is_the_finite_processed_entries_and_vllms_columns_stay(patched):
    s, batch = engine(patched, MIXED)
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(3))
    out = s(logits, batch)
    plain, processed = plain_step(patched, s, logits, batch)
    assert torch.equal(out.sampled_token_ids, plain.sampled_token_ids)
    width = plain.logprobs_tensors.logprobs.shape[1]
    ids = out.logprobs_tensors.logprob_token_ids
    assert ids.dtype == torch.int64 and torch.equal(ids[:, :width], plain.logprobs_tensors.logprob_token_ids)
    assert ids.shape[1] == width + -(-(wire.HEADER + wire.bitmask_words(VOCAB)) // 2)  # two words a column
    assert torch.equal(out.logprobs_tensors.logprobs, plain.logprobs_tensors.logprobs)
    rows = wire.decode(ids[:, width:].numpy())
    assert len(rows) == len(MIXED)
    for r, (p, row) in enumerate(zip(MIXED, rows)):
        sampled = int(out.sampled_token_ids[r, 0])
        if p.temperature == 0:
            assert row.tolist() == [sampled]
        else:
            assert row.tolist() == torch.nonzero(torch.isfinite(processed[r]))[:, 0].tolist()
            assert sampled in row.tolist()
    assert [len(r) for r in rows[:1]] == [5]  # top_k 5


def test_rows_follow_every_setting_alone(patched):
    for p in MIXED:
        s, batch = engine(patched, [p])
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(11))
        out = s(logits, batch)
        _, processed = plain_step(patched, s, logits, batch)
        row = wire.decode(out.logprobs_tensors.logprob_token_ids[:, 1 + max(p.logprobs, 0):].numpy())[0]
        want = [int(out.sampled_token_ids[0, 0])] if p.temperature == 0 else \
            torch.nonzero(torch.isfinite(processed[0]))[:, 0].tolist()
        assert row.tolist() == want, p


def test_untouched_logits_give_the_whole_vocabulary(patched):
    s, batch = engine(patched, [SamplingParams(), SamplingParams(temperature=0.0)])
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    out = s(logits, batch)
    rows = wire.decode(out.logprobs_tensors.logprob_token_ids[:, 1:].numpy())
    assert rows[0].tolist() == list(range(VOCAB))
    assert rows[1].tolist() == [int(out.sampled_token_ids[1, 0])]


def test_all_logprobs_steps_carry_blocks_too(patched):
    params = [SamplingParams(temperature=0.8, top_k=7, logprobs=-1)]
    s, batch = engine(patched, params)
    out = s(torch.randn(1, VOCAB), batch)
    assert out.logprobs_tensors.logprobs.shape == (1, VOCAB + 1)
    assert len(wire.decode(out.logprobs_tensors.logprob_token_ids[:, VOCAB + 1:].numpy())[0]) == 7


def test_steps_without_logprobs_carry_nothing(patched):
    s, batch = engine(patched, [SamplingParams(top_k=5, logprobs=None)] * 2)
    out = s(torch.randn(2, VOCAB), batch)
    assert out.logprobs_tensors is None
    assert getattr(s, sampler_v2._STEP) is None  # the [B, V] tensor is not kept past the step


def test_the_fused_draw_is_taken_only_without_processed_logprobs():
    cls = v2_sampler_class(fused=True)
    sampler_v2.install(cls, current_config=lambda: None)
    try:
        s, batch = engine(cls, [SamplingParams(top_k=5, logprobs=None)])
        out = s(torch.randn(1, VOCAB), batch)  # fused: top-k not on the tensor, and no log-probs to widen
        assert out.logprobs_tensors is None
        s, batch = engine(cls, [SamplingParams(top_k=5, logprobs=0)])
        out = s(torch.randn(1, VOCAB), batch)  # processed log-probs asked: vLLM's unfused path
        assert len(wire.decode(out.logprobs_tensors.logprob_token_ids[:, 1:].numpy())[0]) == 5
    finally:
        _patching.undo()


def test_seeded_requests_draw_the_same_tokens_with_the_plugin(patched):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=5)] * 3
    logits = torch.randn(3, VOCAB)
    s, batch = engine(patched, params)
    with_plugin = s(logits, batch).sampled_token_ids
    plain, _ = plain_step(patched, s, logits, batch)
    assert torch.equal(with_plugin, plain.sampled_token_ids)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_modes_are_refused_at_construction(patched, mode):
    with pytest.raises(sampler.SupportRefused, match="logprobs_mode='processed_logprobs'"):
        engine(patched, [], mode=mode)


def config(**fields):
    model = type("ModelConfig", (), {"logits_processors": fields.pop("logits_processors", None)})()
    return type("VllmConfig", (), {"speculative_config": None, "watermark_config": None, "model_config": model,
                                   **fields})()


@pytest.mark.parametrize("cfg, kwargs, match", [
    (config(speculative_config=object()), {}, "speculative_config"),
    (config(watermark_config=object()), {}, "without watermark_config"),
    (config(logits_processors=["my_pkg:Bias"]), {}, r"custom logits processors \(my_pkg:Bias\)"),
    (config(), {"custom_logits_processors": [type("Bias", (), {})()]}, r"custom logits processors \(Bias\)"),
    (config(), {"enable_trace_replay": True}, "enable_trace_replay=False"),
])
def test_start_up_refusals_name_the_setting(cfg, kwargs, match):
    cls = v2_sampler_class()
    sampler_v2.install(cls, current_config=lambda: None)
    try:
        with pytest.raises(sampler.SupportRefused, match=match):
            cls(cfg, 4, VOCAB, "cpu", None, logprobs_mode="processed_logprobs", **kwargs)
        cls(config(), 4, VOCAB, "cpu", None, logprobs_mode="processed_logprobs")  # the plain config passes
    finally:
        _patching.undo()


def test_the_current_config_is_read_when_none_is_passed():
    cls = v2_sampler_class()
    sampler_v2.install(cls, current_config=lambda: config(speculative_config=object()))
    try:
        with pytest.raises(sampler.SupportRefused, match="speculative"):
            cls(None, 4, VOCAB, "cpu", None, logprobs_mode="processed_logprobs")
    finally:
        _patching.undo()


@pytest.mark.parametrize("cpu", [False, True])
def test_undo_leaves_the_class_as_found(cpu):
    cls = v2_sampler_class(cpu=cpu)
    before = dict(vars(cls))
    sampler_v2.install(cls, current_config=lambda: None)
    sampler_v2.install(cls, current_config=lambda: None)  # idempotent
    assert {name for _, name in _patching.installed()} == {"__init__", "sample", "__call__"}
    assert len(_patching.installed()) == 3
    _patching.undo()
    assert dict(vars(cls)) == before
    s, batch = engine(cls, [SamplingParams(top_k=5)], mode="raw_logprobs")
    assert s(torch.randn(1, VOCAB), batch).logprobs_tensors.logprob_token_ids.shape == (1, 1)


def test_greedy_rows_read_both_state_layouts():
    for cpu in (False, True):
        s, batch = engine(v2_sampler_class(cpu=cpu), [SamplingParams(temperature=0.0), SamplingParams()],
                          mode="processed_logprobs")
        greedy = sampler_v2.greedy_rows(s.sampling_states, batch.expanded_idx_mapping, batch.idx_mapping_np)
        assert greedy.tolist() == [True, False]
        s, batch = engine(v2_sampler_class(cpu=cpu), [SamplingParams()] * 2)
        assert sampler_v2.greedy_rows(s.sampling_states, batch.expanded_idx_mapping, batch.idx_mapping_np) is None


@pytest.mark.parametrize("version, reads", [("0.29.1", False), ("0.30.0", True), ("0.33.2", True), ("0.34.0", True),
                                            ("0.35.0", False)])
def test_the_read_releases(version, reads):
    assert sampler_v2.reads(version) is reads
