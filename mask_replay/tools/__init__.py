"""The work behind the command-line tools, callable without click (one module per tool)."""
