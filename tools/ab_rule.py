"""One gradient-rule helper's effect on the training step, measured in one process (as ab_pass.py).

    python tools/ab_rule.py FUNCTION [--models cnn] [--pairs 30] [--warmup 3] [--threads 2]

FUNCTION names a module-level function that a gradient rule consults to pick a faster form and
that returning None turns off, e.g. ``passes.autodiff.rules.conv._tiled`` (pools whose windows
tile the input: backward without scatter or ConvTranspose). Two TrainingSessions of each
benchmark model (tools/bench_training.py) are built, one as the build makes it, one with the
function patched to return None; their steps alternate (A B, B A, ...), --pairs pairs after
--warmup steps each; printed are the median steps and the median of the per-pair ratios with /
without (below 1: the form is faster), with their min-max. onnxruntime's threads do not spin
between runs (see ab_pass.py).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_training  # noqa: E402 - tools/ is not a package
from ab_pass import interleave, run_ab  # noqa: E402


def _target(path: str) -> tuple[object, str]:
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as exc:
        raise SystemExit(f"cannot import {module_name!r} ({exc}); name the function as module.function") from None
    if not callable(getattr(module, name, None)):
        raise SystemExit(f"{path!r} is no function of {module_name}")
    return module, name


def measure(name: str, out_dir: str, module: object, attr: str, args) -> None:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    original = getattr(module, attr)
    with_form, feeds, _, _ = bench_training._gradgraph_session(name, out_dir, args, opts)
    setattr(module, attr, lambda *a, **k: None)
    try:
        without, _, _, _ = bench_training._gradgraph_session(name, out_dir, args, opts)
    finally:
        setattr(module, attr, original)
    if len(with_form.artifacts.train.graph.node) == len(without.artifacts.train.graph.node):
        print(f"WARNING: {name}: both training graphs have the same node count: {attr} may not apply",
              flush=True)
    interleave(name, with_form, without, feeds, args)


def main() -> None:
    run_ab(__doc__, "FUNCTION", "cnn", _target,
           lambda name, out_dir, target, args: measure(name, out_dir, *target, args))


if __name__ == "__main__":
    main()
