"""Replay in verl 0.9.1's FSDP engine, with the real verl (skipped without it; `make check-verl` runs it).

verl's own code runs here: DataProto (reorder, chunk, to_tensordict), left_right_2_no_padding,
prepare_micro_batches (fixed and dynamic batch size), FSDPEngineWithLMHead.prepare_model_inputs /
prepare_model_outputs (rmpad packing, static pad, no-rmpad path), logprobs_from_logits,
no_padding_2_padding, EngineRegistry.new. Stand-ins: the engine is built without __init__ (no FSDP
wrapping, no model load) and the model is verl_helpers.ToyLM (logits from token and position id).
"""
import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is installed by `make venv-verl`")

import os  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import verl  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import reduce_metrics  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches  # noqa: E402

from mask_replay.errors import InputError, OutsideSupportError  # noqa: E402
from mask_replay.integrations.verl import trainer  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402
from tests.helpers import torchrun  # noqa: E402
from tests.integrations.verl import verl_helpers as h  # noqa: E402

SP_WORKER = os.path.join(os.path.dirname(__file__), "verl_sp_worker.py")
PROMPTS, RESPONSES = [3, 1, 4, 2, 5, 2], [5, 2, 6, 1, 3, 4]
T = 0.7


@pytest.fixture
def replay():
    trainer.install()
    yield
    trainer.uninstall()


def micro_batches(data, **non_tensor):
    kw = non_tensor or {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2}
    return prepare_micro_batches(h.to_engine_batch(data, T, **kw))[0]


def response_mask(mb):
    return mb["attention_mask"][:, mb["prompts"].shape[1]:].bool()


@pytest.mark.parametrize("bucket", [0, 16])
def test_logprobs_and_gradients_match_float64_reference(replay, bucket):
    # bucket 16: verl's static pad (pad_to_length) at the tail of the packed sequence
    e, model = h.engine(pad_to_length_bucket=bucket), h.ToyLM(1)
    for k, mb in enumerate(micro_batches(h.make_batch(0, PROMPTS, RESPONSES))):
        w = torch.randn(mb["responses"].shape, generator=torch.Generator().manual_seed(k)) * response_mask(mb)
        lp = h.response_logprobs(e, model, mb)
        ref = h.reference(model, mb, T)
        torch.testing.assert_close(lp.double(), ref.detach(), atol=2e-6, rtol=0)
        model.zero_grad()
        (w * lp).sum().backward()
        got = [model.E.grad.clone(), model.P.grad.clone()]
        model.zero_grad()
        (w.double() * h.reference(model, mb, T)).sum().backward()
        for g, r in zip(got, [model.E.grad, model.P.grad]):
            torch.testing.assert_close(g, r, atol=2e-6, rtol=0)
        # the replayed values are not verl's full-vocabulary ones (the check above could not pass by accident)
        assert (ref - h.reference(model, mb, T, replay=False)).abs().max() > 0.1


def test_without_remove_padding(replay):
    # verl's use_remove_padding=False path: padded [B, S, V] logits, unpadded packed labels
    e, model = h.engine(), h.ToyLM(2)
    for mb in micro_batches(h.make_batch(1, PROMPTS, RESPONSES)):
        tu.assign_non_tensor(mb, use_remove_padding=False)
        lp = h.response_logprobs(e, model, mb)
        torch.testing.assert_close(lp.double(), h.reference(model, mb, T).detach(), atol=2e-6, rtol=0)


def test_unrecorded_and_whole_vocabulary_rows_keep_verls_value_bit_for_bit():
    data = h.make_batch(3, PROMPTS, RESPONSES, whole_rows={(0, 0), (2, 5), (4, 1)}, empty_rows={(1, 1), (2, 0)})
    e, model = h.engine(), h.ToyLM(3)
    off = [h.response_logprobs(e, model, mb) for mb in micro_batches(data)]
    trainer.install()
    try:
        on = [h.response_logprobs(e, model, mb) for mb in micro_batches(data)]
    finally:
        trainer.uninstall()
    # micro-batches of 2: sample 0 -> (0, 0), sample 1 -> (0, 1), sample 2 -> (1, 0), sample 4 -> (2, 0)
    for (mb, row), positions in {(0, 0): [0], (0, 1): [1], (1, 0): [5, 0], (2, 0): [1]}.items():
        for j in positions:
            assert torch.equal(on[mb][row, j], off[mb][row, j])
    assert not torch.equal(on[0][0, 1:], off[0][0, 1:])  # the recorded rows next to them are replayed


def test_off_leaves_verl_unchanged():
    cls = transformer_impl.FSDPEngineWithLMHead
    original = (transformer_impl.logprobs_from_logits, cls.prepare_model_outputs, cls.forward_step,
                EngineRegistry.__dict__["new"])
    data = h.make_batch(4, PROMPTS, RESPONSES)
    e, model = h.engine(), h.ToyLM(4)
    before = [h.response_logprobs(e, model, mb) for mb in micro_batches(data)]
    trainer.install()
    assert transformer_impl.logprobs_from_logits is not original[0]
    trainer.uninstall()
    assert (transformer_impl.logprobs_from_logits, cls.prepare_model_outputs, cls.forward_step,
            EngineRegistry.__dict__["new"]) == original
    after = [h.response_logprobs(e, model, mb) for mb in micro_batches(data)]
    for b, a, mb in zip(before, after, micro_batches(data)):
        assert torch.equal(b, a)
        torch.testing.assert_close(b.double(), h.reference(model, mb, T, replay=False).detach(), atol=2e-6, rtol=0)


