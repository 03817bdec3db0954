"""ReplayGRPOTrainer's vLLM mode on engine-shaped outputs: TRL's VLLMGeneration replaced by a fake that
samples from the trainer's own tiny model with top-k and returns what TRL 1.16's `VLLMGeneration.generate`
returns under `logprobs_mode="processed_logprobs"` with `logprobs=N` (per token up to N + 1 entries sorted
by rank, -inf outside the support). No real engine."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import trl.trainer.grpo_trainer as grpo_module

from mask_replay.errors import EngineOutputError, InputError
from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer, vllm_mode
from mask_replay.integrations.vllm_support import wire
from tests.integrations.trl_helpers import V, grpo_args, prompts, reward_len, tiny_model, tiny_tokenizer


class FakeVLLMGeneration:
    """TRL's VLLMGeneration (colocate) surface: attributes from its arguments, generate, sync_weights."""

    instances = []

    def __init__(self, model, accelerator, processing_class, **kwargs):
        self.model, self.tensor_parallel_size = model, 1
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.calls = []
        FakeVLLMGeneration.instances.append(self)

    def sync_weights(self):
        pass

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler):
        self.calls.append(dict(logprobs=self.logprobs, top_k=self.top_k))
        self.last_supports = []
        g = torch.Generator().manual_seed(len(self.calls))
        completions, lps, ids = [], [], []
        for prompt in prompts:
            seq, seq_lp, seq_ids, seq_support = [], [], [], []
            ctx = list(prompt)
            for _ in range(self.max_completion_length):
                z = self.model(input_ids=torch.tensor([ctx])).logits[0, -1].double() / self.temperature
                k = self.top_k if self.top_k and self.top_k > 0 else V
                cut = z.topk(k).values[-1]
                x = torch.where(z >= cut, z, torch.tensor(-math.inf, dtype=z.dtype))
                logp = torch.log_softmax(x, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=g))
                seq_support.append(torch.nonzero(torch.isfinite(logp))[:, 0].tolist())
                order = torch.argsort(logp, descending=True)[:self.logprobs].tolist()
                keys = order + ([tok] if tok not in order else [])
                keys.sort(key=lambda i: -float(logp[i]))  # TRL sorts by rank
                seq.append(tok)
                seq_ids.append(keys)
                seq_lp.append([float(logp[i]) for i in keys])
                ctx.append(tok)
                if tok == 1:
                    break
            self.last_supports.append(seq_support)  # what the plugin would report (PluginVLLMGeneration)
            completions.append(seq)
            lps.append(seq_lp)
            ids.append(seq_ids)
        return [list(p) for p in prompts], completions, lps, ids


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeVLLMGeneration.instances.clear()
    monkeypatch.setattr(grpo_module, "VLLMGeneration", FakeVLLMGeneration)
    return FakeVLLMGeneration


def make(tmp_path, **kw):
    return ReplayGRPOTrainer(model=tiny_model(), reward_funcs=reward_len,
                             args=grpo_args(tmp_path, use_vllm=True, vllm_mode="colocate", **kw),
                             train_dataset=prompts(4), processing_class=tiny_tokenizer())


def test_vllm_mode_asks_for_top_k_plus_one_and_builds_each_completions_support(tmp_path, fake_vllm):
    trainer = make(tmp_path, top_k=5, temperature=0.8)
    engine = fake_vllm.instances[0]
    assert engine.logprobs == 6  # top_k + 1: every row ends in a -inf, so the guard can tell it is whole
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert engine.calls == [dict(logprobs=6, top_k=5)]
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        mask = trainer._replay_masks[i]
        n = int(batch["completion_mask"][b].sum())
        assert mask.num_rows == n and bool((mask.lengths() == 5).all())
        assert torch.equal(mask.sampled, batch["completion_ids"][b, :n].cpu())
    # TRL's sampling log-prob is the sampled token's (not the rank-1 entry's), and replay's old log-probs
    # over the engine's support agree with it: the IS ratio TRL computes is 1
    live = batch["completion_mask"].bool()
    assert torch.allclose(batch["old_per_token_logps"][live], batch["sampling_per_token_logps"][live], atol=1e-5)
    assert abs(trainer._metrics["train"]["sampling/importance_sampling_ratio/mean"][-1] - 1.0) < 1e-4
    assert 0 < trainer._metrics["train"]["replay/kept_mass/mean"][-1] < 1
    assert trainer._metrics["train"]["replay/support_size/mean"][-1] == 5.0


