"""DropoutNoisePass: a training Dropout reads its scaled mask from a graph input.

onnxruntime's CPU ``Dropout`` draws its numbers one at a time from one generator, on one
thread, whatever the session's thread count: on the GPT-2-like benchmark model (13 Dropouts,
4.2 M elements a step) its kernels took 19.7 of the forward session's 92 ms and their
gradients (a Cast and two Muls each) 3.2 ms of the backward's
(``tools/profile_ortmodule.py --models gpt2 --top-nodes 700``, 2-core CPU). A caller that draws
faster (gradgraph's ORTModule: numpy on every core, 7.4 ms for those 4.2 M, see
:mod:`gradgraph.dropout_noise`) feeds each rewritten Dropout its noise, the tensor torch's
own CPU dropout multiplies by::

    noise = (U >= ratio) / (1 - ratio)      U uniform on [0, 1), X's shape and type
    Y     = Mul(X, noise)                   mask (output 1), where read: Greater(noise, 0)

which is what onnxruntime's kernel computes from its own draws (``mask = draw >= ratio``,
``Y = X * mask / (1 - ratio)``); the backward of the Mul reads ``noise`` (one pass,
``dX = dY * noise``). ``noise`` is a new graph input named ``<Y's name>.noise``, its metadata
``NOISE_KEY`` holding the ratio (``repr`` of the float); :func:`noise_inputs` lists them. The
caller feeds new noise on every run (the same noise twice repeats the mask).

Rewritten: a default-domain Dropout (opset 12 or later) of the main graph whose
``training_mode`` is the constant true, whose ratio is absent (0.5) or a constant in (0, 1),
whose input is float32 or float64 of a known static shape; a float32 ratio is read as its
shortest decimal (the exporter's rounding of the user's p: 0.999, not 0.99900001, whose scale
differs by 1.3e-5; a p that is no short decimal, 1/3, keeps float32's precision: 1e-8 relative
in a float64 model). A ratio of exactly 1, which onnxruntime's kernel refuses, with its mask
unread, becomes ``Y = X * 0`` (torch's result) for any input. Anything else is left alone
(inference Dropout is the identity; a ratio of 0 or one computed at run time stays
onnxruntime's). The ``seed`` attribute goes with the node: the caller's draws decide.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.kernels._graph import DEFAULT_DOMAINS, const_array, default_opset, take_over
from passes.names import free_name

NOISE_KEY = "gradgraph.dropout_noise"
_TYPES = {ir.DataType.FLOAT: np.float32, ir.DataType.DOUBLE: np.float64}


@dataclasses.dataclass(frozen=True)
class NoiseInput:
    """A graph input :class:`DropoutNoisePass` made: its shape, dtype and dropout ratio."""

    shape: tuple[int, ...]
    dtype: type  # numpy float32 or float64
    ratio: float


def _ratio(node: ir.Node) -> float | None:
    """The Dropout's ratio where the rewrite applies (module docstring), else None."""
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return None  # no training_mode: inference
    training = const_array(node.inputs[2])
    if training is None or training.size != 1 or not bool(training.reshape(())):
        return None
    ratio = 0.5
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        value = const_array(node.inputs[1])
        if value is None or value.size != 1:
            return None
        # an exporter's float32 ratio is the user's decimal p rounded (0.999 -> 0.99900001):
        # its shortest decimal (a numpy scalar's: its dtype decides) is that p, whose scale
        # 1 / (1 - p) torch uses
        scalar = value.dtype.type(value.reshape(-1)[0])
        ratio = float(scalar) if value.dtype == np.float64 else float(np.format_float_positional(scalar, unique=True))
    return ratio if 0.0 < ratio <= 1.0 else None


def _mask_unread(node: ir.Node) -> bool:
    mask = node.outputs[1] if len(node.outputs) > 1 else None
    return mask is None or not (mask.uses() or mask.is_graph_output())


def _static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None or value.shape is None or value.dtype not in _TYPES:
        return None
    dims = [d for d in value.shape if isinstance(d, int)]
    return tuple(dims) if len(dims) == len(value.shape) else None


