"""Multi-turn supports through verl 0.9.1's own agent loop: AgentLoopWorker.generate_sequences runs the
real tool_agent / single_turn_agent loops (continuous-token builders: the default, Qwen's, which inserts
a boundary newline, GLM's, which removes the turn's stop token), the real LLMServerClient.generate and
_postprocess, against the scripted stand-in server of agent_loop_helpers. The expected rows come from
the engine's call log alone (where each call's tokens sit in the final sequence), not from the code
under test; the supports then go through verl's DataProto and micro-batching into the replayed log-probs."""
import asyncio

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is installed by `make venv-verl`")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402

from mask_replay.errors import EngineOutputError  # noqa: E402
from mask_replay.integrations.verl import agent_loop, rollout, trainer  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402
from tests.integrations.verl import agent_loop_helpers as a  # noqa: E402
from tests.integrations.verl import verl_helpers as h  # noqa: E402

WANTED_CALLS = [0, 1, 2, 3, 1, 2]  # tool calls each sample's prompt asks for


@pytest.fixture
def replay():
    rollout.install(a.ScriptedServer)
    rollout.install_client()
    agent_loop.install()
    yield
    agent_loop.uninstall()
    rollout.uninstall()


def run(cfg, engine, wanted=WANTED_CALLS, model_type=None, max_tokens=None):
    server = a.ScriptedServer(engine, max_tokens or cfg.actor_rollout_ref.rollout.response_length)
    return asyncio.run(a.worker(cfg, server, model_type).generate_sequences(a.prompts(wanted)))


def rows_of(support):
    ids, offsets = support["token_ids"], support["offsets"]
    return [ids[offsets[j]:offsets[j + 1]].tolist() for j in range(len(offsets) - 1)]


@pytest.mark.parametrize("model_type,call_end", [(None, "<|im_end|>"), ("qwen2", "<|im_end|>"),
                                                 ("glm4_moe", "<|observation|>")])
def test_each_response_token_gets_its_turns_row(replay, model_type, call_end):
    engine = a.ScriptedEngine(call_end=call_end)
    data = run(a.config(response_length=16), engine, model_type=model_type)
    lengths = data.batch["attention_mask"][:, data.batch["prompts"].shape[1]:].sum(1)
    tool_tokens = truncated = 0
    for i, support in enumerate(data.non_tensor_batch[SUPPORT_KEY]):
        n = int(lengths[i])
        rows = rows_of(support)
        assert rows == a.expected_rows(engine, data, i)  # one row per response token, each its turn's
        mask = data.batch["response_mask"][i, :n].tolist()
        assert [len(r) > 0 for r in rows] == [m == 1 for m in mask]  # nobody sampled a mask-0 token
        tool_tokens += mask.count(0)
        # cut inside a turn by the response length (every turn ends with <|im_end|> or <|observation|>)
        truncated += n == 16 and int(data.batch["responses"][i, n - 1]) not in (a.ID["<|im_end|>"], a.ID[call_end])
    assert tool_tokens > 10 and truncated >= 2  # the cases the test is about did occur
    responses = data.batch["responses"]
    if model_type == "qwen2":  # the builder inserted its boundary newline: a mask-0 token with an empty row
        assert bool(((responses == a.ID["\n"]) & (data.batch["response_mask"] == 0)).any())
    if model_type == "glm4_moe":  # the builder removed the turns' stop token (and verl its mask entry)
        assert any(a.ID["<|observation|>"] in call.tokens for call in engine.log)
        assert not bool((responses == a.ID["<|observation|>"]).any())


def test_engine_asked_for_logprobs_and_verl_got_none(replay):
    # calculate_log_probs=False: verl sends logprobs=None; the engine gets logprobs=0 (the plugin records
    # only then) and verl's agent loop still gets no log-probs (no rollout_log_probs in the batch)
    engine = a.ScriptedEngine()
    data = run(a.config(), engine)
    assert {call.sampling_params.logprobs for call in engine.log} == {0}
    assert "rollout_log_probs" not in data.batch.keys()