def test_vllm_top_p_only_without_the_plugin_is_refused_with_the_fix(tmp_path, fake_vllm):
    with pytest.raises(InputError, match="MASK_REPLAY_VLLM_SUPPORT=1 .*or pass replay_top_k_cap=K"):
        make(tmp_path, top_p=0.9)  # would ask vLLM for V log-prob objects per token
    trainer = ReplayGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, replay_top_k_cap=7,
                                args=grpo_args(tmp_path, use_vllm=True, vllm_mode="colocate", top_p=0.9),
                                train_dataset=prompts(4), processing_class=tiny_tokenizer())
    assert trainer.vllm_generation.logprobs == 8 and trainer.vllm_generation.top_k == 7


def test_vllm_max_logprobs_below_the_n_needed_is_refused_at_construction(tmp_path, fake_vllm, monkeypatch):
    # vLLM's default max_logprobs is 20 and TRL builds LLM(...) without it: top_k 30 needs 31
    config = SimpleNamespace(model_config=SimpleNamespace(max_logprobs=20))
    monkeypatch.setattr(fake_vllm, "llm", SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config)),
                        raising=False)
    with pytest.raises(InputError, match="max_logprobs is 20: replay reads the support off 31"):
        make(tmp_path, top_k=30)


def test_vllm_without_token_ids_is_one_clear_error(tmp_path, fake_vllm, monkeypatch):
    trainer = make(tmp_path, top_k=5)
    original = fake_vllm.generate
    monkeypatch.setattr(fake_vllm, "generate", lambda self, *a, **k: original(self, *a, **k)[:3] + (None,))
    trainer.model.train()
    with pytest.raises(EngineOutputError, match="neither sampling masks nor processed log-probs"):
        trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_vllm_generation_kwargs_that_change_the_support_are_refused(tmp_path, fake_vllm):
    with pytest.raises(InputError, match="generation_kwargs logprobs, top_k: with replay"):
        make(tmp_path, top_k=5, generation_kwargs={"top_k": 3, "logprobs": 0})


