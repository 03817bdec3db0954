"""`mask-replay`: capture sampling supports from rollout dumps, score replay against training logits.

Commands live one per module; each imports torch and the heavy library code only when it runs.
"""
import click

from mask_replay import __version__
from mask_replay.cli.common import CONTEXT, Group
from mask_replay.cli.capture import capture
from mask_replay.cli.convert import convert
from mask_replay.cli.demo import demo
from mask_replay.cli.example import example
from mask_replay.cli.experiment import experiment
from mask_replay.cli.info import info
from mask_replay.cli.inspect import inspect
from mask_replay.cli.score import score


@click.group(cls=Group, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="mask-replay")
def main():
    """Record the support of truncated sampling at rollout time and replay it in the trainer.

    \b
    Typical use:
      mask-replay capture rollout.safetensors -o masks.safetensors
      mask-replay score --masks masks.safetensors --training training.safetensors --plot score.png
      mask-replay demo            (the whole thing on a synthetic RL run)
    """


for command in (capture, score, inspect, convert, demo, example, info):
    main.add_command(command)
main.add_command(experiment)


if __name__ == "__main__":
    main()
