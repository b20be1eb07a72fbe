"""DropoutNoisePass (a training Dropout reads its noise from a graph input) and the noise
ORTModule draws for it (gradgraph.dropout_noise)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from gradgraph.dropout_noise import DropoutNoise
from gradgraph.torch import DebugOptions, ORTModule
from passes.kernels import NOISE_KEY, DropoutNoisePass, NoiseInput, noise_inputs


def _dropout_model(ratio=0.25, training=True, shape=(4, 8), elem=TensorProto.FLOAT, mask_out=True,
                   ratio_input=False, opset=17) -> ir.Model:
    inits, inputs = [], [helper.make_tensor_value_info("x", elem, list(shape))]
    if ratio_input:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, []))
    else:
        inits.append(helper.make_tensor("r", TensorProto.FLOAT, [], [ratio]))
    if training is not None:
        inits.append(helper.make_tensor("t", TensorProto.BOOL, [], [training]))
    node = helper.make_node("Dropout", ["x", "r", "t" if training is not None else ""],
                            ["y", "mask"] if mask_out else ["y"], name="drop", seed=3)
    outputs = [helper.make_tensor_value_info("y", elem, list(shape))]
    if mask_out:
        outputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, list(shape)))
    graph = helper.make_graph([node], "g", inputs, outputs, inits)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("elem, dtype", [(TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64)])
def test_a_training_dropout_multiplies_by_the_noise_it_is_fed(elem, dtype):
    model = _dropout_model(0.25, elem=elem)
    assert DropoutNoisePass()(model).modified
    assert [n.op_type for n in model.graph] == ["Mul", "Constant", "Greater"]
    found = noise_inputs(model.graph)
    assert list(found) == ["y.noise"]
    assert found["y.noise"] == NoiseInput((4, 8), dtype, 0.25)
    assert model.graph.inputs[-1].metadata_props[NOISE_KEY] == repr(0.25)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(dtype)
    noise = ((rng.random((4, 8)) >= 0.25) / 0.75).astype(dtype)
    y, mask = _run(model, {"x": x, "y.noise": noise})
    np.testing.assert_array_equal(y, x * noise)
    np.testing.assert_array_equal(mask, noise > 0)


def test_a_mask_nobody_reads_is_not_computed():
    model = _dropout_model(0.1, mask_out=False)
    DropoutNoisePass()(model)
    assert [n.op_type for n in model.graph] == ["Mul"]


@pytest.mark.parametrize("case", [
    {"training": False}, {"training": None}, {"ratio": 0.0}, {"ratio": 1.0}, {"ratio_input": True},
    {"shape": ("batch", 8)}, {"elem": TensorProto.FLOAT16}, {"opset": 11},
])
def test_what_the_pass_leaves_to_onnxruntime(case):
    if case.get("opset") == 11:  # Dropout-10: ratio an attribute, no training_mode input
        node = helper.make_node("Dropout", ["x"], ["y"], ratio=0.3)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]))
    else:
        model = _dropout_model(**case)
    assert not DropoutNoisePass()(model).modified
    assert [n.op_type for n in model.graph] == ["Dropout"]
    assert noise_inputs(model.graph) == {}


def test_noise_depends_on_the_seed_alone_and_keeps_one_minus_ratio():
    inputs = {"a": NoiseInput((3, 1000, 200), np.float32, 0.1), "b": NoiseInput((7, 5), np.float64, 0.6)}
    one, two = DropoutNoise(inputs, threads=1), DropoutNoise(inputs, threads=2)
    a1, b1 = one.draw(123)
    a2, b2 = two.draw(123)
    np.testing.assert_array_equal(a1, a2)  # the thread count does not change the values
    np.testing.assert_array_equal(b1, b2)
    assert a1.dtype == np.float32 and a1.shape == (3, 1000, 200) and b1.dtype == np.float64
    assert set(np.unique(a1)) == {np.float32(0.0), np.float32(1 / 0.9)}
    assert set(np.unique(b1)) <= {0.0, 1 / 0.4}
    kept = float((a1 > 0).mean())  # 600,000 Bernoulli(0.9): standard deviation 3.9e-4
    assert abs(kept - 0.9) < 2e-3, kept
    assert abs(float(a1.mean()) - 1.0) < 3e-3  # the scale keeps the expectation
    a3, _ = one.draw(124)
    assert (a3 != a1).mean() > 0.1  # another seed, other noise
    chunks = a1.reshape(-1)[: 4 * (1 << 18)].reshape(4, -1)  # chunks seeded apart, not repeated
    assert all((chunks[i] != chunks[j]).any() for i in range(4) for j in range(i))


class _Dropped(torch.nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.lin(x)).sum(dim=1) + self.drop(x).mean(dim=1)


def test_ortmodule_draws_dropout_from_torch_seed_and_its_backward_reuses_the_mask(tmp_path):
    torch.manual_seed(0)
    module = _Dropped(0.3).train()
    wrapped = ORTModule(copy.deepcopy(module), DebugOptions(save_onnx=True, onnx_prefix=str(tmp_path / "m")),
                        fallback="raise")
    x = torch.randn(64, 16, requires_grad=True)
    wrapped(x)  # the build (its export runs the module)
    forward = onnx.load(tmp_path / "m_execution_model_forward_training.onnx")
    assert "Dropout" not in {n.op_type for n in forward.graph.node}
    assert sum(NOISE_KEY in {p.key for p in v.metadata_props} for v in forward.graph.input) == 2

    torch.manual_seed(7)
    first = wrapped(x)
    torch.manual_seed(7)
    again = wrapped(x)
    other = wrapped(x)
    torch.testing.assert_close(again, first, rtol=0, atol=0)  # torch's seed repeats the noise
    assert not torch.equal(other, first)

    # the backward multiplies by the forward's noise: d/dx of drop(x).mean(dim=1) is noise / 16
    probe = ORTModule(torch.nn.Dropout(0.3).train(), fallback="raise")
    y = probe(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    noise = torch.where(x != 0, y / x, 0.0)
    scale = torch.tensor(1 / 0.7)
    assert bool(((noise == 0) | torch.isclose(noise, scale, rtol=1e-6)).all())
    torch.testing.assert_close(grad, noise, rtol=1e-6, atol=0)
    dropped = float((y == 0).float().mean())  # 1024 Bernoulli(0.3): standard deviation 0.014
    assert abs(dropped - 0.3) < 0.07, dropped


def test_ortmodule_dropout_under_no_grad_in_train_mode_still_drops():
    module = torch.nn.Dropout(0.5).train()
    wrapped = ORTModule(module, fallback="raise")
    x = torch.ones(32, 32)
    with torch.no_grad():
        wrapped(x)
        y = wrapped(x)
    assert set(torch.unique(y).tolist()) == {0.0, 2.0}
    assert 0.35 < float((y == 0).float().mean()) < 0.65


def test_two_dropouts_of_one_tensor_stay_two_draws_through_the_optimizer():
    """SimCSE / R-Drop: one encoder run twice on one batch; onnxscript's optimizer merged the
    two Dropouts (same op, inputs and attributes) into one, so both views had one mask."""

    class TwoViews(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.2), torch.nn.Linear(64, 16))

        def forward(self, x):
            return (self.enc(x) - self.enc(x)).abs().amax()

    torch.manual_seed(0)
    wrapped = ORTModule(TwoViews().train(), fallback="raise")
    x = torch.randn(8, 32)
    wrapped(x)
    assert float(wrapped(x).detach()) > 0.0  # two masks: the views differ
    with torch.no_grad():
        assert float(wrapped(x)) > 0.0


def test_seed_random_ops_gives_distinct_seeds_and_keeps_given_ones():
    from passes.forward.random_seeds import SeedRandomOpsPass

    model = ir.from_proto(onnx.parser.parse_model("""<ir_version: 9, opset_import: ["" : 17]>