class MaskingVLLMGeneration(FakeVLLMGeneration):
    """A colocated build whose engine outputs carry `sampling_mask` (TRL's generate calls `self.llm.generate`
    and flattens the outputs): the support must come from those masks, not from the log-probs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.llm = SimpleNamespace(generate=self._engine)
        self.support = 4  # the masks say 4 ids, the log-probs (top_k + 1 of them) would say top_k

    def _engine(self, prompts):
        out = []
        for p in prompts:
            tokens = [3 + (len(p) + t) % (V - 8) for t in range(3)]
            rows = [sorted({tok, *range(40, 40 + self.support - 1)}) for tok in tokens]
            out.append(SimpleNamespace(request_id=str(len(out)), outputs=[SimpleNamespace(
                index=0, token_ids=tokens, logprobs=None, sampling_mask=rows)]))
        return out

    def generate(self, prompts, images, num_generations, profiler):
        raw = self.llm.generate(prompts)
        completions = [list(o.outputs[0].token_ids) for o in raw]
        # TRL's lists, rank order: a rank-1 token that is not the sampled one comes first
        ids = [[[45, tok] for tok in c] for c in completions]
        lps = [[[-0.1, -2.5] for _ in c] for c in completions]
        return [list(p) for p in prompts], completions, lps, ids


def test_vllm_sampling_masks_are_used_where_the_engine_returns_them(tmp_path, monkeypatch):
    monkeypatch.setattr(grpo_module, "VLLMGeneration", MaskingVLLMGeneration)
    trainer = make(tmp_path, top_k=5)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        mask = trainer._replay_masks[i]
        assert bool((mask.lengths() == 4).all())  # the engine's masks, not the top-N log-probs
        for t, tok in enumerate(batch["completion_ids"][b, :mask.num_rows].tolist()):
            assert tok in mask.row(t).tolist()
    live = batch["completion_mask"].bool()
    assert bool((batch["sampling_per_token_logps"][live] == -2.5).all())  # the sampled entry, not rank 1


def test_vllm_output_one_row_short_names_the_completion(tmp_path, fake_vllm, monkeypatch):
    trainer = make(tmp_path, top_k=5)
    original = fake_vllm.generate

    def short(self, *a, **k):
        p, c, lps, ids = original(self, *a, **k)
        return p, c, [lps[0][:-1]] + lps[1:], [ids[0][:-1]] + ids[1:]

    monkeypatch.setattr(fake_vllm, "generate", short)
    trainer.model.train()
    with pytest.raises(EngineOutputError, match=r"completion 0: (\d+) tokens, (\d+) logprobs rows"):
        trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_vllm_server_mode_takes_the_same_path(tmp_path, fake_vllm, monkeypatch):
    # server mode: GRPOTrainer asks the server for its logprobs mode; the rest is VLLMGeneration.generate
    monkeypatch.setattr(fake_vllm, "vllm_client", SimpleNamespace(
        get_server_info=lambda: {"model_config": {"logprobs_mode": "processed_logprobs"}}, base_url="http://x",
        model="m", _post=lambda url, json: {"choices": [{"index": 0, "token_ids": [5]}]}), raising=False)
    trainer = ReplayGRPOTrainer(model=tiny_model(), reward_funcs=reward_len,
                                args=grpo_args(tmp_path, use_vllm=True, vllm_mode="server", top_k=4),
                                train_dataset=prompts(4), processing_class=tiny_tokenizer())
    assert trainer.vllm_generation.mode == "server" and trainer.vllm_generation.logprobs == 5
    trainer.train()
    logged = trainer.state.log_history[0]
    assert abs(logged["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
    assert logged["replay/support_size/mean"] == 4.0 and 0 < logged["replay/kept_mass/mean"] < 1


def test_vllm_generation_kwargs_temperature_is_the_same_rule_as_transformers(tmp_path, fake_vllm):
    with pytest.raises(InputError, match=r"generation_kwargs temperature=0\.5 differs from GRPOConfig\.temperature"):
        make(tmp_path, top_k=5, generation_kwargs={"temperature": 0.5})
    assert make(tmp_path, top_k=5, generation_kwargs={"temperature": 1.0}).vllm_generation.logprobs == 6


def test_vllm_engine_generate_wrapper_installed_by_a_user_stays(tmp_path, fake_vllm):
    trainer = make(tmp_path, top_k=5)
    engine, calls = trainer.vllm_generation, []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return FakeVLLMGeneration.generate(engine, *args, **kwargs)

    engine.generate = wrapper
    trainer.model.train()
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert calls and vars(engine)["generate"] is wrapper


def test_vllm_kept_mass_is_the_policys_under_peft_with_a_reference(tmp_path, fake_vllm):
    # beta > 0 with PEFT: TRL scores the reference with the policy's own module, the adapter off; with IS
    # correction off that comes first. The kept mass logged must be the policy's (adapter on).
    peft = pytest.importorskip("peft")
    T = 0.9
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    trainer = ReplayGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, peft_config=lora,
                                args=grpo_args(tmp_path, use_vllm=True, vllm_mode="colocate", beta=0.1,
                                               vllm_importance_sampling_correction=False, temperature=T, top_k=6),
                                train_dataset=prompts(4), processing_class=tiny_tokenizer())
    model = trainer.model
    with torch.no_grad():  # LoRA's B starts at 0: make the adapter matter
        for j, (name, p) in enumerate(model.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(j))
    model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert "replay/kept_mass/mean" not in trainer._metrics["train"]  # the reference scoring measured nothing
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    k = batch["completion_ids"].shape[1]
    trainer._replay_active = batch[INDEX_KEY]  # the policy's first scoring of the batch
    try:
        trainer._get_per_token_logps_and_entropies(model, input_ids, attention, k)
    finally:
        trainer._replay_active = None
    with torch.no_grad():
        z = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1][:, -k:].double() / T
    p = torch.softmax(z, -1)
    kept = []
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        mask = trainer._replay_masks[i]
        kept += (p[b, :mask.num_rows] * mask.to_dense(V)).sum(-1).tolist()
    logged = trainer._metrics["train"]["replay/kept_mass/mean"]
    assert len(logged) == 1 and abs(logged[0] - sum(kept) / len(kept)) < 1e-5


# ---- greedy tokens: TRL's sampling log-prob agrees with the one-id support (issue 48, item 4) ---------
class GreedyEngine:
    """TRL's VLLMGeneration.generate on greedy requests as vLLM 0.32 answers them: each token the argmax,
    its log-prob over the whole vocabulary (processed mode too: greedy rows are untruncated), and, by
    `source`, the plugin's one-id supports, vLLM's own sampling masks, or the top-N log-probs alone."""

    def __init__(self, source):
        self.source, self.mode, self.tensor_parallel_size, self.logprobs, self.top_k = source, "colocate", 1, 2, -1
        g = torch.Generator().manual_seed(0)
        self.lp = torch.log_softmax(torch.randn(2, 3, V, generator=g, dtype=torch.float64), -1)  # [seq, token, V]
        if source != "logprobs":
            self.llm = SimpleNamespace(generate=self._engine)

    def _tokens(self):
        return [self.lp[s].argmax(-1).tolist() for s in range(2)]

    def _engine(self, prompts):
        def field(tokens):
            rows = [[t] for t in tokens]
            if self.source == "plugin":
                return {"sampling_support": wire.join([np.array(r, np.int32) for r in rows], V)}
            return {"sampling_mask": rows}
        def logprobs(s, tokens):  # the offline layout: per position {id: Logprob}, the sampled token's
            return [{t: SimpleNamespace(logprob=float(self.lp[s, j, t]))} for j, t in enumerate(tokens)]
        return [SimpleNamespace(request_id=str(s), outputs=[SimpleNamespace(index=0, token_ids=c,
                                                                            logprobs=logprobs(s, c), **field(c))])
                for s, c in enumerate(self._tokens())]

    def generate(self, prompts, images, num_generations, profiler):
        if self.source != "logprobs":
            self.llm.generate(prompts)
        tokens = self._tokens()
        ranked = [[torch.argsort(self.lp[s, t], descending=True)[:self.logprobs].tolist() for t in range(3)]
                  for s in range(2)]
        lps = [[[float(self.lp[s, t, i]) for i in ranked[s][t]] for t in range(3)] for s in range(2)]
        return [list(p) for p in prompts], tokens, lps, ranked


@pytest.mark.parametrize("source", ["plugin", "sampling_mask", "logprobs"])
def test_greedy_tokens_hand_trl_the_log_prob_over_their_one_id_support(source):
    engine = GreedyEngine(source)
    support = vllm_mode.EngineSupport(vllm_mode.PLUGIN if source == "plugin" else vllm_mode.LOGPROBS)
    with vllm_mode.recording(engine, temperature=0.0, vocab_size=V, support=support, accelerator=None) as recorded:
        _, tokens, logprobs, _ = engine.generate([[1, 2], [3]], None, 1, None)
    mask = recorded()
    assert mask.to_lists() == [[t] for seq in tokens for t in seq]
    assert float(engine.lp.max(-1).values.max()) < -1e-3  # vLLM's values are far from 0
    assert [lp[0] for seq in logprobs for lp in seq] == mask.logprobs.tolist() == [0.0] * 6
