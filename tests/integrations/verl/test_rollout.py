"""The rollout wrapper (rollout.py) with verl 0.9.1's real TokenOutput, on STAND-INS for the server and the
engine: vllm 0.24 (verl's rollout engine) is not installed here, so verl's vLLMHttpServer cannot be
imported. StandInServer.generate has the shape of vLLMHttpServer.generate (iterates
self.engine.generate(prompt=..., sampling_params=..., request_id=...) to the final output, returns a
TokenOutput of outputs[0] with extra_fields); StandInEngine yields outputs carrying the attribute that
mask-replay's vLLM plugin (issue 38) attaches. Neither is the real engine. The last test hands the
TokenOutputs on to verl's real AgentLoopWorker._postprocess and the trainer side."""
import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is installed by `make venv-verl`")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopMetrics,
    AgentLoopWorker,
    _InternalAgentLoopOutput,
)
from verl.workers.config import RolloutConfig  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from mask_replay.errors import EngineOutputError, InputError  # noqa: E402
from mask_replay.integrations.verl import rollout, trainer  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402
from tests.integrations.verl import verl_helpers as h  # noqa: E402


class Params(SimpleNamespace):
    """SamplingParams' members the wrapper uses (logprobs, clone)."""

    def clone(self):
        return Params(**vars(self))


class Support:
    def __init__(self, rows):
        self.token_ids = np.array([t for r in rows for t in r], dtype=np.int32)
        self.offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)


class StandInEngine:
    """Yields a growing completion token by token (as AsyncLLM streams), each output with the support so far;
    `attach=False` leaves the attribute off, `extra_row` records one row too many."""

    def __init__(self, attach=True, extra_row=False):
        self.attach, self.extra_row, self.version = attach, extra_row, "stand-in"

    async def generate(self, prompt, sampling_params, request_id, **_):
        self.seen = sampling_params
        base = int(request_id.split("-")[1])
        tokens = [base + k for k in range(3)]
        for n in range(1, 4):
            await asyncio.sleep(0)  # let the other request interleave
            rows = [[t, t + 1] for t in tokens[:n]] + ([[0]] if self.extra_row and n == 3 else [])
            completion = SimpleNamespace(token_ids=tokens[:n])
            if self.attach:
                completion.sampling_support = Support(rows)
            yield SimpleNamespace(outputs=[completion])


class StandInServer:
    """verl's generate: its logprobs flag to SamplingParams(logprobs=0 or None), log_probs only if asked."""

    def __init__(self, engine, config=None):
        self.engine, self.config = engine, config

    async def generate(self, prompt_ids, sampling_params, request_id, priority=0):
        params = Params(logprobs=0 if sampling_params.pop("logprobs", False) else None)
        self.params = params
        final = None
        async for output in self.engine.generate(prompt={"prompt_token_ids": prompt_ids},
                                                 sampling_params=params, request_id=request_id):
            final = output
        log_probs = [-1.0] * len(final.outputs[0].token_ids) if params.logprobs is not None else None
        return TokenOutput(token_ids=final.outputs[0].token_ids, log_probs=log_probs, stop_reason="completed",
                           extra_fields={"global_steps": 0})

    async def launch_server(self):
        self.launched = True


@pytest.fixture
def server_cls():
    cls = type("Server", (StandInServer,), {"generate": StandInServer.generate,  # a fresh class per test
                                            "launch_server": StandInServer.launch_server})
    rollout.install(cls)
    yield cls
    rollout.uninstall(cls)


def test_each_request_gets_its_own_support(server_cls):
    server = server_cls(StandInEngine())

    async def both():
        return await asyncio.gather(server.generate([1, 2], {}, "req-10"), server.generate([3], {}, "req-20"))

    for out, base in zip(asyncio.run(both()), (10, 20)):
        support = out.extra_fields[SUPPORT_KEY]
        assert out.token_ids == [base, base + 1, base + 2]
        assert support["token_ids"].dtype == np.int32 and support["offsets"].dtype == np.int64
        assert support["token_ids"].tolist() == [base, base + 1, base + 1, base + 2, base + 2, base + 3]
        assert support["offsets"].tolist() == [0, 2, 4, 6]
        assert out.extra_fields["global_steps"] == 0  # verl's own fields kept
    assert server.engine.records == {}  # nothing left behind per request
    assert server.engine.version == "stand-in"  # the proxy passes other attributes through


def test_missing_or_mismatched_support_names_the_request(server_cls):
    with pytest.raises(EngineOutputError, match="request req-5: the completion carries no 'sampling_support'"):
        asyncio.run(server_cls(StandInEngine(attach=False)).generate([1], {}, "req-5"))
    with pytest.raises(EngineOutputError, match="request req-7: the support has 4 rows but the completion has 3"):
        asyncio.run(server_cls(StandInEngine(extra_row=True)).generate([1], {}, "req-7"))


@pytest.mark.parametrize("asked", [False, True])
def test_engine_asked_for_logprobs_and_verl_gets_what_it_asked(server_cls, asked):
    # rollout.calculate_log_probs=False: verl sends logprobs=None; the plugin records a support only for a
    # request that asks for log-probs, so the engine gets logprobs=0 on a copy and verl's own params and
    # result (log_probs None) stay as they were
    engine = StandInEngine()
    server = server_cls(engine)
    out = asyncio.run(server.generate([1], {"logprobs": asked}, "req-4"))
    assert engine.seen.logprobs == 0
    assert server.params.logprobs == (0 if asked else None)
    assert (engine.seen is server.params) is asked  # copied only when changed
    assert (out.log_probs is None) is not asked
    assert out.extra_fields[SUPPORT_KEY]["offsets"].tolist() == [0, 2, 4, 6]


