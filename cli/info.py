"""`mask-replay info`: versions, compiled kernels, visible devices."""
import platform

import click
import torch

from mask_replay._ops import build_info
from mask_replay.cli.common import CONTEXT, console
from mask_replay.version import __version__


@click.command(context_settings=CONTEXT)
def info():
    """Versions, which kernels were compiled, and the devices torch sees."""
    out = console()
    out.print(f"mask-replay {__version__}")
    out.print(f"python {platform.python_version()} ({platform.platform()})")
    out.print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}), "
              f"{torch.get_num_threads()} CPU threads")
    for name, value in build_info().items():
        out.print(f"build {name}: {value}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out.print("devices: cpu" + "".join(f", cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(n)))
