"""One fixed draw of a model's random numbers, fed to both sides of ``gradgraph check``.

A forward that draws random numbers (a training-mode Dropout, RandomNormal(Like),
RandomUniform(Like), Bernoulli, Multinomial) computes another function at every run:
differences of its loss would measure the draws, and an analytic gradient computed with one
mask compared with a loss computed with another (or with none) says nothing. The check
therefore draws once and holds the draw fixed on both sides:

1. each random node of the main graph without a ``seed`` gets one derived from the check's
   seed (:class:`passes.forward.random_seeds.SeedRandomOpsPass`), so the draw is the same on
   every run of the check; onnxruntime runs the forward once at the check's inputs and its
   draws are read (a Dropout's mask, ratio and training flag; the other ops' outputs);
2. the model is rewritten to read them from new graph inputs named ``<output>.draw``:

   - a Dropout becomes ``Y = Mul(X, noise)`` with ``noise = mask / (1 - ratio)`` (the scale
     onnxruntime's kernel applies; ``mask`` all true and ``noise`` 1 where the training flag
     was false at run time), its mask output, where read, ``Greater(noise, 0)``;
   - any other random op's output is the graph input itself (its value does not depend on
     the values of the op's inputs, so no gradient is lost).

The gradient graph is built from the rewritten model and both it and the oracle's
differences are fed the same draw: the check compares the gradient of one function. A random
node inside a subgraph (Loop, If, Scan) cannot be rewritten this way and is refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from gradgraph.feeds import NP_OF_ORT, check_feeds, unshaped_inputs
from gradgraph.runtime.external import session_parts
from passes.autodiff import GradientError
from passes.cleanup import is_random
from passes.forward.random_seeds import SeedRandomOpsPass
from passes.names import free_name
from passes.subgraphs import node_subgraphs

DRAW_SUFFIX = ".draw"


def random_nodes(model: ir.Model, model_desc: str) -> list[ir.Node]:
    """The main graph's random nodes; a random node inside a subgraph is refused."""
    found = []
    for node in model.graph:
        if any(node_subgraphs(node)):
            if is_random(node):
                raise GradientError(
                    f"cannot check {model_desc}: node {node.name!r} ({node.op_type}) draws random "
                    "numbers inside its subgraph, which the check cannot hold fixed, so the loss "
                    "would change from run to run; feed the random values as an input to check "
                    "this model", op_type=node.op_type)
            continue
        if is_random(node):
            found.append(node)
    return found


def freeze_random_draws(model: ir.Model, feeds: Mapping[str, np.ndarray], seed: int,
                        model_desc: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Rewrite ``model`` in place as the module docstring says.

    Returns the draws to add to the feeds (new graph input name -> array) and the notes the
    check prints (empty when the model draws nothing).
    """
    nodes = random_nodes(model, model_desc)
    if not nodes:
        return {}, []
    named = [repr(n.name or n.outputs[0].name) for n in nodes]
    counts = Counter(n.op_type for n in nodes)
    SeedRandomOpsPass(seed)(model)
    wanted = _probe_values(nodes)
    values = _run_probe(model, wanted, feeds, model_desc)
    taken = ({v.name or "" for v in model.graph.inputs} | set(model.graph.initializers)
             | {v.name or "" for n in model.graph for v in n.outputs})
    draws: dict[str, np.ndarray] = {}
    for node in nodes:
        if node.op_type == "Dropout":
            _freeze_dropout(model.graph, node, values, draws, taken)
        else:
            _freeze_output(model.graph, node, values, draws, taken)
    ops = ", ".join(f"{count} {op}" for op, count in counts.items())
    shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return draws, [f"random draws held fixed ({ops}: {shown}): drawn once with seed {seed} and "
                   "fed to both the gradient graph and the differences of the loss"]


def _mask_of(node: ir.Node) -> ir.Value | None:
    return node.outputs[1] if len(node.outputs) > 1 else None


def _probe_values(nodes: list[ir.Node]) -> list[ir.Value]:
    """The values the probe run returns: a Dropout's mask (made if absent), ratio and training
    flag; any other random op's outputs."""
    wanted: list[ir.Value] = []
    for node in nodes:
        if node.op_type == "Dropout":
            if _mask_of(node) is None:
                node.resize_outputs(2)
            mask = _mask_of(node)
            assert mask is not None
            if mask.name is None:
                mask.name = f"{node.outputs[0].name}.mask"
            wanted.append(mask)
            wanted += [v for v in node.inputs[1:3] if v is not None]
        else:
            wanted += list(node.outputs)
    return wanted


def _run_probe(model: ir.Model, wanted: list[ir.Value], feeds: Mapping[str, np.ndarray],
               model_desc: str) -> dict[str, np.ndarray]:
    """The arrays of ``wanted`` in one onnxruntime run of ``model`` at ``feeds``."""
    proto, injected, arrays = session_parts(model)  # the weights as OrtValues: > 2 GB models too
    known = {o.name for o in proto.graph.output}
    names = list(dict.fromkeys(v.name or "" for v in wanted))
    for name in names:
        if name not in known:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
    if injected:
        opts.add_external_initializers(injected, values)
    try:
        session = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types
        raise GradientError(f"cannot check {model_desc}: it draws random numbers, and onnxruntime "
                            f"cannot load it to draw them once: {' '.join(str(exc).split())[:300]}") from exc
    check_feeds(session.get_inputs(), feeds, "the inputs given", unshaped=unshaped_inputs(proto))
    given = {i.name: np.asarray(feeds[i.name], dtype=NP_OF_ORT.get(i.type)) for i in session.get_inputs()}
    try:
        arrays = session.run(names, given)
    except Exception as exc:  # noqa: BLE001
        raise GradientError(f"cannot check {model_desc}: it draws random numbers, and onnxruntime "
                            f"cannot run it to draw them once: {' '.join(str(exc).split())[:300]}") from exc
    return {n: np.asarray(a) for n, a in zip(names, arrays)}


def _new_input(graph: ir.Graph, like: ir.Value, array: np.ndarray, taken: set[str],
               draws: dict[str, np.ndarray]) -> ir.Value:
    name = free_name(f"{like.name or 'random'}{DRAW_SUFFIX}", taken)
    value = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     shape=ir.Shape(array.shape))
    graph.inputs.append(value)
    draws[name] = array
    return value


