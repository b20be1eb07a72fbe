"""Issue 14's leftovers and the bullets under its "Why" that had no test of their own.

1. ``load_checkpoint(strict=False)`` of another model's checkpoint is refused, changing
   nothing; a partly matching one loads what matches and warns about the rest.
2. ``--save-stages`` / ``save_stages`` / ``DebugOptions.save_stages`` are all or nothing: a
   failing build leaves the folder as it was (no ``00_forward.onnx``, no temp folder).
3. One test per remaining bullet: a typed error and exit 2 (one line, no traceback), or the
   correct behaviour, and the previous checkpoint bit-identical where one existed.

Every test runs on the bundled example model (a 3-layer MLP, ``gradgraph/examples``) in well
under a second or two.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import gradgraph
import gradgraph.io as gio
from gradgraph import (
    GradientError,
    TrainingConfig,
    TrainingParameters,
    TrainingSession,
    UpdateOptions,
)
from gradgraph.cli.main import main as cli_main
from gradgraph.cli.train import (
    CHECKPOINT_NAME,
    CURVE_NAME,
    EXIT_DIVERGED,
    INFERENCE_NAME,
    save_curve,
)
from gradgraph.feeds import InputError
from gradgraph.training.build import build_training_artifacts
from gradgraph.training.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from gradgraph.training.options import DebugOptions, GraphSavePaths
from passes.autodiff import lookup

EXAMPLE = Path(gradgraph.__file__).parent / "examples" / "mlp.onnx"
CPU = ["CPUExecutionProvider"]
ROWS = 32


# ---- fixtures and helpers -------------------------------------------------------------------
def _renamed(prefix: str, only: tuple[str, ...] | None = None) -> onnx.ModelProto:
    """The example model with its initializers (all, or those in ``only``) renamed."""
    model = onnx.load(str(EXAMPLE))
    names = {i.name: prefix + i.name for i in model.graph.initializer if only is None or i.name in only}
    for init in model.graph.initializer:
        init.name = names.get(init.name, init.name)
    for node in model.graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
    return model


def _data(path: Path, rows: int = ROWS, **override: np.ndarray) -> Path:
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((rows, 16)).astype(np.float32),
              "labels": rng.integers(0, 4, rows).astype(np.int64), **override}
    np.savez(path, **arrays)
    return path


def _feeds(rows: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((rows, 16)).astype(np.float32),
            "labels": rng.integers(0, 4, rows).astype(np.int64)}


def _session(model: object = EXAMPLE, steps: int = 0, **config: object) -> TrainingSession:
    session = TrainingSession(model if isinstance(model, onnx.ModelProto) else str(model),
                              TrainingConfig("loss", **config), providers=CPU)  # type: ignore[arg-type]
    for _ in range(steps):
        session.train_step(_feeds(), lr=1e-2)
    return session


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes), folders as empty entries."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(folder.rglob("*"))}


def _one_line_error(err: str, command: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"gradgraph {command}: error: "), err


def _train_args(data: Path, *extra: str) -> list[str]:
    return ["train", str(EXAMPLE), "--loss", "loss", "--data", str(data), "--steps", "2",
            "--batch-size", "8", "--quiet", *extra]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data file, a finished 2-step run's --checkpoint-dir): copy the folder before changing it."""
    root = tmp_path_factory.mktemp("run")
    data = _data(root / "data.npz")
    out = root / "run"
    assert cli_main(_train_args(data, "--checkpoint-dir", str(out))) == 0
    return data, out


