"""Transformer-layer recompute on exports that carry no anchors: layers found by structure.

The model: a GPT-2-style decoder (pre-norm blocks, tanh-GELU written out as Mul/Pow/Tanh, no
Dropout nodes), exported by the TorchScript exporter and then stripped of node names and
metadata, so neither the reference's Gelu/Dropout edges nor module scopes find its layers.
Checks: the residual-stream search finds the blocks; the recompute pass clones them and the
gradients stay equal (onnxruntime, same inputs); through TrainingSession the graph onnxruntime
optimizes (``model_with_training_graph_after_optimization_path``) holds more nodes than
without recompute and SGD training is unchanged (losses and weights, rel 1e-5); an option that
matches nothing warns naming itself, or raises in the ``error`` mode; ``gradgraph build``
prints the count per option.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import gradgraph
from gradgraph.cli.main import main as cli_main
from passes.autodiff import GradientError
from passes.marks import Role, role_of
from passes.recompute import RecomputeOptions, RecomputePass, recomputed_counts, residual_layers
from passes.recompute.patterns import reference_layers, scope_layers
from passes.recompute.residual import repeated_groups

torch = pytest.importorskip("torch")
nn = torch.nn

D, HEADS, VOCAB, SEQ, BATCH = 16, 2, 11, 5, 2
LAYERS = 3
CPU = ["CPUExecutionProvider"]
# TrainingSession with and without recompute: losses and weights agree to this relative distance
TRAIN_RTOL = 1e-5


class RMSNorm(nn.Module):
    """RMSNorm written out (Pow, ReduceMean, Add, Sqrt, Div, Mul in the export)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Block(nn.Module):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.ln1, self.ln2 = norm(D), norm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (z.reshape(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // HEADS)
        causal = torch.triu(torch.full((t, t), -1e4), diagonal=1)
        y = torch.softmax(scores + causal, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        a = self.fc(self.ln2(x))
        a = 0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * torch.pow(a, 3))))
        return x + self.out(a)


class TinyGPT(nn.Module):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block(norm) for _ in range(LAYERS))
        self.ln_f, self.head = norm(D), nn.Linear(D, VOCAB)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def export_without_metadata(norm: type[nn.Module], path: Path) -> tuple[str, dict[str, np.ndarray]]:
    torch.manual_seed(0)
    model = TinyGPT(norm)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids, labels), str(path), input_names=["ids", "labels"],
                          output_names=["loss"], opset_version=17, dynamo=False,
                          do_constant_folding=False)
    proto = onnx.load(path)
    for node in proto.graph.node:  # no module scopes anywhere: names and metadata gone
        node.name = ""
        del node.metadata_props[:]
    assert not any(n.op_type in ("Gelu", "Erf", "Dropout") for n in proto.graph.node)
    onnx.save(proto, path)
    return str(path), {"ids": ids.numpy(), "labels": labels.numpy()}


