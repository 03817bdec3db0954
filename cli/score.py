"""`mask-replay score`: training log-probs with and without replay against the rollout's."""
import click

from mask_replay.cli.common import CONTEXT, CliError, check_device, console, fmt, one_line_errors


@click.command(context_settings=CONTEXT)
@click.option("--masks", required=True, type=click.Path(), help="Mask file written by `capture`.")
@click.option("--training", required=True, type=click.Path(),
              help="Training dump: logits [N, V], same rows in the same order as the rollout.")
@click.option("--json", "json_out", type=click.Path(), default=None,
              help="Write the metrics as JSON here ('-': standard output, the table then goes to stderr).")
@click.option("--plot", type=click.Path(), default=None, help="Write a PNG of the metrics over steps here.")
@click.option("--title", default=None, help="Title of the plot (default: the training file's name).")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=None,
              help="Rows per chunk (default: about 256 MB of logits).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:i].")
@click.option("--resume", is_flag=True, help="Skip if the --json report (and --plot) are already complete.")
@one_line_errors
def score(masks, training, json_out, plot, title, chunk_rows, device, resume):
    """Compare training log-probs with the rollout's, with replay (over the recorded support) and
    without (over the full vocabulary): importance ratios, log-prob differences, KL estimates."""
    import os

    from mask_replay.io import check_distinct, check_writable, write_text
    from mask_replay.score import report_json, score_files

    check_device(device)
    if plot == "-":
        raise CliError("--plot -: standard output is for --json only; name a PNG file")
    check_distinct([("--masks", masks), ("--training", training)], [("--json", json_out), ("--plot", plot)])
    from mask_replay.distributed import cli as dist_cli, launch, resume as resumed
    if resume and resumed.score_complete(json_out, plot):
        return
    for out in (json_out, plot):
        if out:
            check_writable(out)
    if plot:
        from mask_replay.dumps import Dump

        with Dump(masks) as d:  # header only; refuse now rather than after scoring
            if "step" not in d:
                raise CliError(f"{plot}: nothing to plot: {masks} has no 'step' key")
    score_fn = dist_cli.score_under_torchrun if launch.under_torchrun() else score_files
    result = score_fn(masks, training, chunk_rows=chunk_rows, device=device, progress=True)
    if result is None:  # under torchrun, a rank other than 0: rank 0 reports
        return
    for note in result.notes:
        console(err=True).print(f"mask-replay: note: {note}")
    print_report(result.report, err=json_out == "-")
    if plot:  # first: it is the one that can still refuse (no steps to plot), before any output
        from mask_replay.plots import plot_report

        plot_report(result.report, plot, title=title or f"rollout vs training log-probs: {os.path.basename(training)}")
    if json_out:
        write_text(json_out, report_json(result.report))


ROWS = (
    ("importance ratio mean", "importance_ratio_mean"), ("importance ratio median", "importance_ratio_median"),
    ("logp diff mean", "logp_diff_mean"), ("logp diff std", "logp_diff_std"), ("KL k1", "kl_k1"),
    ("KL k3", "kl_k3"), ("chi2", "chi2"), ("frac r outside [0.9, 1.1]", "frac_outside_0.9_1.1"),
    ("sequences", "sequences"), ("sequence ratio mean", "sequence_ratio_mean"),
    ("sequence ratio median", "sequence_ratio_median"), ("sequence ratio std", "sequence_ratio_std"),
    ("sequence log-ratio mean", "sequence_log_ratio_mean"), ("sequence log-ratio std", "sequence_log_ratio_std"),
)


def print_report(report: dict, err: bool = False) -> None:
    from rich.table import Table

    out = console(err=err)
    table = Table(title=f"{report['tokens']} tokens, rollout kept mass mean {fmt(report['kept_mass_mean'])}",
                  title_justify="left")
    table.add_column("metric (r = exp(training - rollout))")
    table.add_column("no replay", justify="right", style="red")
    table.add_column("replay", justify="right", style="blue")
    for label, key in ROWS:
        if key in report["replay"]:
            table.add_row(label, fmt(report["no_replay"][key]), fmt(report["replay"][key]))
    out.print(table)
    if report["per_step"]:
        steps = Table(title="per step", title_justify="left")
        for col in ("step", "tokens", "kept mass", "ratio (no replay)", "ratio (replay)",
                    "KL k3 (no replay)", "KL k3 (replay)"):
            steps.add_column(col, justify="right")
        for s, m in sorted(report["per_step"].items(), key=lambda kv: int(kv[0])):
            steps.add_row(s, str(m["tokens"]), fmt(m["kept_mass_mean"]),
                          fmt(m["no_replay"]["importance_ratio_mean"]), fmt(m["replay"]["importance_ratio_mean"]),
                          fmt(m["no_replay"]["kl_k3"]), fmt(m["replay"]["kl_k3"]))
        out.print(steps)
