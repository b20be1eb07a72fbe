"""Public entry points: build_gradient_graph and the reference-compatible GradientGraphBuilder."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import onnx
import onnx_ir as ir
from onnx_ir.passes import Sequential

from gradgraph.io import atomic_write_bytes, load_model, model_proto
from gradgraph.pipeline import Pipeline, Stage
from gradgraph.runtime.compat import for_runtime
from gradgraph.validate import check_names, unknown_names
from passes.autodiff import GradientError, GradientOptions
from passes.autodiff.gradient_pass import GradientPass
from passes.forward.prepare import PrepareForGradientPass
from passes.forward.reduce_loss import ReduceLossPass


def gradient_pipeline(loss: str, weights_to_train: Sequence[str] | None, options: GradientOptions,
                      loss_reduction: str | None = None) -> Pipeline:
    """The declared stages of gradient construction (each stage's model can be saved).

    The forward stage refuses exports whose parameters were folded irreversibly only when
    the trained set is the default one (``weights_to_train=None``).
    """
    forward = Sequential(PrepareForGradientPass(strict_parameters=weights_to_train is None),
                         *([] if options.seed_from_input else [ReduceLossPass(loss, loss_reduction)]))
    return Pipeline([
        Stage("forward", forward),
        Stage("gradient", GradientPass(loss, weights_to_train, options)),
    ])


def build_gradient_graph(
    model: onnx.ModelProto | ir.Model | str | os.PathLike | bytes | Any,
    loss: str,
    weights_to_train: Iterable[str] | None = None,
    *,
    loss_reduction: str | None = None,
    allow_unused: bool = False,
    seed_from_input: bool = False,
    save_stages: str | os.PathLike | None = None,
    target_ir_version: int | None = None,
    max_opset: int | None = None,
    as_ir: bool = False,
) -> Any:
    """Return ``model`` plus the gradient of ``loss`` w.r.t. ``weights_to_train``.

    The result keeps the forward inputs, initializers and outputs, and adds one
    output ``<name>_grad`` per trained name (same dtype and shape). ``model`` is a path,
    bytes, an ``onnx.ModelProto``, an ``onnx_ir.Model`` or a ``torch.onnx.ONNXProgram``.
    ``weights_to_train`` names initializers and/or graph inputs; ``None`` means the model's
    parameters that reach the loss (see :func:`gradgraph.list_weights`). A scalar loss is
    seeded with 1; a non-scalar one needs ``loss_reduction`` ("sum" or "mean"), or
    ``seed_from_input``: then the seed is an extra input ``<loss>_grad``. Raises
    :class:`GradientError` for anything it refuses; nothing is written then.

    ``target_ir_version``/``max_opset`` make the result loadable by an older runtime
    (onnxruntime 1.19, the last onnxruntime-training, reads IR <= 10 and opset <= 21): the
    forward model is converted down to ``max_opset`` first, so the gradient rules emit ops
    valid there, and the result's IR version is lowered (see :func:`gradgraph.runtime.compat.for_runtime`).

    ``as_ir``: return the ``onnx_ir.Model`` instead (tensors of a model over 1 GiB stay in
    their external data files; save it with :func:`gradgraph.io.save_model`).
    """
    if weights_to_train is not None:
        if not isinstance(weights_to_train, (str, bytes)):
            weights_to_train = list(weights_to_train)  # a generator is read once
        check_names("weights_to_train", weights_to_train)
        weights_to_train = list(weights_to_train)
        if not weights_to_train:
            raise GradientError("weights_to_train is empty: name the weights to differentiate, or "
                                "pass None for the model's parameters (gradgraph.list_weights)")
        if len(set(weights_to_train)) != len(weights_to_train):
            dup = next(w for w in weights_to_train if weights_to_train.count(w) > 1)
            raise GradientError(f"weights_to_train names {dup!r} more than once")
    ir_model = load_model(model)
    if weights_to_train is not None:
        known = set(ir_model.graph.initializers) | {v.name for v in ir_model.graph.inputs if v.name}
        unknown_names("weights_to_train", weights_to_train, known)
    targeting = target_ir_version is not None or max_opset is not None
    if targeting and as_ir:
        raise GradientError("as_ir returns the IR model as built: give target_ir_version / "
                            "max_opset without it")
    if targeting:
        limits = {"max_ir_version": target_ir_version if target_ir_version is not None else 10**6,
                  "max_opset": max_opset if max_opset is not None else 10**6}
        ir_model = ir.from_proto(for_runtime(ir.to_proto(ir_model), **limits))
    weights = None if weights_to_train is None else list(weights_to_train)
    options = GradientOptions(allow_unused=allow_unused, seed_from_input=seed_from_input)
    pipeline = gradient_pipeline(loss, weights, options, loss_reduction)
    result = pipeline.run(ir_model, save_dir=save_stages)
    if as_ir:  # gradgraph grad: saved without a ModelProto holding the weights (models over 2 GB)
        return result
    proto = model_proto(result)
    return for_runtime(proto, **limits) if targeting else proto


class GradientGraphBuilder:
    """Same shape as onnxruntime's pybind ``GradientGraphBuilder``.

    ``GradientGraphBuilder(model_bytes, y_node_arg_names, x_node_arg_names, loss_node_arg_name)``;
    ``build()``, ``get_model() -> bytes``, ``save(path)``. ``y`` names the outputs to
    differentiate (the loss when ``loss_node_arg_name`` is given, seeded with 1), ``x`` the
    tensors to differentiate with respect to; gradients are added as graph outputs.
    """

    def __init__(self, model: bytes | str | os.PathLike | onnx.ModelProto, y_node_arg_names: Iterable[str],
                 x_node_arg_names: Iterable[str], loss_node_arg_name: str = "") -> None:
        self._model = model
        self._ys = sorted(y_node_arg_names)
        self._xs = sorted(x_node_arg_names)
        self._loss = loss_node_arg_name
        if not self._loss:
            if len(self._ys) != 1:
                raise GradientError(
                    "without loss_node_arg_name exactly one y name is needed (got "
                    f"{self._ys}); gradgraph seeds that output from an input '<y>_grad'")
        elif self._ys and self._loss not in self._ys:
            raise GradientError(f"loss {self._loss!r} is not among the y names {self._ys}")
        self._result: onnx.ModelProto | None = None

    def build(self) -> None:
        loss = self._loss or self._ys[0]
        self._result = build_gradient_graph(self._model, loss, self._xs,
                                            seed_from_input=not self._loss)

    def get_model(self) -> bytes:
        if self._result is None:
            raise GradientError("call build() before get_model()")
        return self._result.SerializeToString()

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_bytes(path, self.get_model())
