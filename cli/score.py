"""`mask-replay score`: training log-probs with and without replay against the rollout's."""
import os

import click

from mask_replay.cli.common import (
    CONTEXT,
    CliError,
    check_device,
    console,
    one_line_errors,
)
from mask_replay.cli.tables import print_report
from mask_replay.files.dumps import Dump
from mask_replay.files.safe_output import check_distinct, check_writable, write_text
from mask_replay.tools import launch
from mask_replay.tools import resume as resumed
from mask_replay.tools import torchrun as dist_cli
from mask_replay.tools.plots import plot_report
from mask_replay.tools.score import report_json, score_files


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
    without (over the full vocabulary): importance ratios, log-prob differences, KL estimates.

    The metrics are summed chunk by chunk, with no per-token arrays in memory; the values the
    medians need wait in unnamed temporary files ($TMPDIR, 16 bytes a token, 32 with steps; freed
    when score ends)."""

    check_device(device)
    if plot == "-":
        raise CliError("--plot -: standard output is for --json only; name a PNG file")
    check_distinct([("--masks", masks), ("--training", training)], [("--json", json_out), ("--plot", plot)])
    if resume and resumed.score_complete(json_out, plot, masks, training):
        return
    for out in (json_out, plot):
        if out:
            check_writable(out)
    if plot:
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

        plot_report(result.report, plot, title=title or f"rollout vs training log-probs: {os.path.basename(training)}")
    if json_out:
        write_text(json_out, report_json(result.report))
