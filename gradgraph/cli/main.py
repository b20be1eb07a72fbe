"""The ``gradgraph`` command (``main``); the user-facing help is ``DESCRIPTION``.

Each sub-command is a module of this package with ``add_parser`` and ``run``.
"""

from __future__ import annotations

import argparse
import sys

from gradgraph.cli import build, check, grad, train
from gradgraph.cli.common import run_command
from gradgraph.cli.parser import CommandParser, parse

DESCRIPTION = """\
Gradient and training graphs for ONNX models, in standard ONNX ops.

  gradgraph grad MODEL.onnx --loss NAME -o OUT.onnx     write the gradient graph
  gradgraph check MODEL.onnx --loss NAME                finite-difference check of it
  gradgraph train MODEL.onnx --loss NAME --data D.npz --steps N --batch-size B
  gradgraph build MODEL.onnx --loss NAME --save-stages DIR [--recompute ...]
                                                        the training pipeline, stage by stage

By default the model's parameters are differentiated/trained; --list-weights shows which
and why. Results go to stdout, progress and errors to stderr. A user error prints one line
and exits 2. `gradgraph SUB-COMMAND -h` for each sub-command's options.
"""


def build_parser() -> CommandParser:
    from gradgraph import __version__

    parser = CommandParser(prog="gradgraph", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gradgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (grad, check, train, build):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(build_parser(), argv)
    args.argv = argv  # ``train --nproc`` relaunches the same command line in each rank
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
