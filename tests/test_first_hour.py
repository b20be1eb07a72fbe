"""What a new user meets in the first hour (issue 38), each a finding of a trial from the README
alone: a misspelt or abbreviated flag, a bad choice, `check --inputs` with more rows than the
exported batch, a `.pt` file given as the model, and PyTorch missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

import gradgraph
from gradgraph.cli.main import main as cli_main

EXAMPLES = Path(gradgraph.__file__).parent / "examples"
EXAMPLE = EXAMPLES / "mlp.onnx"
DATA = EXAMPLES / "mlp_data.npz"


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The one stderr line of a usage error (exit 2) of ``gradgraph COMMAND``."""
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    prog = f"gradgraph {command}".strip()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize(("typo", "meant"), [("--learning-rate", "--lr"), ("--optimiser", "--optimizer"),
                                              ("--check-point-dir", "--checkpoint-dir")])
def test_a_misspelt_flag_of_a_sub_command_names_the_flag_meant(typo: str, meant: str, capsys) -> None:
    line = _usage_error(["train", str(EXAMPLE), "--loss", "loss", typo, "1"], capsys, "train")
    assert typo in line and meant in line


def test_a_bad_choice_lists_the_choices_and_the_closest(capsys) -> None:
    line = _usage_error(["train", str(EXAMPLE), "--loss", "loss", "--optimizer", "Adam"], capsys, "train")
    assert "sgd, adam, adamw, lamb" in line and "did you mean 'adam'" in line
    line = _usage_error(["trian", str(EXAMPLE)], capsys, "")  # the sub-command itself
    assert "did you mean 'train'" in line


def test_abbreviated_flags_are_refused(capsys) -> None:
    line = _usage_error(["train", str(EXAMPLE), "--loss", "loss", "--data", str(DATA), "--step", "5",
                         "--batch", "8", "--quiet"], capsys, "train")
    assert "--step (did you mean --steps" in line and "--batch-size" in line
    line = _usage_error(["check", str(EXAMPLE), "--loss", "loss", "--max-elem", "2"], capsys, "check")
    assert "--max-elements" in line


def test_help_still_prints_every_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["train", "-h"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--checkpoint-dir" in out and "--max-skipped" in out


FIXED_BATCH = """
<ir_version: 8, opset_import: ["" : 17]>
fixed (float[4, 3] x, float[3, 2] w) => (float loss) {
    flat = Reshape(x, shape)
    y = MatMul(flat, w)
    sq = Mul(y, y)
    loss = ReduceMean<keepdims = 0>(sq)
}
"""


def test_check_generalises_an_exported_batch_as_train_does(tmp_path: Path, capsys) -> None:
    model = onnx.parser.parse_model(FIXED_BATCH)
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "w")
    shape = onnx.numpy_helper.from_array(np.array([4, 3], np.int64), "shape")  # the batch baked in
    model.graph.initializer.extend([w, shape])
    del model.graph.input[1]
    path = tmp_path / "fixed.onnx"
    onnx.save(model, path)
    inputs = tmp_path / "rows.npz"
    np.savez(inputs, x=rng.standard_normal((64, 3)).astype(np.float32))
    assert cli_main(["check", str(path), "--loss", "loss", "--inputs", str(inputs)]) == 0
    captured = capsys.readouterr()
    assert "exported with batch 4" in captured.err and "64 rows" in captured.err
    assert "1 passed, 0 failed" in captured.out


def test_a_torch_checkpoint_gets_the_export_hint(tmp_path: Path, capsys) -> None:
    torch = pytest.importorskip("torch")
    module = torch.nn.Linear(3, 2)
    for name, obj, zipped in [("m.pt", module.state_dict(), True), ("m.pth", module, True),
                              ("legacy.bin", module.state_dict(), False)]:
        path = tmp_path / name
        torch.save(obj, path, _use_new_zipfile_serialization=zipped)
        assert cli_main(["grad", str(path), "--loss", "loss", "-o", str(tmp_path / "g.onnx")]) == 2
        err = capsys.readouterr().err
        assert "PyTorch file" in err and "torch.onnx.export(" in err and "Wire format" not in err, err
        assert not (tmp_path / "g.onnx").exists()


def _without_torch(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python where ``import torch`` fails as it does when it is not installed."""
    prelude = "import sys; sys.modules['torch'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                          timeout=120)


def test_without_torch_nproc_names_the_extra() -> None:
    proc = _without_torch("from gradgraph.cli.main import main\nraise SystemExit(main(["
                          f"'train', {str(EXAMPLE)!r}, '--loss', 'loss', '--data', {str(DATA)!r}, "
                          "'--steps', '1', '--batch-size', '8', '--nproc', '2', '--quiet']))")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pip install 'gradgraph[torch]'" in lines[0] and "--nproc 2" in lines[0]


def test_without_torch_import_names_the_extra() -> None:
    proc = _without_torch("import gradgraph.torch")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: gradgraph.torch needs PyTorch"), proc.stderr
    assert "pip install 'gradgraph[torch]'" in last
    assert "During handling" not in proc.stderr  # one error, not torch's chained under it