@pytest.fixture
def resumable(run_dir: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    data, out = run_dir
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    return data, copy


# ---- 1. load_checkpoint(strict=False) of another model's checkpoint ------------------------
def test_other_models_checkpoint_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "mlp.safetensors"
    _session(steps=2).save_checkpoint(path)
    other = _session(_renamed("encoder."), steps=3)
    other.train_step(_feeds(), lr=1e-2)  # mid-run state: step 4, moments non-zero
    before, skipped = other.get_state(), other.skipped_steps
    with pytest.raises(CheckpointError) as info:
        other.load_checkpoint(path, strict=False)
    message = str(info.value)
    assert isinstance(info.value, GradientError)
    assert str(path) in message and "none of its 18 weight and state tensors" in message
    assert "'fc1_bias'" in message and "'encoder.fc1_bias'" in message  # names on each side
    assert "another model" in message and "load a checkpoint saved by a session of this model" in message
    after = other.get_state()
    assert sorted(after) == sorted(before) and other.skipped_steps == skipped
    for name, value in before.items():
        assert np.array_equal(value, after[name]) and value.dtype == after[name].dtype, name
    assert other.step == 4


def test_checkpoint_matching_in_part_loads_what_matches_and_warns(tmp_path: Path) -> None:
    path = tmp_path / "mlp.safetensors"
    source = _session(steps=2)
    source.save_checkpoint(path)
    renamed = ("fc3_weight", "fc3_bias")
    target = _session(_renamed("head.", renamed))
    head_before = target.get_state()["head.fc3_weight"]
    with pytest.warns(UserWarning) as caught:
        target.load_checkpoint(path, strict=False)
    (warning,) = [w for w in caught if str(path) in str(w.message)]
    text = str(warning.message)
    assert "12 of its 18 weight and state tensors loaded" in text
    assert "skipped 6 tensor(s) the model does not have" in text and "'fc3_bias'" in text
    assert "6 of the model's kept their current values" in text and "'head.fc3_bias'" in text
    state, expected = target.get_state(), source.get_state()
    assert np.array_equal(state["fc1_weight"], expected["fc1_weight"])
    assert np.array_equal(state["fc2_bias.exp_avg"], expected["fc2_bias.exp_avg"])
    assert np.array_equal(state["head.fc3_weight"], head_before)
    assert target.step == 2


def test_strict_load_of_a_matching_checkpoint_does_not_warn(tmp_path: Path, recwarn) -> None:
    path = tmp_path / "mlp.safetensors"
    _session(steps=1).save_checkpoint(path)
    _session().load_checkpoint(path, strict=False)
    assert not [w for w in recwarn if "strict=False" in str(w.message)]


# ---- 2. --save-stages is all or nothing ------------------------------------------------------
# An op with no gradient rule that onnxruntime runs: a contrib op (not a model-local function:
# the forward stage inlines those, and every default-domain op has a rule or is a stop).
NO_RULE_DOMAIN, NO_RULE_OP = "com.microsoft", "Inverse"


@pytest.fixture(scope="module")
def failing_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its forward stage succeeds, its gradient stage fails (com.microsoft's Inverse has no
    gradient rule)."""
    assert lookup(NO_RULE_DOMAIN, NO_RULE_OP, 1) is None, f"{NO_RULE_OP} has a rule now: pick another op"
    path = tmp_path_factory.mktemp("failing") / "no_rule.onnx"
    onnx.save(onnx.parser.parse_model(f"""<ir_version: 9, opset_import: ["" : 18, "{NO_RULE_DOMAIN}" : 1]>
g (float[2,3] x) => (float loss) <float[3,3] w = {{1,2,3,4,5,6,7,8,9}}, float[3,2] v = {{1,0,0,1,1,1}}> {{
 y = MatMul(x, w)
 s = MatMul(y, v)
 z = {NO_RULE_DOMAIN}.{NO_RULE_OP}(s)
 loss = ReduceSum<keepdims=0>(z)
}}"""), str(path))
    return path


def _no_staging_left(folder: Path) -> None:
    assert not [p.name for p in folder.rglob("*") if ".staging-" in p.name]


def test_failed_build_leaves_no_stage_folder(failing_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "new" / "deeper" / "stages"
    code = cli_main(["build", str(failing_model), "--loss", "loss", "--save-stages", str(out)])
    assert code == 2
    _one_line_error(capsys.readouterr().err, "build")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor the parents made for it


def test_failed_build_leaves_an_existing_folder_as_it_was(failing_model: Path, tmp_path: Path,
                                                          capsys) -> None:
    out = tmp_path / "stages"
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    assert "00_forward.onnx" in before and "summary.txt" in before
    capsys.readouterr()
    assert cli_main(["build", str(failing_model), "--loss", "loss", "--save-stages", str(out)]) == 2
    _one_line_error(capsys.readouterr().err, "build")
    assert _snapshot(out) == before
    _no_staging_left(tmp_path)


def test_build_replaces_an_earlier_builds_stage_files_only(tmp_path: Path) -> None:
    out = tmp_path / "stages"
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out),
                     "--accumulate", "2"]) == 0
    assert (out / "05_accumulate.onnx").is_file()
    (out / "notes.txt").write_text("mine")
    (out / "model.onnx").write_bytes(b"not a stage file")
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["00_forward.onnx", "01_graph_transforms.onnx", "02_gradient.onnx",
                     "03_recompute.onnx", "04_training.onnx", "06_eval.onnx", "model.onnx",
                     "notes.txt", "summary.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    _no_staging_left(tmp_path)


@pytest.mark.parametrize("how", ["argument", "debug_options", "session"])
def test_python_save_stages_is_all_or_nothing(failing_model: Path, tmp_path: Path, how: str) -> None:
    out = tmp_path / "stages"
    with pytest.raises(GradientError, match="no gradient rule"):
        if how == "argument":
            build_training_artifacts(str(failing_model), TrainingConfig("loss"), save_stages=out)
        elif how == "debug_options":
            build_training_artifacts(str(failing_model), TrainingConfig(
                "loss", debug=DebugOptions(save_stages=str(out))))
        else:
            TrainingSession(str(failing_model), TrainingConfig("loss"), providers=CPU, save_stages=out)
    assert list(tmp_path.iterdir()) == []
    build_training_artifacts(str(EXAMPLE), TrainingConfig("loss"), save_stages=out)
    assert (out / "00_forward.onnx").is_file() and (out / "06_eval.onnx").is_file()


def test_ctrl_c_during_a_build_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    from passes.autodiff.gradient_pass import GradientPass

    def interrupted(self, model):
        raise KeyboardInterrupt

    monkeypatch.setattr(GradientPass, "call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_training_artifacts(str(EXAMPLE), TrainingConfig("loss"), save_stages=tmp_path / "stages")
    assert list(tmp_path.iterdir()) == []


def test_staging_folders_of_a_killed_build_are_removed(tmp_path: Path) -> None:
    """A killed build leaves its staging folder beside DIR (DIR new) or inside it (DIR there):
    the next build into DIR removes those whose process is gone, and only those."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "stages"
    beside = tmp_path / f".stages.staging-{dead.pid}-abc123.tmp"
    beside.mkdir()
    (beside / "00_forward.onnx").write_bytes(b"x" * 100)
    alive = tmp_path / f".stages.staging-{os.getppid()}-def456.tmp"  # a running process's
    alive.mkdir()
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out)]) == 0
    assert not beside.exists() and alive.is_dir()
    inside = out / f".staging-{dead.pid}-ghi789.tmp"
    inside.mkdir()
    (inside / "00_forward.onnx").write_bytes(b"x" * 100)
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out)]) == 0
    assert not inside.exists() and not [p for p in out.iterdir() if p.name.startswith(".")]


