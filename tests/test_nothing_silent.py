"""Issue 35 §4: requests that were done only in part, or not at all, with exit 0.

1. ``gradgraph check`` on a forward that draws random numbers holds one draw fixed on both
   sides of the comparison (gradgraph.check_draws), so it is deterministic and compares the
   gradient of one function.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import parser

from gradgraph.check import gradcheck
from gradgraph.cli.main import main as cli_main

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
