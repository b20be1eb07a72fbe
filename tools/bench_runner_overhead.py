"""The host-side cost of one training-graph run: kept IOBindings against a binding made per run.

    python tools/bench_runner_overhead.py [--weights 20] [--runs 3000]

gradgraph.training.ort_state.GraphRunner keeps one IOBinding per state of its StateStore (the
held weights and optimizer state bound as inputs, their spares as outputs) and binds only the
feeds and fetches per run; a run that finds the kept bindings busy (another thread is running
the same graph) binds everything anew, as every run did before. This times both paths on a
graph whose kernels cost next to nothing (--weights held tensors of 4 floats, each updated by
one Add and summed into the loss), so the difference is the binding: --runs runs alternating
(kept, fresh, fresh, kept, ...), the fresh path taken by holding the runner's lock. Prints the
median microseconds per run of each and their difference; one thread, CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gradgraph.training.ort_state import GraphRunner, StateStore  # noqa: E402
from passes.optimizer.optimizer_pass import TrainingNames  # noqa: E402


def _graph(names: TrainingNames, k: int) -> object:
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [4])]
    nodes, acc = [], "x"
    for i in range(k):
        w = f"w{i}"
        inputs.append(helper.make_tensor_value_info(w, TensorProto.FLOAT, [4]))
        nodes.append(helper.make_node("Add", [w, "x"], [names.updated(w)]))
        outputs.append(helper.make_tensor_value_info(names.updated(w), TensorProto.FLOAT, [4]))
        nodes.append(helper.make_node("Add", [acc, w], [f"a{i}"]))
        acc = f"a{i}"
    nodes.append(helper.make_node("Identity", [acc], ["loss"]))
    return helper.make_model(helper.make_graph(nodes, "held", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3000)
    args = parser.parse_args()
    names = TrainingNames()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    store = StateStore()
    for i in range(args.weights):
        store.set(f"w{i}", np.zeros(4, np.float32))
    runner = GraphRunner(_graph(names, args.weights), {f"w{i}" for i in range(args.weights)}, names,  # type: ignore[arg-type]
                         options, ["CPUExecutionProvider"], None)
    feeds = {"x": np.ones(4, np.float32)}

    def kept() -> None:
        runner.run(store, feeds, ["loss"])

    def fresh() -> None:
        with runner._lock:  # the kept bindings are busy: this run binds everything anew
            runner.run(store, feeds, ["loss"])

    for _ in range(20):
        kept()
        fresh()
    times: dict[str, list[float]] = {"kept": [], "fresh": []}
    for i in range(args.runs):
        for label, fn in (("kept", kept), ("fresh", fresh)) if i % 2 == 0 else (("fresh", fresh), ("kept", kept)):
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    k, f = (1e6 * statistics.median(times[x]) for x in ("kept", "fresh"))
    print(f"{args.weights} held tensors ({2 * args.weights} bound with their spares), median of {args.runs} runs: "
          f"kept bindings {k:.1f} us, a binding per run {f:.1f} us, saved {f - k:.1f} us a run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
