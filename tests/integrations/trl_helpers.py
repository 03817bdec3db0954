"""A tiny random Llama, a word-level tokenizer and a prompt set for GRPOTrainer runs (no network)."""
from __future__ import annotations

import torch

from mask_replay.integrations.trl import INDEX_KEY

V = 48


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers  # optional dependency: with transformers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def tiny_model(seed: int = 0, tie: bool = False, **config):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=tie, **config)
    return transformers.LlamaForCausalLM(cfg)


def prompts(n: int = 4):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"w{3 + (i * 7 + j) % (V - 3)}" for j in range(2 + i % 3))
                                         for i in range(n)]})


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def grpo_args(out, **kw):
    from trl import GRPOConfig

    base = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                max_steps=1, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, seed=0, bf16=False, beta=0.0)
    base.update(kw)
    return GRPOConfig(**base)


def replayed_batch(trainer, model):
    """One generation batch of `trainer` and replay's per-token log-probs of it, as the loss computes
    them: (log-probs [B, K], the batch, input ids, the backbone's hidden states at the K completion
    positions, K)."""
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    k = batch["completion_ids"].shape[1]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    trainer._replay_active = batch[INDEX_KEY]
    try:
        lp, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, k)
    finally:
        trainer._replay_active = None
    hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1][:, -k:]
    return lp, batch, input_ids, hidden, k
