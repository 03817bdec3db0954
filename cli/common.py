"""What every command shares: one-line errors, option settings, terminal output."""
from __future__ import annotations

import functools
import sys

import click

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class CliError(click.ClickException):
    """Printed as a single line 'mask-replay: error: ...' on stderr; exit status 1."""

    def show(self, file=None):
        click.echo(f"mask-replay: error: {self.format_message()}", err=True)


def one_line_errors(fn):
    """Data and file errors end the command with one line, not a traceback; a bug still shows
    its traceback. Outputs are atomic, so nothing partial is left behind either way."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from mask_replay.io import DumpError

        try:
            return fn(*args, **kwargs)
        except DumpError as exc:
            raise CliError(str(exc).splitlines()[0]) from exc
        except OSError as exc:  # disk full, permission lost mid-write, ...
            name = f"{exc.filename}: " if exc.filename else ""
            raise CliError(f"{name}{exc.strerror or exc}") from exc

    return wrapper


def console(err: bool = False):
    from rich.console import Console

    return Console(file=sys.stderr if err else sys.stdout, highlight=False)


def fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"
    return str(x)


def check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--device {device}: no CUDA device is visible (torch {torch.__version__})")
