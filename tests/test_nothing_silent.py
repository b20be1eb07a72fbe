"""Issue 35 §4: requests that were done only in part, or not at all, with exit 0.

1. ``gradgraph check`` on a forward that draws random numbers holds one draw fixed on both
   sides of the comparison (gradgraph.check_draws), so it is deterministic and compares the
   gradient of one function.
2. A negative (or too large) class label or embedding id is refused as torch refuses it:
   ``gradgraph train --data`` at load, :class:`TrainingSession` before onnxruntime runs,
   ``gradgraph check --inputs``; a hand-built model opts in to ONNX's negative Gather indices.
4. Data-parallel ranks started with other options, weights or data shapes stop at the start
   with one line naming the difference.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import parser

from gradgraph.check import gradcheck
from gradgraph.cli.main import main as cli_main
from gradgraph.feeds import InputError
from gradgraph.index_inputs import ALLOW_NEGATIVE_KEY, index_uses
from gradgraph.training.options import TrainingConfig
from gradgraph.training.session import TrainingSession
from passes.autodiff import GradientError
from passes.optimizer import SGDConfig
from tests.ranks import launch

torch = pytest.importorskip("torch")


def _rows(report) -> list[tuple[str, int, float, str]]:
    return [(r.name, r.checked, r.max_abs_err, r.result) for r in report]


class _SdpaDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x)
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        return (y * y).sum()


def test_check_of_sdpa_dropout_is_deterministic_and_passes(tmp_path, capsys):
    """A train-mode SDPA with dropout_p exported with optimize=False: the gradient graph trains
    the attention's dropout; the check used to switch it off on the differences' side only
    (every entry failed, differently on each run, while it said the Dropout was off)."""
    torch.manual_seed(0)
    path = str(tmp_path / "sdpa.onnx")
    torch.onnx.export(_SdpaDropout().train(), (torch.randn(2, 2, 4, 8),), path, dynamo=True,
                      optimize=False, output_names=["loss"])
    first, second = gradcheck(path, "loss"), gradcheck(path, "loss")
    assert first.ok and all(r.checked for r in first), _rows(first)
    assert _rows(first) == _rows(second)
    assert "random draws held fixed" in first.notes[0] and "Dropout" in first.notes[0]
    assert cli_main(["check", path, "--loss", "loss"]) == 0
    assert "note: random draws held fixed" in capsys.readouterr().out


_RANDOM_OPS = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[4, 3] x) => (float loss) <float[3, 5] w = {W}, float ratio = {0.4}, bool train = {1},
                                     float[4, 5] p = {P}> {
    h = MatMul(x, w)
    t = Tanh(h)
    d, m = Dropout(t, ratio, train)
    u = RandomUniformLike<low = 0.5, high = 1.5>(d)
    b = Bernoulli(p)
    n = RandomNormal<shape = [4, 5]>()
    mf = Cast<to = 1>(m)
    du = Mul(d, u)
    dub = Mul(du, b)
    e = Add(dub, n)
    f = Mul(e, e)
    g2 = Mul(f, mf)
    loss = ReduceSum(g2)
}
"""


def _random_ops_model() -> onnx.ModelProto:
    w = np.linspace(-1, 1, 15).astype(np.float32)
    p = np.full(20, 0.5, np.float32)
    text = _RANDOM_OPS.replace("{W}", "{" + ", ".join(map(str, w)) + "}")
    return parser.parse_model(text.replace("{P}", "{" + ", ".join(map(str, p)) + "}"))


def test_check_holds_every_random_op_fixed(tmp_path):
    """Dropout (mask read too), RandomUniformLike, Bernoulli and RandomNormal: one draw, the same
    on both sides, the same on every run; another seed is another draw."""
    path = str(tmp_path / "random.onnx")
    onnx.save(_random_ops_model(), path)
    first, second = gradcheck(path, "loss"), gradcheck(path, "loss")
    assert first.ok and first[0].checked == 15, _rows(first)
    assert _rows(first) == _rows(second) and first.loss_value == second.loss_value
    for op in ("Dropout", "RandomUniformLike", "Bernoulli", "RandomNormal"):
        assert op in first.notes[0]
    other = gradcheck(path, "loss", seed=1)
    assert other.ok and other.loss_value != first.loss_value


