"""Mixed-precision training through the whole pipeline: fp16 and bf16 track fp32, the dynamic
loss scaler skips an overflowing step and halves its scale."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import gradgraph
from gradgraph import LossScaleSettings, MixedPrecisionConfig, TrainingConfig, TrainingSession

CPU = ["CPUExecutionProvider"]
STEPS = 50
LR = 2e-3
# The loss curves of fp16/bf16 training stay within this relative distance of fp32's, step by
# step (the target).
CURVE_RTOL = 0.02


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    model_zoo = pytest.importorskip("model_zoo")
    path = str(tmp_path_factory.mktemp("bert") / "bert.onnx")
    feeds = model_zoo.export_with_feeds("bert", "legacy", "eval", path)
    return path, feeds


def _curve(path: str, feeds: dict[str, np.ndarray], dtype: str | None,
           scaler: LossScaleSettings | None = None) -> tuple[list[float], TrainingSession]:
    config = TrainingConfig("loss", gradgraph.AdamWConfig(weight_decay=0.0),
                            mixed_precision=MixedPrecisionConfig(
                                dtype=dtype, loss_scaler=scaler or LossScaleSettings()))
    session = TrainingSession(path, config, providers=CPU)
    return [session.train_step(feeds, lr=LR) for _ in range(STEPS)], session


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_tracks_fp32(tiny_bert, dtype: str) -> None:
    path, feeds = tiny_bert
    fp32, _ = _curve(path, feeds, None)
    low, session = _curve(path, feeds, dtype)
    assert fp32[-1] < 0.8 * fp32[0], "the fp32 run must learn for the comparison to mean anything"
    rel = np.abs(np.array(low) - np.array(fp32)) / np.abs(np.array(fp32))
    assert rel.max() <= CURVE_RTOL, f"{dtype}: worst step {int(rel.argmax())} off by {rel.max():.3%}"
    assert session.skipped_steps == 0
    # the weights the session holds (master weights) stay float32
    assert all(v.dtype == np.float32 for v in session.get_model_state()["full_precision"].values())


@pytest.mark.slow
def test_overflow_skips_that_step_and_halves_the_scale(tiny_bert) -> None:
    path, feeds = tiny_bert
    _, session = _curve(path, feeds, "float16")
    names = session.names
    assert session.loss_scale == LossScaleSettings().init_scale  # 50 finite steps: no growth yet
    before = session.get_state()
    huge = np.asarray(1e30, np.float32)  # the scaled fp16 gradients overflow
    session.store.set(names.loss_scale, huge)
    session.train_step(feeds, lr=LR)
    assert not session.last_step_finite and session.skipped_steps == 1
    after = session.get_state()
    for name in session.artifacts.params:
        np.testing.assert_array_equal(after[name], before[name])  # weights untouched
    assert after[names.step] == before[names.step]
    assert session.loss_scale == pytest.approx(float(huge) / 2, rel=1e-6)
    # the next step at a sane scale goes through
    session.store.set(names.loss_scale, np.asarray(1024.0, np.float32))
    session.train_step(feeds, lr=LR)
    assert session.last_step_finite and session.step == before[names.step] + 1


def test_scale_grows_after_a_window_of_finite_steps(tiny_bert) -> None:
    path, feeds = tiny_bert
    scaler = LossScaleSettings(init_scale=256.0, up_scale_window=3)
    config = TrainingConfig("loss", gradgraph.SGDConfig(),
                            mixed_precision=MixedPrecisionConfig(dtype="float16", loss_scaler=scaler))
    session = TrainingSession(path, config, providers=CPU)
    scales = []
    for _ in range(7):
        session.train_step(feeds, lr=1e-3)
        scales.append(session.loss_scale)
    assert scales == [256.0, 256.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]


def test_fixed_scale_from_training_parameters(tiny_bert) -> None:
    path, feeds = tiny_bert
    params = gradgraph.TrainingParameters()
    params.loss_output_name = "loss"
    params.use_mixed_precision = True
    params.loss_scale = 128.0
    config = params.to_config()
    assert config.mixed_precision.dtype == "float16"
    assert dataclasses.replace(config.mixed_precision.loss_scaler).dynamic is False
    session = TrainingSession(path, params, providers=CPU)
    for _ in range(3):
        session.train_step(feeds, lr=1e-3)
    assert session.loss_scale == 128.0