class DropoutNoisePass(InPlacePass):
    """The rewrite of the module docstring, on every Dropout it applies to."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if default_opset(model) < 12:  # training_mode became an input at opset 12
            return PassResult(model, False)
        dropouts = [(n, r) for n in graph if n.op_type == "Dropout" and n.domain in DEFAULT_DOMAINS
                    and (r := _ratio(n)) is not None]
        dropped = [n for n, r in dropouts if r == 1.0 and _mask_unread(n)]
        found = [(n, r, s) for n, r in dropouts if r < 1.0 and (s := _static_shape(n.inputs[0])) is not None]
        taken = ({v.name for v in graph.inputs} | set(graph.initializers)
                 | {v.name for n in graph for v in n.outputs}) if dropped or found else set()
        for node in dropped:
            self._drop_all(graph, node, taken)
        if found:
            for node, ratio, shape in found:
                self._rewrite(graph, node, ratio, shape, taken)
        return PassResult(model, bool(found or dropped))

    @staticmethod
    def _drop_all(graph: ir.Graph, node: ir.Node, taken: set) -> None:
        """Ratio 1 (onnxruntime's kernel refuses it): ``Y = X * 0``, as torch computes it."""
        x = node.inputs[0]
        assert x is not None and x.dtype is not None
        name = free_name(f"{node.name or node.outputs[0].name or 'Dropout'}/dropped_zero", taken)
        zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, x.dtype.numpy()))}, name=name)
        apply = ir.node("Mul", [x, zero.outputs[0]], name=f"{name}_apply")
        zero.outputs[0].name = name
        apply.outputs[0].type, apply.outputs[0].shape = x.type, x.shape
        for new in (zero, apply):
            new.metadata_props.update(node.metadata_props)
        graph.insert_before(node, [zero, apply])
        take_over(graph, node.outputs[0], apply.outputs[0])
        graph.remove(node, safe=True)

    @staticmethod
    def _rewrite(graph: ir.Graph, node: ir.Node, ratio: float, shape: tuple[int, ...], taken: set) -> None:
        x, out = node.inputs[0], node.outputs[0]
        assert x is not None and x.dtype is not None
        name = free_name(f"{out.name or node.name or 'Dropout'}.noise", taken)
        noise = ir.Value(name=name, type=ir.TensorType(x.dtype), shape=ir.Shape(shape))
        noise.metadata_props[NOISE_KEY] = repr(ratio)
        graph.inputs.append(noise)
        apply = ir.node("Mul", [x, noise], name=f"{node.name or name}/noise_apply")
        apply.outputs[0].type, apply.outputs[0].shape = ir.TensorType(x.dtype), ir.Shape(shape)
        made = [apply]
        mask = node.outputs[1] if len(node.outputs) > 1 else None
        if not _mask_unread(node):
            assert mask is not None
            zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, _TYPES[x.dtype]))},
                           name=f"{node.name or name}/noise_zero")
            kept = ir.node("Greater", [noise, zero.outputs[0]], name=f"{node.name or name}/noise_mask")
            kept.outputs[0].type, kept.outputs[0].shape = ir.TensorType(ir.DataType.BOOL), ir.Shape(shape)
            made += [zero, kept]
        for new in made:
            new.metadata_props.update(node.metadata_props)
            for k_out, value in enumerate(new.outputs):
                if value.name is None:
                    value.name = f"{new.name}_{k_out}" if k_out else new.name
        graph.insert_before(node, made)
        take_over(graph, out, apply.outputs[0])
        if len(made) > 1:
            assert mask is not None
            take_over(graph, mask, made[2].outputs[0])
        graph.remove(node, safe=True)


def noise_inputs(graph: ir.Graph) -> dict[str, NoiseInput]:
    """The graph inputs a caller feeds with new dropout noise on every run
    (:class:`DropoutNoisePass`), in graph-input order."""
    found = {}
    for v in graph.inputs:
        ratio = v.metadata_props.get(NOISE_KEY)
        shape = _static_shape(v)
        if ratio is not None and shape is not None:
            found[v.name or ""] = NoiseInput(shape, _TYPES[v.dtype], float(ratio))  # type: ignore[index]
    return found
