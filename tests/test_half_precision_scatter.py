"""float16 / bfloat16 gradients that scatter-add (Gather's, a cross-entropy's on its valid rows)
run on onnxruntime's CPU provider, whose scatters do not reduce in those types: the builder
accumulates in float32 and casts back. A kernel onnxruntime lacks is reported as such, not as
bad data."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgraph import (
    AdamWConfig,
    GradientError,
    TrainingConfig,
    TrainingSession,
    build_gradient_graph,
)
from gradgraph.feeds import InputError
from gradgraph.training.session import _run_error


def _embedding_model(dtype: int) -> tuple:
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((6, 4)).astype(np.float32)
    init = numpy_helper.from_array(table.astype(np_dtype), "E")
    if dtype == TensorProto.BFLOAT16:
        init = helper.make_tensor("E", dtype, [6, 4], table.reshape(-1).tolist())
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)],
        "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, [5])],
        [helper.make_tensor_value_info("loss", dtype, [])], [init])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), table


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16])
def test_gather_gradient_in_half_precision_runs_on_cpu(dtype) -> None:
    model, _ = _embedding_model(dtype)
    ids = np.array([1, 3, 1, 5, 1], np.int64)
    grad_model = build_gradient_graph(model, "loss", ["E"])
    scatters = [n for n in grad_model.graph.node if n.op_type in ("ScatterND", "ScatterElements")]
    assert scatters  # the case this test is about
    session = ort.InferenceSession(grad_model.SerializeToString(), providers=["CPUExecutionProvider"])
    (grad,) = session.run(["E_grad"], {"ids": ids})
    expected = np.zeros((6, 4))
    np.add.at(expected, ids, 1.0)  # each row read k times gets k
    assert grad.dtype == np.float16
    np.testing.assert_array_equal(grad.astype(np.float64), expected)


def test_half_precision_embedding_trains_in_a_session() -> None:
    model, _ = _embedding_model(TensorProto.FLOAT16)
    # eps 1e-4: rows no id reads have m = v = 0 (see the next test)
    session = TrainingSession(model, TrainingConfig(loss="loss", weights_to_train=("E",),
                                                    optimizer=AdamWConfig(eps=1e-4)))
    losses = [float(session.train_step({"ids": np.array([1, 3, 1, 5, 1], np.int64)}, lr=0.5)) for _ in range(2)]
    assert np.isfinite(losses).all() and losses[1] < losses[0] and session.skipped_steps == 0


def test_an_eps_that_is_zero_in_float16_is_warned_about() -> None:
    model, _ = _embedding_model(TensorProto.FLOAT16)
    with pytest.warns(UserWarning, match=r"eps=1e-08\) is 0 in float16.*0 / 0 = NaN"):
        session = TrainingSession(model, TrainingConfig(loss="loss", weights_to_train=("E",)))
    session.train_step({"ids": np.array([1, 3, 1, 3, 1], np.int64)}, lr=0.5)
    assert session.skipped_steps == 1  # as torch's Adam would make those rows NaN


def test_a_missing_kernel_is_not_blamed_on_the_feeds() -> None:
    missing = _run_error(RuntimeError("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : MLFloat16 data type is not "
                                      "supported with ScatterND opset 16 when reduction is 'add'."), "the step")
    assert isinstance(missing, GradientError) and not isinstance(missing, InputError)
    assert "no kernel" in str(missing)
    bad_label = _run_error(RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : indices element out of "
                                        "data bounds, idx=7 must be within the inclusive range [-4,3]"), "the step")
    assert isinstance(bad_label, InputError) and "class label" in str(bad_label)