def test_single_turn_truncated_response_lines_up(replay):
    # verl's single_turn_agent_loop cuts response_ids to response_length but hands extra_fields on whole
    engine = a.ScriptedEngine()
    data = run(a.config(response_length=2, agent="single_turn_agent"), engine, wanted=[0, 0, 0], max_tokens=8)
    for i, support in enumerate(data.non_tensor_batch[SUPPORT_KEY]):
        assert len(engine.log[i].tokens) > 2
        assert rows_of(support) == a.expected_rows(engine, data, i)
        assert len(rows_of(support)) == 2


def test_multi_turn_supports_reach_replay(replay):
    """The multi-turn batch through verl's DataProto and micro-batching into the trainer's log-probs:
    replayed over each generated token's row, verl's own value on the tool tokens (empty rows)."""
    data = run(a.config(response_length=16), a.ScriptedEngine())
    trainer.install()
    empties = 0
    try:
        e, model = h.engine(), h.ToyLM(21)
        for mb in prepare_micro_batches(h.to_engine_batch(data, 0.9, use_dynamic_bsz=False,
                                                          micro_batch_size_per_gpu=2))[0]:
            lp = h.response_logprobs(e, model, mb)
            ref = h.reference(model, mb, 0.9)
            torch.testing.assert_close(lp.double(), ref.detach(), atol=2e-6, rtol=0)
            plain = h.reference(model, mb, 0.9, replay=False)
            for i, support in enumerate(tu.get(mb, SUPPORT_KEY)):
                empty = np.flatnonzero(np.diff(support["offsets"]) == 0)  # tool tokens: verl's own value
                torch.testing.assert_close(lp[i, empty].double(), plain[i, empty].detach(), atol=2e-6, rtol=0)
                empties += empty.size
            assert (ref - plain).abs().max() > 0.1
    finally:
        trainer.uninstall()
    assert empties > 10


def test_rows_that_do_not_match_their_tokens_name_sample_and_position(replay):
    # only sample 1 calls the tool; its second turn records a row without its token at the turn's position 1
    engine = a.ScriptedEngine(corrupt=(1, 1))
    with pytest.raises(EngineOutputError) as err:
        run(a.config(), engine, wanted=[0, 1, 0, 0, 0])
    bad = next(c for c in engine.log if a.ID["tool"] in c.prompt)
    first = next(c for c in engine.log if c is not bad and bad.prompt[:len(c.prompt)] == c.prompt)
    position = len(bad.prompt) - len(first.prompt) + 1  # response position of the bad row
    assert (f"sample 1 (rollout 0, agent loop 'tool_agent'), response position {position}: token "
            f"{bad.tokens[1]} is not in its recorded support") in str(err.value)


def test_agent_loop_without_the_continuous_token_merge_is_refused(replay):
    with pytest.raises(EngineOutputError, match=r"sample 0 \(rollout 0, agent loop 'mask_replay_raw'\): 1 "
                                                r"generation\(s\) not merged into the response"):
        run(a.config(agent="mask_replay_raw"), a.ScriptedEngine(), wanted=[0])


def test_replay_adds_its_key_and_changes_nothing_else():
    off = run(a.config(response_length=22), a.ScriptedEngine())
    rollout.install(a.ScriptedServer)
    rollout.install_client()
    agent_loop.install()
    try:
        on = run(a.config(response_length=22), a.ScriptedEngine())
    finally:
        agent_loop.uninstall()
        rollout.uninstall()
    assert set(on.non_tensor_batch) - set(off.non_tensor_batch) == {SUPPORT_KEY}
    assert sorted(on.batch.keys()) == sorted(off.batch.keys())
    for key in off.batch.keys():
        assert torch.equal(on.batch[key], off.batch[key]), key
