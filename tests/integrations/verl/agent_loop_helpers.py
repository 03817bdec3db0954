"""Pieces of the agent-loop tests: verl 0.9.1's own AgentLoopWorker, agent loops, LLMServerClient and
continuous-token builders, run on a small self-made chat tokenizer (40 ids: the verl_helpers toy LM's
vocabulary), a registered tool parser and a function tool, against STAND-INS for the rollout server
and its engine (ScriptedServer: the shape of vLLMHttpServer.generate, wrapped by rollout.install like
the real one; ScriptedEngine: yields CUMULATIVE outputs with the attribute mask-replay's vLLM plugin
attaches, and logs every call so that the tests work out the expected rows on their own).
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, AgentLoopWorker, register
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.function_tool import FunctionTool
from verl.tools.schemas import OpenAIFunctionSchema, OpenAIFunctionToolSchema
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

SPECIAL = ["[PAD]", "[UNK]", "<|im_start|>", "<|im_end|>", "\n", "<|observation|>", "<|user|>"]
WORDS = ["system", "user", "assistant", "tool", "CALL"] + [f"w{i}" for i in range(28)]
VOCAB = SPECIAL + WORDS  # 40 ids
ID = {t: i for i, t in enumerate(VOCAB)}
TEMPLATE = ("{%- for m in messages -%}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>\n{%- endfor -%}"
            "{%- if add_generation_prompt -%}<|im_start|>assistant {% endif -%}")


def tokenizer() -> PreTrainedTokenizerFast:
    """Whole words and the chat template's special tokens; "\\n" one token of its own (the Qwen builder
    asks for that)."""
    core = Tokenizer(models.WordLevel(vocab=ID, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="<|im_end|>",
                                  additional_special_tokens=SPECIAL[2:4] + SPECIAL[5:])
    tok.add_tokens(["\n"])
    tok.chat_template = TEMPLATE
    return tok


@ToolParser.register("mask_replay_test")
class CallParser(ToolParser):
    """A turn that holds the token CALL calls the tool `lookup`."""

    async def extract_tool_calls(self, responses_ids, tools=None):
        text = self.tokenizer.decode(responses_ids)
        calls = [FunctionCall(name="lookup", arguments='{"q": "w1"}')] if ID["CALL"] in responses_ids else []
        return text, calls


def lookup(q: str) -> str:
    return "w20 w21 w22"


LOOKUP = FunctionTool(name="lookup", fn=lookup, tool_schema=OpenAIFunctionToolSchema(
    type="function", function=OpenAIFunctionSchema(name="lookup", description="look a word up")))


def support_row(token: int, salt: int) -> list[int]:
    """The row a token was drawn from: the token and 1..5 others, ascending."""
    g = np.random.default_rng(token * 1009 + salt)
    return sorted({token, *g.integers(0, len(VOCAB), int(g.integers(1, 6))).tolist()})


class Support:
    def __init__(self, rows):
        self.token_ids = np.array([t for r in rows for t in r], dtype=np.int32)
        self.offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)


class ScriptedEngine:
    """Answers a prompt whose first word is wK with K tool calls, one per turn (w.. CALL, then `call_end`),
    then a final answer (w.. <|im_end|>); words depend on the prompt length. Each output carries the rows
    so far (`corrupt`: (turn, position): in every call that is a sample's turn-th, that position's row
loses its token); every call is logged (prompt,
    tokens, rows, the sampling params it got)."""

    def __init__(self, call_end="<|im_end|>", corrupt=None):
        self.log, self.call_end, self.corrupt = [], ID[call_end], corrupt

    async def generate(self, prompt, sampling_params, request_id, **_):
        ids = list(prompt["prompt_token_ids"])
        wanted = int(next(t for t in (VOCAB[i] for i in ids) if t.startswith("w"))[1:])  # the first word
        calls = ids.count(ID["tool"])  # one "tool" turn per tool response so far
        n = len(ids)
        words = [ID[f"w{(n + k) % 20}"] for k in range(2 + n % 3)]
        tokens = words + ([ID["CALL"], self.call_end] if calls < wanted else [ID["<|im_end|>"]])
        tokens = tokens[:sampling_params.max_tokens]
        rows = [support_row(t, n + k) for k, t in enumerate(tokens)]
        if self.corrupt is not None and self.corrupt[0] == calls:
            rows[self.corrupt[1]] = [t for t in rows[self.corrupt[1]] if t != tokens[self.corrupt[1]]]
        self.log.append(SimpleNamespace(prompt=ids, tokens=tokens, rows=rows, sampling_params=sampling_params))
        for k in range(1, len(tokens) + 1):
            await asyncio.sleep(0)
            completion = SimpleNamespace(token_ids=tokens[:k], sampling_support=Support(rows[:k]),
                                         finish_reason="stop" if k == len(tokens) else None)
            yield SimpleNamespace(outputs=[completion])


class ScriptedServer:
    """The shape of vLLMHttpServer.generate: verl's logprobs flag to SamplingParams-like logprobs 0 / None,
    max_tokens from the config, iterate the engine to the final output, TokenOutput of outputs[0]."""

    def __init__(self, engine, max_tokens):
        self.engine, self.max_tokens = engine, max_tokens

    async def generate(self, prompt_ids, sampling_params, request_id, **_):
        params = dict(sampling_params)
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        params = Params(max_tokens=params.pop("max_tokens", self.max_tokens), **params)
        final = None
        async for output in self.engine.generate(prompt={"prompt_token_ids": prompt_ids}, sampling_params=params,
                                                 request_id=request_id):
            final = output
        return TokenOutput(token_ids=final.outputs[0].token_ids, log_probs=None, stop_reason="completed",
                           extra_fields={"global_steps": 3})


class Params(SimpleNamespace):
    """SamplingParams' two members the wrapper uses (logprobs, clone)."""

    def clone(self):
        return Params(**vars(self))


