"""Non-finite steps: skipped inside the graph (state bit-identical), counted, and stopping `train`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _training_models import MLP, export_training, mlp_batches

import gradgraph
from gradgraph.cli.train import CHECKPOINT_NAME, EXIT_DIVERGED, main
from gradgraph.training.checkpoint import read_checkpoint


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    torch.manual_seed(0)
    feeds = mlp_batches(1)[0]
    return export_training(MLP(), (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])), ["x", "y"])


def _state(session: gradgraph.TrainingSession) -> dict[str, np.ndarray]:
    return session.get_state()


@pytest.mark.parametrize("optimizer", [gradgraph.AdamWConfig(), gradgraph.SGDConfig(momentum=0.9),
                                       gradgraph.LambConfig()])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_nan_input_and_nan_lr_leave_state_bit_identical(model_bytes: bytes, optimizer, accumulate) -> None:
    config = gradgraph.TrainingConfig("loss", optimizer, update=gradgraph.UpdateOptions(
        accumulation_steps=accumulate, max_grad_norm=1.0))
    session = gradgraph.TrainingSession(model_bytes, config, providers=["CPUExecutionProvider"])
    batches = mlp_batches(8)
    for feeds in batches[:2 * accumulate]:  # some real steps first: non-zero optimizer state
        session.train_step(feeds, lr=1e-2)
    assert session.step == 2 and session.skipped_steps == 0 and session.last_step_finite
    before = _state(session)
    bad = dict(batches[2])
    bad["x"] = bad["x"].copy()
    bad["x"][3, 1] = np.nan
    for _ in range(accumulate - 1):
        session.train_step(batches[3], lr=1e-2)
    session.train_step(bad, lr=1e-2)  # the applying micro-step sees a NaN
    assert not session.last_step_finite and session.skipped_steps == 1
    after = _state(session)
    for name, value in before.items():
        if "accumulation" in name:
            continue  # the buffer is reset at the next step's first micro-step
        assert np.array_equal(value, after[name]), name
    for _ in range(accumulate):
        session.train_step(batches[4], lr=float("nan"))
    assert not session.last_step_finite and session.skipped_steps == 2
    for name, value in before.items():
        if "accumulation" not in name:
            assert np.array_equal(value, session.get_state()[name]), name
    for _ in range(accumulate):  # and a finite step afterwards trains again
        session.train_step(batches[5], lr=1e-2)
    assert session.last_step_finite and session.step == 3


def test_train_stops_after_max_skipped_with_exit_3(model_bytes: bytes, tmp_path: Path, capsys) -> None:
    (tmp_path / "m.onnx").write_bytes(model_bytes)
    rows = mlp_batches(4, batch=8)
    data = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    np.savez(tmp_path / "good.npz", **data)
    base = ["train", str(tmp_path / "m.onnx"), "--loss", "loss", "--batch-size", "8", "--quiet",
            "--optimizer", "adamw", "--lr", "1e-2"]
    out = tmp_path / "run"
    assert main([*base, "--data", str(tmp_path / "good.npz"), "--steps", "3", "--checkpoint-dir", str(out)]) == 0
    good, meta = read_checkpoint(out / CHECKPOINT_NAME)
    data["x"][:] = np.nan
    np.savez(tmp_path / "nan.npz", **data)
    code = main([*base, "--data", str(tmp_path / "nan.npz"), "--steps", "10", "--checkpoint-dir", str(out),
                 "--resume", "--max-skipped", "4"])
    assert code == EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "4 steps in a row" in err and "Traceback" not in err
    after, meta_after = read_checkpoint(out / CHECKPOINT_NAME)
    assert meta_after["step"] == meta["step"] == 3 and meta_after["skipped_steps"] == 4
    for name, value in good.items():
        assert np.array_equal(value, after[name]), name


def test_non_scalar_loss_is_refused_unless_reduced(tmp_path: Path) -> None:
    import onnx

    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4, 3] x) => (float[4] per_row) <float[3, 2] W = {1,2,3,4,5,6}> {
            y = MatMul(x, W)
            per_row = ReduceSum<keepdims=0>(y, axes)
        }""".replace("axes)", "axes)\n            ").replace("<float[3, 2] W", "<int64[1] axes = {1}, float[3, 2] W"))
    with pytest.raises(gradgraph.GradientError, match="not a scalar.*--reduce"):
        gradgraph.build_gradient_graph(model, "per_row")
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    for reduction, scale in (("sum", 1.0), ("mean", 0.25)):
        grad = gradgraph.build_gradient_graph(model, "per_row", loss_reduction=reduction)
        import onnxruntime as ort

        out = ort.InferenceSession(grad.SerializeToString()).run(["W_grad"], {"x": x})[0]
        expected = np.repeat(x.sum(0)[:, None], 2, axis=1) * scale  # d sum(xW) / dW = x^T 1
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
