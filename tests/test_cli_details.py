"""CLI details a new user met: file permissions of what is written, a folder given as an output
file, a data file that is not an .npz, a resume at or past --steps, option values that name
nothing in the model (an error where they would size nothing, a warning where they would
allow or match nothing), a loss named by a graph input, the summary's stage numbers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import gradgraph
from gradgraph.cli.main import main as cli_main
from gradgraph.cli.train import CHECKPOINT_NAME

EXAMPLE = Path(gradgraph.__file__).parent / "examples" / "mlp.onnx"


def _data(path: Path, rows: int = 32) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.standard_normal((rows, 16)).astype(np.float32),
             labels=rng.integers(0, 4, rows).astype(np.int64))
    return path


def _train(data: Path, *extra: str) -> list[str]:
    return ["train", str(EXAMPLE), "--loss", "loss", "--data", str(data), "--batch-size", "8", "--quiet", *extra]


def _error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"gradgraph {command}: error: "), err
    return lines[0]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_outputs_follow_the_umask(tmp_path: Path, umask_022, capsys) -> None:
    out = tmp_path / "g.onnx"
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "-o", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o644
    stages = tmp_path / "stages"
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(stages)]) == 0
    assert stages.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in stages.iterdir()} == {0o644}
    run = tmp_path / "run"
    assert cli_main(_train(_data(tmp_path / "d.npz"), "--steps", "2", "--checkpoint-dir", str(run))) == 0
    assert {p.stat().st_mode & 0o777 for p in run.iterdir()} == {0o644}


def test_a_folder_as_output_file(tmp_path: Path, capsys) -> None:
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "-o", str(tmp_path)]) == 2
    line = _error(capsys.readouterr().err, "grad")
    assert "is a folder" in line and ".tmp" not in line


def test_a_folder_as_model_or_data_file(tmp_path: Path, capsys) -> None:
    assert cli_main(["grad", str(tmp_path), "--loss", "loss", "-o", str(tmp_path / "g.onnx")]) == 2
    line = _error(capsys.readouterr().err, "grad")
    assert "is a folder; name the .onnx file in it" in line and "does not exist" not in line
    assert cli_main(_train(tmp_path, "--steps", "2")) == 2
    line = _error(capsys.readouterr().err, "train")
    assert "is a folder; name the .npz file" in line


@pytest.mark.parametrize("content, said", [(b"garbage", "is not an .npz archive"),
                                           (None, "is one .npy array, not an .npz archive")])
def test_a_data_file_that_is_not_an_npz(tmp_path: Path, content: bytes | None, said: str, capsys) -> None:
    bad = tmp_path / "bad.npz"
    if content is None:
        with open(bad, "wb") as f:
            np.save(f, np.zeros(3))
    else:
        bad.write_bytes(content)
    assert cli_main(_train(bad, "--steps", "2")) == 2
    line = _error(capsys.readouterr().err, "train")
    assert said in line and "pickle" not in line


def test_resume_at_or_past_the_steps(tmp_path: Path, capsys) -> None:
    data, run = _data(tmp_path / "d.npz"), tmp_path / "run"
    assert cli_main(_train(data, "--steps", "3", "--checkpoint-dir", str(run))) == 0
    capsys.readouterr()
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    assert cli_main(_train(data, "--steps", "2", "--checkpoint-dir", str(run), "--resume")) == 2
    line = _error(capsys.readouterr().err, "train")
    assert "at step 3, past --steps 2" in line
    assert cli_main(_train(data, "--steps", "3", "--checkpoint-dir", str(run), "--resume")) == 0
    assert "already at step 3" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # nothing rewritten
    assert cli_main(_train(data, "--steps", "4", "--checkpoint-dir", str(run), "--resume")) == 0
    assert gradgraph.training.checkpoint.read_checkpoint(run / CHECKPOINT_NAME)[1]["step"] == 4


@pytest.mark.parametrize("flags, said", [
    (["--dim", "nosuch=3"], "no symbolic dimension 'nosuch' (its symbolic dimensions: batch)"),
    (["--dim", "btach=3"], "did you mean 'batch'"),
    (["--recompute-layers", "2"], "needs --recompute transformer_layers"),
])
def test_options_that_size_nothing_are_errors(tmp_path: Path, flags: list[str], said: str, capsys) -> None:
    out = tmp_path / "stages"
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out), *flags]) == 2
    assert said in _error(capsys.readouterr().err, "build")
    assert not out.exists()


def test_a_dim_of_a_model_with_only_numbers_warns(tmp_path: Path, capsys) -> None:
    static = tmp_path / "static.onnx"
    model = onnx.load(str(EXAMPLE))
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_value = 8
    onnx.save(model, str(static))
    out = tmp_path / "stages"
    assert cli_main(["build", str(static), "--loss", "loss", "--save-stages", str(out), "--dim", "batch=8"]) == 0
    assert "gradgraph build: warning: --dim: 'batch' is ignored: every dimension of the model is a number" \
        in capsys.readouterr().err


def test_options_that_match_nothing_warn(tmp_path: Path, capsys) -> None:
    out = tmp_path / "stages"
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out), "--cast-level", "1",
                     "--cast-allow", "relu"]) == 0
    err = capsys.readouterr().err
    assert "gradgraph build: warning: propagate_cast_ops allow list: no node of the model is a 'relu' " \
           "(did you mean 'Relu'?)" in err
    assert cli_main(_train(_data(tmp_path / "d.npz"), "--steps", "1", "--weight-decay", "0.1",
                           "--no-decay", "zzz*")) == 0
    assert "gradgraph train: warning: parameter group 0 ['zzz*'] matches no trained weight" in capsys.readouterr().err
    assert cli_main(_train(_data(tmp_path / "d.npz"), "--steps", "1", "--weight-decay", "0.1",
                           "--no-decay", "*bias")) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_loss_named_by_a_graph_input(tmp_path: Path, capsys) -> None:
    assert cli_main(["grad", str(EXAMPLE), "--loss", "x", "-o", str(tmp_path / "g.onnx")]) == 2
    assert "'x' is a graph input; the loss must be computed by the graph" in _error(capsys.readouterr().err, "grad")


def test_summary_numbers_are_the_file_numbers(tmp_path: Path, capsys) -> None:
    out = tmp_path / "stages"
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out)]) == 0
    numbered = {line.split()[0] + "_" + line.split()[1] for line in (out / "summary.txt").read_text().splitlines()
                if line[:2].isdigit()}
    assert numbered == {p.stem for p in out.glob("*.onnx")}
    assert all(onnx.load(str(p)) is not None for p in out.glob("*.onnx"))


CLIP_BOUND = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3] x) => (float loss) <float[3, 2] W = {1., 2., 3., 4., 5., 6.}, float hi = {0.5},
                                   float lo = {-0.5}> {
  y = MatMul(x, W)
  c = Clip(y, lo, hi)
  loss = ReduceSum<keepdims=0>(c)
}
"""


