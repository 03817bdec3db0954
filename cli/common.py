"""What every command shares: one-line errors, option settings, terminal output."""
from __future__ import annotations

import contextlib
import functools
import math
import signal
import sys

import click
import numpy as np
import torch
from rich.console import Console

from mask_replay.errors import DumpError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class CliError(click.ClickException):
    """Printed as a single line 'mask-replay: error: ...' on stderr; exit status 1."""

    def show(self, file=None):
        click.echo(f"mask-replay: error: {one_line(self.format_message())}", err=True)


def one_line(text: str) -> str:
    """An error line stays one line whatever a path or key in it holds: control characters (a newline
    in a file name) are written as escapes, the rest of the text as it is."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


class Terminated(BaseException):
    """A termination signal (a scheduler's time-out, `timeout`, `docker stop`, a closed terminal):
    raised where the command is, so that its atomic outputs unwind and remove their temp files."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# SIGTERM and SIGHUP end a command as Ctrl-C does: cleanly, with one line and exit status 128 + N.
TERMINATION_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _raise_terminated(signum, _frame):
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_cleanly():
    """While the command runs, a termination signal unwinds it (Terminated) instead of killing it
    mid-write. Only in the main thread (signal handlers can be set only there); restored after."""
    try:
        previous = {s: signal.signal(s, _raise_terminated) for s in TERMINATION_SIGNALS}
    except ValueError:  # not the main thread (e.g. the command invoked from a test's worker thread)
        previous = {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Group(click.Group):
    """The top-level command: every error is one line on stderr, never a traceback or a usage dump.

    Bad flags (click's usage errors) exit 2, data and file errors 1, Ctrl-C 130 like every Unix
    tool; outputs are atomic, so an interrupted command leaves nothing half-written behind."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            with terminate_cleanly():
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except Terminated as exc:
            fail(f"terminated by {signal.Signals(exc.signum).name} (unfinished outputs removed)", 128 + exc.signum)
        except click.UsageError as exc:
            fail(_usage_line(exc), 2)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
            fail("interrupted", 130)
        except BrokenPipeError:  # `... | head`: the reader left, nothing to report
            sys.stderr.close()
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _usage_line(exc: click.UsageError) -> str:
    cmd = exc.ctx.command_path if exc.ctx is not None else "mask-replay"
    return f"{exc.format_message()} (see '{cmd} --help')"


def fail(message: str, code: int):
    click.echo(f"mask-replay: error: {one_line(message)}", err=True)
    sys.exit(code)


def one_line_errors(fn):
    """Data and file errors end the command with one line, not a traceback; a bug still shows
    its traceback. Outputs are atomic, so nothing partial is left behind either way."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DumpError as exc:  # one line by design: a newline in it is a path's or a key's
            raise CliError(str(exc)) from exc
        except OSError as exc:  # disk full, permission lost mid-write, ...
            name = f"{exc.filename}: " if exc.filename else ""
            raise CliError(f"{name}{exc.strerror or exc}") from exc

    return wrapper


def console(err: bool = False):
    """The terminal, printing text as it is: file names, keys and metadata are the user's, and rich
    markup ("[red]", "[/INST]") or emoji codes (":x:") in them must neither raise nor vanish."""
    return Console(file=sys.stderr if err else sys.stdout, highlight=False, markup=False, emoji=False)


def fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"
    return str(x)


def check_device(device: str) -> None:
    """--device names cpu or a visible CUDA device (meta, another backend, a typo: refused)."""

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CliError(f"--device {device}: not a device name (use cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise CliError(f"--device {device}: only cpu and cuda are supported")
    if dev.type == "cpu":
        return
    if not torch.cuda.is_available():
        raise CliError(f"--device {device}: no CUDA device is visible (torch {torch.__version__})")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CliError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")


INT64_MAX = 2 ** 63 - 1

# --seed of the commands that load a model (example, experiment): torch.manual_seed takes nothing above
# 2**64 - 1 and numpy's SeedSequence no negative seed, so these are refused when the flags are parsed,
# before a model is loaded or --out is created.
SEED = click.IntRange(min=0, max=2 ** 64 - 1)


def check_sampling_flags(temperature=None, top_k=None, top_p=None, min_p=None, *, greedy_ok=True) -> None:
    """Sampling flags are finite and in range before any file is opened; errors name the flag.
    The kernels compute in float32 (temperature) and int64 (top-k): a value that does not survive
    that conversion is refused here rather than reported against the dump's keys."""

    if temperature is not None:
        t32 = float(np.float32(temperature)) if math.isfinite(temperature) and abs(temperature) < 1e39 else math.inf
        if not math.isfinite(temperature) or not math.isfinite(t32):
            raise CliError(f"--temperature {temperature}: must be a finite number (float32 range)")
        if temperature < 0 or (temperature == 0 and not greedy_ok):
            raise CliError(f"--temperature {temperature}: must be {'>= 0' if greedy_ok else '> 0'}")
        if temperature > 0 and t32 == 0:
            raise CliError(f"--temperature {temperature}: rounds to 0 in float32 (that is greedy; pass 0 to mean it)")
    if top_k is not None and not -INT64_MAX - 1 <= top_k <= INT64_MAX:
        raise CliError(f"--top-k {top_k}: out of range (a 64-bit integer; <= 0 or >= vocab means off)")
    if top_p is not None and not (0 < top_p <= 1):  # NaN fails every comparison
        raise CliError(f"--top-p {top_p}: must be in (0, 1]")
    if min_p is not None and not (0 <= min_p <= 1):
        raise CliError(f"--min-p {min_p}: must be in [0, 1]")
