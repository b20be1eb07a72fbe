"""The ``gradgraph`` command line: one module per sub-command (grad, check, train, build)."""

from gradgraph.cli.main import main

__all__ = ["main"]