def test_graph_save_paths_are_never_half_written(tmp_path: Path, monkeypatch) -> None:
    """A failing write (a full disk at fsync) keeps the previous file and leaves no temp file;
    onnxruntime's optimized graph is written through a temp name too."""
    paths = GraphSavePaths(str(tmp_path / "after_transforms.onnx"), str(tmp_path / "gradient.onnx"),
                           str(tmp_path / "training.onnx"), str(tmp_path / "sub" / "optimized.onnx"))
    config = TrainingConfig("loss", debug=DebugOptions(graph_save_paths=paths))
    TrainingSession(str(EXAMPLE), config, providers=CPU)
    for path in (paths.model_after_graph_transforms_path, paths.model_with_gradient_graph_path,
                 paths.model_with_training_graph_path,
                 paths.model_with_training_graph_after_optimization_path):
        onnx.checker.check_model(onnx.load(path))
    assert [p.name for p in tmp_path.rglob(".*")] == []
    previous = _snapshot(tmp_path)

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gio.os, "fsync", full_disk)
    with pytest.raises(gio.WriteError, match="after_transforms.onnx.*No space left"):
        build_training_artifacts(str(EXAMPLE), config)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == previous  # the file whose write failed is the previous one


# ---- 3. the bullets under "Why" ------------------------------------------------------------
# Security
@pytest.mark.parametrize("location", ["/etc/passwd", "../secret.bin", "secret.bin"])
def test_training_session_never_reads_external_data_of_bytes_or_protos(tmp_path: Path,
                                                                       location: str) -> None:
    model = onnx.load(str(EXAMPLE))
    weight = next(i for i in model.graph.initializer if i.name == "fc1_bias")
    weight.ClearField("raw_data")
    del weight.float_data[:]
    weight.data_location = onnx.TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", location
    for given in (model, model.SerializeToString()):
        with pytest.raises(GradientError, match="external file.*pass the path of the .onnx"):
            TrainingSession(given, TrainingConfig("loss"), providers=CPU)


