"""`mask-replay demo`: a synthetic RL run, captured and scored, with replay against without."""
import time

import click

from mask_replay.cli.common import (
    CONTEXT,
    CliError,
    check_sampling_flags,
    console,
    fmt,
    one_line_errors,
)
from mask_replay.cli.tables import print_report, print_summary
from mask_replay.tools.demo import DemoConfig, run_demo

# The demo builds each step's [tokens, vocab] float32 logits in memory (and its trainer's copy).
DEMO_MAX_STEP_ELEMENTS = 1 << 30


@click.command(context_settings=CONTEXT)
@click.option("--out", type=click.Path(file_okay=False), default="demo_out", show_default=True,
              help="Folder for the dumps, the mask file, score.json and score.png.")
@click.option("--vocab", type=click.IntRange(min=2), default=32768, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--tokens-per-step", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--top-p", type=float, default=0.9, show_default=True, help="Top-p in (0, 1].")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="Temperature > 0.")
@click.option("--seed", type=click.IntRange(min=0, max=2 ** 63 - 1), default=0, show_default=True)
@one_line_errors
def demo(out, vocab, steps, tokens_per_step, top_p, temperature, seed):
    """Generate a synthetic RL run (LLM-like logits, a drifting policy, top-p sampling in fp32, a
    bf16 trainer), capture its masks, score training against rollout with and without replay, and
    plot it. Nothing is downloaded."""

    check_sampling_flags(temperature, None, top_p, None, greedy_ok=False)
    if vocab >= 2 ** 31:
        raise CliError(f"--vocab {vocab}: token ids are int32, the vocabulary must be below 2^31")
    if tokens_per_step * vocab > DEMO_MAX_STEP_ELEMENTS:
        raise CliError(f"--tokens-per-step {tokens_per_step} x --vocab {vocab}: a step's logits would take "
                       f"{4 * tokens_per_step * vocab / 2 ** 30:.3g} GiB (the demo holds them in memory; "
                       f"at most {DEMO_MAX_STEP_ELEMENTS * 4 // 2 ** 30} GiB)")

    cfg = DemoConfig(vocab=vocab, steps=steps, tokens_per_step=tokens_per_step, seed=seed,
                     temperature=temperature, top_p=top_p)
    t0 = time.perf_counter()
    summary, result, paths = run_demo(out, cfg, progress=True)
    print_summary(summary, paths["masks"])
    print_report(result.report)
    rep, full = result.report["replay"], result.report["no_replay"]
    c = console()
    c.print(f"without replay the mean ratio is {fmt(full['importance_ratio_mean'])} "
            f"(kept mass {fmt(result.report['kept_mass_mean'])}), logp diff {fmt(full['logp_diff_mean'])}; "
            f"with replay {fmt(rep['importance_ratio_mean'])}, logp diff {fmt(rep['logp_diff_mean'])}.")
    c.print(f"wrote {', '.join(paths.values())} in {time.perf_counter() - t0:.1f} s")