class LocalClient(LLMServerClient):
    """verl's LLMServerClient (its own generate) with the Ray load balancer replaced by one local server."""

    def __init__(self, config, server):
        super().__init__(config)
        self._server = SimpleNamespace(generate=SimpleNamespace(remote=server.generate))

    async def _acquire_server(self, request_id, **extra):
        return "local", self._server

    def _release_server(self, server_id, request_id=None):
        pass


def config(response_length=40, agent="tool_agent", builder_model_type=None):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {
            "name": "vllm", "logprobs_mode": "processed_logprobs", "temperature": 1.0, "top_p": 0.9, "top_k": 8,
            "calculate_log_probs": False, "prompt_length": 24, "response_length": response_length,
            "full_determinism": False, "val_kwargs": {"top_p": 1.0, "top_k": -1, "temperature": 0},
            "agent": {"default_agent_loop": agent},
            "multi_turn": {"max_user_turns": 8, "max_assistant_turns": 8, "max_parallel_calls": 1,
                           "max_tool_response_length": 64, "tool_response_truncate_side": "right",
                           "format": "mask_replay_test"}}},
        "data": {"apply_chat_template_kwargs": {}}})


def worker(cfg, server, model_type=None) -> AgentLoopWorker:
    """verl's own AgentLoopWorker, built without __init__ (no Ray, no model files): what its
    generate_sequences, _run_agent_loop, _agent_loop_postprocess and _postprocess read."""
    w = AgentLoopWorker.__new__(AgentLoopWorker)
    w.config, w.rollout_config = cfg, cfg.actor_rollout_ref.rollout
    w.llm_client = LocalClient(cfg, server)
    w.tokenizer, w.processor, w.hf_model_type = tokenizer(), None, model_type
    w.dataset_cls, w.tools, w.mm_processor_kwargs = None, [LOOKUP], {}
    w.reward_loop_worker_handles, w.distillation_enabled = None, False
    return w


def prompts(wanted_calls) -> DataProto:
    """One sample per entry: its user turn asks for that many tool calls."""
    raw = [[{"role": "user", "content": f"w{k}" + " w3" * (i + 1)}] for i, k in enumerate(wanted_calls)]
    return DataProto.from_dict(non_tensors={"raw_prompt": np.array(raw + [None], dtype=object)[:-1],
                                            "index": np.arange(len(raw))})


def expected_rows(engine: ScriptedEngine, data: DataProto, i: int) -> list[list[int]]:
    """Sample i's rows worked out from the engine's log alone: a logged call whose prompt is a prefix of
    the sample's whole sequence put its tokens (and rows) right after that prompt."""
    mask = data.batch["attention_mask"][i]
    seq = data.batch["input_ids"][i][mask.bool()].tolist()
    prompt_len = int(mask[:data.batch["prompts"].shape[1]].sum())
    n = len(seq) - prompt_len
    rows = [[] for _ in range(n)]
    for call in engine.log:
        p = len(call.prompt)
        if seq[:p] != call.prompt:
            continue
        for k, (token, row) in enumerate(zip(call.tokens, call.rows)):
            if p + k >= len(seq) or seq[p + k] != token:
                break  # cut by the response length, or a token the builder removed after the turn
            rows[p - prompt_len + k] = row
    return rows


class RawLoop(AgentLoopBase):
    """An agent loop that builds its response itself, without verl's continuous-token merge."""

    async def run(self, sampling_params, **kwargs):
        prompt = self.tokenizer.apply_chat_template(list(kwargs["raw_prompt"]), tokenize=True,
                                                    add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        out = await self.server_manager.generate(request_id="raw", prompt_ids=prompt, sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=prompt, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                               num_turns=2, metrics={}, extra_fields=out.extra_fields)


register("mask_replay_raw")(RawLoop)
