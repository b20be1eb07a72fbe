"""``python -m gradgraph.examples [DIR]``: copy the bundled example files into DIR (default: .)."""

from __future__ import annotations

import sys

from gradgraph.examples import copy_to

if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__.strip())
        raise SystemExit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    for written in copy_to(sys.argv[1] if len(sys.argv) > 1 else "."):
        print(f"wrote {written}")
