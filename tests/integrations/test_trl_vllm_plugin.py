"""ReplayGRPOTrainer with mask_replay's vLLM plugin (integrations/trl/vllm_mode.py, source PLUGIN), on TRL-shaped
fakes of VLLMGeneration whose engine outputs carry `sampling_support` as the plugin attaches it (colocate:
`CompletionOutput.sampling_support`; server: the `/v1/completions` choices' JSON). vLLM is asked for what
plain TRL asks (logprobs=0), the supports come from the engine, TRL's IS ratio is 1. The real engine:
tests/integrations/vllm_support_engine.py and test_trl_vllm_engine.py (engine venv)."""
from types import SimpleNamespace

import numpy as np
import pytest
import trl.trainer.grpo_trainer as grpo_module

from mask_replay.integrations import vllm_support
from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer, vllm_mode
from mask_replay.integrations.vllm_support import wire
from mask_replay.sampler.adapters.vllm_support import support_to_json
from tests.integrations.test_trl_vllm import FakeVLLMGeneration
from tests.integrations.trl_helpers import V, grpo_args, prompts, reward_len, tiny_model, tiny_tokenizer


def supports(rows):
    return wire.join([np.array(r, np.int32) for r in rows], V)


class PluginColocate(FakeVLLMGeneration):
    """TRL's colocate generate: `self.llm.generate` (the engine), then flatten; the plugin's field on each output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.llm = SimpleNamespace(generate=self._engine)

    def _engine(self, prompt_ids):
        _, completions, lps, _ = FakeVLLMGeneration.generate(self, prompt_ids, None, 1, None)
        return [SimpleNamespace(request_id=str(i), prompt_token_ids=p, outputs=[SimpleNamespace(
            index=0, token_ids=c, logprobs=None, sampling_support=supports(rows), lps=lp)])
            for i, (p, c, lp, rows) in enumerate(zip(prompt_ids, completions, lps, self.last_supports))]

    def generate(self, prompts, images, num_generations, profiler):
        raw = self.llm.generate(prompts)
        completions = [list(o.outputs[0].token_ids) for o in raw]
        lps = [[[row[0]] for row in o.outputs[0].lps] for o in raw]  # logprobs=0: the sampled entry alone
        return [list(p) for p in prompts], completions, lps, [[[t] for t in c] for c in completions]


class PluginServer(FakeVLLMGeneration):
    """TRL's server generate: VLLMClient posts to /v1/completions; choices carry the plugin's JSON."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vllm_client = SimpleNamespace(base_url="http://127.0.0.1:1", model="m", _post=self._server,
                                           get_server_info=lambda: {"model_config": {
                                               "logprobs_mode": "processed_logprobs"}})
        self.posts = []

    def _server(self, url, json):
        self.posts.append(json)
        if json["max_tokens"] == 1:  # the probe
            return {"choices": [{"index": 0, "token_ids": [5], "sampling_support": support_to_json(supports([[5]]))}]}
        _, completions, lps, _ = FakeVLLMGeneration.generate(self, json["prompt"], None, 1, None)
        return {"choices": [{"index": i, "token_ids": c, "lps": lp,
                             "sampling_support": support_to_json(supports(rows))}
                            for i, (c, lp, rows) in enumerate(zip(completions, lps, self.last_supports))]}

    def generate(self, prompts, images, num_generations, profiler):
        choices = self.vllm_client._post(f"{self.vllm_client.base_url}/v1/completions",
                                         json={"prompt": prompts, "max_tokens": self.max_completion_length})["choices"]
        completions = [c["token_ids"] for c in choices]
        lps = [[[row[0]] for row in c["lps"]] for c in choices]
        return [list(p) for p in prompts], completions, lps, [[[t] for t in c] for c in completions]


def trainer_with(engine_cls, tmp_path, monkeypatch, mode="colocate", **kw):
    monkeypatch.setattr(grpo_module, "VLLMGeneration", engine_cls)
    return ReplayGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, train_dataset=prompts(4),
                             args=grpo_args(tmp_path, use_vllm=True, vllm_mode=mode, **kw),
                             processing_class=tiny_tokenizer())


@pytest.mark.parametrize("engine_cls, mode", [(PluginColocate, "colocate"), (PluginServer, "server")])
def test_plugin_supports_replace_the_logprob_request_and_replay_is_exact(engine_cls, mode, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_support, "active", lambda: True)  # colocate: the plugin loaded in this process
    trainer = trainer_with(engine_cls, tmp_path, monkeypatch, mode=mode, top_k=4)
    engine = trainer.vllm_generation
    assert trainer.replay_vllm_support.source == vllm_mode.PLUGIN and trainer.replay_vllm_settings is None
    assert engine.logprobs == 0  # what plain GRPOTrainer asks: no top-N request for the support
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    for b, i in enumerate(batch[INDEX_KEY].tolist()):
        mask = trainer._replay_masks[i]
        assert bool((mask.lengths() == 4).all())
        for t, tok in enumerate(batch["completion_ids"][b, :mask.num_rows].tolist()):
            assert tok in mask.row(t).tolist()
    trainer.train()
    logged = trainer.state.log_history[0]
    assert abs(logged["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4


def test_top_p_only_runs_with_the_plugin(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_support, "active", lambda: True)
    trainer = trainer_with(PluginColocate, tmp_path, monkeypatch, top_p=0.9)  # refused without the plugin
    assert trainer.vllm_generation.logprobs == 0


def test_server_without_the_plugin_falls_back_or_names_the_fix(tmp_path, monkeypatch):
    class PlainServer(PluginServer):
        def _server(self, url, json):
            return {"choices": [{"index": 0, "token_ids": [5]}]}  # no sampling_support: the plugin is off

    trainer = trainer_with(PlainServer, tmp_path, monkeypatch, mode="server", top_k=4)
    assert trainer.replay_vllm_support.source == vllm_mode.LOGPROBS and trainer.vllm_generation.logprobs == 5
    with pytest.raises(Exception, match="MASK_REPLAY_VLLM_SUPPORT=1"):
        trainer_with(PlainServer, tmp_path, monkeypatch, mode="server", top_p=0.9)


def test_a_completion_without_support_after_the_probe_is_one_clear_error(tmp_path, monkeypatch):
    class Forgetful(PluginColocate):
        def _engine(self, prompt_ids):
            out = super()._engine(prompt_ids)
            out[1].outputs[0].sampling_support = None
            return out

    monkeypatch.setattr(vllm_support, "active", lambda: True)
    trainer = trainer_with(Forgetful, tmp_path, monkeypatch, top_k=4)
    trainer.model.train()
    with pytest.raises(Exception, match="without sampling_support"):
        trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_a_server_whose_max_logprobs_is_too_small_is_named_at_construction(tmp_path, monkeypatch):
    class CappedServer(PluginServer):
        def _server(self, url, json):
            if json.get("logprobs", 0) > 20:  # vLLM's answer when the request exceeds --max-logprobs
                raise Exception("Request failed: 400, Requested sample logprobs of 31, which is greater than "
                                "max allowed: 20 (max_logprobs)")
            return {"choices": [{"index": 0, "token_ids": [5]}]}  # the plugin is off

    with pytest.raises(Exception, match="--max-logprobs 31"):
        trainer_with(CappedServer, tmp_path, monkeypatch, mode="server", top_k=30)