g (float[4] x, bool c) => (float[4] a, float[4] b, float[4] d, float[4] e, float[4] u, float[4] w)
  <float r = {0.5}, bool t = {1}, bool f = {0}> {
    a = Dropout(x, r, t)
    b = Dropout(x, r, t)
    d = Dropout<seed = 5>(x, r, t)
    e = Dropout(x, r, f)
    u = RandomUniformLike(x)
    w = If(c) <then_branch = g1 () => (float[4] o) { o = RandomUniformLike(x) },
               else_branch = g2 () => (float[4] o) { o = Identity(x) }>
}"""))
    assert SeedRandomOpsPass(11)(model).modified
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    seeded = {n.outputs[0].name: n.attributes["seed"].value for n in nodes if "seed" in n.attributes}
    assert set(seeded) == {"a", "b", "d", "u", "o"}  # not the inference Dropout, not the If
    assert seeded["d"] == 5
    assert all(type(seeded[k]) is int for k in ("a", "b", "d")) and type(seeded["u"]) is float  # the schemas'
    new = [seeded[k] for k in ("a", "b", "u", "o")]
    assert len(set(new)) == 4 and all(float(int(v)) == v for v in new)
    assert not SeedRandomOpsPass(11)(model).modified  # every random node has a seed now
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_a_dropout_left_to_onnxruntime_runs_and_the_optimizer_keeps_its_graph(caplog):
    """float16 (the noise pass leaves it): the seeded Dropout loads in onnxruntime; and
    onnxscript's optimizer accepts the seeded graphs (it fell back on a float seed)."""
    import logging

    wrapped = ORTModule(torch.nn.Dropout(0.5).train(), fallback="raise")
    y = wrapped(torch.ones(64, 64, dtype=torch.float16))
    assert y.dtype == torch.float16 and set(torch.unique(y).tolist()) == {0.0, 2.0}
    with caplog.at_level(logging.INFO, logger="gradgraph.torch"):
        ORTModule(_Dropped(0.2).train(), fallback="raise")(torch.randn(4, 16))
    assert not [r for r in caplog.records if "optimizer gave an invalid graph" in r.getMessage()]


