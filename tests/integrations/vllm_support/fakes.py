"""Stand-ins for the vLLM 0.32.0 classes the plugin patches, written from that release's shapes (no vLLM
needed): `LogprobsTensors` / `LogprobsLists` (vllm/v1/outputs.py: NamedTuples, ids int32 [rows, N + 1];
`tolists` to numpy after the device-to-host copy, `slice_request` one request's rows for the scheduler),
the V1 `Sampler` (vllm/v1/sample/sampler.py: forward -> sample -> gather_logprobs, greedy rows by
temperature < 1e-5), `LogprobsProcessor` (vllm/v1/engine/logprobs.py: one row per new token) and
`RequestState._new_completion_output` (vllm/v1/engine/output_processor.py: all tokens, or the new ones in
DELTA mode). The sampler and output classes are created per test, and the NamedTuples' methods are
wrapped only inside fixtures that undo it, so that patches never leak between tests."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np
import torch

SAMPLING_EPS = 1e-5


class LogprobsLists(NamedTuple):
    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: Optional[list] = None

    def slice_request(self, req_idx: int, num_positions: int):
        if self.cu_num_generated_tokens is not None:
            req_idx = self.cu_num_generated_tokens[req_idx]
        end = req_idx + num_positions
        return LogprobsLists(self.logprob_token_ids[req_idx:end], self.logprobs[req_idx:end],
                             self.sampled_token_ranks[req_idx:end], None)


class LogprobsTensors(NamedTuple):
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor
    cu_num_generated_tokens: Optional[list] = None
    cu_num_generated_tokens_tensor: Optional[torch.Tensor] = None

    def tolists(self, cu_num_generated_tokens=None):
        cu = self.cu_num_generated_tokens if cu_num_generated_tokens is None else cu_num_generated_tokens
        return LogprobsLists(self.logprob_token_ids.cpu().numpy(), self.logprobs.cpu().numpy(),
                             self.selected_token_ranks.cpu().numpy(), cu)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs_tensors: Optional[LogprobsTensors]


@dataclass
class SamplingMetadata:
    temperature: Optional[torch.Tensor]
    all_greedy: bool
    all_random: bool
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    max_num_logprobs: Optional[int] = 0
    logprob_token_ids: dict = field(default_factory=dict)


def sampler_class():
    """A fresh V1-shaped Sampler: temperature, top-k / top-p by masking to -inf, processed log-probs."""

    class Sampler:
        def __init__(self, logprobs_mode="raw_logprobs"):
            self.logprobs_mode = logprobs_mode

        def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
            md = sampling_metadata
            sampled, processed = self.sample(logits.float(), md)
            if md.max_num_logprobs is None:
                tensors = None
            elif md.max_num_logprobs == -1:
                tensors = LogprobsTensors(torch.empty(0), processed, torch.empty(0))
            else:
                top = torch.topk(processed, md.max_num_logprobs, dim=-1)
                ids = torch.cat([sampled[:, None], top.indices], 1).to(torch.int32)
                lps = torch.cat([processed.gather(1, sampled[:, None]), top.values], 1)
                tensors = LogprobsTensors(ids, lps, torch.zeros(len(sampled), dtype=torch.int64))
            return SamplerOutput(sampled.to(torch.int32)[:, None], tensors)

        def sample(self, logits, sampling_metadata):
            md = sampling_metadata
            greedy = logits.argmax(-1)
            if md.all_greedy:
                return greedy, logits.log_softmax(-1) if md.max_num_logprobs is not None else None
            temp = md.temperature if md.all_random else torch.where(md.temperature < SAMPLING_EPS, 1.0, md.temperature)
            z = logits / temp[:, None]
            if md.top_k is not None:
                kth = torch.stack([row.topk(int(k)).values[-1] for row, k in zip(z, md.top_k)])
                z = z.masked_fill(z < kth[:, None], float("-inf"))
            if md.top_p is not None:
                order = z.argsort(-1, descending=True)
                probs = z.gather(1, order).softmax(-1)
                drop = (probs.cumsum(-1) - probs) > md.top_p[:, None]
                z = z.scatter(1, order, z.gather(1, order).masked_fill(drop, float("-inf")))
            processed = z.log_softmax(-1)
            drawn = torch.multinomial(processed.exp(), 1, generator=torch.Generator().manual_seed(0))[:, 0]
            if md.all_random:
                return drawn, processed
            return torch.where(md.temperature < SAMPLING_EPS, greedy, drawn), processed

    return Sampler


class OutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class CompletionOutput:
    index: int
    token_ids: list
    logprobs: Optional[list]


def output_classes():
    """Fresh LogprobsProcessor / RequestState stand-ins."""

    class LogprobsProcessor:
        def __init__(self):
            self.logprobs, self.seen_ids = [], []

        def _update_sample_logprobs(self, logprobs_lists):
            for ids, lps in zip(logprobs_lists.logprob_token_ids, logprobs_lists.logprobs):
                assert ids.shape == lps.shape  # vLLM's own loop zips them entry by entry
                self.seen_ids.append(ids.tolist())
                self.logprobs.append(dict(zip(ids.tolist(), lps.tolist())))

    class RequestState:
        def __init__(self, output_kind=OutputKind.FINAL_ONLY, request_id="req-0"):
            self.output_kind, self.logprobs_processor, self.tokens = output_kind, LogprobsProcessor(), []
            self.request_id = request_id

        def _new_completion_output(self, token_ids, finish_reason, stop_reason):
            delta = self.output_kind == OutputKind.DELTA
            tokens = token_ids if delta else self.tokens
            lps = self.logprobs_processor.logprobs
            return CompletionOutput(0, list(tokens), lps[-len(tokens):] if delta and tokens else lps)

    return LogprobsProcessor, RequestState
