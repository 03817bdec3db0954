"""The OpenAI-compatible server: each choice of /v1/completions and /v1/chat/completions carries its
completion's support as `sampling_support` (the JSON of `mask_replay.sampler.adapters.vllm_support`).

Follows vLLM 0.32.0's `vllm/entrypoints/openai/completion/serving.py`
(`OpenAIServingCompletion.request_output_to_completion_response`: one choice per (request output,
completion), in that order) and `vllm/entrypoints/openai/chat_completion/serving.py`
(`OpenAIServingChat.chat_completion_full_generator`: the last `RequestOutput` of the result generator, one
choice per completion, `index` = the completion's index); and vLLM 0.34.0's
`vllm/entrypoints/openai/chat_completion/batch_serving.py` (`OpenAIServingChatBatch.
chat_completion_full_generator_batch`, /v1/chat/completions/batch: one generator per conversation, choices
in conversation order, then completion order, `index` = the conversation's). The choice classes allow extra
fields (`OpenAIBaseModel`, extra="allow"). Streaming responses carry no support (documented).
"""
from __future__ import annotations

from mask_replay.integrations.vllm_support import _patching
from mask_replay.sampler.adapters.vllm_support import FIELD, support_to_json


def install(completion_cls, chat_cls, chat_batch_cls=None) -> None:
    """chat_batch_cls: vLLM's batch chat handler where the release has one (0.34), else None."""
    _patching.wrap(completion_cls, "request_output_to_completion_response", _completion_response)
    _patching.wrap(chat_cls, "chat_completion_full_generator", _chat_response)
    if chat_batch_cls is not None:
        _patching.wrap(chat_batch_cls, "chat_completion_full_generator_batch", _chat_batch_response)


def _attach(choice, output) -> None:
    support = getattr(output, FIELD, None)
    if support is not None:
        setattr(choice, FIELD, support_to_json(support))


def _completion_response(original):
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        response = original(self, final_res_batch, *args, **kwargs)
        outputs = [output for final in final_res_batch for output in final.outputs]
        for choice, output in zip(response.choices, outputs):
            _attach(choice, output)
        return response
    return request_output_to_completion_response


def _chat_response(original):
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        last = []

        async def watched():
            async for res in result_generator:
                last[:] = [res]
                yield res

        response = await original(self, request, watched(), *args, **kwargs)
        if last and hasattr(response, "choices"):
            by_index = {output.index: output for output in last[0].outputs}
            for choice in response.choices:
                if choice.index in by_index:
                    _attach(choice, by_index[choice.index])
        return response
    return chat_completion_full_generator


def _chat_batch_response(original):
    async def chat_completion_full_generator_batch(self, request, generators, *args, **kwargs):
        last = [None] * len(generators)

        async def watched(i, generator):
            async for res in generator:
                last[i] = res
                yield res

        response = await original(self, request, [watched(i, g) for i, g in enumerate(generators)], *args, **kwargs)
        if hasattr(response, "choices") and all(res is not None for res in last):
            outputs = [output for res in last for output in res.outputs]
            if len(outputs) == len(response.choices):
                for choice, output in zip(response.choices, outputs):
                    _attach(choice, output)
        return response
    return chat_completion_full_generator_batch
