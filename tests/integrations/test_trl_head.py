"""ReplayGRPOTrainer's LM head: a tied head (the gradient reaches the one shared weight through both its
uses) and a config `logit_scale`, which TRL's fused head multiplies the logits by and replay folds into
the temperature; a final logit softcap (TRL: x = c * tanh(z * s / c) / T), replayed from the support's
gathered logits; against a float64 dense reference over the support."""
import pytest
import torch

from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer
from tests.helpers import hidden_ref, replay_ref
from tests.integrations.trl_helpers import V, grpo_args, prompts, replayed_batch, reward_len, tiny_model, tiny_tokenizer


def test_tied_head_with_logit_scale_matches_dense_reference_and_gradients(tmp_path):
    T, scale = 0.8, 0.5
    model = tiny_model(tie=True, logit_scale=scale)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    trainer = ReplayGRPOTrainer(model=model, reward_funcs=reward_len, train_dataset=prompts(4),
                                args=grpo_args(tmp_path, temperature=T, top_k=5), processing_class=tiny_tokenizer())
    lp, batch, input_ids, hidden, k = replayed_batch(trainer, model)
    weight = model.lm_head.weight
    ref = torch.zeros(lp.shape, dtype=torch.float64)
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        m = trainer._replay_masks[i]
        n, y = m.num_rows, input_ids[b, -k:][:m.num_rows]
        # logits * scale / T over the support: hidden scaled by `scale` gives logits * scale
        ref[b, :n] = hidden_ref(hidden[b, :n] * scale, weight, None, m.to_dense(V), y, T)
    live = batch["completion_mask"].bool()
    torch.testing.assert_close(lp.double()[live], ref[live], rtol=1e-5, atol=1e-5)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    (got,) = torch.autograd.grad((lp * w).sum(), [weight])
    (want,) = torch.autograd.grad((ref * w.double()).sum(), [weight])
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_softcapped_head_matches_dense_reference_and_gradients(tmp_path, scale):
    T, cap = 0.7, 2.0  # a cap near the logits' size, so that tanh bends them
    model = tiny_model(final_logit_softcapping=cap, **({} if scale == 1.0 else {"logit_scale": scale}))
    trainer = ReplayGRPOTrainer(model=model, reward_funcs=reward_len, train_dataset=prompts(4),
                                args=grpo_args(tmp_path, temperature=T, top_k=6, top_p=0.95),
                                processing_class=tiny_tokenizer())
    lp, batch, input_ids, hidden, k = replayed_batch(trainer, model)
    weight = model.lm_head.weight
    ref = torch.zeros(lp.shape, dtype=torch.float64)
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        m = trainer._replay_masks[i]
        n, y = m.num_rows, input_ids[b, -k:][:m.num_rows]
        z = hidden[b, :n].double() @ weight.double().T
        x = cap * torch.tanh(z * scale / cap)  # replay_ref divides by T
        ref[b, :n] = replay_ref(x, m.to_dense(V), y, T, dtype=torch.float64)
    live = batch["completion_mask"].bool()
    assert live.any()
    torch.testing.assert_close(lp.double()[live], ref[live], rtol=1e-5, atol=1e-5)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    params = [weight, model.model.layers[0].mlp.down_proj.weight]
    got = torch.autograd.grad((lp * w).sum(), params)
    want = torch.autograd.grad((ref * w.double()).sum(), params)
    for g, e in zip(got, want):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, e.float(), rtol=1e-4, atol=1e-6)
