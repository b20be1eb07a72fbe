"""What every sub-command shares: running one with user errors as one line, weight lists."""

from __future__ import annotations

import argparse
import sys

from gradgraph.feeds import InputError
from gradgraph.training.checkpoint import CheckpointError
from passes.autodiff import GradientError

# Exit status of a user error (bad file, option or model): one line on stderr, nothing written.
EXIT_USER_ERROR = 2


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed sub-command; user mistakes print one line and return 2."""
    try:
        return int(args.func(args) or 0)
    except (GradientError, InputError, CheckpointError) as exc:
        print(f"gradgraph {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        print(f"gradgraph {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def weights_arg(values: list[str] | None) -> list[str] | None:
    """``--weights a b,c`` -> ["a", "b", "c"]; nothing given -> None (the default set)."""
    if not values:
        return None
    names: list[str] = []
    for value in values:
        names.extend(v for v in value.split(",") if v)
    return names


def list_weights(args: argparse.Namespace) -> int:
    """``--list-weights``: every float initializer, whether it is trained and why."""
    from gradgraph.weights import format_weights
    from gradgraph.weights import list_weights as listing

    print(format_weights(listing(args.model, args.loss)))
    return 0


def add_list_weights(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list-weights", action="store_true",
                        help="print every float initializer, whether it is trained and why; then exit")


def main_for(add_parser: object, argv: list[str] | None) -> int:
    """Run one sub-command's parser alone (``python -m gradgraph.cli.train ...``)."""
    parser = argparse.ArgumentParser(prog="gradgraph")
    add_parser(parser.add_subparsers(dest="command", required=True))  # type: ignore[operator]
    return run_command(parser.parse_args(argv))
