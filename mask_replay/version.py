"""The package version, importable without torch (the CLI prints it before loading anything)."""
__version__ = "0.1.0"
