"""Run models in the onnxruntime-training reference venv (see tools/setup_ort_training.sh).

Runs with that venv's python and imports only onnxruntime, onnx and numpy (never gradgraph),
because the training build ships its own module named ``onnxruntime``.

  python ort_training_worker.py run --model M.onnx --inputs in.npz --outputs a,b --out out.npz
      Run M on the inputs; write the named outputs (all outputs if --outputs is empty).

  python ort_training_worker.py reference-grad --model F.onnx --inputs in.npz --loss L \
        --x w1,w2 [--y L] [--save-model G.onnx] --out out.npz
      Build the gradient graph of F with the training build's own
      ``onnxruntime.capi._pybind_state.GradientGraphBuilder(model_bytes, y, x, loss)``, run it
      and write ``<x>_grad`` for each x (plus the loss).

Both modes print one JSON line on stdout: ``{"ok": true, "outputs": [...], ...}`` or, when
building or running fails, ``{"ok": false, "stage": "build"|"load"|"run", "error": "..."}``
with exit status 0 (the reference builder refuses many models; that is a result, not a crash).
Bad arguments exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

# `import onnxruntime` in the training build imports onnxruntime.training, which imports torch
# (~5 s). Only onnxruntime.capi (InferenceSession, GradientGraphBuilder) is used here, and that
# works without torch, so keep torch out.
sys.modules.setdefault("torch", None)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnxruntime.capi import _pybind_state as C  # noqa: E402


def _session(model_bytes: bytes) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def _load_inputs(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _summary(message: str) -> str:
    """The gist of an onnxruntime error: without source paths and C++ signatures."""
    text = " ".join(message.split())
    # ORT_ENFORCE: "<file>:<line> <return type> <function>(<params>) [const] <condition> was false. <msg>"
    found = re.match(r"^\S+:\d+ (?:\S+ )?([\w:]+)\([^)]*\)(?: const)? (.*)$", text)
    if found:
        function = found.group(1).split("::")[-2:]
        text = f"{'::'.join(function)}: {found.group(2)}"
    return text[:500]


def _error(stage: str, exc: BaseException) -> dict:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return {"ok": False, "stage": stage, "summary": _summary(str(exc)),
            "error": f"{type(exc).__name__}: {' | '.join(lines)[:2000]}"}


def _run(model_bytes: bytes, feeds: dict[str, np.ndarray], outputs: list[str], out: str) -> dict:
    try:
        sess = _session(model_bytes)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several pybind types
        return _error("load", exc)
    known = {i.name for i in sess.get_inputs()}
    names = outputs or [o.name for o in sess.get_outputs()]
    try:
        values = sess.run(names, {k: v for k, v in feeds.items() if k in known})
    except Exception as exc:  # noqa: BLE001
        return _error("run", exc)
    np.savez(out, **dict(zip(names, values)))
    return {"ok": True, "outputs": names}


def cmd_run(args: argparse.Namespace) -> dict:
    with open(args.model, "rb") as f:
        model_bytes = f.read()
    return _run(model_bytes, _load_inputs(args.inputs), _names(args.outputs), args.out)


def cmd_reference_grad(args: argparse.Namespace) -> dict:
    xs = _names(args.x)
    ys = _names(args.y) or [args.loss]
    model = onnx.load(args.model)
    feeds = _load_inputs(args.inputs)
    try:
        builder = C.GradientGraphBuilder(model.SerializeToString(), set(ys), set(xs), args.loss)
        builder.build()
        grad_bytes = builder.get_model()
    except Exception as exc:  # noqa: BLE001
        return _error("build", exc)
    grad_model = onnx.load_from_string(grad_bytes)
    if args.save_model:
        with open(args.save_model, "wb") as f:
            f.write(grad_bytes)
    available = {o.name for o in grad_model.graph.output}
    wanted = [f"{x}_grad" for x in xs]
    missing = [n for n in wanted if n not in available]
    if missing:
        return {"ok": False, "stage": "build",
                "error": f"the reference gradient graph has no output(s) {missing}"}
    result = _run(grad_bytes, feeds, [args.loss, *wanted], args.out)
    result["ops"] = sorted({f"{n.domain}::{n.op_type}" if n.domain else n.op_type
                            for n in grad_model.graph.node})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run", help="run a model on npz inputs")
    run.add_argument("--model", required=True)
    run.add_argument("--inputs", required=True)
    run.add_argument("--outputs", default="", help="comma-separated output names (default: all)")
    run.add_argument("--out", required=True)
    run.set_defaults(func=cmd_run)
    ref = sub.add_parser("reference-grad", help="the training build's own GradientGraphBuilder")
    ref.add_argument("--model", required=True)
    ref.add_argument("--inputs", required=True)
    ref.add_argument("--loss", required=True)
    ref.add_argument("--x", required=True, help="comma-separated names to differentiate for")
    ref.add_argument("--y", default="", help="comma-separated y names (default: the loss)")
    ref.add_argument("--save-model", default="")
    ref.add_argument("--out", required=True)
    ref.set_defaults(func=cmd_reference_grad)
    args = parser.parse_args(argv)
    result = args.func(args)
    result["onnxruntime"] = ort.__version__
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
