"""``gradgraph train`` (gradgraph.cli.train): a run, a resumed run, the loss curve."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from _training_models import MLP, export_training, mlp_batches

from gradgraph.cli.train import CHECKPOINT_NAME, CURVE_NAME, INFERENCE_NAME, add_parser, main
from gradgraph.training.checkpoint import read_checkpoint
from gradgraph.training.schedules import Schedule


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    feeds = mlp_batches(1)[0]
    model = export_training(MLP(), (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])), ["x", "y"])
    (root / "mlp.onnx").write_bytes(model)
    rows = mlp_batches(5, batch=8)
    np.savez(root / "data.npz", **{k: np.concatenate([r[k] for r in rows]) for k in rows[0]})
    return root / "mlp.onnx", root / "data.npz"


def _args(model: Path, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", str(model), "--loss", "loss", "--data", str(data), "--optimizer", "adamw",
            "--lr", "1e-2", "--steps", str(steps), "--batch-size", "8", "--accumulate", "2",
            "--clip", "1.0", "--schedule", "cosine", "--warmup-steps", "2", "--checkpoint-dir",
            str(out), "--quiet", *extra]


def test_train_resume_matches_uninterrupted(files: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = files
    assert main(_args(model, data, tmp_path / "full", 8)) == 0
    assert main(_args(model, data, tmp_path / "part", 8, "--stop-at", "5")) == 0
    assert main(_args(model, data, tmp_path / "part", 8, "--resume")) == 0
    full, meta_full = read_checkpoint(tmp_path / "full" / CHECKPOINT_NAME)
    part, meta_part = read_checkpoint(tmp_path / "part" / CHECKPOINT_NAME)
    assert meta_full["step"] == meta_part["step"] == 8
    assert meta_full["user"]["losses"] == meta_part["user"]["losses"]
    for name in full:
        assert np.array_equal(full[name], part[name]), name
    for name in (CURVE_NAME, INFERENCE_NAME):
        assert (tmp_path / "full" / name).stat().st_size > 0


def test_add_parser_is_self_contained() -> None:
    parser = argparse.ArgumentParser(prog="gradgraph")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "m.onnx", "--loss", "l", "--data", "d.npz", "--steps", "3",
                              "--batch-size", "2"])
    assert (args.optimizer, args.schedule, args.accumulate, args.clip) == ("adamw", "constant", 1, None)
    assert callable(args.func)


@pytest.mark.parametrize("kind", ["constant", "linear-warmup", "cosine"])
def test_schedules(kind: str) -> None:
    s = Schedule(kind, 1.0, total_steps=10, warmup_steps=2)
    assert s.lr_at(0) == pytest.approx(0.5)
    assert s.lr_at(1) == pytest.approx(1.0)
    assert s.lr_at(10) == pytest.approx(1.0 if kind == "constant" else 0.0)


def test_fixed_batch_export_trains_at_another_batch_size(tmp_path: Path, capsys) -> None:
    import warnings

    from passes.batching import BATCH_ERROR

    torch.manual_seed(0)
    rows = mlp_batches(4, batch=8)
    data = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    np.savez(tmp_path / "data.npz", **data)
    x, y = torch.from_numpy(data["x"][:4]), torch.from_numpy(data["y"][:4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(MLP(), (x, y), str(tmp_path / "b4.onnx"), input_names=["x", "y"],
                          output_names=["loss"], dynamo=False)  # batch 4 baked in
    out = tmp_path / "run"
    args = ["train", str(tmp_path / "b4.onnx"), "--loss", "loss", "--data", str(tmp_path / "data.npz"),
            "--steps", "3", "--batch-size", "8", "--quiet", "--checkpoint-dir", str(out)]
    assert main(args) == 0
    _, meta = read_checkpoint(out / CHECKPOINT_NAME)
    assert meta["step"] == 3 and all(np.isfinite(meta["user"]["losses"]))

    class RowMixer(torch.nn.Module):  # mixes batch rows into features: no batch-free form
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(12, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.fc(x.reshape(2, -1)), y[:2])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(RowMixer(), (x, y), str(tmp_path / "mix.onnx"), input_names=["x", "y"],
                          output_names=["loss"], dynamo=False)
    args[1] = str(tmp_path / "mix.onnx")
    args.append("--overwrite")  # the folder holds the first run's checkpoint
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cannot make the batch dimension" in err and "dynamic_axes" in err and "Traceback" not in err
    assert BATCH_ERROR.split("{")[0] in err


def test_train_with_mixed_precision_and_pass_flags(files: tuple[Path, Path], tmp_path: Path) -> None:
    """The graph-transform flags reach the training pipeline: fp16 training (its loss scale held
    in the checkpoint, resumable), clean-up and cast propagation, ending at a finite, lower loss."""
    model, data = files
    extra = ("--mixed-precision", "float16", "--cleanup", "--cast-level", "1", "--save-stages",
             str(tmp_path / "stages"))
    assert main(_args(model, data, tmp_path / "mp", 6, *extra)) == 0
    state, meta = read_checkpoint(tmp_path / "mp" / CHECKPOINT_NAME)
    assert state["loss_scale"].dtype == np.float32 and float(state["loss_scale"]) > 0
    losses = meta["user"]["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert main(_args(model, data, tmp_path / "mp", 8, *extra, "--resume")) == 0
    transformed = sorted((tmp_path / "stages").glob("*graph_transforms.onnx"))
    assert transformed, "the stages were saved"
    import onnx

    casts = [n for n in onnx.load(transformed[0]).graph.node if n.op_type == "Cast"]
    assert casts, "mixed precision casts the weights to fp16 at their use"


def test_bad_pass_flags_are_user_errors(files: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    model, data = files
    assert main(_args(model, data, tmp_path / "bad", 2, "--memory-budget", "-1")) == 2
    assert "memory_budget" in capsys.readouterr().err


def test_flags_that_would_do_nothing_are_said_so(files: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    """A malformed --dim or a --stop-at past --steps is an error; --dim without the recompute
    planner and --momentum with another optimizer than SGD are warnings (all ran silently)."""
    model, data = files
    assert main(_args(model, data, tmp_path / "a", 2, "--dim", "batch=x")) == 2
    assert "--dim 'batch=x'" in capsys.readouterr().err
    assert main(_args(model, data, tmp_path / "b", 2, "--stop-at", "5")) == 2
    assert "--stop-at must be in [0, --steps]" in capsys.readouterr().err
    assert main(_args(model, data, tmp_path / "c", 2, "--dim", "batch=8", "--momentum", "0.9")) == 0
    err = capsys.readouterr().err
    assert "warning: --dim sizes symbolic dimensions for the recompute planner" in err
    assert "warning: --momentum is SGD's; --optimizer adamw ignores it" in err


def test_resume_with_other_settings_names_the_setting(files: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    model, data = files
    out = tmp_path / "run"
    assert main(_args(model, data, out, 2)) == 0
    capsys.readouterr()
    assert main([*_args(model, data, out, 4, "--resume"), "--accumulate", "1"]) == 2
    assert "written with accumulation_steps 2 (CLI --accumulate), the session uses 1" in capsys.readouterr().err
    other = tmp_path / "other"  # accumulating 4 instead of 2: the same state, it resumes
    assert main(_args(model, data, other, 2)) == 0
    assert main([*_args(model, data, other, 4, "--resume"), "--accumulate", "4"]) == 0
    frozen = read_checkpoint(out / CHECKPOINT_NAME)[1]["trained"][0]
    assert main(_args(model, data, out, 4, "--resume", "--freeze", frozen)) == 2
    assert f"written training other weights (frozen now ['{frozen}'])" in capsys.readouterr().err
    assert main(_args(model, data, out, 4, "--resume")) == 0