def test_replay_metrics_reach_verls_metric_reduction(replay, monkeypatch):
    # verl's own forward_step (device lookups stood in for the CPU: verl's get_device_id asks CUDA), then
    # verl's postprocess_batch_func and reduce_metrics, as TrainingWorker and ray_trainer run them
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    data = h.make_batch(8, PROMPTS, RESPONSES, whole_rows={(0, 2)}, empty_rows={(3, 0)})
    td = h.to_engine_batch(data, T, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    mbs, indices = prepare_micro_batches(td)
    e = h.engine()
    e.module, e._autocast_dtype = h.ToyLM(8), torch.float32
    outputs = [e.forward_step(mb, loss_function=None, forward_only=True)[1] for mb in mbs]
    for out, mb in zip(outputs, mbs):
        kept, size = h.kept_and_sizes(e.module, mb, T)
        assert out["metrics"][trainer.KEPT_MASS] == pytest.approx(kept, abs=1e-5)
        assert out["metrics"][trainer.SUPPORT_SIZE] == pytest.approx(size, abs=1e-12)
    reduced = reduce_metrics(postprocess_batch_func(outputs, indices, td)["metrics"])
    expected = [h.kept_and_sizes(e.module, mb, T) for mb in mbs]
    assert reduced[trainer.KEPT_MASS] == pytest.approx(np.mean([k for k, _ in expected]), abs=1e-5)
    assert reduced[trainer.SUPPORT_SIZE] == pytest.approx(np.mean([s for _, s in expected]), abs=1e-12)
    assert 0 < reduced[trainer.KEPT_MASS] < 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_supports_follow_their_samples_through_verls_data_path(replay, dynamic):
    # verl's shuffle (DataProto.reorder, as _balance_batch), dispatch split (chunk per DP rank) and
    # micro-batching (fixed, or dynamic: samples regrouped by token count) move each sample's support with it
    data = h.make_batch(5, PROMPTS * 2, RESPONSES[::-1] * 2)
    e, model = h.engine(), h.ToyLM(5)
    whole = micro_batches(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(data))[0]
    expected = dict(zip(tu.get(whole, "uid"), h.reference(model, whole, T).detach()))
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    data.reorder(perm)
    kw = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 20} if dynamic else \
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 3}
    seen = []
    for rank_data in data.chunk(2):
        for mb in micro_batches(rank_data, **kw):
            lp = h.response_logprobs(e, model, mb)
            for uid, row, m in zip(tu.get(mb, "uid"), lp, response_mask(mb)):
                n = int(m.sum())
                torch.testing.assert_close(row[:n].double(), expected[uid][:n], atol=2e-6, rtol=0)
                seen.append(uid)
    assert sorted(seen) == sorted(expected)


def test_support_not_matching_its_response_is_one_error_naming_sample_and_position(replay):
    data = h.make_batch(6, PROMPTS, RESPONSES)
    s = data.non_tensor_batch[SUPPORT_KEY][2]
    data.non_tensor_batch[SUPPORT_KEY][2] = {"token_ids": s["token_ids"][:s["offsets"][4]], "offsets": s["offsets"][:5]}
    mb = micro_batches(data)[1]  # samples 2 and 3: sample 2 is row 0 of this micro-batch
    with pytest.raises(InputError, match=r"sample 0: the support has 4 rows but the response has 6 tokens "
                                         r"\(response position 4"):
        h.response_logprobs(h.engine(), h.ToyLM(6), mb)
    y = int(data.batch["responses"][2, 1])
    data.non_tensor_batch[SUPPORT_KEY][2] = {"token_ids": np.array([(y + 1) % h.V] * 6, dtype=np.int32),
                                             "offsets": np.arange(7, dtype=np.int64)}
    data.non_tensor_batch[SUPPORT_KEY][2]["token_ids"][0] = int(data.batch["responses"][2, 0])
    with pytest.raises(OutsideSupportError, match=f"sample 0, response position 1: token {y} is not in"):
        h.response_logprobs(h.engine(), h.ToyLM(6), micro_batches(data)[1])


def test_batch_without_supports_is_refused_when_on(replay):
    data = h.make_batch(7, PROMPTS, RESPONSES)
    data.non_tensor_batch.pop(SUPPORT_KEY)
    with pytest.raises(InputError, match="the batch carries no 'sampling_support'"):
        h.response_logprobs(h.engine(), h.ToyLM(7), micro_batches(data)[0])


def test_configurations_not_built_are_refused_at_start_up(replay):
    with pytest.raises(NotImplementedError, match="engine backend 'megatron' is not supported yet"):
        EngineRegistry.new(model_type="language_model", backend="megatron")
    fused = type("Cfg", (), {"use_fused_kernels": True})()
    with pytest.raises(NotImplementedError, match="use_fused_kernels=True is not supported yet"):
        EngineRegistry.new(model_type="language_model", backend="fsdp2", engine_config=fused)


def test_install_checks_the_verl_version(monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.9.0")
    with pytest.raises(ImportError, match="tested against verl 0.9.1, found verl 0.9.0"):
        trainer.install()
    assert not trainer.installed()


@pytest.mark.slow  # torchrun, two ranks importing verl
@pytest.mark.parametrize("bucket", [0, 16])
def test_sequence_parallel_two_ranks(tmp_path, bucket):
    proc = torchrun(2, SP_WORKER, str(bucket), timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        assert f"rank {rank}: ok" in proc.stdout, proc.stdout[-3000:]