def test_temp_files_never_follow_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / f".{CURVE_NAME}.tmp.png").symlink_to(victim)  # the old fixed temp name
    save_curve([3.0, 2.0, 1.0], tmp_path / CURVE_NAME)
    link = tmp_path / "checkpoint.safetensors"
    link.symlink_to(victim)  # the target itself a link: replaced, not written through
    gio.atomic_write_bytes(link, b"new")
    assert victim.read_text() == "precious"
    assert (tmp_path / CURVE_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not link.is_symlink() and link.read_bytes() == b"new"


# Losing work: a diverging run, an unwritable checkpoint folder, a resume without checkpoint
@pytest.mark.parametrize("flags", [["--lr", "nan"], ["--lr", "inf"], ["--lr", "-1"], ["--clip", "nan"],
                                   ["--optimizer", "sgd", "--momentum", "nan"]],
                         ids=["lr nan", "lr inf", "lr -1", "clip nan", "momentum nan"])
def test_diverging_options_are_refused_keeping_the_run(resumable: tuple[Path, Path], flags: list[str],
                                                       capsys) -> None:
    data, out = resumable
    before = _snapshot(out)
    capsys.readouterr()
    assert cli_main(_train_args(data, "--checkpoint-dir", str(out), "--resume", "--steps", "4",
                                *flags)) == 2
    _one_line_error(capsys.readouterr().err, "train")
    assert _snapshot(out) == before


def test_huge_learning_rate_never_checkpoints_non_finite_weights(resumable: tuple[Path, Path],
                                                                 capsys) -> None:
    data, out = resumable
    code = cli_main(_train_args(data, "--checkpoint-dir", str(out), "--resume", "--steps", "20",
                                "--lr", "1e30"))
    assert code == EXIT_DIVERGED, capsys.readouterr().err
    tensors, meta = read_checkpoint(out / CHECKPOINT_NAME)
    assert meta["skipped_steps"] > 0
    assert all(np.isfinite(v).all() for v in tensors.values() if v.dtype.kind == "f")
    weights = onnx.load(str(out / INFERENCE_NAME)).graph.initializer
    assert all(np.isfinite(numpy_helper.to_array(w)).all() for w in weights)


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path: Path, monkeypatch, capsys) -> None:
    import gradgraph.training.session as session_module

    def no_training(*args, **kwargs):
        raise AssertionError("training started before the checkpoint folder was checked")

    monkeypatch.setattr(session_module.TrainingSession, "__init__", no_training)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    data = _data(tmp_path / "data.npz")
    assert cli_main(_train_args(data, "--checkpoint-dir", str(blocker / "run"))) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert "is not a writable folder" in err and str(blocker / "run") in err


def test_resume_without_a_checkpoint_exits_2(tmp_path: Path, capsys) -> None:
    data = _data(tmp_path / "data.npz")
    out = tmp_path / "run"
    assert cli_main(_train_args(data, "--checkpoint-dir", str(out), "--resume")) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert CHECKPOINT_NAME in err and str(out) in err and not out.exists()


# Invalid output with exit 0
def test_duplicate_weight_names_are_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "g.onnx"
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "--weights", "fc1_bias", "fc1_bias",
                     "-o", str(out)]) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "grad")
    assert "'fc1_bias' more than once" in err and not out.exists()


def test_initializer_claiming_far_more_than_its_data_is_refused(tmp_path: Path, capsys) -> None:
    model = onnx.load(str(EXAMPLE))
    weight = next(i for i in model.graph.initializer if i.name == "fc1_bias")
    weight.raw_data = np.zeros(12, np.float32).tobytes()  # 48 bytes
    weight.dims[:] = [10**6, 10**6]
    with pytest.raises(GradientError, match="fc1_bias.*1,000,000,000,000 elements"):
        gradgraph.build_gradient_graph(model, "loss")
    path, out = tmp_path / "huge.onnx", tmp_path / "g.onnx"
    onnx.save(model, str(path))
    assert cli_main(["grad", str(path), "--loss", "loss", "-o", str(out)]) == 2
    _one_line_error(capsys.readouterr().err, "grad")
    assert not out.exists()


# Silently ignored input
def test_typo_in_freeze_is_an_error_with_close_matches(tmp_path: Path, capsys) -> None:
    data = _data(tmp_path / "data.npz")
    out = tmp_path / "run"
    assert cli_main(_train_args(data, "--checkpoint-dir", str(out), "--freeze", "fc1_weights")) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert "'fc1_weights'" in err and "did you mean 'fc1_weight'" in err
    assert not (out / CHECKPOINT_NAME).exists()


def test_a_string_where_a_list_of_names_belongs_is_an_error() -> None:
    with pytest.raises(GradientError, match="not the single string 'fc1_bias'"):
        _session(weights_not_to_train="fc1_bias")
    with pytest.raises(GradientError, match="not the single string 'fc1_bias'"):
        _session(weights_to_train="fc1_bias")


def _parameters(**values: object) -> TrainingParameters:
    params = TrainingParameters()
    params.loss_output_name = "loss"
    for name, value in values.items():
        setattr(params, name, value)
    return params


