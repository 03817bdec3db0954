"""The `mask-replay` command line: thin click commands over the library (see main.py)."""