@pytest.fixture(scope="module", params=[nn.LayerNorm, RMSNorm], ids=["layernorm", "rmsnorm"])
def gpt(request, tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    return export_without_metadata(request.param, tmp_path_factory.mktemp("gpt") / "gpt.onnx")


def _gradient_model(path: str) -> ir.Model:
    proto = onnx.load(path)
    names = [t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    return ir.from_proto(gradgraph.build_gradient_graph(proto, "loss", names))


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts, providers=CPU)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def test_no_anchor_and_no_scope_finds_nothing_but_the_residual_search(gpt) -> None:
    model = _gradient_model(gpt[0])
    options = RecomputeOptions()
    assert reference_layers(model.graph, options) == []
    assert scope_layers(model.graph, options) == []
    layers = residual_layers(model.graph)
    assert len(layers) == LAYERS
    ops = [sorted(n.op_type for n in layer) for layer in layers]
    assert ops[0] == ops[1] == ops[2]
    assert sum(n.op_type == "MatMul" for n in layers[0]) >= 6  # qkv, q.k, att.v, proj, fc, out
    assert all(role_of(n) == Role.FORWARD for layer in layers for n in layer)
    # layers do not overlap and keep graph order
    seen = [id(n) for layer in layers for n in layer]
    assert len(seen) == len(set(seen))


def test_layers_recomputed_with_the_same_gradients(gpt) -> None:
    path, feeds = gpt
    model = _gradient_model(path)
    before = _run(model, feeds)
    changed = ir.from_proto(ir.to_proto(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it finds something: no "recomputed nothing" warning
        assert RecomputePass(RecomputeOptions(transformer_layers=True))(changed).modified
    assert not RecomputePass(RecomputeOptions(transformer_layers=True))(changed).modified
    onnx.checker.check_model(ir.to_proto(changed), full_check=True)
    counts = recomputed_counts(changed)
    assert set(counts) == {"transformer_layers"} and counts["transformer_layers"] > 20
    after = _run(changed, feeds)
    grads = [k for k in before if k.endswith("_grad")]
    assert len(grads) > 10
    for name in grads:
        np.testing.assert_allclose(after[name], before[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_number_recompute_layers_counts_blocks(gpt) -> None:
    model = _gradient_model(gpt[0])
    all_but_last = ir.from_proto(ir.to_proto(model))
    RecomputePass(RecomputeOptions(transformer_layers=True))(all_but_last)
    one = ir.from_proto(ir.to_proto(model))
    RecomputePass(RecomputeOptions(transformer_layers=True, number_recompute_layers=1))(one)
    many, few = recomputed_counts(all_but_last)["transformer_layers"], recomputed_counts(one)["transformer_layers"]
    assert few < many and abs(many - 2 * few) <= 2  # LAYERS - 1 = 2 blocks against 1


def _train(path: str, feeds: dict[str, np.ndarray], saved: Path, **props: object):
    params = gradgraph.TrainingParameters()
    params.loss_output_name = "loss"
    params.training_optimizer_name = "SGDOptimizer"
    params.model_with_training_graph_after_optimization_path = str(saved)
    for key, value in props.items():
        setattr(params, key, value)
    session = gradgraph.TrainingSession(path, params, providers=CPU)
    losses = [session.train_step(feeds, lr=0.1) for _ in range(3)]
    return losses, session.get_state()


def test_training_session_recomputes_and_trains_the_same(gpt, tmp_path: Path) -> None:
    path, feeds = gpt
    base_losses, base_state = _train(path, feeds, tmp_path / "plain.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses, state = _train(path, feeds, tmp_path / "recompute.onnx", transformer_layer_recompute=True)
    np.testing.assert_allclose(losses, base_losses, rtol=TRAIN_RTOL)
    assert set(state) == set(base_state)
    for name in base_state:
        np.testing.assert_allclose(state[name], base_state[name], rtol=TRAIN_RTOL, atol=1e-7, err_msg=name)
    plain = onnx.load(tmp_path / "plain.onnx").graph.node
    optimized = onnx.load(tmp_path / "recompute.onnx").graph.node
    clones = [n for n in optimized if n.name.endswith("_recompute")]
    # onnxruntime's optimizations did not merge the clones back into their originals
    assert clones and len(optimized) >= len(plain) + len(clones) - 1


def _mlp_gradient_model() -> ir.Model:
    text = """<ir_version: 9, opset_import: ["" : 20]>
    g (float[4,8] x, float[8,8] w1, float[8,8] w2) => (float loss) {
      h = MatMul(x, w1)
      t = Tanh(h)
      o = MatMul(t, w2)
      loss = ReduceSum<keepdims = 0>(o)
    }"""
    return ir.from_proto(gradgraph.build_gradient_graph(onnx.parser.parse_model(text), "loss", ["w1", "w2"]))


@pytest.mark.parametrize("option,words", [
    ("transformer_layers", "residual stream"),
    ("gelu", "Gelu, FastGelu or BiasGelu"),
    ("attn_dropout", "fed by Softmax"),
])
def test_an_option_matching_nothing_warns_or_raises(option: str, words: str) -> None:
    model = _mlp_gradient_model()
    with pytest.warns(UserWarning, match=rf"RecomputeOptions\.{option}=True .*recomputed nothing") as caught:
        assert not RecomputePass(RecomputeOptions(**{option: True}))(model).modified
    assert words in str(caught[0].message)
    with pytest.raises(GradientError, match=rf"RecomputeOptions\.{option}=True"):
        RecomputePass(RecomputeOptions(**{option: True}, nothing_recomputed="error"))(model)


def test_a_budget_that_already_fits_warns() -> None:
    with pytest.warns(UserWarning, match="memory_budget=1000000000 .*already fit"):
        RecomputePass(RecomputeOptions(memory_budget=10**9))(_mlp_gradient_model())


def test_nothing_recomputed_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="nothing_recomputed"):
        RecomputeOptions(nothing_recomputed="ignore")


@pytest.mark.parametrize("signatures,expected", [
    ("AMAMAM", (2, 0, 3)),  # pre-norm blocks: attention and MLP halves
    ("EAMAMAM", (2, 1, 3)),  # something different before the blocks
    ("AAAA", (1, 0, 4)),
    ("ABCD", (0, 0, 0)),  # nothing repeats: no layers
    ("AMAMX", (2, 0, 2)),
])
def test_repeated_groups(signatures: str, expected: tuple[int, int, int]) -> None:
    assert repeated_groups(list(signatures)) == expected


def test_build_prints_the_count_per_option(gpt, tmp_path: Path, capsys) -> None:
    path, _ = gpt
    assert cli_main(["build", path, "--loss", "loss", "--save-stages", str(tmp_path / "s"),
                     "--recompute", "transformer_layers", "gelu"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("recomputed:"))
    count = int(line.split("transformer_layers ")[1].split()[0])
    assert count > 20
    assert "gelu " in line
