"""Compare an engine's reported log-probs (a dump's `rollout_logprobs`) with capture's own.

Both are log-probs of the same sampled token over a support, so rows that disagree beyond float
noise say that capture's support is not the one the engine sampled from. Each row gets a cause code
(`CAUSES`); `summarise` turns them into the count, worst row and likely cause of the report.
"""
from __future__ import annotations

from typing import Sequence

import torch

from mask_replay.trainer.replay import full_logprobs

DEFAULT_TOLERANCE = 1e-4  # nats; float32 log-softmax noise on a 150k vocabulary is ~1e-6

# code -> likely cause (0 = agrees; -1 = the row's dump has no rollout_logprobs)
CAUSES = {
    -1: "not compared (no rollout_logprobs)",
    0: "agrees",
    1: "engine log-prob higher: the engine's support is smaller (a tie group or threshold split "
       "differently; try the engine's --profile)",
    2: "engine log-prob lower: the engine's support is larger (another filter order, e.g. "
       "SGLang's joint top-p or transformers' min-p after top-p; try the engine's --profile)",
    3: "engine log-prob equals the full-vocabulary log-softmax: the engine reported raw log-probs "
       "(vLLM logprobs_mode='processed_logprobs' reports the sampled distribution)",
    4: "sampled token outside capture's support",
    5: "engine log-prob is NaN or +inf",
}


def compare_logprobs(engine: torch.Tensor, captured: torch.Tensor, full: Sequence[torch.Tensor] = (),
                     tolerance: float = DEFAULT_TOLERANCE) -> torch.Tensor:
    """Cause code per row (int8, see CAUSES). `engine`, `captured`: [N] log-probs of the sampled
    token (captured -inf where the token is outside capture's support); `full`: [N] log-probs of it
    over the whole vocabulary (at the row's temperature, and at T = 1 as vLLM's raw_logprobs are),
    to recognise engine log-probs that were never processed."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    engine = engine.to(torch.float64).cpu()
    captured = captured.to(torch.float64).cpu()
    if engine.shape != captured.shape:
        raise ValueError(f"rollout_logprobs has shape {tuple(engine.shape)}, expected {tuple(captured.shape)}")
    code = torch.zeros(engine.shape, dtype=torch.int8)
    diff = engine - captured
    code[diff > tolerance] = 1
    code[diff < -tolerance] = 2
    for f in full:
        raw = (code != 0) & ((engine - f.to(torch.float64).cpu()).abs() <= tolerance)
        code[raw] = 3
    code[torch.isneginf(captured)] = 4
    code[torch.isnan(engine) | torch.isposinf(engine)] = 5
    return code


def summarise(code: torch.Tensor, engine: torch.Tensor, captured: torch.Tensor,
              tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """JSON-able report: rows compared, rows disagreeing, the worst row and the dominant cause."""
    code = code.cpu()
    compared = code >= 0
    bad = code > 0
    out = {"tolerance": tolerance, "rows_compared": int(compared.sum()), "rows": int(bad.sum())}
    if not bool(bad.any()):
        return out
    gap = (engine.double().cpu() - captured.double().cpu()).abs()
    gap = torch.where(bad & torch.isfinite(gap), gap, torch.full_like(gap, -1.0))
    worst = int(torch.argmax(gap)) if bool((gap >= 0).any()) else int(torch.nonzero(bad)[0])
    counts = {int(c): int((code == c).sum()) for c in CAUSES if c > 0 and bool((code == c).any())}
    top = max(counts, key=counts.get)
    out.update({
        "worst_row": worst,
        "worst_gap": float(gap[worst]) if gap[worst] >= 0 else None,
        "by_cause": {CAUSES[c]: n for c, n in counts.items()},
        "likely_cause": CAUSES[top],
    })
    return out


def check_rows(logits: torch.Tensor, sampled: torch.Tensor, temperature, engine: torch.Tensor,
               captured: torch.Tensor, tolerance: float = DEFAULT_TOLERANCE) -> torch.Tensor:
    """Cause codes for one chunk of a dump: `engine` (rollout_logprobs) against `captured` (capture's
    log-probs), with the full-vocabulary log-probs at T and at T = 1 computed from `logits` to tell
    unprocessed engine log-probs apart. Greedy rows (T == 0) are compared at T = 1."""

    n = logits.shape[0]
    t = temperature if isinstance(temperature, torch.Tensor) else torch.full((n,), float(temperature))
    t = t.to(device=logits.device, dtype=torch.float32).reshape(-1).expand(n)
    t = torch.where(t == 0, torch.ones_like(t), t)
    with torch.no_grad():
        full = [full_logprobs(logits, sampled, t), full_logprobs(logits, sampled, 1.0)]
    return compare_logprobs(engine, captured, full, tolerance)