def _draw_in_child(queue) -> None:
    noise = DropoutNoise({"a": NoiseInput((4, 1 << 18), np.float32, 0.5)}, threads=2)
    queue.put(float(noise.draw(1)[0].mean()))


def test_noise_draws_in_a_forked_child_after_the_parent_drew():
    """The parent's pool threads do not exist in a forked child (DataLoader workers, a fork
    server): the child makes its own pool instead of waiting for them forever."""
    import multiprocessing

    DropoutNoise({"a": NoiseInput((4, 1 << 18), np.float32, 0.5)}, threads=2).draw(0)  # the parent's pool
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_draw_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung drawing dropout noise")
    assert child.exitcode == 0 and abs(queue.get(timeout=5) - 1.0) < 0.05


class _Attention(torch.nn.Module):
    """scaled_dot_product_attention with dropout, then an ordinary Dropout (with the graph
    drawing random numbers, the first call's comparison with PyTorch is skipped)."""

    def __init__(self, attn_p: float) -> None:
        super().__init__()
        self.attn_p = attn_p
        self.qkv = torch.nn.Linear(8, 24)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        qkv = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_p)
        return self.drop(out).sum()


def test_attention_dropout_is_applied_and_its_gradient_matches_central_differences():
    """torchlib wrote SDPA's dropout as an inference Dropout (the identity, then removed):
    attention dropout vanished. Float64; the noise repeated by torch's seed, so the loss is a
    function of the weights that central differences (step 1e-6) can check."""
    torch.manual_seed(0)
    module = _Attention(0.5).double().train()
    wrapped = ORTModule(module, fallback="raise")
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def loss() -> torch.Tensor:
        torch.manual_seed(123)
        return wrapped(x)

    with torch.no_grad():
        module.attn_p = 0.0
        without = float(loss())
        module.attn_p = 0.5
        assert float(loss()) != without  # the attention's dropout is there
    value = loss()
    value.backward()
    weight = module.qkv.weight
    analytic = weight.grad.clone()
    with torch.no_grad():
        for index in [(0, 0), (3, 5), (9, 2), (17, 7), (23, 1)]:
            saved = float(weight[index])
            weight[index] = saved + 1e-6
            up = float(loss())
            weight[index] = saved - 1e-6
            down = float(loss())
            weight[index] = saved
            np.testing.assert_allclose(float(analytic[index]), (up - down) / 2e-6, rtol=1e-5, atol=1e-7)


