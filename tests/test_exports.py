"""Default torch exports: the trained set is the module's parameters (folded ones recovered), and
torch's gradient conventions recorded in the export's metadata are followed."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradgraph

pytestmark = pytest.mark.slow  # exports torch modules (about 35 s)

RTOL, ATOL = 1e-4, 1e-6  # float32 graph vs float32 torch autograd, relative to each tensor's max


class Conventions(nn.Module):
    """padding_idx, ReLU6 (hardtanh: no gradient at 0 or 6), clamp (gradient at the bounds),
    two equal-valued norm weights (merged by the exporter) and linear layers (transposed)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.fc = nn.Linear(8, 8, bias=False)
        self.scale_a = nn.Parameter(torch.ones(8))
        self.scale_b = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).mean(1) * self.scale_a
        a = F.relu6(self.fc(h) * x)   # x has exact zeros and sixes: the kinks are hit
        c = torch.clamp(h * x, 0.0, 6.0) * self.scale_b
        return F.cross_entropy(self.head(a + c), labels)


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (4, 5), generator=g)
    ids[:, 0] = 0  # the padding row is used
    x = torch.randn(4, 8, generator=g)
    x[:, :3] = 0.0
    return ids, x, torch.tensor([0, 1, 2, 3])


def _export(module: nn.Module, args: tuple, path: Path, how: str) -> Path:
    names = ["ids", "x", "labels"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "legacy":
            torch.onnx.export(module, args, str(path), dynamo=False, input_names=names, output_names=["loss"])
        else:
            torch.onnx.export(module, args, str(path), input_names=names, output_names=["loss"],
                              optimize=how == "dynamo")
    return path


@pytest.mark.parametrize("how", ["dynamo", "dynamo_noopt"])
def test_trained_set_and_gradients_follow_torch(how: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Conventions()
    args = _batch()
    path = _export(module, args, tmp_path / "m.onnx", how)
    module.zero_grad()
    module(*args).backward()
    expected = {n: p.grad.numpy() for n, p in module.named_parameters() if p.grad is not None}

    rows = gradgraph.list_weights(path, "loss")
    assert {r.name for r in rows if r.trained} == set(expected)
    grad_model = gradgraph.build_gradient_graph(path, "loss")
    outputs = [o.name for o in grad_model.graph.output]
    feeds = {"ids": args[0].numpy(), "x": args[1].numpy(), "labels": args[2].numpy()}
    got = dict(zip(outputs, ort.InferenceSession(grad_model.SerializeToString()).run(None, feeds)))
    for name, want in expected.items():
        scale = max(float(np.abs(want).max()), 1e-12)
        np.testing.assert_allclose(got[name + "_grad"], want, rtol=RTOL, atol=ATOL * scale, err_msg=name)
    assert np.all(got["emb.weight_grad"][0] == 0)  # padding row


def test_without_metadata_clip_blocks_at_bounds_and_scalars_are_constants(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Conventions()
    path = _export(module, _batch(), tmp_path / "legacy.onnx", "legacy")
    rows = {r.name: r for r in gradgraph.list_weights(path, "loss")}
    for row in rows.values():
        if row.trained:
            assert int(np.prod(row.shape)) > 1
        elif row.kind == "constant":
            assert int(np.prod(row.shape)) <= 1 or "inf" in row.reason
    # The legacy exporter's own fold (README, "Which weights are trained"): with its default
    # constant folding, fc.weight is stored transposed as onnx::MatMul_N (trained under that
    # name). scale_b, equal to scale_a, was deduplicated into Identity(scale_a): recovered.
    trained = {n for n, r in rows.items() if r.trained}
    params = {n for n, _ in module.named_parameters()}
    assert params - trained == {"fc.weight"}
    assert "deduplicated" in rows["scale_b"].reason
    extra = trained - params
    assert len(extra) == 1 and next(iter(extra)).startswith("onnx::MatMul")


def test_onnx_program_and_ir_model_are_accepted(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Conventions()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, _batch(), dynamo=True)
    from_program = gradgraph.build_gradient_graph(program, program.model.graph.outputs[0].name)
    grads = {o.name for o in from_program.graph.output if o.name.endswith("_grad")}
    assert grads == {n + "_grad" for n, _ in module.named_parameters()}
    before = len(program.model.graph)
    gradgraph.build_gradient_graph(program.model, program.model.graph.outputs[0].name)
    assert len(program.model.graph) == before  # the caller's model is not edited


def test_cli_list_weights_and_unknown_names(tmp_path: Path, capsys) -> None:
    from gradgraph.cli.main import main

    torch.manual_seed(0)
    path = _export(Conventions(), _batch(), tmp_path / "m.onnx", "dynamo")
    assert main(["grad", str(path), "--loss", "loss", "--list-weights"]) == 0
    out = capsys.readouterr().out
    assert "emb.weight" in out and "trained" in out and "bytes" in out
    assert main(["grad", str(path), "--loss", "loss", "--weights", "fc.weigth", "-o", str(tmp_path / "g.onnx")]) == 2
    err = capsys.readouterr().err
    assert "'fc.weight'" in err and err.count("\n") == 1
    assert not (tmp_path / "g.onnx").exists()


def test_a_parameter_the_exporter_dropped_is_not_called_folded(tmp_path: Path) -> None:
    """torch 2.13's dynamo export of LSTM(proj_size=...) has no projection weight (optimize=False
    or not): the refusal says the exporter dropped it, instead of advising optimize=False for
    an export that already used it."""

    class ProjectedLSTM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True, proj_size=4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(x)[0].pow(2).mean()

    torch.manual_seed(0)
    path = tmp_path / "lstm.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ProjectedLSTM(), (torch.randn(3, 7, 8),), str(path), input_names=["x"],
                          output_names=["loss"], optimize=False)
    with pytest.raises(gradgraph.GradientError) as raised:
        gradgraph.build_gradient_graph(str(path), loss="loss")
    message = str(raised.value)
    assert "no initializer for torch parameter(s) ['lstm.weight_hr_l0']" in message
    assert "torch's exporter dropped them" in message and "optimizer folded" not in message


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self.bn(self.dw(self.conv(x))))
        return F.cross_entropy(self.fc(h.mean((2, 3))), labels)


def test_batch_norm_mode_and_fused_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = ConvBN()
    x, labels = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 2, 0])
    names = ["x", "labels"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.train(), (x, labels), str(tmp_path / "train.onnx"), input_names=names,
                          output_names=["loss"], optimize=False)
        torch.onnx.export(module.eval(), (x, labels), str(tmp_path / "eval.onnx"), input_names=names,
                          output_names=["loss"], optimize=False)
        torch.onnx.export(module.eval(), (x, labels), str(tmp_path / "opt.onnx"), input_names=names,
                          output_names=["loss"])
    # The exporter writes train-mode BatchNorm in inference mode; the FX record says training.
    train_graph = gradgraph.build_gradient_graph(tmp_path / "train.onnx", "loss").graph
    modes = [a.i for n in train_graph.node if n.op_type == "BatchNormalization"
             for a in n.attribute if a.name == "training_mode"]
    assert modes == [1]
    # Eval mode: running statistics, gradients equal torch's.
    module.zero_grad()
    module(x, labels).backward()
    grad_model = gradgraph.build_gradient_graph(tmp_path / "eval.onnx", "loss")
    outputs = [o.name for o in grad_model.graph.output]
    got = dict(zip(outputs, ort.InferenceSession(grad_model.SerializeToString()).run(
        None, {"x": x.numpy(), "labels": labels.numpy()})))
    for name, param in module.named_parameters():
        want = param.grad.numpy()
        np.testing.assert_allclose(got[name + "_grad"], want, rtol=RTOL,
                                   atol=ATOL * max(float(np.abs(want).max()), 1e-12), err_msg=name)
    # optimize=True fuses Conv+BatchNorm: the conv keeps its name with fused values. Refused.
    with pytest.raises(gradgraph.GradientError, match=r"bn\.weight.*optimize=False") as err:
        gradgraph.build_gradient_graph(tmp_path / "opt.onnx", "loss")
    assert "dw.weight" in str(err.value)