def test_a_string_in_training_parameters_is_named_as_such() -> None:
    with pytest.raises(GradientError, match="single string 'fc1_bias'"):
        TrainingSession(str(EXAMPLE), _parameters(weights_not_to_train="fc1_bias"), providers=CPU)
    for name in ("weights_to_train", "propagate_cast_ops_allow", "sliced_tensor_names"):
        with pytest.raises(GradientError, match=f"TrainingParameters.{name} must be a list of names, "
                                                "not the single string 'Add'"):
            _parameters(**{name: "Add"}).to_config()


def test_fractional_accumulation_is_refused() -> None:
    with pytest.raises(GradientError, match="accumulation_steps must be a positive integer.*2.5"):
        _session(update=UpdateOptions(accumulation_steps=2.5))  # type: ignore[arg-type]
    with pytest.raises(GradientError, match="max_grad_norm must be a finite number > 0.*nan"):
        _session(update=UpdateOptions(max_grad_norm=float("nan")))


def test_fractional_accumulation_in_training_parameters_is_refused() -> None:
    with pytest.raises(GradientError, match="2.5"):
        TrainingSession(str(EXAMPLE), _parameters(gradient_accumulation_steps=2.5), providers=CPU)
    for bad in (True, 0, -1, "2", float("nan")):
        with pytest.raises(GradientError, match="TrainingParameters.gradient_accumulation_steps must "
                                                "be a positive integer"):
            _parameters(gradient_accumulation_steps=bad).to_config()
    for good in (3, np.int64(3), 3.0):  # a whole float is still that number of micro-batches
        assert _parameters(gradient_accumulation_steps=good).to_config().update.accumulation_steps == 3


