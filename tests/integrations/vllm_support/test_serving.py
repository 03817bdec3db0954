"""The OpenAI-compatible responses (integrations/vllm_support/serving.py) on stand-ins shaped like vLLM 0.32's
serving methods: each completion / chat choice gets its completion's support as JSON, in vLLM's own choice
order (request outputs, then their completions; chat by `index`), and a completion without one gets none."""
import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from mask_replay.integrations.vllm_support import _patching, serving, wire
from mask_replay.sampler.adapters.vllm_support import support_rows


def out(index, rows):
    return SimpleNamespace(index=index, sampling_support=None if rows is None else
                           wire.join([np.array(r, np.int32) for r in rows], 20))


class Completion:
    def request_output_to_completion_response(self, final_res_batch, request, *rest):
        return SimpleNamespace(choices=[SimpleNamespace(index=i) for i, _ in
                                        enumerate(o for f in final_res_batch for o in f.outputs)])


class Chat:
    async def chat_completion_full_generator(self, request, result_generator, *rest):
        final = None
        async for res in result_generator:
            final = res
        return SimpleNamespace(choices=[SimpleNamespace(index=o.index) for o in reversed(final.outputs)])


class ChatBatch:
    """vLLM 0.34's batch handler: every generator drained, choices by conversation, then completion."""

    async def chat_completion_full_generator_batch(self, request, generators, *rest):
        finals = []
        for generator in generators:
            async for res in generator:
                final = res
            finals.append(final)
        return SimpleNamespace(choices=[SimpleNamespace(index=i) for i, f in enumerate(finals) for _ in f.outputs])


@pytest.fixture
def patched():
    serving.install(Completion, Chat, ChatBatch)
    yield
    _patching.undo()


def rows(choice):
    s = support_rows(choice.sampling_support, "choice")
    return [s.token_ids[a:b].tolist() for a, b in zip(s.offsets[:-1], s.offsets[1:])]


def test_completion_choices_in_vllms_order(patched):
    batch = [SimpleNamespace(outputs=[out(0, [[1, 2]]), out(1, [[3]])]), SimpleNamespace(outputs=[out(0, [[4], [5]])])]
    response = Completion().request_output_to_completion_response(batch, None)
    assert [rows(c) for c in response.choices] == [[[1, 2]], [[3]], [[4], [5]]]


def test_chat_choices_by_index_from_the_last_output(patched):
    async def results():
        yield SimpleNamespace(outputs=[out(0, [[9]]), out(1, [[8]])])  # an earlier partial output
        yield SimpleNamespace(outputs=[out(0, [[1]]), out(1, [[2, 3]])])

    response = asyncio.run(Chat().chat_completion_full_generator(None, results()))
    assert {c.index: rows(c) for c in response.choices} == {0: [[1]], 1: [[2, 3]]}


def test_a_completion_without_support_gets_no_field(patched):
    response = Completion().request_output_to_completion_response([SimpleNamespace(outputs=[out(0, None)])], None)
    assert not hasattr(response.choices[0], "sampling_support")


def test_batch_chat_choices_by_conversation_from_each_last_output(patched):
    async def results(*steps):
        for step in steps:
            yield SimpleNamespace(outputs=step)

    generators = [results([out(0, [[9]])], [out(0, [[1]])]), results([out(0, [[2, 3]]), out(1, [[4]])])]
    response = asyncio.run(ChatBatch().chat_completion_full_generator_batch(None, generators))
    assert [rows(c) for c in response.choices] == [[[1]], [[2, 3]], [[4]]]
