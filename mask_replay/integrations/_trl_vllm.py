"""ReplayGRPOTrainer's vLLM mode: the support of every completion token read off TRL's vLLM engine.

Checked against trl 1.16.0, generation/vllm_generation.py: `VLLMGeneration` builds its colocated engine
with `logprobs_mode="processed_logprobs"` (the server is checked for the same flag by GRPOTrainer) and
`generate()` returns (prompt_ids, completion_ids, logprobs, logprob_token_ids), per token up to N + 1
entries sorted by rank when its `logprobs` attribute is N. Replay

- sets that N from `vllm_logprobs_settings` (top_k + 1; top-p / min-p alone: the whole vocabulary, or
  `top_k_cap` + 1 with top_k = cap added to the sampling), so that the finite entries are the support;
- reads each completion's rows with `mask_from_trl_vllm` (its exactness guard refuses a row that may be
  cut off), or, where the colocated engine's own outputs carry `sampling_mask` (vLLM builds that return
  sampling masks; tensor_parallel_size 1), with `mask_from_vllm` from those outputs;
- hands TRL the sampled token's log-prob as entry 0: GRPOTrainer keeps `lp[0]` per token as the
  sampling log-prob, which is the sampled token's only while N = 0 (with N > 0 entry 0 is the rank-1
  token).
Nothing is recomputed on the trainer side.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Optional

from mask_replay.errors import EngineOutputError, InputError
from mask_replay.integrations._shadow import shadowed
from mask_replay.mask import SamplingMask
from mask_replay.sampler.adapters.vllm import mask_from_vllm
from mask_replay.sampler.adapters.vllm_logprobs import VllmLogprobsSettings, mask_from_trl_vllm, vllm_logprobs_settings

__all__ = ["configure_engine", "recording", "sampled_first"]

_SET_BY_REPLAY = {"top_k", "top_p", "min_p", "logprobs", "logprobs_mode"}


def configure_engine(engine, *, temperature: float, top_k: Optional[int], top_p: Optional[float],
                     min_p: Optional[float], vocab_size: int, top_k_cap: Optional[int]) -> VllmLogprobsSettings:
    """Ask TRL's VLLMGeneration for the log-probs that show the whole support (and the top_k cap, if any)."""
    # colocate mode applies generation_kwargs over the sampling settings (and N): a support replay did not ask for
    clash = sorted(set(getattr(engine, "generation_kwargs", None) or {}) & _SET_BY_REPLAY)
    if clash:
        raise InputError(f"generation_kwargs {', '.join(clash)}: with replay these come from GRPOConfig "
                         "(temperature, top_k, top_p, min_p) and from replay (logprobs)")
    settings = vllm_logprobs_settings(temperature=temperature, top_k=top_k or None, top_p=top_p, min_p=min_p,
                                      vocab_size=vocab_size, top_k_cap=top_k_cap)
    engine.logprobs = settings.logprobs
    if top_k_cap is not None and not top_k:
        engine.top_k = settings.sampling["top_k"]
    return settings


def sampled_first(completion_ids, logprobs, token_ids) -> list:
    """Per sequence, per token, [log-prob of the sampled token] (what GRPOTrainer reads as lp[0])."""
    out = []
    for s, (tokens, lps, ids) in enumerate(zip(completion_ids, logprobs, token_ids)):
        seq = []
        for t, (tok, lp, tid) in enumerate(zip(tokens, lps, ids)):
            if tok not in tid:
                raise EngineOutputError(f"completion {s} token {t}: the sampled token {tok} is not among the "
                                        f"{len(tid)} log-probs vLLM returned")
            seq.append([lp[list(tid).index(tok)]])
        out.append(seq)
    return out


def _engine_masks(outputs) -> Optional[SamplingMask]:
    """The engine's own sampling masks, where every completion carries one (else None)."""
    choices = [c for o in outputs for c in getattr(o, "outputs", [])]
    if not choices or any(getattr(c, "sampling_mask", None) is None for c in choices):
        return None
    return mask_from_vllm(outputs)


@contextmanager
def recording(engine, *, temperature: float, vocab_size: int):
    """For the duration, `engine.generate` records; yields a function giving the mask of the local
    completions (rows sequence-major, extras['sequence'] numbering them)."""
    generate, captured = engine.generate, {}
    llm = getattr(engine, "llm", None)
    raw_generate = getattr(llm, "generate", None) if llm is not None else None

    def llm_generate(*args, **kwargs):  # colocate: the engine's outputs, for its sampling masks
        captured["raw"] = raw_generate(*args, **kwargs)
        return captured["raw"]

    def recording_generate(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = generate(*args, **kwargs)
        raw = captured.pop("raw", None)
        masks = _engine_masks(raw) if raw is not None and getattr(engine, "tensor_parallel_size", 1) == 1 else None
        if masks is not None:
            captured["mask"] = masks
            if logprobs is None or token_ids is None:
                return prompt_ids, completion_ids, logprobs, token_ids
            return prompt_ids, completion_ids, sampled_first(completion_ids, logprobs, token_ids), token_ids
        if token_ids is None or logprobs is None:
            raise EngineOutputError("the vLLM generation returned neither sampling masks nor processed log-probs "
                                    "with their token ids: replay cannot know the support (vLLM with "
                                    "logprobs_mode='processed_logprobs' and logprobs >= 1 is needed)")
        captured["mask"] = mask_from_trl_vllm(completion_ids, logprobs, token_ids, requested=engine.logprobs,
                                              temperature=temperature, vocab_size=vocab_size,
                                              top_k=getattr(engine, "top_k", None))
        return prompt_ids, completion_ids, sampled_first(completion_ids, logprobs, token_ids), token_ids

    with ExitStack() as stack:  # instance attributes: shadow the methods for this call only
        stack.enter_context(shadowed(engine, "generate", recording_generate))
        if raw_generate is not None:
            stack.enter_context(shadowed(llm, "generate", llm_generate))
        yield lambda: captured.get("mask")
