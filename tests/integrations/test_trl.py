"""ReplayGRPOTrainer on a tiny random Llama with real trl 1.16 (installed by `make test`, the [trl] extra):
log-probs against a float64 dense reference, identity with GRPOTrainer when nothing is cut, supports
through TRL's shuffle/split, and the errors."""
import importlib

import pytest
import torch
import trl
from trl import GRPOTrainer

import mask_replay.integrations.trl.trainer as replay_trl
from mask_replay.errors import InputError
from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer
from tests.helpers import hidden_ref
from tests.integrations.trl_helpers import V, grpo_args, prompts, reward_len, tiny_model, tiny_tokenizer

TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def make(cls, tmp_path, n=8, model=None, **kw):
    return cls(model=model if model is not None else tiny_model(), reward_funcs=reward_len,
               args=grpo_args(tmp_path, **kw), train_dataset=prompts(n), processing_class=tiny_tokenizer())


def generated_batch(trainer):
    """One generation batch as _prepare_inputs buffers it (shuffled, split)."""
    trainer.model.train()
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def completion_tokens(batch):
    ids, cmask = batch["completion_ids"], batch["completion_mask"]
    return [ids[b, :int(cmask[b].sum())] for b in range(ids.shape[0])]


def override_logps(trainer, batch):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    trainer._replay_active = batch[INDEX_KEY]
    try:
        lp, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention, batch["completion_ids"].shape[1], compute_entropy=True)
    finally:
        trainer._replay_active = None
    return lp, entropy, input_ids, attention


def test_logps_equal_dense_float64_reference_with_gradients(tmp_path):
    T = 0.7
    trainer = make(ReplayGRPOTrainer, tmp_path, temperature=T, top_k=6, top_p=0.9, min_p=0.02)
    batch = generated_batch(trainer)
    model = trainer.model
    lp, entropy, input_ids, attention = override_logps(trainer, batch)
    k = batch["completion_ids"].shape[1]

    # the reference: dense float64 logits of every completion position, log-softmax over the support
    masks = [trainer._replay_masks[i] for i in batch[INDEX_KEY].tolist()]
    assert all(int(m.lengths().max()) < V for m in masks)  # truncation happened: replay has work to do
    weight = model.lm_head.weight
    hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1][:, -k:]
    ref = torch.zeros(lp.shape, dtype=torch.float64)
    for b, m in enumerate(masks):
        n = m.num_rows
        y = input_ids[b, -k:][:n]
        assert torch.equal(m.sampled.cpu(), y)  # the mask belongs to this completion
        ref[b, :n] = hidden_ref(hidden[b, :n], weight, None, m.to_dense(V), y, T)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    # entropy: exactly TRL's (the override passes it through)
    _, trl_entropy, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, model, input_ids, attention, k, compute_entropy=True)
    assert torch.equal(entropy, trl_entropy)

    weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
    params = [weight, model.model.layers[0].mlp.down_proj.weight]
    got = torch.autograd.grad((lp * weights).sum(), params)
    want = torch.autograd.grad((ref * weights.double()).sum(), params)
    for g, w in zip(got, want):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, w.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # seconds: kept out of the fast loop, run by make test
def test_no_truncation_is_plain_grpo_bit_for_bit(tmp_path):
    kw = dict(top_p=1.0, top_k=0, min_p=None, max_steps=2)
    histories = []
    for cls in (GRPOTrainer, ReplayGRPOTrainer):
        trainer = make(cls, tmp_path / cls.__name__, **kw)
        trainer.train()
        histories.append(trainer.state.log_history)
    plain, replay = histories
    assert len(plain) == len(replay) == 3
    for p, r in zip(plain, replay):
        extra = {key: r.pop(key) for key in list(r) if key.startswith("replay/")}
        if "loss" in p:  # the step logs carry the replay metrics: nothing was cut
            assert extra == {"replay/kept_mass/mean": 1.0, "replay/support_size/mean": float(V)}
        assert {k: v for k, v in p.items() if k not in TIMING} == {k: v for k, v in r.items() if k not in TIMING}


class Spy(ReplayGRPOTrainer):
    """Checks, at every loss computation, that each sample's support is the one recorded for it."""

    seen = []

    def _compute_loss(self, model, inputs):
        index = inputs[INDEX_KEY].tolist()
        for b, tokens in enumerate(completion_tokens(inputs)):
            mask = self._replay_masks[index[b]]
            assert torch.equal(mask.sampled.cpu(), tokens.cpu()), f"sample {b} got another sample's support"
        self.seen.append(index)
        return super()._compute_loss(model, inputs)


@pytest.mark.slow  # seconds: kept out of the fast loop, run by make test
def test_supports_follow_their_samples_through_shuffle_and_split(tmp_path):
    Spy.seen = []
    trainer = make(Spy, tmp_path, n=8, top_k=5, max_steps=2, steps_per_generation=2, num_iterations=2,
                   gradient_accumulation_steps=2, per_device_train_batch_size=2)
    trainer.train()
    # 2 optimizer steps x 2 micro-batches; each generation (4 samples x 2 iterations) reused num_iterations times
    assert len(Spy.seen) == 4 and all(len(s) == 2 for s in Spy.seen)
    assert any(s != sorted(s) or s[1] != s[0] + 1 for s in Spy.seen)  # TRL did reorder the samples
    assert {i for s in Spy.seen for i in s} == set(range(4))  # one generation of 4, every sample used
    history = trainer.state.log_history[0]
    assert 0 < history["replay/kept_mass/mean"] < 1 and history["replay/support_size/mean"] <= 5


def test_row_count_mismatch_names_sample_and_position(tmp_path):
    trainer = make(ReplayGRPOTrainer, tmp_path, top_k=5)
    batch = generated_batch(trainer)
    lengths = [len(t) for t in completion_tokens(batch)]
    b = max(range(len(lengths)), key=lambda i: lengths[i])
    i = int(batch[INDEX_KEY][b])
    trainer._replay_masks[i] = trainer._replay_masks[i].select_rows(0, lengths[b] - 1)  # one row short
    with pytest.raises(InputError, match=rf"sample {b} \(replay_index {i}\): the support has {lengths[b] - 1} rows "
                                         rf"but the completion has {lengths[b]} tokens \(position {lengths[b] - 1}"):
        override_logps(trainer, batch)
    # at generation: the recorder's rows per sequence against TRL's completions
    whole = trainer._replay_masks[int(batch[INDEX_KEY][0])]
    whole.extras["sequence"] = torch.zeros(whole.num_rows, dtype=torch.int64)
    with pytest.raises(InputError, match=rf"completion 0: the recorded support has {whole.num_rows} rows but the "
                                         rf"completion has {whole.num_rows + 2} tokens \(first position without a "
                                         rf"match: {whole.num_rows}\)"):
        replay_trl._per_sequence(whole, [whole.num_rows + 2])


def test_unbuilt_paths_and_other_trl_versions_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(InputError, match="generation option generation_kwargs typical_p=0.5: its support cannot be "):
        make(ReplayGRPOTrainer, tmp_path, generation_kwargs={"typical_p": 0.5})
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(ImportError, match=r"tested against trl 1\.16\.x, found trl 1\.17\.0"):
        importlib.reload(replay_trl)
    monkeypatch.undo()
    importlib.reload(replay_trl)
