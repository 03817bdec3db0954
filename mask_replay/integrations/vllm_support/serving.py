"""The OpenAI-compatible server: each choice of /v1/completions and /v1/chat/completions carries its
completion's support as `sampling_support` (the JSON of `mask_replay.sampler.adapters.vllm_support`).

Follows vLLM 0.32.0's `vllm/entrypoints/openai/completion/serving.py`
(`OpenAIServingCompletion.request_output_to_completion_response`: one choice per (request output,
completion), in that order) and `vllm/entrypoints/openai/chat_completion/serving.py`
(`OpenAIServingChat.chat_completion_full_generator`: the last `RequestOutput` of the result generator, one
choice per completion, `index` = the completion's index). Both choice classes allow extra fields
(`OpenAIBaseModel`, extra="allow"). Streaming responses carry no support (documented).
"""
from __future__ import annotations

from mask_replay.integrations.vllm_support import _patching
from mask_replay.integrations.vllm_support.outputs import ATTRIBUTE
from mask_replay.sampler.adapters.vllm_support import support_to_json


def install(completion_cls, chat_cls) -> None:
    _patching.wrap(completion_cls, "request_output_to_completion_response", _completion_response)
    _patching.wrap(chat_cls, "chat_completion_full_generator", _chat_response)


def _attach(choice, output) -> None:
    support = getattr(output, ATTRIBUTE, None)
    if support is not None:
        setattr(choice, ATTRIBUTE, support_to_json(support))


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
