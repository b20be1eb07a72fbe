"""What ``gradgraph train --checkpoint-dir`` writes, and what it refuses (issue 38's first hour):

1. a folder that already holds a checkpoint is refused without ``--resume`` or ``--overwrite``
   (one line naming the folder and both flags, exit 2, nothing changed);
2. ``inference.onnx`` is a model for inference: the loss and the inputs only it reads (the
   labels) are gone when the forward has other outputs; a loss-only model keeps its loss;
3. ``checkpoint.safetensors`` loads back into the torch module (``load_state_dict``), which
   then computes what ``inference.onnx`` computes.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from gradgraph.cli.train import CHECKPOINT_NAME, INFERENCE_NAME, main

CPU = ["CPUExecutionProvider"]


class Classifier(torch.nn.Module):
    """forward returns the logits and the loss (the usual shape of a model's forward)."""

    def __init__(self, loss_only: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.loss_only = loss_only

    def forward(self, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
        logits = self.fc2(torch.tanh(self.fc1(x)))
        loss = torch.nn.functional.cross_entropy(logits, y)
        return loss if self.loss_only else (logits, loss)


def _export(tmp: Path, loss_only: bool = False) -> tuple[Path, Path, Classifier]:
    torch.manual_seed(0)
    module = Classifier(loss_only)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = rng.integers(0, 4, 8).astype(np.int64)
    path = tmp / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(x), torch.from_numpy(y)), str(path), dynamo=True,
                          optimize=False, input_names=["x", "y"],
                          output_names=["loss"] if loss_only else ["logits", "loss"])
    np.savez(tmp / "data.npz", x=x, y=y)
    return path, tmp / "data.npz", module


def _train(model: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["train", str(model), "--loss", "loss", "--data", str(data), "--steps", "3", "--batch-size", "4",
                 "--optimizer", "sgd", "--lr", "0.1", "--checkpoint-dir", str(out), "--quiet", *extra])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Classifier]:
    return _export(tmp_path_factory.mktemp("classifier"))


def test_a_folder_holding_a_checkpoint_needs_resume_or_overwrite(exported, tmp_path: Path, capsys) -> None:
    model, data, _ = exported
    out = tmp_path / "ck"
    assert _train(model, data, out) == 0
    before = (out / CHECKPOINT_NAME).read_bytes()
    capsys.readouterr()
    assert _train(model, data, out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(out) in err and "--resume" in err and "--overwrite" in err
    assert (out / CHECKPOINT_NAME).read_bytes() == before
    assert _train(model, data, out, "--resume", "--overwrite") == 2
    assert "give one of them" in capsys.readouterr().err
    # --overwrite starts afresh: the same 3 steps again, the same file
    assert _train(model, data, out, "--overwrite") == 0
    assert (out / CHECKPOINT_NAME).read_bytes() == before


def test_inference_onnx_drops_the_loss_and_labels_and_the_checkpoint_loads_into_torch(
        exported, tmp_path: Path) -> None:
    import safetensors.torch

    model, data, module = exported
    out = tmp_path / "ck"
    assert _train(model, data, out) == 0
    infer = ort.InferenceSession(str(out / INFERENCE_NAME), providers=CPU)
    assert [i.name for i in infer.get_inputs()] == ["x"]
    assert [o.name for o in infer.get_outputs()] == ["logits"]
    trained = Classifier()
    state = safetensors.torch.load_file(str(out / CHECKPOINT_NAME))
    result = trained.load_state_dict(state, strict=False)
    assert result.missing_keys == []  # every parameter of the module is in the checkpoint
    assert not torch.equal(trained.fc1.weight, module.fc1.weight)  # trained, not the export's
    x = np.random.default_rng(5).standard_normal((3, 6)).astype(np.float32)
    with torch.no_grad():
        logits, _ = trained(torch.from_numpy(x), torch.zeros(3, dtype=torch.int64))
    np.testing.assert_allclose(infer.run(None, {"x": x})[0], logits.numpy(), rtol=1e-5, atol=1e-6)


def test_a_loss_only_model_keeps_its_loss_in_inference_onnx(tmp_path: Path) -> None:
    model, data, _ = _export(tmp_path, loss_only=True)
    assert _train(model, data, tmp_path / "ck") == 0
    infer = ort.InferenceSession(str(tmp_path / "ck" / INFERENCE_NAME), providers=CPU)
    assert sorted(i.name for i in infer.get_inputs()) == ["x", "y"]
    assert [o.name for o in infer.get_outputs()] == ["loss"]
