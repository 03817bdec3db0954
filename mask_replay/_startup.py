"""Ctrl-C while the command line is still starting (importing torch takes seconds): one line and
exit status 130, like every Unix tool, instead of a KeyboardInterrupt traceback.

Installed first thing by the package, before torch is imported, and only when this process is the
`mask-replay` command (console script or `python -m mask_replay`): a program that merely imports
the library keeps Python's own handling. Once click runs, cli/common.Group handles Ctrl-C itself.
"""
import os
import sys


def _is_cli() -> bool:
    if os.path.basename(sys.argv[0] if sys.argv else "") == "mask-replay":
        return True
    orig = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b == "mask_replay" for a, b in zip(orig, orig[1:]))


def _interrupted(exc_type, exc, tb, _previous=sys.excepthook):
    if issubclass(exc_type, KeyboardInterrupt):
        try:
            sys.stderr.write("\nmask-replay: error: interrupted\n")
            sys.stderr.flush()
        finally:
            os._exit(130)
    _previous(exc_type, exc, tb)


if _is_cli():
    sys.excepthook = _interrupted
