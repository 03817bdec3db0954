"""The CLI under torchrun: detect it, set up the process group, split rows, agree on failures.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous variables; the process group uses
NCCL for `--device cuda` and gloo otherwise, and a gloo group always carries the control traffic
(errors, per-rank results: small CPU objects). Every collective has a timeout
(MASK_REPLAY_DIST_TIMEOUT seconds, default 1800), so a rank that dies or hangs fails the whole
run instead of leaving the others waiting; torchrun itself stops the remaining ranks with SIGTERM
when one exits, and a rank stopped that way unwinds (temporary outputs removed) and says so.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mask_replay.errors import DumpError

DEFAULT_TIMEOUT_S = 1800


# After this many seconds of waiting on the other ranks, a rank says on stderr what it waits for.
WAIT_NOTE_S = 5.0
# MASK_REPLAY_DISTRIBUTED=1 joins the process group whatever launched the command, =0 never does.
FORCE_ENV = "MASK_REPLAY_DISTRIBUTED"


def under_torchrun() -> bool:
    """Whether this command was launched by torchrun FOR ITSELF, and so joins a process group.

    RANK and WORLD_SIZE alone are not enough: a command started from inside a torchrun job (a training
    script's subprocess) inherits them, and joining would wait for ranks that never come. A rank torchrun
    launched is a direct child of the torchrun agent; where the parent cannot be read (no /proc),
    the variables decide, as before."""
    forced = os.environ.get(FORCE_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    parent = _cmdline(os.getppid())
    return parent is None or _is_torchrun(parent)


def _cmdline(pid: int):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def _is_torchrun(argv: list) -> bool:
    names = [os.path.basename(a) for a in argv[:3]]
    return ("torchrun" in names or any(a in ("torch.distributed.run", "torch.distributed.launch") for a in argv[:4])
            or any(a.endswith(("/torch/distributed/run.py", "/torch/distributed/launch.py")) for a in argv[:3]))


@contextlib.contextmanager
def waiting_note(what: str, after: float = WAIT_NOTE_S):
    """Say on stderr, once, what this rank is waiting for when the wait passes `after` seconds."""
    t0 = time.monotonic()

    def note():
        rank = os.environ.get("RANK", "?")
        print(f"mask-replay: note: rank {rank}: still waiting for {what} after {time.monotonic() - t0:.0f} s "
              f"(timeout MASK_REPLAY_DIST_TIMEOUT={os.environ.get('MASK_REPLAY_DIST_TIMEOUT', DEFAULT_TIMEOUT_S)} s)",
              file=sys.stderr, flush=True)

    timer = threading.Timer(after, note)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class RankStopped(BaseException):
    """SIGTERM from torchrun (another rank failed): unwind so atomic outputs clean up."""


class RunFailed(Exception):
    """The run failed on some rank; rank 0 has printed the reason. Exit status 1 everywhere."""


@dataclass
class Ranks:
    rank: int
    world: int
    control: object  # gloo process group for objects and barriers
    timeout: datetime.timedelta

    def share(self, n: int) -> tuple[int, int]:
        """This rank's contiguous rows of n: the first n % world ranks get one more."""
        return share(n, self.world, self.rank)

    def agree(self, error: str | None) -> None:
        """Every rank reports its error (or None); all raise if any failed, and rank 0 prints the
        first in rank order, which for row errors is the first bad row of the whole input, the
        one a single process reports. Also where a dead rank shows up (by name)."""
        errors = self.gather_all(error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            if self.rank == 0:
                say(first)
            self.barrier()  # rank 0 prints before any rank exits (torchrun then stops the rest)
            raise RunFailed(first)

    def gather_all(self, obj) -> list:
        self.barrier()
        out = [None] * self.world
        _collective("exchanging results", dist.all_gather_object, out, obj, group=self.control)
        return out

    def gather_to_0(self, obj) -> list | None:
        out = [None] * self.world if self.rank == 0 else None
        _collective("gathering results", dist.gather_object, obj, out, dst=0, group=self.control)
        return out

    def barrier(self) -> None:
        # names the ranks that did not arrive within the timeout (gloo only, hence the control group)
        _collective("waiting for the other ranks", dist.monitored_barrier, group=self.control,
                    timeout=self.timeout, wait_all_ranks=True)


def share(n: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def say(message: str) -> None:
    print(f"mask-replay: error: {message}", file=sys.stderr, flush=True)


def _collective(what: str, fn, *args, **kwargs):
    try:
        with waiting_note(f"the other ranks ({what})"):
            return fn(*args, **kwargs)
    except RuntimeError as exc:  # a peer closed its connection or the timeout passed
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        first = re.sub(r"^\[Rank \d+\]: ", "", first)
        raise RunFailed(f"rank {dist.get_rank()}: another rank died or hung (timeout "
                        f"MASK_REPLAY_DIST_TIMEOUT={_timeout_s():g} s) while {what}: {first}") from exc


def _timeout_s() -> float:
    raw = os.environ.get("MASK_REPLAY_DIST_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DumpError(f"MASK_REPLAY_DIST_TIMEOUT: expected a number of seconds > 0, got {raw!r}")
    return value


def _stop(signum, frame):
    raise RankStopped()


@contextlib.contextmanager
def process_group(device: str):
    """Initialise torch.distributed from torchrun's environment; yields Ranks. Errors while
    initialising are one line (DumpError); RunFailed and RankStopped become exit status 1."""
    timeout = datetime.timedelta(seconds=_timeout_s())
    cuda = device.startswith("cuda")
    try:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        with waiting_note(f"{os.environ.get('WORLD_SIZE')} ranks to join the process group at {where}"):
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    except (RuntimeError, ValueError) as exc:
        raise DumpError(f"torchrun: cannot set up the process group ({str(exc).strip().splitlines()[0]})") from exc
    previous = signal.signal(signal.SIGTERM, _stop)
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), control, timeout)
    try:
        yield ranks
    except RunFailed as exc:
        if exc.args and exc.args[0].startswith(f"rank {ranks.rank}: another rank died"):
            say(str(exc))  # (an agreed error was printed by rank 0 already)
        raise SystemExit(1)
    except RankStopped:
        say(f"rank {ranks.rank}: stopped by torchrun (another rank failed); no output written")
        raise SystemExit(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
