"""Record the sampling support where transformers samples: `MaskRecorder`, `SupportWarper`, `generate`.

Where the recorder must sit (checked against transformers 5.24.0, generation/utils.py,
`GenerationMixin._get_logits_processor`): `generate` first builds its processors (repetition
penalty, bad words, ...), then appends the `logits_processor` the caller passes, and only then
appends its own sampling warpers, in the order temperature, top-k, top-p, min-p (then typical,
epsilon, eta). With `do_sample=True` and no `top_k` set anywhere, it also applies top_k = 50. A
recorder passed naively therefore sees the scores *before* temperature and truncation and records
the whole vocabulary. Two ways record what was actually sampled from:

- `generate(model, inputs, recorder=MaskRecorder(), temperature=..., top_k=..., top_p=...)` builds the
  warper chain itself (generate's order) with the recorder last, and switches generate's warpers off;
- the explicit chain: `model.generate(..., do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
  logits_processor=[*hf_warpers(...), recorder])` (`recorder.reference` after the temperature
  warper also gives `kept_mass`).

`SupportWarper` replaces the four warpers by one pass of mask_replay's capture kernel (sort-free,
ties at the top-k and top-p cuts kept whole; docs/semantics.md) and records as it goes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Union

import torch

try:
    import transformers
    from transformers import (
        LogitsProcessor,
        LogitsProcessorList,
        MinPLogitsWarper,
        StoppingCriteria,
        StoppingCriteriaList,
        StopStringCriteria,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "mask_replay.integrations.transformers needs transformers: pip install 'mask-replay[hf]'") from exc

from mask_replay._ops import ops
from mask_replay.csr import segment_logsumexp
from mask_replay.integrations.transformers.steplog import StepLog
from mask_replay.mask import SamplingMask
from mask_replay.params import describe, expand_params

__all__ = ["MaskRecorder", "SupportWarper", "generate", "hf_warpers", "WARPERS_OFF"]

# generate() arguments that switch off every warper it would append itself (including its default
# top_k = 50), so that the caller's chain is the only truncation applied; only those this version of
# transformers knows (top_h is recent).
WARPERS_OFF = {key: value for key, value in dict(
    temperature=1.0, top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
    top_h=None).items() if hasattr(transformers.GenerationConfig(), key)}


def _check_sampling(temperature, top_k, top_p, min_p):
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be a non-negative integer or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1] or None, got {min_p!r}")


def hf_warpers(temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
               min_p: Optional[float] = None, *, reference: Optional[LogitsProcessor] = None) -> list:
    """transformers' own warpers for these parameters, in generate's order (temperature, top-k, top-p,
    min-p) and with generate's skip rules; `reference` is placed right after the temperature warper."""
    _check_sampling(temperature, top_k, top_p, min_p)
    chain = []
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(float(temperature)))
    if reference is not None:
        chain.append(reference)
    if top_k:
        chain.append(TopKLogitsWarper(top_k=int(top_k)))
    if top_p is not None and top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=float(top_p)))
    if min_p is not None:
        chain.append(MinPLogitsWarper(min_p=float(min_p)))
    return chain


def _eos_of(output_or_model) -> object:
    config = getattr(output_or_model, "generation_config", None)
    return getattr(config, "eos_token_id", None)


def _sequences(output) -> torch.Tensor:
    return output.sequences if hasattr(output, "sequences") else output


class _Reference(LogitsProcessor):
    """Sees the scores before truncation (after temperature) so the recorder can report kept_mass."""

    def __init__(self, owner: "MaskRecorder"):
        self.owner = owner

    def __call__(self, input_ids, scores):
        self.owner._ref_lse = torch.logsumexp(scores.float(), dim=-1)
        self.owner._ref_step = self.owner._log.steps
        return scores


