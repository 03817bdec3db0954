"""`mask-replay` as a torchrun worker script, with one rank made to fail on purpose.

MASK_REPLAY_TEST_FAIL="RANK:kill" makes that rank SIGKILL itself when it reaches its first chunk
of rows (capture or score); "RANK:hang" makes it sleep there instead (for the collective timeout).
MASK_REPLAY_TEST_TRACE=PREFIX writes the logits rows each rank read to PREFIX<rank>.json.
Only this test script does that: the library has no such switch.
"""
import atexit
import json
import os
import signal
import sys
import time

import mask_replay.tools.capture as capture_dumps
import mask_replay.tools.score as score
from mask_replay.cli.main import main


def fail(how):
    def stop(*args, **kwargs):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    return stop


def trace(prefix):
    """Record the [start, stop) of every logits read of this rank."""
    from mask_replay.files.dumps import Dump

    read, get = [], Dump.get

    def logged(self, key, start=None, stop=None, **kwargs):
        if key == "logits":
            read.append([os.path.basename(self.path), start, stop])
        return get(self, key, start, stop, **kwargs)

    Dump.get = logged
    atexit.register(lambda: open(f"{prefix}{os.environ['RANK']}.json", "w").write(json.dumps(read)))


if "MASK_REPLAY_TEST_FAIL" in os.environ:
    rank, how = os.environ["MASK_REPLAY_TEST_FAIL"].split(":")
    if os.environ.get("RANK") == rank:
        capture_dumps._capture_chunk = fail(how)
        score._replay = fail(how)
if "MASK_REPLAY_TEST_TRACE" in os.environ:
    trace(os.environ["MASK_REPLAY_TEST_TRACE"])
sys.exit(main(prog_name="mask-replay"))