def test_torch_seed_repeats_a_signatures_first_call():
    """The export's run of the module drew from torch's generator before the noise's seed."""
    wrapped = ORTModule(_Dropped(0.5).train(), fallback="raise")
    x = torch.randn(16, 16)
    torch.manual_seed(5)
    first = wrapped(x)  # exports and builds, then runs
    torch.manual_seed(5)
    torch.testing.assert_close(wrapped(x), first, rtol=0, atol=0)


@pytest.mark.parametrize("p, dtype", [(0.999, torch.float32), (0.3, torch.float64)])
def test_the_scale_is_one_over_one_minus_the_modules_p(p, dtype):
    """The exporter's float32 ratio is read as the p it rounds (0.999, not 0.99900001)."""
    wrapped = ORTModule(torch.nn.Dropout(p).train(), fallback="raise")
    x = torch.ones(20000, dtype=dtype)
    y = wrapped(x)
    kept = y[y != 0]
    assert kept.numel() > 0
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)), rtol=1e-7 if dtype == torch.float32 else 1e-15,
                               atol=0)


def test_dropout_of_p_one_gives_zeros_in_onnxruntime():
    """onnxruntime's kernel refuses ratio 1 (the signature fell back to PyTorch, its warning
    blaming the export): Y = X * 0."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(1.0)).train()
    wrapped = ORTModule(module, fallback="raise")
    y = wrapped(torch.randn(3, 4))
    assert not bool(y.any())
    y.sum().backward()
    assert not bool(module[0].weight.grad.any())


def test_a_submodule_replaced_on_the_wrapped_module_rebuilds():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    wrapped = ORTModule(net, fallback="raise")
    x = torch.randn(2, 4)
    wrapped(x)
    net[1] = torch.nn.Sigmoid()  # same plain attributes, another class
    torch.testing.assert_close(wrapped(x), net(x))
    net[1].forward = lambda t: t * 2  # a forward set on the instance
    torch.testing.assert_close(wrapped(x), net(x))


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
@pytest.mark.parametrize("training", [True, False])
def test_both_exporters_write_attention_dropout_in_training(exporter, training):
    """torch applies an explicit dropout_p > 0 in either mode (the module's Dropout only in train)."""
    from gradgraph.torch.export import export_call

    module = _Attention(0.5).train(training)
    exported = export_call(module, (torch.randn(2, 5, 8),), {}, training=training, exporter=exporter)
    dropouts = [n for n in exported.model.graph.node if n.op_type == "Dropout"]
    assert len(dropouts) == (2 if training else 1)  # the attention's, and the module's in train mode
    assert all(len(n.input) == 3 and n.input[2] for n in dropouts), [list(n.input) for n in dropouts]


def test_two_unnamed_dropouts_of_p_one_make_distinct_names():
    model = _dropout_model(1.0, mask_out=False)
    proto = ir.to_proto(model)
    proto.graph.node[0].name = ""
    second = onnx.helper.make_node("Dropout", ["y", "r", "t"], ["z"])
    proto.graph.node.append(second)
    proto.graph.output[0].name = "z"
    model = ir.from_proto(proto)
    assert DropoutNoisePass()(model).modified
    assert [n.op_type for n in model.graph].count("Mul") == 2
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_a_users_own_export_keeps_its_attention_dropout(tmp_path):
    """torch.onnx.export(optimize=False) of a module calling SDPA with dropout_p: the inference
    Dropout torchlib writes is trained (convention 5 of passes.exports.conventions), so the
    CLI's and the API's training graphs apply the attention's dropout."""
    import io
    from contextlib import redirect_stdout

    from passes.forward.prepare import PrepareForGradientPass

    path = tmp_path / "attention.onnx"
    with redirect_stdout(io.StringIO()):
        torch.onnx.export(_Attention(0.5).train(), (torch.randn(2, 5, 8),), str(path), dynamo=True, optimize=False)
    model = ir.load(str(path))
    untrained = [n for n in model.graph if n.op_type == "Dropout" and (len(n.inputs) < 3 or n.inputs[2] is None)]
    assert len(untrained) == 1  # the attention's, as the exporter writes it
    PrepareForGradientPass()(model)
    dropouts = [n for n in model.graph if n.op_type == "Dropout"]
    assert len(dropouts) == 2 and all(len(n.inputs) == 3 and n.inputs[2] is not None for n in dropouts)