class _Watched(StoppingCriteria):
    """A stopping criterion whose per-sequence verdicts the recorder sees: generate does not tell a
    logits processor which sequences are finished, and a sequence stopped by a criterion (not by an
    EOS) is padded from then on. Without this, the padding positions would be kept as sampled rows."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __call__(self, input_ids, scores, **kwargs):
        done = self.inner(input_ids, scores, **kwargs)
        self.log.stopped(input_ids, done)
        return done


class _Recording:
    """What MaskRecorder and SupportWarper share: the step log and mask()."""

    def watch(self, stopping_criteria) -> StoppingCriteriaList:
        """The caller's stopping criteria, wrapped so that a sequence one of them stops ends its rows
        there (pass the result to model.generate as `stopping_criteria`; generate() does it itself)."""
        return StoppingCriteriaList([_Watched(c, self._log) for c in (stopping_criteria or [])])

    temperature: Optional[float] = None
    eos_token_id = None

    def reset(self) -> None:
        """Forget the recorded generation (generate() does this before it starts)."""
        self._log.reset()

    @property
    def steps(self) -> int:
        return self._log.steps

    def mask(self, output, eos_token_id=None) -> SamplingMask:
        """One SamplingMask row per generated token, aligned with `output` (generate's return value,
        or its sequences): rows sequence-major, those after a sequence's first EOS dropped (the EOS
        itself kept). extras `sequence` (batch row of `output.sequences`) and `position` (0-based
        index among the generated tokens); `sampled`; `logprobs` of the sampled token under the
        processed scores; `kept_mass` when the scores before truncation were seen."""
        eos = eos_token_id if eos_token_id is not None else self.eos_token_id
        extras = {"temperature": self.temperature} if self.temperature is not None else None
        return self._log.build(_sequences(output), eos, metadata=self._metadata(), extras=extras)


class MaskRecorder(_Recording, LogitsProcessor):
    """Last logits processor of a generation: records the finite support of the scores it receives.

    Per step it keeps a bool [B, V] on the scores' device and two [B] tensors; every `flush_every`
    steps the pending steps are compacted to CSR (one host sync), which bounds memory. It returns
    the scores unchanged. Place `recorder.reference` after the temperature warper (before the
    truncating ones) to get `kept_mass`. entry_logprobs=True also records every support entry's
    log-prob under the processed scores (the mask's `entry_logprobs`; the sampled entry is `logprobs`
    bit for bit); it keeps the pending steps' float32 [B, V] log-probs until each flush.
    """

    def __init__(self, flush_every: int = 16, entry_logprobs: bool = False):
        self._log = StepLog(flush_every, entry_logprobs)
        self.reference = _Reference(self)
        self._ref_lse, self._ref_step = None, -1

    def reset(self) -> None:
        super().reset()
        self._ref_lse, self._ref_step = None, -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self._log.begin(input_ids, scores)
        lse = torch.logsumexp(scores.float(), dim=-1)
        # the entries' log-probs by the sampled token's arithmetic (StepLog._gather): bit for bit
        self._log.add_dense(torch.isfinite(scores),
                            scores.float() - lse.float()[:, None] if self._log.entry_logprobs else None)
        kept = torch.exp(lse - self._ref_lse) if self._ref_step == self._log.steps else None
        self._log.end(scores, lse, kept)
        return scores

    def _metadata(self) -> dict:
        return {"recorded_by": f"mask_replay.integrations.transformers.MaskRecorder "
                               f"(transformers {transformers.__version__})"}


class SupportWarper(_Recording, LogitsProcessor):
    """Drop-in for transformers' temperature/top-k/top-p/min-p warpers: computes the support with
    mask_replay.capture (exact semantics: min-p, then top-k with ties at the k-th value kept, then
    top-p with tie groups kept whole), returns the scores divided by the temperature on the support
    and -inf elsewhere, and records the mask in the same pass.

    The support can differ from transformers' on ties and on its order (transformers applies min-p
    after top-p); docs/integrations/transformers.md. On CUDA, capture syncs once per step (its output size).
    entry_logprobs=True also records every support entry's log-prob (O(support) per step).
    """

    def __init__(self, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 min_p: Optional[float] = None, record: bool = True, entry_logprobs: bool = False):
        _check_sampling(temperature, top_k, top_p, min_p)
        self.temperature = float(temperature)
        self.top_k, self.top_p, self.min_p = top_k or None, top_p, min_p
        self.record = record
        self._log = StepLog(entry_logprobs=entry_logprobs)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.dim() != 2:
            raise ValueError(f"scores must be [batch, vocab], got shape {tuple(scores.shape)}")
        if self.record:
            self._log.begin(input_ids, scores)
        n = scores.shape[0]
        t, k, p, mp = expand_params(n, scores.device, self.temperature, self.top_k, self.top_p, self.min_p)
        # one capture pass gives the support and, when recording, the full normaliser for kept_mass
        token_ids, offsets, logz = ops.capture(scores, t, k, p, mp, self.record)
        support = SamplingMask(token_ids, offsets)
        rows, ids = support.row_ids(), token_ids.long()
        values = scores[rows, ids].float() / t[rows]  # capture's x = float32(z) / float32(T)
        out = torch.full(scores.shape, float("-inf"), dtype=torch.float32, device=scores.device)
        out[rows, ids] = values
        if self.record:
            lse = segment_logsumexp(values.double(), rows, n)  # O(support), not another pass over [B, V]
            # the entries by the sampled token's arithmetic (StepLog._gather on `out`): bit for bit
            self._log.add_csr(token_ids, support.lengths(),
                              values - lse.float()[rows] if self._log.entry_logprobs else None)
            self._log.end(out, lse, torch.exp(lse - logz.double()).float())
        return out

    def _metadata(self) -> dict:
        return {"recorded_by": "mask_replay.integrations.transformers.SupportWarper",
                "params": describe(self.temperature, self.top_k, self.top_p, self.min_p)}


def generate(model, inputs, recorder: Union[MaskRecorder, SupportWarper, None] = None, *,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             min_p: Optional[float] = None, **kwargs):
    """`model.generate` with sampling, recording the support actually sampled from.

    `inputs`: input ids [B, L] or a tokenizer's output (a mapping, e.g. with an attention_mask).
    With a MaskRecorder (the default: a new one) the sampling parameters build transformers' own
    warpers in generate's order, the recorder last; with a SupportWarper, the warper's own parameters
    are the sampling and passing any here is an error. generate's warpers are switched off either
    way; other generate arguments pass through. Returns (output, mask); output is generate's dict
    output (`return_dict_in_generate=True`).
    """
    recorder = MaskRecorder() if recorder is None else recorder
    if kwargs.get("num_beams", 1) != 1:
        raise ValueError("generate: beam search is not supported (num_beams must be 1)")
    clash = sorted(set(kwargs) & (set(WARPERS_OFF) | {"do_sample"}))
    if clash:
        raise ValueError(f"generate: pass {', '.join(clash)} as this function's sampling arguments, "
                         "not to model.generate")
    if isinstance(recorder, SupportWarper):
        if (temperature, top_k, top_p, min_p) != (1.0, None, None, None):
            raise ValueError("generate: with a SupportWarper the sampling parameters are the warper's; "
                             "pass none here")
        chain = [recorder]
    elif isinstance(recorder, MaskRecorder):
        recorder.temperature = float(temperature)
        chain = hf_warpers(temperature, top_k, top_p, min_p, reference=recorder.reference) + [recorder]
    else:
        raise TypeError(f"recorder must be a MaskRecorder or a SupportWarper, got {type(recorder).__name__}")
    user = list(kwargs.pop("logits_processor", None) or [])
    criteria = list(kwargs.pop("stopping_criteria", None) or [])
    if kwargs.get("stop_strings") is not None:  # built here so that its per-sequence stops are seen
        if kwargs.get("tokenizer") is None:
            raise ValueError("generate: stop_strings needs tokenizer=... (as model.generate does)")
        criteria.append(StopStringCriteria(tokenizer=kwargs["tokenizer"], stop_strings=kwargs.pop("stop_strings")))
    recorder.reset()
    recorder.eos_token_id = _eos_of(model) if kwargs.get("eos_token_id") is None else kwargs["eos_token_id"]
    call = dict(kwargs, do_sample=True, return_dict_in_generate=True,
                logits_processor=LogitsProcessorList(user + chain),
                stopping_criteria=recorder.watch(criteria), **WARPERS_OFF)
    output = model.generate(**inputs, **call) if isinstance(inputs, Mapping) else model.generate(inputs, **call)
    return output, recorder.mask(output)