def test_check_of_a_train_mode_hf_bert_passes(tmp_path):
    """A default HF BERT (dropout 0.1 everywhere) in train mode: 10 of 41 names failed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=3)
    bert = transformers.BertForSequenceClassification(cfg).train()

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = bert

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels).loss

    ids, labels = torch.randint(0, 50, (2, 6)), torch.tensor([0, 2])
    path = str(tmp_path / "bert.onnx")
    torch.onnx.export(Loss(), (ids, labels), path, dynamo=True, optimize=False, output_names=["loss"])
    report = gradcheck(path, "loss", inputs={"ids": ids.numpy(), "labels": labels.numpy()},
                       max_elements=4)
    assert report.ok and not report.failed and len(report) > 20, _rows(report)
    assert "Dropout" in report.notes[0]


# ---- 2. negative labels and ids ----------------------------------------------------------------

_CLASSIFIER = """
<ir_version: 9, opset_import: ["" : 17]>
g (int64[N, 3] ids, int64[N] y) => (float loss) <float[10, 4] emb = {EMB}, float[4, 5] w = {W}> {
    shape = Constant<value = int64[1] {-1}>()
    shape3 = Constant<value = int64[3] {-1, 3, 4}>()
    flat = Reshape(ids, shape)
    e = Gather(emb, flat)
    e3 = Reshape(e, shape3)
    h = ReduceMean<axes = [1], keepdims = 0>(e3)
    s = MatMul(h, w)
    labels = Identity(y)
    loss = SoftmaxCrossEntropyLoss<ignore_index = -100, reduction = "mean">(s, labels)
}
"""


def _classifier(allow_negative: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    text = _CLASSIFIER.replace("{EMB}", "{" + ", ".join(map(str, rng.standard_normal(40).round(3))) + "}")
    model = parser.parse_model(text.replace("{W}", "{" + ", ".join(map(str, rng.standard_normal(20).round(3))) + "}"))
    if allow_negative:
        onnx.helper.set_model_props(model, {ALLOW_NEGATIVE_KEY: "true"})
    return model


def _data(**bad) -> dict[str, np.ndarray]:
    data = {"ids": np.arange(24).reshape(8, 3) % 10, "y": np.arange(8) % 5}
    for name, (position, value) in bad.items():
        data[name][position] = value
    return data


def test_index_inputs_are_found_structurally():
    uses = index_uses(_classifier())
    assert [(u.op_type, u.size, u.ignore_index) for u in uses["ids"]] == [("Gather", 10, None)]
    assert [(u.op_type, u.size, u.ignore_index) for u in uses["y"]] == [("SoftmaxCrossEntropyLoss", 5, -100)]


@pytest.mark.parametrize(("bad", "shown"), [
    ({"y": (3, -1)}, "input 'y' holds -1 at position [3]"),
    ({"y": (5, 5)}, "input 'y' holds 5 at position [5]"),
    ({"ids": ((2, 1), -1)}, "input 'ids' holds -1 at position [2, 1]"),
    ({"ids": ((7, 0), 10)}, "input 'ids' holds 10 at position [7, 0]"),
])
def test_train_refuses_bad_labels_and_ids_at_load(tmp_path, capsys, bad, shown):
    """`gradgraph train` on labels -1 trained with exit 0 (the label wrapped to the last class)."""
    model, data = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(_classifier(), model)
    np.savez(data, **_data(**bad))
    code = cli_main(["train", str(model), "--loss", "loss", "--data", str(data), "--steps", "2",
                     "--batch-size", "4", "--lr", "0.1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and shown in err and "torch raises IndexError" in err and f"{data}" in err
    assert len(err.strip().splitlines()[-1]) > 40 and "Traceback" not in err


def test_ignore_index_labels_train():
    session = TrainingSession(_classifier(), TrainingConfig("loss", SGDConfig()))
    batch = _data(y=(1, -100))
    assert np.isfinite(session.train_step({k: v[:4] for k, v in batch.items()}, lr=0.1))


def test_session_refuses_bad_indices_before_onnxruntime():
    session = TrainingSession(_classifier(), TrainingConfig("loss", SGDConfig()))
    batch = {k: v[:4] for k, v in _data(y=(2, -1)).items()}
    with pytest.raises(InputError, match=r"train_step: input 'y' holds -1 at position \[2\]"):
        session.train_step(batch, lr=0.1)
    with pytest.raises(InputError, match=r"eval_step: input 'y' holds -1"):
        session.eval_step(batch)
    batch = {k: v[:4] for k, v in _data(ids=((0, 0), -3)).items()}
    with pytest.raises(InputError, match=r"metadata property gradgraph.allow_negative_indices=true"):
        session.train_step(batch, lr=0.1)
    assert session.step == 0


def test_a_model_opts_in_to_negative_gather_indices():
    """ONNX reads -i as row n - i: a hand-built model that means it sets the metadata property;
    below -n, and negative labels, are refused still."""
    session = TrainingSession(_classifier(allow_negative=True), TrainingConfig("loss", SGDConfig()))
    reference = TrainingSession(_classifier(), TrainingConfig("loss", SGDConfig()))
    wrapped = {k: v[:4] for k, v in _data(ids=((0, 0), -1)).items()}
    plain = {k: v[:4] for k, v in _data(ids=((0, 0), 9)).items()}
    assert session.train_step(wrapped, lr=0.1) == reference.train_step(plain, lr=0.1)
    with pytest.raises(InputError, match=r"holds -11 .* in \[-10, 10\)"):
        session.train_step({k: v[:4] for k, v in _data(ids=((0, 0), -11)).items()}, lr=0.1)
    with pytest.raises(InputError, match=r"input 'y' holds -2"):
        session.train_step({k: v[:4] for k, v in _data(y=(0, -2)).items()}, lr=0.1)


def test_check_refuses_bad_labels_in_given_inputs():
    with pytest.raises(InputError, match=r"the inputs given: input 'y' holds -1"):
        gradcheck(_classifier(), "loss", inputs={k: v[:4] for k, v in _data(y=(0, -1)).items()})


# ---- 4. data-parallel ranks that were started differently ---------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "gradgraph" / "examples"
ROOT = Path(__file__).resolve().parent.parent


def _two_ranks(tmp_path: Path, differs: list[str], timeout: float = 100.0) -> list[subprocess.CompletedProcess]:
    """Rank 0 and rank 1 of `gradgraph train` started by hand (as torchrun would), rank 1 with
    ``differs`` appended to its command line (argparse: the last value of a flag wins)."""
    base = [sys.executable, "-m", "gradgraph", "train", str(EXAMPLES / "mlp.onnx"), "--loss", "loss",
            "--data", str(EXAMPLES / "mlp_data.npz"), "--optimizer", "sgd", "--lr", "0.05",
            "--steps", "3", "--batch-size", "8", "--quiet"]
    return launch([base + (differs if rank else []) + ["--checkpoint-dir", str(tmp_path / f"r{rank}")]
                   for rank in range(2)], timeout)


@pytest.mark.parametrize(("differs", "named"), [
    (["--lr", "0.1"], "differ in --lr: rank 0 has '0.05', rank 1 has '0.1'"),
    (["--steps", "4"], "differ in --steps: rank 0 has '3', rank 1 has '4'"),
    (["--optimizer", "adamw"], "differ in TrainingConfig.optimizer"),
    (["--freeze", "fc1_weight"], "differ in TrainingConfig.weights_not_to_train"),
    (["--batch-size", "4"], "differ in --batch-size: rank 0 has '8', rank 1 has '4'"),
])
def test_ranks_started_differently_stop_naming_the_difference(tmp_path, differs, named):
    """They finished with exit 0 and different weights (--lr, --optimizer), died in gloo
    (--freeze) or hit the 60 s collective timeout (--steps)."""
    start = time.monotonic()
    rank0, rank1 = _two_ranks(tmp_path, differs)
    assert rank0.returncode == 2 and rank1.returncode == 2, (rank0.stderr[-2000:], rank1.stderr[-2000:])
    lines = [line for line in rank0.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and named in lines[0], rank0.stderr[-2000:]
    assert "Traceback" not in rank0.stderr + rank1.stderr
    assert time.monotonic() - start < 55  # not the collective timeout


# ---- 5. mixed precision that computes nothing in low precision ---------------------------------

def _mlp_session(dtype: str | None) -> tuple[TrainingSession, list[str]]:
    from gradgraph.training.options import MixedPrecisionConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = TrainingSession(str(EXAMPLES / "mlp.onnx"), TrainingConfig(
            "loss", SGDConfig(), mixed_precision=MixedPrecisionConfig(dtype=dtype)),
            providers=["CPUExecutionProvider"])
    return session, [str(w.message) for w in caught if "mixed_precision" in str(w.message)]


def test_fp16_on_the_cpu_warns_that_nothing_runs_in_fp16():
    """The loss of an fp16 step on the CPU is fp32's, bit for bit: said, naming the option."""
    data = dict(np.load(EXAMPLES / "mlp_data.npz"))
    batch = {k: v[:8] for k, v in data.items()}
    fp32, quiet = _mlp_session(None)
    fp16, said = _mlp_session("float16")
    assert not quiet
    assert fp16.train_step(batch, lr=0.1) == fp32.train_step(batch, lr=0.1)
    assert len(said) == 1 and "mixed_precision.dtype='float16' (--mixed-precision float16)" in said[0]
    assert "no op of this model computes in float16" in said[0]
    _, said_bf16 = _mlp_session("bfloat16")
    assert len(said_bf16) == 1 and "values are rounded to bfloat16" in said_bf16[0]


def test_a_cast_inserted_by_onnxruntime_is_told_from_a_native_kernel():
    from gradgraph.training.precision_warning import runs_natively

    assert runs_natively("Gemm", "", int(onnx.TensorProto.FLOAT)) is True
    assert runs_natively("Gemm", "", int(onnx.TensorProto.FLOAT16)) is False


def test_check_refuses_a_random_draw_inside_a_subgraph():
    """A Dropout in an If branch cannot be held fixed by the check: refused, naming the node."""
    model = parser.parse_model("""
<ir_version: 9, opset_import: ["" : 18]>
g (float[4, 3] x, bool c) => (float loss) <float[3] w = {1.0, 2.0, 3.0}, float r = {0.5}, bool t = {1}> {
    y = Mul(x, w)
    z = If(c) <then_branch = g1 () => (float[4, 3] d1) { d1, m1 = Dropout(y, r, t) },
                else_branch = g2 () => (float[4, 3] d2) { d2 = Identity(y) }>
    loss = ReduceSum(z)
}
""")
    model.graph.node[1].name = "branchy"
    with pytest.raises(GradientError, match=r"node 'branchy' \(If\) draws random numbers inside its subgraph"):
        gradcheck(model, "loss")