def rollout_config(**changes):
    base = {"name": "vllm", "logprobs_mode": "processed_logprobs", "mtp": {"enable": False, "enable_rollout": False}}
    return OmegaConf.create({**base, **changes})


@pytest.mark.parametrize("changes,env,key", [
    ({"name": "sglang"}, {}, "actor_rollout_ref.rollout.name"),
    ({"name": "trtllm"}, {}, "actor_rollout_ref.rollout.name"),
    ({"logprobs_mode": "raw_logprobs"}, {}, "actor_rollout_ref.rollout.logprobs_mode"),
    ({"mtp": {"enable": True, "enable_rollout": True}}, {}, "actor_rollout_ref.rollout.mtp.enable_rollout"),
    ({}, {"MASK_REPLAY_VLLM_SUPPORT": "0"}, "MASK_REPLAY_VLLM_SUPPORT")])
def test_rollout_configs_not_built_are_one_error_naming_the_key(changes, env, key):
    with pytest.raises(InputError, match=f"^key '{key}': "):
        rollout.check_rollout_config(rollout_config(**changes), environ=env)


def test_rollout_config_built_passes():
    rollout.check_rollout_config(rollout_config(), environ={})
    rollout.check_rollout_config(rollout_config(), environ={"MASK_REPLAY_VLLM_SUPPORT": "1"})
    rollout.check_rollout_config(RolloutConfig(name="vllm"), environ={})  # verl's own dataclass, its defaults


def test_server_refuses_at_launch_before_the_engine_starts(server_cls):
    server = server_cls(StandInEngine(), config=rollout_config(name="sglang"))
    with pytest.raises(InputError, match="key 'actor_rollout_ref.rollout.name'"):
        asyncio.run(server.launch_server())
    assert not hasattr(server, "launched")


def test_server_switches_the_vllm_plugin_on_before_verl_starts_the_engine(server_cls, monkeypatch):
    server = server_cls(StandInEngine(), config=rollout_config())
    seen = []
    monkeypatch.setattr(rollout, "enable_vllm_support", lambda: seen.append(hasattr(server, "launched")))
    asyncio.run(server.launch_server())
    assert seen == [False] and server.launched  # on once, before verl's own launch_server body ran


def test_trainer_start_up_refuses_another_rollout_backend(monkeypatch):
    monkeypatch.delenv("MASK_REPLAY_VLLM_SUPPORT", raising=False)
    rollout.install_client()
    try:
        with pytest.raises(InputError, match="key 'actor_rollout_ref.rollout.name': .* this run uses 'sglang'"):
            LLMServerManager(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout_config(name="sglang")}}))
    finally:
        rollout.uninstall()
    assert "__wrapped__" not in LLMServerManager.__init__.__dict__


def test_uninstall_restores_generate():
    cls = type("Server", (StandInServer,), {"generate": StandInServer.generate})  # a fresh class per test
    original = cls.__dict__["generate"]
    rollout.install(cls)
    assert cls.__dict__["generate"] is not original
    rollout.uninstall(cls)
    assert cls.__dict__["generate"] is original
    out = asyncio.run(cls(StandInEngine()).generate([1], {}, "req-1"))
    assert SUPPORT_KEY not in out.extra_fields


def test_extra_fields_reach_replay_through_verls_agent_loop(server_cls):
    """TokenOutput.extra_fields (stand-in server) -> verl's own AgentLoopWorker._postprocess (the padded
    per-sample outputs as single_turn_agent_loop hands them on, built here) -> DataProto -> micro-batches
    -> the replayed log-probs, against the float64 reference over each sample's own support."""
    server = server_cls(StandInEngine())

    async def three():
        return await asyncio.gather(*(server.generate([1], {}, f"req-{b}") for b in (10, 20, 30)))

    p, r = 3, 5  # verl pads prompts on the left, responses on the right
    inputs = []
    for k, out in enumerate(asyncio.run(three())):
        prompt, response = list(range(1, k + 2)), list(out.token_ids)
        prompts = torch.tensor([[0] * (p - len(prompt)) + prompt])
        responses = torch.tensor([response + [0] * (r - len(response))])
        attention = torch.tensor([[0] * (p - len(prompt)) + [1] * len(prompt) + [1] * len(response) +
                                  [0] * (r - len(response))])
        inputs.append(_InternalAgentLoopOutput(
            prompt_ids=prompts, response_ids=responses, input_ids=torch.cat([prompts, responses], 1),
            position_ids=(attention.cumsum(1) - 1).clamp(min=0), response_mask=attention[:, p:],
            attention_mask=attention, metrics=AgentLoopMetrics(), num_turns=2,
            extra_fields=out.extra_fields))
    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # _postprocess reads only this attribute
    worker.reward_loop_worker_handles = None
    data = worker._postprocess(inputs)
    assert [s["offsets"].tolist() for s in data.non_tensor_batch[SUPPORT_KEY]] == [[0, 2, 4, 6]] * 3
    trainer.install()
    try:
        e, model = h.engine(), h.ToyLM(9)
        for mb in prepare_micro_batches(h.to_engine_batch(data, 0.9, use_dynamic_bsz=False,
                                                          micro_batch_size_per_gpu=3))[0]:
            lp = h.response_logprobs(e, model, mb)
            ref = h.reference(model, mb, 0.9)
            torch.testing.assert_close(lp.double(), ref.detach(), atol=2e-6, rtol=0)
            assert (ref - h.reference(model, mb, 0.9, replay=False)).abs().max() > 0.1
    finally:
        trainer.uninstall()
