"""A synthetic RL run that shows what replay fixes, built from nothing but a seed.

Each step, a policy emits LLM-like logits: a Zipf (unigram-like) prior over the vocabulary, per-context
noise, and a few context-specific candidate tokens whose lead over the rest varies from row to row
(so supports range from one token to hundreds). Over the steps the policy grows more confident, as RL
policies do. The rollout engine samples with top-p from the truncated distribution in fp32 and
reports its own log-probs; the trainer recomputes the same logits in bf16 (with tiny kernel noise).
Without replay the trainer scores the sampled token over the full vocabulary, so the importance
ratio sits at the kept mass (< 1); with replay it scores over the recorded support and only the
numerical mismatch remains.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mask_replay.errors import DumpError
from mask_replay.files import safetensors_stream
from mask_replay.files.safe_output import write_text
from mask_replay.sampler.capture import capture
from mask_replay.tools.capture import capture_dumps
from mask_replay.tools.plots import plot_report
from mask_replay.tools.score import report_json, score_files

ZIPF_EXPONENT = 1.1
CANDIDATES = 24  # context-specific tokens per row
SEQUENCE_LEN = 64  # tokens per sequence (for sequence-level ratios)
TRAINER_NOISE = 0.02
# Lead of the top candidate over the background (logits) and its drift per step; spread of the
# gaps between candidates. Tuned so supports look like LLM ones under top_p=0.9: median of a few
# tokens, many singletons, a long tail of uncertain rows with hundreds.
LEAD_MEAN, LEAD_STD, LEAD_DRIFT = 8.5, 3.0, 0.25
GAP_LOG_MEAN, GAP_LOG_STD = 1.0, 0.8


@dataclass
class DemoConfig:
    vocab: int = 32768
    steps: int = 6
    tokens_per_step: int = 256
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.9


def _step_logits(cfg: DemoConfig, prior: torch.Tensor, step: int, gen: torch.Generator) -> torch.Tensor:
    n, v = cfg.tokens_per_step, cfg.vocab
    z = prior + torch.randn(n, v, generator=gen)
    # Confidence of each context: how far the candidates lead the background. It drifts up by step.
    lead = LEAD_MEAN + LEAD_STD * torch.randn(n, 1, generator=gen) + LEAD_DRIFT * step
    gap_scale = torch.exp(GAP_LOG_MEAN + GAP_LOG_STD * torch.randn(n, 1, generator=gen))
    gaps = torch.cumsum(torch.empty(n, CANDIDATES).exponential_(1.0, generator=gen) * gap_scale, dim=1)
    cand = torch.randint(0, v, (n, CANDIDATES), generator=gen)
    z.scatter_reduce_(1, cand, lead - gaps + gaps[:, :1], reduce="amax")
    return z


def _sample_from_support(logits, mask, temperature, gen):
    """Sample each row from softmax(x / T) restricted to its support, touching only the nnz gathered
    logits (Gumbel-max per CSR segment); also the engine's log-prob of the sampled token."""
    rows = mask.row_ids()
    ids = mask.token_ids.long()
    x = logits[rows, ids].double() / temperature
    n = mask.num_rows
    key = x - torch.log(-torch.log(torch.rand(x.shape, generator=gen, dtype=torch.float64)))
    best = torch.full((n,), float("-inf"), dtype=torch.float64).scatter_reduce(0, rows, key, "amax")
    hit = torch.nonzero(key == best[rows]).flatten()
    first = torch.full((n,), x.numel(), dtype=torch.int64).scatter_reduce(0, rows[hit], hit, "amin")
    sampled = ids[first]
    mx = torch.full((n,), float("-inf"), dtype=torch.float64).scatter_reduce(0, rows, x, "amax")
    lse = mx + torch.log(torch.zeros(n, dtype=torch.float64).index_add_(0, rows, torch.exp(x - mx[rows])))
    return sampled, (x[first] - lse).float()


def generate_run(out_dir, cfg: DemoConfig, progress: bool = False) -> tuple[str, str]:
    """Write rollout.safetensors and training.safetensors into out_dir; returns their paths."""

    gen = torch.Generator().manual_seed(cfg.seed)
    rank = torch.empty(cfg.vocab)
    rank[torch.randperm(cfg.vocab, generator=gen)] = torch.arange(1, cfg.vocab + 1, dtype=torch.float32)
    prior = -ZIPF_EXPONENT * torch.log(rank)

    n = cfg.steps * cfg.tokens_per_step
    rollout_logits = torch.empty(n, cfg.vocab, dtype=torch.float32)
    training_logits = torch.empty(n, cfg.vocab, dtype=torch.bfloat16)
    sampled = torch.empty(n, dtype=torch.int64)
    rollout_lp = torch.empty(n, dtype=torch.float32)
    from tqdm import tqdm

    for s in tqdm(range(cfg.steps), desc="generate", unit="step", disable=not progress or None, leave=False):
        a, b = s * cfg.tokens_per_step, (s + 1) * cfg.tokens_per_step
        z = _step_logits(cfg, prior, s, gen)
        rollout_logits[a:b] = z
        support = capture(z, temperature=cfg.temperature, top_p=cfg.top_p)
        sampled[a:b], rollout_lp[a:b] = _sample_from_support(z, support, cfg.temperature, gen)
        training_logits[a:b] = (z + TRAINER_NOISE * torch.randn(z.shape, generator=gen)).to(torch.bfloat16)

    rows = torch.arange(n)
    rollout = {
        "logits": rollout_logits, "sampled": sampled, "rollout_logprobs": rollout_lp,
        "temperature": torch.tensor(cfg.temperature), "top_p": torch.tensor(cfg.top_p),
        "step": rows // cfg.tokens_per_step, "sequence": (rows % cfg.tokens_per_step) // SEQUENCE_LEN,
    }
    paths = os.path.join(out_dir, "rollout.safetensors"), os.path.join(out_dir, "training.safetensors")
    meta = {"generator": "mask-replay demo", "config": repr(cfg)}
    for path, tensors in zip(paths, (rollout, {"logits": training_logits})):
        safetensors_stream.save(path, tensors, meta)
    return paths


def make_out_dir(out_dir) -> None:
    """Create the output folder itself, never its missing parents (a typo in a path should not
    leave a tree of folders behind)."""

    out_dir = os.fspath(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise DumpError(f"{out_dir}: parent folder {parent} does not exist (create it first)")
    try:
        os.mkdir(out_dir)
    except FileExistsError:
        if not os.path.isdir(out_dir):
            raise DumpError(f"{out_dir}: exists and is not a folder") from None
    except OSError as exc:
        raise DumpError(f"{out_dir}: cannot create the folder ({exc.strerror})") from exc


def run_demo(out_dir, cfg: DemoConfig, progress: bool = False):
    """Generate the run, capture its masks and score the trainer against them, through the same
    library code the capture and score commands use. Returns (capture summary, score result, paths)."""

    make_out_dir(out_dir)
    rollout, training = generate_run(out_dir, cfg, progress)
    masks = os.path.join(out_dir, "masks.safetensors")
    summary = capture_dumps([rollout], masks, progress=progress)
    result = score_files(masks, training, progress=progress)
    report_path, plot_path = os.path.join(out_dir, "score.json"), os.path.join(out_dir, "score.png")
    write_text(report_path, report_json(result.report))
    plot_report(result.report, plot_path, title=f"synthetic RL run, V={cfg.vocab}, top_p={cfg.top_p}")
    paths = {"rollout": rollout, "training": training, "masks": masks, "json": report_path, "plot": plot_path}
    return summary, result, paths
