"""`python -m mask_replay` runs the command line."""
from mask_replay.cli.main import main

main(prog_name="mask-replay")
