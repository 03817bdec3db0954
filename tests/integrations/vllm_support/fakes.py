"""Stand-ins for the vLLM 0.32.0 classes the plugin patches, written from that release's shapes (no vLLM
needed): `LogprobsTensors` / `LogprobsLists` (vllm/v1/outputs.py: NamedTuples, ids int32 [rows, N + 1];
`tolists` to numpy after the device-to-host copy, `slice_request` one request's rows for the scheduler),
the V1 `Sampler` (vllm/v1/sample/sampler.py: forward -> sample -> gather_logprobs, greedy rows by
temperature < 1e-5), `LogprobsProcessor` (vllm/v1/engine/logprobs.py: one row per new token) and
`RequestState._new_completion_output` (vllm/v1/engine/output_processor.py: all tokens, or the new ones in
DELTA mode); and Model Runner V2's samplers (0.34.0, below). The sampler and output classes are created
per test, and the NamedTuples' methods are wrapped only inside fixtures that undo it, so that patches never
leak between tests."""
from __future__ import annotations

import enum
import math
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


# ---- Model Runner V2 (vllm/v1/worker/gpu/sample/sampler.py `Sampler`, vllm/v1/worker/cpu/sampler.py
# `CPUSampler`, 0.34.0): per-request states keyed by slot (`add_request`), `__call__(logits, input_batch)` ->
# `sample(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos,
# seq_lens_upper_bound_np, return_logprobs)` -> (sampled int64, processed fp32 or the logits untouched when
# no row needs processing); processing = penalties, temperature (0 -> left unscaled), min-p, top-k / top-p
# to -inf; temperature 0 rows take the argmax, others a seeded Gumbel draw; log-prob ids int64
# [rows, 1 + N] (`compute_topk_scores`); the fused (FlashInfer) draw skips top-k / top-p on the returned
# tensor and is used only when no processed log-probs are asked for.

PROCESSED_LOGPROBS_MODES = ("processed_logprobs", "processed_logits")
NO_LOGPROBS = -1


class UvaBackedTensor:
    """GPU SamplingStates' per-slot buffers: a host array and its device view."""

    def __init__(self, size, dtype, fill):
        self.gpu = torch.full((size,), fill, dtype=dtype)
        self.np = self.gpu.numpy()


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    logprobs: Optional[int] = 0


@dataclass
class InputBatch:
    idx_mapping_np: np.ndarray
    output_tokens: list  # per batch row: the tokens generated so far (for the penalty)
    positions: torch.Tensor = None

    @property
    def idx_mapping(self):
        return torch.from_numpy(self.idx_mapping_np.astype(np.int64))

    expanded_idx_mapping = idx_mapping
    num_reqs = property(lambda self: len(self.idx_mapping_np))


@dataclass
class V2SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs_tensors: Optional[LogprobsTensors]
    num_sampled: torch.Tensor = None
    sampling_mask_tensors: object = None