def test_check_leaves_torch_padding_rows_out(tmp_path: Path, capsys) -> None:
    from gradgraph.cli.main import main

    torch.manual_seed(0)
    args = _batch()
    path = _export(Conventions(), args, tmp_path / "m.onnx", "dynamo_noopt")
    np.savez(tmp_path / "batch.npz", ids=args[0].numpy(), x=args[1].numpy(), labels=args[2].numpy())
    code = main(["check", str(path), "--loss", "loss", "--inputs", str(tmp_path / "batch.npz"),
                 "--weights", "emb.weight", "--max-elements", "80"])
    out = capsys.readouterr().out
    # All 80 entries asked for; the 72 outside padding row 0 (10 rows x 8) are compared, row 0 is not.
    assert code == 0, out
    assert "emb.weight" in out and " 72 " in out


class TiedLM(nn.Module):
    """An output projection tied to the embedding: the exporter's optimizer keeps the weight for
    the Gather and folds a transposed copy of it for the MatMul."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.ln(self.emb(ids))))
        return F.cross_entropy(logits.reshape(-1, 10), labels.reshape(-1))


class KeptAndScaled(nn.Module):
    """A parameter used as it is and, scaled, as a folded constant: that use cannot be undone."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * self.w) @ (self.w.unsqueeze(1) * 2.0)).sum()