def test_inputs_with_different_row_counts_are_refused(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    data = _data(tmp_path / "data.npz", rows=512, labels=rng.integers(0, 4, 100).astype(np.int64))
    assert cli_main(_train_args(data)) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert "same number of rows" in err and "'x': 512" in err and "'labels': 100" in err
    session = _session()
    before = session.get_state()
    feeds = {"x": rng.standard_normal((512, 16)).astype(np.float32),
             "labels": rng.integers(0, 4, 100).astype(np.int64)}
    with pytest.raises(InputError, match=r"'x' and 'labels' from the feeds disagree on dimension"):
        session.train_step(feeds, lr=1e-2)
    assert all(np.array_equal(v, session.get_state()[k]) for k, v in before.items())
    assert session.micro_step == 0


# Untyped errors
CLI_CASES = {
    "extra array": (lambda p: _data(p, junk=np.zeros(3)), [], "unexpected ['junk']"),
    "zero rows": (lambda p: _data(p, rows=0), [], "holds no rows"),
    "labels out of range": (lambda p: _data(p, labels=np.full(ROWS, 9, np.int64)), [],
                            "must be in [0, 4) (torch raises IndexError)"),
    "batch-size 0": (_data, ["--batch-size", "0"], "--batch-size must be a positive integer"),
    "accumulate 0": (_data, ["--accumulate", "0"], "--accumulate must be a positive integer"),
    "steps -5": (_data, ["--steps", "-5"], "--steps must be a positive integer"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_data_and_options_are_one_line_errors(resumable: tuple[Path, Path], tmp_path: Path,
                                                  case: str, capsys) -> None:
    make, flags, expected = CLI_CASES[case]
    _, out = resumable
    before = _snapshot(out)
    data = make(tmp_path / "bad.npz")
    capsys.readouterr()
    assert cli_main(_train_args(data, "--checkpoint-dir", str(out), "--resume", "--steps", "4",
                                *flags)) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert expected in err
    assert _snapshot(out) == before


def test_cuda_without_a_gpu_build_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has CUDA")
    data = _data(tmp_path / "data.npz")
    assert cli_main(_train_args(data, "--device", "cuda")) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert "CUDAExecutionProvider" in err and "onnxruntime-gpu" in err
    with pytest.raises(GradientError, match="CUDAExecutionProvider"):
        TrainingSession(str(EXAMPLE), TrainingConfig("loss"), providers=["CUDAExecutionProvider"])


def _read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", str(args[0]) if args else None)


def test_read_only_file_system_is_a_one_line_error(tmp_path: Path, monkeypatch, capsys) -> None:
    """Every write gradgraph makes goes through gradgraph.io (a temp file or folder first):
    refused there, each command prints one line, exits 2 and leaves no folder behind."""
    import gradgraph.cli.train as train_cli

    fake = types.SimpleNamespace(mkstemp=_read_only, mkdtemp=_read_only,
                                 TemporaryDirectory=_read_only, NamedTemporaryFile=_read_only)
    monkeypatch.setattr(gio, "tempfile", fake)
    monkeypatch.setattr(train_cli, "tempfile", fake)
    data = _data(tmp_path / "data.npz")
    commands = {
        "grad": ["grad", str(EXAMPLE), "--loss", "loss", "-o", str(tmp_path / "ro" / "g.onnx")],
        "build": ["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(tmp_path / "ro")],
        "train": _train_args(data, "--save-stages", str(tmp_path / "ro")),
    }
    for command, argv in commands.items():
        assert cli_main(argv) == 2, command
        err = capsys.readouterr().err
        _one_line_error(err, command)
        assert "Read-only file system" in err and str(tmp_path / "ro") in err
        assert not (tmp_path / "ro").exists()
    assert cli_main(_train_args(data, "--checkpoint-dir", str(tmp_path / "run"))) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert "is not a writable folder: Read-only file system" in err


def _hostile(out: Path, *, user: object = None, **meta: object) -> None:
    tensors, old = read_checkpoint(out / CHECKPOINT_NAME)
    doc = {k: v for k, v in old.items() if k not in ("format", "version")}
    doc.update(meta)
    if user is not None:
        doc["user"] = user
    if "tensor_step" in meta:
        tensors["step"] = np.array(meta["tensor_step"], np.int64)
        del doc["tensor_step"]
    write_checkpoint(out / CHECKPOINT_NAME, tensors, doc)


HOSTILE = {
    "user not an object": ({"user": "x"}, "metadata 'user' must be a JSON object"),
    "negative step": ({"step": -3}, "metadata 'step' must be an integer >= 0"),
    "step as text": ({"step": "3"}, "metadata 'step' must be an integer >= 0"),
    "negative skipped_steps": ({"skipped_steps": -1}, "'skipped_steps' must be an integer >= 0"),
    "step tensor negative": ({"tensor_step": -3}, "step tensor holds -3"),
    "losses 5": ({"user": {"losses": 5}}, "metadata 'losses' must be a list of numbers"),
    "losses with text": ({"user": {"losses": [1.5, "2.0"]}}, "metadata 'losses' must be a list of numbers"),
    "losses with inf": ({"user": {"losses": [1.5, float("inf")]}}, "'losses' must be a list of numbers"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_checkpoint_metadata_is_a_one_line_error(resumable: tuple[Path, Path], case: str,
                                                         capsys) -> None:
    data, out = resumable
    meta, expected = HOSTILE[case]
    _hostile(out, **meta)  # type: ignore[arg-type]
    before = _snapshot(out)
    capsys.readouterr()
    assert cli_main(_train_args(data, "--checkpoint-dir", str(out), "--resume", "--steps", "4")) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert expected in err and str(out / CHECKPOINT_NAME) in err
    assert _snapshot(out) == before


def test_negative_step_in_a_state_is_refused() -> None:
    session = _session(steps=1)
    state = session.get_state()
    with pytest.raises(CheckpointError, match="'step' must be >= 0; got -2"):
        session.load_state({**state, "step": np.array(-2, np.int64)})
    assert session.step == 1


# ---- 4. the review's leftovers ---------------------------------------------------------------
# Hyper-parameters outside their range: refused where the config is made, naming class and field.
BAD_HYPERPARAMETERS = {
    "sgd momentum 1": (lambda: gradgraph.SGDConfig(momentum=1.0), r"SGDConfig.momentum .*\[0, 1\); got 1.0"),
    "sgd momentum nan": (lambda: gradgraph.SGDConfig(momentum=float("nan")), r"SGDConfig.momentum .*got nan"),
    "sgd weight_decay -1": (lambda: gradgraph.SGDConfig(weight_decay=-1.0),
                            r"SGDConfig.weight_decay must be a finite number >= 0; got -1.0"),
    "sgd dampening 2": (lambda: gradgraph.SGDConfig(momentum=0.5, dampening=2.0), r"SGDConfig.dampening .*\[0, 1\]"),
    "adam beta1 1": (lambda: gradgraph.AdamConfig(beta1=1.0), r"AdamConfig.beta1 .*\[0, 1\); got 1.0"),
    "adam beta2 nan": (lambda: gradgraph.AdamConfig(beta2=float("nan")), r"AdamConfig.beta2 .*\[0, 1\); got nan"),
    "adam eps 0": (lambda: gradgraph.AdamConfig(eps=0.0), r"AdamConfig.eps must be a finite number > 0; got 0.0"),
    "adamw eps inf": (lambda: gradgraph.AdamWConfig(eps=float("inf")), r"AdamWConfig.eps must be a finite number > 0"),
    "adamw weight_decay nan": (lambda: gradgraph.AdamWConfig(weight_decay=float("nan")),
                               r"AdamWConfig.weight_decay must be a finite number >= 0; got nan"),
    "lamb beta2 -0.1": (lambda: gradgraph.LambConfig(beta2=-0.1), r"LambConfig.beta2 .*\[0, 1\)"),
    "lamb eps nan": (lambda: gradgraph.LambConfig(eps=float("nan")), r"LambConfig.eps must be a finite number > 0"),
    "lamb weight_decay inf": (lambda: gradgraph.LambConfig(weight_decay=float("inf")),
                              r"LambConfig.weight_decay must be a finite number >= 0"),
    "momentum as bool": (lambda: gradgraph.SGDConfig(momentum=True), r"SGDConfig.momentum .*got True"),
    "accumulation 2.5": (lambda: UpdateOptions(accumulation_steps=2.5),  # type: ignore[arg-type]
                         r"UpdateOptions.accumulation_steps must be a positive integer .*got 2.5"),
    "accumulation True": (lambda: UpdateOptions(accumulation_steps=True),
                          r"UpdateOptions.accumulation_steps must be a positive integer .*got True"),
    "accumulation 0": (lambda: UpdateOptions(accumulation_steps=0), r"UpdateOptions.accumulation_steps .*got 0"),
    "max_grad_norm nan": (lambda: UpdateOptions(max_grad_norm=float("nan")),
                          r"UpdateOptions.max_grad_norm must be a finite number > 0, or None .*got nan"),
    "max_grad_norm inf": (lambda: UpdateOptions(max_grad_norm=float("inf")), r"UpdateOptions.max_grad_norm .*got inf"),
    "max_grad_norm 0": (lambda: UpdateOptions(max_grad_norm=0.0), r"UpdateOptions.max_grad_norm .*got 0.0"),
    "lr_scale nan": (lambda: gradgraph.ParamGroup(("*bias",), lr_scale=float("nan")),
                     r"ParamGroup.lr_scale must be a finite number >= 0; got nan"),
    "patterns a string": (lambda: gradgraph.ParamGroup("*bias"),  # type: ignore[arg-type]
                          r"ParamGroup.patterns must be a tuple of name patterns, not the single string"),
}


@pytest.mark.parametrize("case", list(BAD_HYPERPARAMETERS))
def test_hyperparameters_out_of_range_are_refused_by_name(case: str) -> None:
    make, expected = BAD_HYPERPARAMETERS[case]
    with pytest.raises(GradientError, match=expected):
        make()


def test_hyperparameter_edges_that_train_are_still_accepted() -> None:
    """The boundaries of each accepted range stay accepted (the refusals above are not too wide)."""
    gradgraph.SGDConfig(momentum=0.0, dampening=1.0, weight_decay=0.0)
    gradgraph.SGDConfig(momentum=0.9, nesterov=True)
    gradgraph.AdamWConfig(beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0)
    gradgraph.LambConfig(ratio_min=0.0, ratio_max=float("inf"))
    UpdateOptions(accumulation_steps=np.int64(4), max_grad_norm=1e-9, clip_eps=0.0)  # type: ignore[arg-type]
    gradgraph.ParamGroup(["*bias"], {"weight_decay": 0.0}, lr_scale=0.0)  # type: ignore[arg-type]
    # A group's overrides go through the same checks when they are applied to a weight.
    from passes.optimizer import resolve

    group = gradgraph.ParamGroup(("*bias",), {"momentum": 1.5})
    with pytest.raises(GradientError, match=r"SGDConfig.momentum .*got 1.5"):
        resolve(gradgraph.SGDConfig(), (group,), "fc1_bias")


def test_input_error_is_a_gradient_error() -> None:
    """API users catching GradientError catch bad feeds too (InputError is a GradientError)."""
    assert issubclass(InputError, GradientError) and issubclass(InputError, ValueError)
    session = _session()
    feeds = _feeds()
    feeds["x"] = feeds["x"][:, :5]  # the model wants 16 features
    with pytest.raises(GradientError, match="input 'x'") as info:
        session.train_step(feeds, lr=1e-2)
    assert isinstance(info.value, InputError) and session.micro_step == 0


def test_feeds_the_training_graph_does_not_take_are_refused() -> None:
    """A misspelled or extra feed was ignored (onnxruntime's binding never saw it); a weight fed
    by name was ignored too (the session feeds what it holds). Both are refused, named."""
    session = _session()
    feeds = {**_feeds(), "z": np.zeros(3, np.float32)}
    with pytest.raises(InputError, match=r"train_step got feeds \['z'\] that the training graph does not take"):
        session.train_step(feeds, lr=1e-2)
    weight = session.artifacts.params[0]
    with pytest.raises(InputError, match=rf"\['{weight}'\] are held by the session"):
        session.train_step({**_feeds(), weight: np.zeros(1, np.float32)}, lr=1e-2)
    assert session.micro_step == 0 and session.step == 0


def test_a_misspelled_parameter_group_override_is_named() -> None:
    """ParamGroup(("*.bias",), {"wd": 0.0}): a GradientError naming the group and the config's
    fields when the config is made (was a TypeError from dataclasses.replace, only where the
    group matched a weight)."""
    group = gradgraph.ParamGroup(("no_such_weight*",), {"wd": 0.0})
    with pytest.raises(GradientError, match=r"ParamGroup 0 \('no_such_weight\*',\) overrides \['wd'\], "
                                            r"which AdamWConfig does not have; its fields are \['beta1'"):
        gradgraph.TrainingConfig(loss="loss", optimizer=gradgraph.AdamWConfig(),
                                 update=gradgraph.UpdateOptions(groups=(group,)))


def test_onnxruntime_does_not_log_its_own_error_line(tmp_path: Path) -> None:
    """Labels out of range: onnxruntime's "[E:onnxruntime:...]" log line is not printed
    before gradgraph's one-line error (the labels are refused at load, naming the range)."""
    data = _data(tmp_path / "data.npz", labels=np.full(ROWS, 9, np.int64))
    result = subprocess.run([sys.executable, "-m", "gradgraph", *_train_args(data)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    _one_line_error(result.stderr, "train")
    assert "must be in [0, 4) (torch raises IndexError)" in result.stderr
    assert "onnxruntime:" not in result.stderr.split("error:", 1)[0]


def test_a_users_session_log_level_is_kept() -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 1
    session = TrainingSession(str(EXAMPLE), TrainingConfig("loss"), options, providers=CPU)
    assert session._train.session.get_session_options().log_severity_level == 1
    assert _session()._train.session.get_session_options().log_severity_level == 4
    plain = ort.SessionOptions()
    TrainingSession(str(EXAMPLE), TrainingConfig("loss"), plain, providers=CPU)
    assert plain.log_severity_level == -1  # the caller's options are left as they were


def test_any_os_error_on_a_users_path_is_a_one_line_error(resumable: tuple[Path, Path], tmp_path: Path,
                                                           monkeypatch, capsys) -> None:
    """EIO reading the checkpoint to resume from; ENAMETOOLONG for a data file and a stage folder."""
    import gradgraph.training.checkpoint as checkpoint_module

    data, out = resumable
    before = _snapshot(out)

    class FailingPath(type(Path())):  # type: ignore[misc]
        def read_bytes(self) -> bytes:
            raise OSError(errno.EIO, "Input/output error", str(self))

        def open(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            raise OSError(errno.EIO, "Input/output error", str(self))

    monkeypatch.setattr(checkpoint_module, "Path", FailingPath)
    capsys.readouterr()
    assert cli_main(_train_args(data, "--checkpoint-dir", str(out), "--resume", "--steps", "4")) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "train")
    assert f"cannot use {str(out / CHECKPOINT_NAME)!r}: Input/output error" in err
    assert _snapshot(out) == before
    monkeypatch.undo()
    long_name = str(tmp_path / ("d" * 300))
    for flags in (["--data", long_name + ".npz"], ["--save-stages", long_name]):
        argv = _train_args(data, *flags)
        assert cli_main(argv) == 2, flags
        err = capsys.readouterr().err
        _one_line_error(err, "train")
        assert "File name too long" in err and long_name in err
    assert cli_main(["grad", long_name + ".onnx", "--loss", "loss", "-o", str(tmp_path / "g.onnx")]) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "grad")
    assert "File name too long" in err and long_name in err


@pytest.mark.parametrize("flag,value", [("--clip", "nan"), ("--clip", "-1"), ("--accumulate", "0")])
def test_build_names_its_flag_when_out_of_range(tmp_path, capsys, flag, value):
    out = tmp_path / "stages"
    code = cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and flag in err[0], err
    assert not out.exists()


def test_a_group_learning_rate_points_to_lr_scale() -> None:
    group = gradgraph.ParamGroup(("*.bias",), {"lr": 1e-4})
    with pytest.raises(GradientError, match=r"overrides \['lr'\].*lr_scale=\.\.\.\), a factor of the step's lr"):
        gradgraph.TrainingConfig(loss="loss", optimizer=gradgraph.AdamWConfig(),
                                 update=gradgraph.UpdateOptions(groups=(group,)))
