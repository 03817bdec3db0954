"""`mask-replay inspect`: what a dump or mask file holds, read from its header (logits are not loaded)."""
import click
from rich.table import Table

from mask_replay.cli.common import CONTEXT, CliError, console, fmt, one_line_errors
from mask_replay.tools.inspect import inspect_file


@click.command(context_settings=CONTEXT)
@click.argument("file", type=click.Path())
@click.option("--force", is_flag=True,
              help="Read .npz members that declare more than 1 GiB compressed (a zip bomb guard).")
@one_line_errors
def inspect(file, force):
    """Keys, shapes, dtypes and rows of FILE; support statistics when it is a mask file."""

    info = inspect_file(file, force=force)
    out = console()
    table = Table(title=f"{file}: {info['kind']}", title_justify="left")
    for col in ("key", "shape", "dtype", "bytes"):
        table.add_column(col, justify="left" if col in ("key", "dtype") else "right")
    for k in info["keys"]:
        table.add_row(k["key"], str(k["shape"]), k["dtype"], f"{k['bytes']:,}")
    out.print(table)
    for name, value in info["summary"].items():
        out.print(f"{name}: {fmt(value)}")
    for name, value in info["metadata"].items():
        out.print(f"metadata {name}: {value}")
    if info["problem"]:  # what could be read is shown above; the defect is the command's error
        raise CliError(info["problem"])