def test_a_kept_parameter_folded_for_another_use(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TiedLM()
    ids, labels = torch.randint(0, 10, (3, 5)), torch.randint(0, 10, (3, 5))
    path = tmp_path / "tied.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (ids, labels), str(path), input_names=["ids", "labels"], output_names=["loss"])
    module(ids, labels).backward()
    rows = gradgraph.list_weights(path, "loss")
    assert {r.name for r in rows if r.trained} == {"head.weight", "ln.weight", "ln.bias"}
    grad_model = gradgraph.build_gradient_graph(path, "loss")
    outputs = [o.name for o in grad_model.graph.output]
    got = dict(zip(outputs, ort.InferenceSession(grad_model.SerializeToString()).run(
        None, {"ids": ids.numpy(), "labels": labels.numpy()})))
    want = module.emb.weight.grad.numpy()  # both uses: the Gather's and the projection's
    np.testing.assert_allclose(got["head.weight_grad"], want, rtol=RTOL, atol=ATOL * float(np.abs(want).max()))

    scaled = tmp_path / "scaled.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(KeptAndScaled(), (torch.randn(2, 6),), str(scaled), input_names=["x"],
                          output_names=["loss"])
    with pytest.raises(gradgraph.GradientError, match=r"\['w'\].*optimize=False"):
        gradgraph.build_gradient_graph(scaled, "loss")


class ScalarHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.tanh(self.fc(x))).squeeze(-1), target)


def test_legacy_one_element_bias_is_trained(tmp_path: Path) -> None:
    """Without a signature a one-element tensor is a constant, unless named like a module's bias."""
    torch.manual_seed(0)
    module = ScalarHead()
    x, target = torch.randn(4, 8), torch.randn(4)
    path = tmp_path / "legacy.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x, target), str(path), dynamo=False, input_names=["x", "target"],
                          output_names=["loss"])
    module(x, target).backward()
    rows = {r.name: r for r in gradgraph.list_weights(path, "loss")}
    assert rows["out.bias"].trained
    grad_model = gradgraph.build_gradient_graph(path, "loss")
    outputs = [o.name for o in grad_model.graph.output]
    got = dict(zip(outputs, ort.InferenceSession(grad_model.SerializeToString()).run(
        None, {"x": x.numpy(), "target": target.numpy()})))
    want = module.out.bias.grad.numpy()
    np.testing.assert_allclose(got["out.bias_grad"], want, rtol=RTOL, atol=ATOL)


class ConvBNHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(F.relu(self.bn(self.c1(x))).mean(dim=(2, 3))), y)


def test_list_weights_has_one_row_per_parameter_as_grad_sees_it(tmp_path: Path) -> None:
    """A default dynamo export folds the BatchNorm into the Conv: the Conv's initializers keep
    their names but hold folded values. One row each, untrained like grad's refusal (they were
    listed twice: trained as torch parameters, then untrained as folded)."""
    torch.manual_seed(0)
    path = tmp_path / "cnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ConvBNHead().train(), (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))), str(path),
                          input_names=["x", "y"], output_names=["loss"], dynamo=True)
    rows = gradgraph.list_weights(path, "loss")
    names = [r.name for r in rows]
    assert len(names) == len(set(names)), names
    folded = {r.name for r in rows if "folded" in r.reason}
    assert {r.name for r in rows if r.trained} == {"fc.weight", "fc.bias"}
    with pytest.raises(gradgraph.GradientError, match="folded"):
        gradgraph.build_gradient_graph(path, "loss")
    assert folded & {"c1.weight", "c1.bias"}, rows
    gradgraph.build_gradient_graph(path, "loss", ["fc.weight", "fc.bias"])  # what the list offers trains