def v2_sampler_class(cpu=False, fused=False):
    """A fresh MRV2-shaped Sampler (cpu=True: CPUSampler's state layout, `temperature` a tensor beside
    `temperature_np`); fused=True: the FlashInfer draw is available."""

    class States:
        def __init__(self, max_num_reqs, vocab_size):
            self.vocab_size = vocab_size
            if cpu:
                self.temperature = torch.zeros(max_num_reqs)
                self.temperature_np = self.temperature.numpy()
            else:
                self.temperature = UvaBackedTensor(max_num_reqs, torch.float32, 0.0)
            self.params = [SamplingParams() for _ in range(max_num_reqs)]

        def temperatures_np(self):
            return self.temperature_np if cpu else self.temperature.np

    class Sampler:
        def __init__(self, vllm_config, max_num_reqs, vocab_size, device, req_states,
                     logprobs_mode="raw_logprobs", num_speculative_tokens=1, use_fp64_gumbel=False,
                     enable_trace_replay=False, return_sampling_mask=False, custom_logits_processors=()):
            self.logprobs_mode = logprobs_mode
            self.sampling_states = States(max_num_reqs, vocab_size)
            self.trace_replay_state = object() if enable_trace_replay else None
            self.logits_processors = [*custom_logits_processors]
            self.use_flashinfer = fused and not return_sampling_mask

        def add_request(self, req_idx, params):
            self.sampling_states.params[req_idx] = params
            self.sampling_states.temperatures_np()[req_idx] = params.temperature

        def __call__(self, logits, input_batch):
            idx = input_batch.idx_mapping_np
            wants = [self.sampling_states.params[i].logprobs for i in idx]
            dims = None if all(w is None for w in wants) else max(w for w in wants if w is not None)
            self._batch = input_batch
            sampled, processed = self.sample(logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
                                             idx, None, None, None, None, return_logprobs=dims is not None)
            tensors = None
            if dims is not None:
                scored = processed if self.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
                n = logits.shape[1] if dims == -1 else dims
                ids = sampled[:, None]
                if n:
                    ids = torch.cat([ids, torch.topk(scored, n, dim=-1).indices], 1)
                lps = scored.float().log_softmax(-1).gather(1, ids)
                tensors = LogprobsTensors(ids, lps, torch.zeros(len(ids), dtype=torch.int64))
            return V2SamplerOutput(sampled.view(-1, 1), tensors, torch.ones(len(idx), dtype=torch.int32))

        def sample(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids,
                   expanded_local_pos, seq_lens_upper_bound_np, return_logprobs=False):
            params = [self.sampling_states.params[i] for i in idx_mapping_np]
            vocab = logits.shape[1]
            needs = [p.temperature != 0 and (p.temperature != 1 or p.min_p or 0 < p.top_k < vocab or p.top_p < 1)
                     or p.presence_penalty for p in params]
            z = logits
            if any(needs):
                z = logits.float().clone()
                for r, (p, prior) in enumerate(zip(params, self._batch.output_tokens)):
                    if p.presence_penalty and prior:
                        z[r, torch.tensor(sorted(set(prior)))] -= p.presence_penalty
                    if p.temperature not in (0.0, 1.0):
                        z[r] /= p.temperature
                    if p.min_p:
                        z[r] = z[r].masked_fill(z[r] < z[r].max() + math.log(p.min_p), float("-inf"))
            fused = self.use_flashinfer and not (
                (return_logprobs and self.logprobs_mode in PROCESSED_LOGPROBS_MODES)
                or any(p.temperature == 0 for p in params))
            cut = z if fused else self._top_k_top_p(z, params)
            drawn = []
            for r, p in enumerate(params):
                if p.temperature == 0:
                    drawn.append(int(cut[r].argmax()))
                    continue
                gen = torch.Generator().manual_seed(p.seed if p.seed is not None else 1234 + r)
                row = self._top_k_top_p(z[r:r + 1], [p])[0] if fused else cut[r]
                noise = -torch.log(-torch.log(torch.rand(vocab, generator=gen)))
                drawn.append(int((row.float() + noise).argmax()))
            return torch.tensor(drawn, dtype=torch.int64), cut

        @staticmethod
        def _top_k_top_p(z, params):
            vocab = z.shape[1]
            if all(not (0 < p.top_k < vocab) and p.top_p >= 1 for p in params):
                return z
            z = z.float().clone()
            for r, p in enumerate(params):
                if 0 < p.top_k < vocab:
                    kth = z[r].topk(p.top_k).values[-1]
                    z[r] = z[r].masked_fill(z[r] < kth, float("-inf"))
                if p.top_p < 1:
                    order = z[r].argsort(descending=True)
                    probs = z[r, order].softmax(-1)
                    drop = (probs.cumsum(-1) - probs) > p.top_p
                    z[r, order[drop]] = float("-inf")
            return z

    Sampler.__name__ = Sampler.__qualname__ = "CPUSampler" if cpu else "Sampler"
    return Sampler
