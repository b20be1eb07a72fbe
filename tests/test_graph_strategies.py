"""The drawn models are valid, run on onnxruntime, and gradgraph differentiates them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings

import gradgraph
from tests.graph_strategies import (
    feeds,
    has_random_ops,
    random_models,
    random_training_models,
    trainable_names,
)

_SETTINGS = settings(max_examples=30, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, inputs)))


def _check(model: onnx.ModelProto, weights: list[str] | None) -> None:
    onnx.checker.check_model(model, full_check=True)
    inputs = feeds(model, seed=1)
    assert inputs == {} or all(isinstance(a, np.ndarray) for a in inputs.values())
    forward = _run(model, inputs)
    assert forward["loss"].shape == ()
    assert all(np.isfinite(a).all() for a in forward.values()), "drawn model overflows"
    trainable = trainable_names(model)
    assert trainable, "every drawn model has a trainable initializer"
    grad_model = gradgraph.build_gradient_graph(model, "loss", weights)
    grads = {k: v for k, v in _run(grad_model, inputs).items() if k.endswith("_grad")}
    assert grads, "no gradient output"
    assert set(grads) <= {f"{w}_grad" for w in trainable}
    for name, value in grads.items():
        assert np.isfinite(value).all(), name
    np.testing.assert_allclose(_run(grad_model, inputs)["loss"], forward["loss"], rtol=1e-5, atol=1e-6)


@_SETTINGS
@given(random_models())
def test_random_models_are_valid_and_differentiable(model: onnx.ModelProto) -> None:
    _check(model, None)


@_SETTINGS
@given(random_training_models(opset=20))
def test_random_training_models_train_every_initializer(model: onnx.ModelProto) -> None:
    _check(model, trainable_names(model))
    grad_model = gradgraph.build_gradient_graph(model, "loss", trainable_names(model))
    outputs = {o.name for o in grad_model.graph.output}
    assert {f"{w}_grad" for w in trainable_names(model)} <= outputs


@settings(max_examples=15, deadline=None, database=None)
@given(random_models())
def test_feeds_are_deterministic_and_training_flag_is_fed(model: onnx.ModelProto) -> None:
    a, b = feeds(model, seed=3), feeds(model, seed=3, training=True)
    assert a.keys() == b.keys()
    for name in a:
        if a[name].dtype == np.bool_:
            assert not a[name] and b[name]
        else:
            np.testing.assert_array_equal(a[name], b[name])
    assert ("training_mode" in a) == has_random_ops(model)
