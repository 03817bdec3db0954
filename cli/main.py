"""`mask-replay`: capture sampling supports from rollout dumps, score replay against training logits.

One module per command. A command's module (and with it torch and the extension) is imported only
when that command runs or its help is shown: `mask-replay --version` and a mistyped command answer
at once (click's lazily loaded subcommands).
"""
import importlib

import click

from mask_replay.cli.common import CONTEXT, CliError, Group
from mask_replay.version import __version__

# command name -> module of cli/ defining a click command of the same name
COMMANDS = ("capture", "score", "inspect", "convert", "demo", "example", "experiment", "selftest", "info")


class LazyGroup(Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        try:
            return getattr(importlib.import_module(f"mask_replay.cli.{name}"), name)
        except ImportError as exc:  # an optional dependency (the [hf] extra) is missing
            return _unavailable(name, str(exc).splitlines()[0])


def _unavailable(name: str, reason: str) -> click.Command:
    """A command whose module cannot be imported here: listed in --help with the reason, and one
    error line (exit 1) when run."""

    def run(**_):
        raise CliError(f"{name}: {reason}")

    return click.Command(name, callback=run, help=f"(unavailable: {reason})",
                         context_settings=dict(CONTEXT, ignore_unknown_options=True, allow_extra_args=True))


@click.group(cls=LazyGroup, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="mask-replay")
def main():
    """Record the support of truncated sampling at rollout time and replay it in the trainer.

    \b
    Typical use:
      mask-replay capture rollout.safetensors -o masks.safetensors
      mask-replay score --masks masks.safetensors --training training.safetensors --plot score.png
      mask-replay demo            (the whole thing on a synthetic RL run)
    """


if __name__ == "__main__":
    main()
