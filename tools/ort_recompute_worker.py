"""onnxruntime-training's own recompute, run the way ORTModule runs a model (reference venv only).

    .venv-ort-training/bin/python tools/ort_recompute_worker.py MODEL.onnx INPUTS.npz CONFIG
        [--threads 2] [--reps 8] [--warmup 2] [--arena]

The 1.19.2 wheel has no TrainingSession and its ORTModule does not import with torch 2.13, but
ORTModule's two engines are in the wheel's C++ bindings: ``OrtModuleGraphBuilder`` (the
pre-training graph transformers, the recompute ones included, then the gradient graph with a
YieldOp between forward and backward) and ``TrainingAgent`` (runs the forward up to the
YieldOp, then the backward from it, as two partial runs of one session). This worker drives
them directly, as ``ortmodule/_graph_execution_manager.py`` and ``_training_manager.py`` do:
the trainable initializers become graph inputs, the loss gradient 1.0 is fed to the backward.

CONFIG (onnxruntime-training's recompute options):

- ``none``: no recompute;
- ``transformer_layer``: ``TrainingGraphTransformerConfiguration.transformer_layer_recompute``
  (the legacy TransformerLayerRecompute, all layers but the last);
- ``gelu_attn``: ``gelu_recompute`` + ``attn_dropout_recompute``;
- ``memopt_level1``: the memory optimizer as ``ORTMODULE_MEMORY_OPT_LEVEL=1`` sets it (probe
  ``1:1``, every Recompute plan the probe finds, written to a JSON config file).

Printed: one ``RESULT {json}`` line with, for ``--measure time``, the median step time (forward +
backward, no optimizer); for ``--measure memory``, the RSS added by the forward (what the
backward keeps: the activations at the YieldOp, read after ``run_forward``) and the RSS growth
over the steps; and the recompute plans applied.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import report_child, rss_mb, timed_runs  # noqa: E402 - tools/ is not a package (stdlib only)

CONFIGS = ("none", "transformer_layer", "gelu_attn", "memopt_level1")
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def trainable(model) -> list[str]:
    import numpy as np
    import onnx

    return [init.name for init in model.graph.initializer
            if init.data_type == onnx.TensorProto.FLOAT and int(np.prod(init.dims)) >= 2
            and not init.name.endswith(BUFFER_SUFFIXES)]


# onnxruntime-training's gradient builders read optional outputs that torch.onnx does not emit
# (the peer's workaround, ../shared/peer/ort_train_bench.py): without them the gradient build
# fails with "GradientBuilderBase::O(size_t, bool) const i < node_->OutputDefs().size()".
OPTIONAL_OUTPUTS = {"SoftmaxCrossEntropyLoss": 2, "Dropout": 2, "LayerNormalization": 3}


def add_optional_outputs(model) -> None:
    for k, node in enumerate(model.graph.node):
        want = OPTIONAL_OUTPUTS.get(node.op_type, 0)
        while len(node.output) < want:
            node.output.append(f"{node.name or node.op_type + str(k)}_opt_out{len(node.output)}")


def run(args) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from onnxruntime.capi import _pybind_state as C

    model = onnx.load(args.model)
    add_optional_outputs(model)
    weights = trainable(model)
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in set(weights)}
    feeds_np = dict(np.load(args.inputs))

    builder_config = C.OrtModuleGraphBuilderConfiguration()
    builder_config.initializer_names = weights
    builder_config.initializer_names_to_train = weights
    builder_config.input_names_require_grad = []
    builder_config.build_gradient_graph = True
    builder_config.enable_caching = False
    builder_config.loglevel = C.Severity.WARNING if hasattr(C, "Severity") else 2
    builder_config.use_memory_efficient_gradient = False
    builder = C.OrtModuleGraphBuilder()
    builder.initialize(model.SerializeToString(), builder_config)
    del model

    transforms = C.TrainingGraphTransformerConfiguration()
    transforms.propagate_cast_ops_config = C.PropagateCastOpsConfiguration()
    if args.config == "transformer_layer":
        transforms.transformer_layer_recompute = True
        transforms.number_recompute_layers = 0  # the reference's default: all layers but the last
    elif args.config == "gelu_attn":
        transforms.gelu_recompute = True
        transforms.attn_dropout_recompute = True
    builder.build(transforms)
    info = builder.get_graph_info()
    graph = builder.get_gradient_model()
    gradient_model = onnx.load_model_from_string(graph)
    fw_names = [i.name for i in gradient_model.graph.input]
    bw_names = [o.name for o in gradient_model.graph.output]
    recompute_nodes = sum(1 for n in gradient_model.graph.node if n.name.endswith("_recompute"))
    del gradient_model

    def options() -> ort.SessionOptions:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # as ORTModule
        opts.enable_cpu_mem_arena = args.arena
        opts.enable_mem_pattern = args.arena
        return opts

    cpu = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    n_fw_out = len(info.user_output_names) + len(info.frontier_node_arg_map)

    def agent(opts):
        session = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
        return session, C.TrainingAgent(session._sess, fw_names, [cpu] * n_fw_out, bw_names,
                                        [cpu] * len(bw_names), 0)

    plans: list[str] = []
    opts = options()
    if args.config == "memopt_level1":
        probe = "1:1"
        session, probe_agent = agent(options())
        _, savings = probe_agent.get_serialized_ortmodule_memory_stat("", probe, False)
        del probe_agent, session
        for cluster in savings:
            picked = [p for p in cluster.split(",") if int(p.split(":")[1]) == 1]
            if picked:
                plans.append(",".join(picked))
        config_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(plans, config_file)
        config_file.close()
        opts.add_session_config_entry("optimization.memory_optimizer_config", config_file.name)
        opts.add_session_config_entry("optimization.enable_memory_probe_recompute_config", probe)
    session, training_agent = agent(opts)

    user_inputs = [n for n in fw_names if n not in values]
    missing = [n for n in user_inputs if n not in feeds_np]
    if missing:
        raise SystemExit(f"{args.inputs} lacks the model inputs {missing}")
    ordered = [feeds_np[n] if n in feeds_np else values[n] for n in fw_names]
    ones = [np.ones((), np.float32) for _ in info.module_output_gradient_name]

    def vector(arrays) -> C.OrtValueVector:
        vec = C.OrtValueVector()
        vec.reserve(len(arrays))
        for a in arrays:
            vec.push_back(C.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), cpu))
        return vec

    inputs = vector(ordered)
    marks = {}

    def step() -> None:
        state = C.PartialGraphExecutionState()
        fw_out = C.OrtValueVector()
        before = rss_mb()
        training_agent.run_forward(inputs, fw_out, state, C.OrtValueCache())
        marks.setdefault("boundary", []).append(rss_mb() - before)
        bw_out = C.OrtValueVector()
        training_agent.run_backward(vector(ones), bw_out, state)
        del state, fw_out, bw_out

    start_rss = rss_mb()
    times = timed_runs(step, args.warmup, args.reps)
    rec = {"ok": True, "config": args.config, "recompute_nodes": recompute_nodes, "memopt_plans": plans,
           "trained": len(weights)}
    if args.measure == "memory":
        rec.update(boundary_mb=statistics.median(marks["boundary"]), run_growth_mb=rss_mb("VmHWM") - start_rss)
    else:
        rec["median_ms"] = statistics.median(times)
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("inputs")
    parser.add_argument("config", choices=CONFIGS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--arena", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--measure", choices=["memory", "time"], default="time",
                        help="memory: report the boundary and step RSS (run it with "
                             "MALLOC_MMAP_THRESHOLD_ fixed, as tools/bench_recompute.py does)")
    args = parser.parse_args()
    rec = report_child(lambda: run(args))
    sys.exit(0 if rec.get("ok") else 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
