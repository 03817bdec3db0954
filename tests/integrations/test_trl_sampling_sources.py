"""ReplayGRPOTrainer (transformers generation): every sampling source (GRPOConfig, generation_kwargs, the
model's own generation_config, transformers' defaults) either reaches the recorded support or is refused
by name at construction; generate keeps a wrapper a user installed on the model; generation_kwargs that
plain TRL runs with (another EOS) run with replay too."""
import pytest
import torch

from mask_replay.errors import InputError
from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer
from tests.integrations.trl_helpers import V, grpo_args, prompts, replayed_batch, reward_len, tiny_model, tiny_tokenizer


def make(tmp_path, model=None, replay_top_k_cap=None, **kw):
    return ReplayGRPOTrainer(model=model if model is not None else tiny_model(), reward_funcs=reward_len,
                             args=grpo_args(tmp_path, **kw), train_dataset=prompts(4),
                             processing_class=tiny_tokenizer(), replay_top_k_cap=replay_top_k_cap)


def generated(trainer):
    trainer.model.train()
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_the_models_own_min_p_and_top_k_are_recorded(tmp_path):
    # GRPOConfig sets neither: generate takes them from the model's generation_config, and so must the recorder
    model = tiny_model()
    model.generation_config.top_k, model.generation_config.min_p = 6, 0.2
    T = 0.8
    trainer = make(tmp_path, model=model, temperature=T, top_k=None, min_p=None, top_p=1.0)
    batch = generated(trainer)
    k = batch["completion_ids"].shape[1]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1][:, -k:].double() / T
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        mask = trainer._replay_masks[i]
        for t in range(mask.num_rows):  # generate's order: top-k 6, then min-p 0.2 of the top probability
            p = torch.softmax(logits[b, t], -1)
            top = torch.zeros(V, dtype=torch.bool)
            top[p.topk(6).indices] = True
            want = torch.nonzero(top & (p >= 0.2 * p.max())).flatten().tolist()
            assert mask.row(t).tolist() == want, f"sample {b} token {t}"


def test_sources_replay_cannot_record_are_refused_by_name(tmp_path):
    cases = [  # (what to set, the words of the error)
        (dict(model_config={"typical_p": 0.5}), r"the model's generation_config typical_p=0\.5"),
        (dict(model_config={"top_h": 0.4}), r"the model's generation_config top_h=0\.4"),
        (dict(generation_kwargs={"do_sample": False}), r"generation_kwargs do_sample=False"),
        (dict(generation_kwargs={"epsilon_cutoff": 0.01}), r"generation_kwargs epsilon_cutoff=0\.01"),
        (dict(generation_kwargs={"temperature": 0.5}),
         r"generation_kwargs temperature=0\.5 differs from GRPOConfig\.temperature=1\.0"),
    ]
    for setting, words in cases:
        model = tiny_model()
        for key, value in setting.get("model_config", {}).items():
            setattr(model.generation_config, key, value)
        with pytest.raises(InputError, match=words):
            make(tmp_path, model=model, generation_kwargs=setting.get("generation_kwargs"))
    for cap in (0, -3, "abc", True, 2.0):
        with pytest.raises(InputError, match=rf"replay_top_k_cap must be an integer >= 1 or None, got {cap!r}"):
            make(tmp_path, replay_top_k_cap=cap)


def test_a_users_generate_wrapper_is_called_and_stays(tmp_path):
    model = tiny_model()
    calls = []

    def wrapper(*args, **kwargs):  # what a user or a library may install on the instance
        calls.append(1)
        return type(model).generate(model, *args, **kwargs)

    model.generate = wrapper
    trainer = make(tmp_path, model=model, top_k=5)
    generated(trainer)
    assert calls and vars(model)["generate"] is wrapper  # called through, and still there afterwards
    generated(trainer)
    assert len(calls) == 2


def test_generation_kwargs_eos_runs(tmp_path):
    # generate stops at 7 or 9 and pads; TRL cuts at the tokenizer's EOS (1), so its completions keep the padding
    trainer = make(tmp_path, top_k=5, max_completion_length=12, generation_kwargs={"eos_token_id": [7, 9]})
    lp, batch, input_ids, hidden, k = replayed_batch(trainer, trainer.model)
    padded = 0
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        mask, tokens = trainer._replay_masks[i], batch["completion_ids"][b][batch["completion_mask"][b].bool()]
        assert mask.num_rows == tokens.numel() and torch.equal(mask.sampled, tokens)
        ends = [t for t, tok in enumerate(tokens.tolist()) if tok in (7, 9)]
        if ends:  # generate's padding after its EOS: nobody sampled it, the whole vocabulary (TRL's own value)
            sizes = mask.lengths().tolist()
            assert sizes[ends[0] + 1:] == [V] * (len(sizes) - ends[0] - 1) and max(sizes[:ends[0] + 1]) <= 5
            padded += len(sizes) - ends[0] - 1
    assert padded > 0 and torch.isfinite(lp).all()


def test_top_k_cap_applies_to_transformers_generation(tmp_path):
    trainer = make(tmp_path, top_p=0.95, replay_top_k_cap=3)
    batch = generated(trainer)
    sizes = torch.cat([trainer._replay_masks[i].lengths() for i in batch[INDEX_KEY].tolist()])
    assert int(sizes.max()) == 3  # top-p 0.95 alone keeps far more of a random model's 48 ids
