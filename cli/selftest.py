"""`mask-replay selftest`: the kernels on this machine against the CPU kernels or the references."""
import click
from rich.table import Table

from mask_replay.cli.common import CONTEXT, CliError, check_device, console
from mask_replay.tools.selftest import selftest as run_selftest


@click.command(context_settings=CONTEXT)
@click.option("--device", default="auto", show_default=True,
              help="cuda (or cuda:N): that GPU's kernels against the CPU kernels; cpu: the CPU kernels against "
                   "the float64 PyTorch references; auto: cuda when one is visible, else cpu.")
@click.option("--quick", is_flag=True, help="The reduced matrix (under a minute on one H100/H200).")
@click.option("--only", metavar="TEXT", help="Run only the cases whose name contains TEXT.")
def selftest(device, quick, only):
    """Run every op on the device against an independent expectation, one line per case, then a
    summary table. Exit status 1 when any case differs or fails; a CUDA error stops the run at once
    and names its case (CUDA_LAUNCH_BLOCKING=1 is set for it)."""

    if device != "auto":
        check_device(device)
    out = console()

    def line(case):
        mark = {"ok": "ok  ", "mismatch": "FAIL", "error": "ERR "}[case.status]
        # plain echo: one unwrapped line per case, whatever the terminal width (logs are grepped)
        click.echo(f"{mark} {case.name} ({case.seconds:.2f} s)" + (f": {case.detail}" if case.detail else ""))

    result = run_selftest(None if device == "auto" else device, quick=quick, only=only, progress=line)
    if not result.cases:
        raise CliError(f"--only {only}: no case name contains it")
    table = Table(title=f"selftest: {result.device} vs {result.expectation}{' (quick)' if result.quick else ''}",
                  title_justify="left")
    for col in ("op", "cases", "ok", "mismatch", "error", "seconds"):
        table.add_column(col, justify="right" if col != "op" else "left", no_wrap=True)
    for op, row in result.by_op().items():
        table.add_row(op, str(row["cases"]), str(row["ok"]), str(row["mismatch"]), str(row["error"]),
                      f"{row['seconds']:.1f}")
    out.print(table)
    if result.stopped_at:
        click.echo(f"stopped at the first CUDA error, in case: {result.stopped_at}")
    bad = len(result.failures)
    click.echo(f"selftest {'PASSED' if result.ok else 'FAILED'}: {len(result.cases)} cases, {bad} failed, "
               f"{result.seconds:.1f} s ({result.device} vs {result.expectation})")
    if not result.ok:
        raise SystemExit(1)
