"""`mask-replay` as a torchrun worker script, with one rank made to fail on purpose.

MASK_REPLAY_TEST_FAIL="RANK:kill" makes that rank SIGKILL itself when it reaches its first chunk
of rows (capture or score); "RANK:hang" makes it sleep there instead (for the collective timeout).
Only this test script does that: the library has no such switch.
"""
import os
import signal
import sys
import time

import mask_replay.capture_dumps as capture_dumps
import mask_replay.score as score
from mask_replay.cli.main import main


def fail(how):
    def stop(*args, **kwargs):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    return stop


rank, how = os.environ["MASK_REPLAY_TEST_FAIL"].split(":")
if os.environ.get("RANK") == rank:
    capture_dumps._capture_chunk = fail(how)
    score._replay = fail(how)
sys.exit(main(prog_name="mask-replay"))
