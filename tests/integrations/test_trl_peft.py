"""ReplayGRPOTrainer under PEFT (LoRA): TRL's reference log-probs come from the same model with the adapter
disabled; they must be over the recorded support too, and equal a float64 dense reference of the base
model. Needs peft (requirements-trl.txt)."""
import pytest
import torch

from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer
from tests.helpers import hidden_ref
from tests.integrations.trl_helpers import V, grpo_args, prompts, reward_len, tiny_model, tiny_tokenizer

peft = pytest.importorskip("peft")


def test_adapter_disabled_reference_is_replayed_over_the_support(tmp_path):
    T = 0.9
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    trainer = ReplayGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, peft_config=lora,
                                args=grpo_args(tmp_path, beta=0.1, temperature=T, top_k=6, top_p=0.9),
                                train_dataset=prompts(8), processing_class=tiny_tokenizer())
    model = trainer.model
    with torch.no_grad():  # LoRA's B starts at 0: make the adapter matter, so that disabling it shows
        for j, (name, p) in enumerate(model.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(j))
    model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    k = batch["completion_ids"].shape[1]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    base = model.get_base_model()
    with torch.no_grad():
        with model.disable_adapter():
            h_ref = base.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1][:, -k:]
        h_pol = base.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1][:, -k:]
    weight = base.lm_head.weight
    ref, pol = (torch.zeros(input_ids.shape[0], k, dtype=torch.float64) for _ in range(2))
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        m = trainer._replay_masks[i]
        n, y = m.num_rows, input_ids[b, -k:][:m.num_rows]
        assert int(m.lengths().max()) < V  # truncated: replay has work to do
        ref[b, :n] = hidden_ref(h_ref[b, :n], weight, None, m.to_dense(V), y, T)
        pol[b, :n] = hidden_ref(h_pol[b, :n], weight, None, m.to_dense(V), y, T)
    live = batch["completion_mask"].bool()
    got = batch["ref_per_token_logps"].double()
    torch.testing.assert_close(got[live], ref[live], rtol=1e-5, atol=1e-5)
    assert (got[live] - pol[live]).abs().max() > 1e-2  # the adapter really was off for the reference
