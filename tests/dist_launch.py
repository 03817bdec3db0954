"""Launch a script or `-m module` under torchrun (torch.distributed.run) from the tests, bounded."""
import os
import subprocess
import sys


def torchrun(nproc: int, *args, timeout: float = 60, env=None, cwd=None) -> subprocess.CompletedProcess:
    """torchrun --standalone (a free rendezvous port, so tests can run side by side), one thread per
    rank (the CI machine has few cores). The timeout bounds a hung collective, too."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