def _replace(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    for i, out in enumerate(graph.outputs):
        if out is old:
            graph.outputs[i] = new
    ir.convenience.replace_all_uses_with(old, new)


def _freeze_output(graph: ir.Graph, node: ir.Node, values: dict[str, np.ndarray],
                   draws: dict[str, np.ndarray], taken: set[str]) -> None:
    for out in node.outputs:
        _replace(graph, out, _new_input(graph, out, values[out.name or ""], taken, draws))
    graph.remove(node, safe=True)


def _scalar(node: ir.Node, index: int, values: dict[str, np.ndarray], default: float) -> float:
    value = node.inputs[index] if len(node.inputs) > index else None
    if value is None:
        return default
    return float(np.asarray(values[value.name or ""]).reshape(-1)[0])


def _freeze_dropout(graph: ir.Graph, node: ir.Node, values: dict[str, np.ndarray],
                    draws: dict[str, np.ndarray], taken: set[str]) -> None:
    x, y, mask = node.inputs[0], node.outputs[0], _mask_of(node)
    assert x is not None and mask is not None and x.dtype is not None
    dtype = x.dtype.numpy()
    kept = values[mask.name or ""].astype(bool)
    ratio = np.float32(_scalar(node, 1, values, 0.5))
    training = bool(_scalar(node, 2, values, 0.0))
    scale = np.float32(1) / (np.float32(1) - ratio) if training and ratio < 1 else np.float32(1)
    noise = (kept.astype(np.float32) * scale).astype(dtype)
    draw = _new_input(graph, y, noise, taken, draws)
    apply = ir.node("Mul", [x, draw], name=f"{node.name or y.name}/draw_apply")
    apply.outputs[0].type, apply.outputs[0].shape = x.type, x.shape
    made = [apply]
    if mask.uses() or mask.is_graph_output():
        zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, dtype))},
                       name=f"{node.name or y.name}/draw_zero")
        greater = ir.node("Greater", [draw, zero.outputs[0]], name=f"{node.name or y.name}/draw_mask")
        greater.outputs[0].type = ir.TensorType(ir.DataType.BOOL)
        greater.outputs[0].shape = ir.Shape(noise.shape)
        made += [zero, greater]
    for new in made:
        for k, out in enumerate(new.outputs):
            out.name = free_name(f"{new.name}_{k}", taken)
    graph.insert_before(node, made)
    name = y.name
    _replace(graph, y, apply.outputs[0])
    y.name, apply.outputs[0].name = None, name
    if len(made) > 1:
        mask_name = mask.name
        _replace(graph, mask, made[2].outputs[0])
        mask.name, made[2].outputs[0].name = None, mask_name
    graph.remove(node, safe=True)
