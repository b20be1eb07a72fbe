"""torchrun for ``gradgraph train --nproc N``: ``python -m gradgraph.cli.launch TORCHRUN-ARGS``.

torch's launcher (``torch.distributed.run``) with its failure report left to gradgraph: when a
rank exits non-zero, torchrun logs the failure and raises ``ChildFailedError``, whose traceback
and report block follow the rank's own one-line error (a user error in a rank exits 2 with
that line, see :func:`gradgraph.cli.common.run_command`). Here the report is one line naming
each failed rank and its exit code, and the exit status is 1 (the caller,
``gradgraph.cli.train``, returns rank 0's own status where it wrote one).
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # its "failed (exitcode: 2) local_rank: 0 ..." line: the report below says it once
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as exc:
        failed = ", ".join(f"rank {rank} exit code {f.exitcode}"
                           for rank, f in sorted(exc.failures.items()))
        print(f"gradgraph train: the data-parallel ranks stopped ({failed})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