@pytest.mark.parametrize("mixed", [[], ["--mixed-precision", "float16"]], ids=["float32", "mixed-precision"])
def test_a_weight_behind_a_non_differentiable_input_names_the_user_loss(tmp_path: Path, capsys, mixed) -> None:
    """A trained Clip bound: the error names Clip's input and the user's loss, never the
    scaled loss that mixed precision differentiates internally."""
    model = tmp_path / "clip.onnx"
    onnx.save(onnx.parser.parse_model(CLIP_BOUND), model)
    stages = tmp_path / "stages"
    code = cli_main(["build", str(model), "--loss", "loss", "--weights", "W", "hi",
                     "--save-stages", str(stages), *mixed])
    line = _error(capsys.readouterr().err, "build")
    assert code == 2 and not stages.exists()
    assert "trained name 'hi' does not reach loss 'loss'" in line
    assert "through input 2 (max) of Clip node" in line
    assert ("(scaled for mixed precision as 'scaled_loss')" in line) == bool(mixed)


def test_build_for_a_device(tmp_path: Path, capsys) -> None:
    """--device cpu: the bf16 stage graphs keep the ops onnxruntime's CPU provider lacks in fp32,
    so every stage loads there; without --device a warning says they may not."""
    import onnxruntime as ort

    out = tmp_path / "cpu"
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(out),
                     "--mixed-precision", "bfloat16", "--device", "cpu"]) == 0
    assert "warning" not in capsys.readouterr().err
    stages = sorted(out.glob("*.onnx"))
    assert len(stages) >= 4
    for path in stages:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert cli_main(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(tmp_path / "any"),
                     "--mixed-precision", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "gradgraph build: warning: without --device the bfloat16 graphs assume every op has a bfloat16 " \
           "kernel" in err and "pass --device cpu" in err


def test_kernel_support_probes_what_can_run_here() -> None:
    """A session's providers with a CPU fallback are probed on the CPU; graphs built for CUDA
    alone on a machine without it assume every kernel (nothing here can be probed)."""
    import onnxruntime as ort

    from gradgraph.training.build import kernel_support

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("a CUDA build of onnxruntime probes CUDA itself")
    assert kernel_support(["CUDAExecutionProvider"], "float16") is None
    # the session falls back to the CPU: its kernels are what the graphs must use (probed)
    assert kernel_support(["CUDAExecutionProvider", "CPUExecutionProvider"], "float16") is not None


def test_summary_names_the_dims_that_would_size_the_stash() -> None:
    """The build summary asks for the named symbolic dims it lacks, and says which stashed
    tensors no --dim can size (a dim computed at run time: the rows a loss keeps, or one shape
    inference left unnamed, ``unk__N``), instead of asking to name those."""
    import numpy as np
    import onnx_ir as ir
    from onnx import TensorProto
    from test_valid_rows_loss import _head_model, _params

    from gradgraph import build_gradient_graph
    from gradgraph.training.summary import stash_lines
    from passes.kernels import ValidRowsLossPass

    model = _head_model("sce", "mean", TensorProto.INT64, False, True, _params(np.random.default_rng(0)))
    head = stash_lines(build_gradient_graph(model, "loss"), {})[0]
    assert "give --dim batch=VALUE seq=VALUE to size them" in head and "unk__" not in head
    head = stash_lines(build_gradient_graph(model, "loss"), {"batch": 3, "seq": 5})[0]
    assert "--dim batch" not in head and "which --dim cannot size" in head
    m = ir.from_proto(model)
    ValidRowsLossPass()(m)
    head = stash_lines(build_gradient_graph(ir.to_proto(m), "loss"), {"batch": 3, "seq": 5})[0]
    assert "give --dim" not in head and "which --dim cannot size" in head


def test_cast_flags_without_a_level_warn_and_recompute_needs_a_pattern(tmp_path: Path, capsys) -> None:
    args = ["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(tmp_path / "s")]
    assert cli_main([*args, "--cast-strategy", "INSERT_AND_REDUCE"]) == 0
    assert "change nothing without --cast-level" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse: "expected at least one argument"
        cli_main(["build", str(EXAMPLE), "--loss", "loss", "--recompute", "--save-stages", str(tmp_path / "t")])
    assert exit_info.value.code == 2
    assert "--recompute: expected at least one argument" in capsys.readouterr().err


def test_list_weights_shows_what_weights_and_freeze_leave_trained(capsys) -> None:
    names = [i.name for i in onnx.load(EXAMPLE).graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    first, second = names[0], names[1]
    assert cli_main(["train", str(EXAMPLE), "--loss", "loss", "--freeze", first, "--list-weights"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert " no " in rows[first] and "--freeze" in rows[first] and " yes " in rows[second]
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "--weights", second, "--list-weights"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert " yes " in rows[second] and " no " in rows[first] and "not in --weights" in rows[first]
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "--weights", f"{first},{second}", "--list-weights"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert " yes " in rows[first] and " yes " in rows[second]  # the commas of --weights, as grad reads them
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "--weights", f"{first},x", "--list-weights"]) == 0
    assert "graph inputs differentiated too (--weights): ['x']" in capsys.readouterr().out  # as grad takes it
    assert cli_main(["grad", str(EXAMPLE), "--loss", "loss", "--weights", "nope", "--list-weights"]) == 2
    assert "'nope'" in capsys.readouterr().err


def test_ctrl_c_before_the_first_step_is_one_line_and_status_130(capsys) -> None:
    import argparse

    from gradgraph.cli.common import run_command

    def interrupted(_args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    assert run_command(argparse.Namespace(command="build", func=interrupted)) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["gradgraph build: interrupted"]


def test_adam_eps_reaches_the_optimizer_and_is_checked(tmp_path: Path, capsys) -> None:
    import argparse

    from gradgraph.cli.build import config_from_args
    from gradgraph.cli.main import build_parser

    args = build_parser().parse_args(["build", str(EXAMPLE), "--loss", "loss", "--save-stages", str(tmp_path / "s"),
                                      "--optimizer", "lamb", "--adam-eps", "1e-4"])
    assert isinstance(args, argparse.Namespace)
    assert config_from_args(args).optimizer.eps == 1e-4  # type: ignore[attr-defined]
    data = Path(gradgraph.__file__).parent / "examples" / "mlp_data.npz"
    common = ["train", str(EXAMPLE), "--loss", "loss", "--data", str(data), "--steps", "1", "--batch-size", "4",
              "--quiet"]
    assert cli_main([*common, "--adam-eps", "-1"]) == 2
    assert "eps must be a finite number > 0" in capsys.readouterr().err
    assert cli_main([*common, "--optimizer", "sgd", "--adam-eps", "1e-4"]) == 2
    assert "sgd has none" in capsys.readouterr().err


def test_a_0d_array_in_the_data_file_is_named(tmp_path: Path, capsys) -> None:
    data = dict(np.load(Path(gradgraph.__file__).parent / "examples" / "mlp_data.npz"))
    first = next(iter(data))
    data[first] = np.float32(1.0)
    np.savez(tmp_path / "d.npz", **data)
    assert cli_main(["train", str(EXAMPLE), "--loss", "loss", "--data", str(tmp_path / "d.npz"), "--steps", "1",
                     "--batch-size", "2", "--quiet"]) == 2
    assert f"['{first}'] are 0-d arrays" in capsys.readouterr().err
