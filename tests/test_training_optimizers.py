"""Optimizer graphs against torch.optim (and a float64 NumPy LAMB) on an MLP, 20 steps, plain and
with accumulation + clipping (the CNN and tiny BERT run the same matrix in test_training_models.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from _training_models import (
    MLP,
    RTOL,
    assert_close_tensor,
    export_training,
    mlp_batches,
    reference_training,
)

from gradgraph import TrainingConfig, TrainingSession, UpdateOptions, build_training_artifacts
from passes.optimizer import AdamConfig, AdamWConfig, LambConfig, ParamGroup, SGDConfig

STEPS = 20
LR = 0.05
CPU = ["CPUExecutionProvider"]

# torch.optim is the reference for SGD and Adam(W) (same hyper-parameters, see
# _training_models.torch_optimizer), the float64 NumPy reference for LAMB.
CASES = {
    "sgd-momentum": SGDConfig(momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov": SGDConfig(momentum=0.8, nesterov=True),
    "sgd-plain": SGDConfig(),
    "adam": AdamConfig(weight_decay=0.1),
    "adamw": AdamWConfig(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05),
    "lamb": LambConfig(weight_decay=0.01),
}


def _mlp(seed: int = 0, dropout: float = 0.0) -> tuple[MLP, bytes]:
    torch.manual_seed(seed)
    module = MLP(dropout=dropout)
    feeds = mlp_batches(1)[0]
    model = export_training(module, (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])),
                            ["x", "y"], seed=seed)
    return module, model


def _compare(session: TrainingSession, ours: list[float], ref: tuple[list[float], dict]) -> None:
    ref_losses, ref_state = ref
    np.testing.assert_allclose(ours, ref_losses, rtol=RTOL)
    state = session.get_model_state()["full_precision"]
    for name in session.artifacts.params:
        assert_close_tensor(state[name], ref_state[name], name)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("accumulate,clip", [(1, None), (3, 0.05)])
def test_matches_reference(case: str, accumulate: int, clip: float | None) -> None:
    config = CASES[case]
    module, model = _mlp()
    session = TrainingSession(model, TrainingConfig("loss", config, update=UpdateOptions(
        accumulation_steps=accumulate, max_grad_norm=clip)), providers=CPU)
    batches = mlp_batches(STEPS * accumulate)
    ours = [session.train_step(f, lr=LR) for f in batches]
    _compare(session, ours, reference_training(module, config, batches, LR, accumulate, clip))
    assert session.step == STEPS


def test_param_groups_match_torch_groups() -> None:
    module, model = _mlp()
    groups = (ParamGroup(("*.bias",), {"weight_decay": 0.0}, lr_scale=0.5),)
    session = TrainingSession(model, TrainingConfig("loss", AdamWConfig(weight_decay=0.2),
                                                    update=UpdateOptions(groups=groups)),
                              providers=CPU)
    batches = mlp_batches(STEPS)
    ours = [session.train_step(f, lr=LR) for f in batches]
    _compare(session, ours, reference_training(module, AdamWConfig(weight_decay=0.2), batches, LR,
                                               groups=groups))


def test_frozen_weights_unchanged() -> None:
    module, model = _mlp()
    session = TrainingSession(model, TrainingConfig("loss", AdamWConfig(),
                                                    weights_not_to_train=("fc1.weight", "fc1.bias")),
                              providers=CPU)
    before = session.get_model_state()["full_precision"]
    for f in mlp_batches(5):
        session.train_step(f, lr=LR)
    after = session.get_model_state()["full_precision"]
    assert np.array_equal(before["fc1.weight"], after["fc1.weight"])
    assert np.array_equal(before["fc1.bias"], after["fc1.bias"])
    assert not np.array_equal(before["fc2.weight"], after["fc2.weight"])
    assert "fc1.weight" not in session.get_optimizer_state()


def test_training_graphs_are_standard_onnx() -> None:
    _, model = _mlp()
    art = build_training_artifacts(model, TrainingConfig("loss", AdamWConfig(), update=UpdateOptions(
        accumulation_steps=2, max_grad_norm=1.0)))
    for proto in (art.train, art.accumulate, art.eval):
        onnx.checker.check_model(proto, full_check=True)
        assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}


def test_dropout_is_real_in_training_and_off_in_eval() -> None:
    _, model = _mlp(dropout=0.5)
    _, plain = _mlp(dropout=0.0)
    feeds = mlp_batches(1)[0]
    drop = TrainingSession(model, TrainingConfig("loss", SGDConfig()), providers=CPU)
    nodrop = TrainingSession(plain, TrainingConfig("loss", SGDConfig()), providers=CPU)
    # lr 0: the weights stay put, only dropout changes the loss
    train_drop = [drop.train_step(feeds, lr=0.0) for _ in range(3)]
    train_plain = nodrop.train_step(feeds, lr=0.0)
    assert all(abs(loss - train_plain) > 1e-6 for loss in train_drop)
    assert len(set(train_drop)) > 1
    evals = [float(drop.eval_step(feeds)["loss"]) for _ in range(3)]
    assert evals == [evals[0]] * 3
    assert evals[0] == pytest.approx(float(nodrop.eval_step(feeds)["loss"]), rel=1e-6)


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="onnxruntime has no CUDAExecutionProvider here")
def test_cuda_matches_cpu() -> None:
    _, model = _mlp()
    config = TrainingConfig("loss", AdamWConfig(), update=UpdateOptions(accumulation_steps=2,
                                                                      max_grad_norm=1.0))
    cpu = TrainingSession(model, config, providers=CPU)
    cuda = TrainingSession(model, config, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert cuda.store.device == "cuda"
    batches = mlp_batches(10)
    np.testing.assert_allclose([cuda.train_step(f, lr=LR) for f in batches],
                               [cpu.train_step(f, lr=LR) for f in batches], rtol=1e-5)
    for name, value in cpu.get_state().items():
        assert_close_tensor(cuda.get_state()[name], value, name)


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="this onnxruntime build has CUDA")
def test_cuda_request_without_cuda_build_is_a_clear_error() -> None:
    _, model = _mlp()
    config = TrainingConfig("loss", AdamWConfig())
    with pytest.raises(ValueError, match="CUDAExecutionProvider.*onnxruntime-gpu"):
        TrainingSession(model, config, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_learning_rate_in_the_weights_precision(tmp_path, dtype) -> None:
    """A float64 model's learning rate is a float64 input: SGD steps equal numpy's float64 ones to
    rounding (a float32 rate, 1e-3 -> 1.00000005e-3, moved the weights off by ~5e-11 relative a
    step); a float32 model keeps a float32 rate."""
    from onnx import helper, numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w0 = np.linspace(-1, 1, 12).reshape(4, 3).astype(dtype)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [2, 4])],
                              [helper.make_tensor_value_info("loss", elem, [])], [numpy_helper.from_array(w0, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    config = TrainingConfig(loss="loss", optimizer=SGDConfig(), weights_to_train=("w",))
    session = TrainingSession(str(path), config, providers=["CPUExecutionProvider"])
    lr_input = next(i for i in session.artifacts.train.graph.input if i.name == config.names.learning_rate)
    assert lr_input.type.tensor_type.elem_type == elem
    x = np.arange(8, dtype=dtype).reshape(2, 4) / 7
    w = w0.astype(np.float64)
    for _ in range(3):
        session.train_step({"x": x}, lr=1e-3)
        w = w - 1e-3 * (x.astype(np.float64).T @ (2 * (x.astype(np.float64) @ w)))
    tol = 1e-13 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(session.get_state()["w"], w, rtol=tol, atol=0)
