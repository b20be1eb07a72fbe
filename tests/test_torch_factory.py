"""TorchOrtFactory: an ONNX graph as a torch.autograd.Function, against torch autograd on the
equivalent module (oracle), rel 1e-5 / abs 1e-6; weights in any order."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from gradgraph.torch import TorchOrtFactory, TorchOrtFunction  # noqa: E402

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((4, 6)).astype(np.float32)
B1 = RNG.standard_normal(6).astype(np.float32)
W2 = RNG.standard_normal((6, 3)).astype(np.float32)


def _model():
    nodes = [helper.make_node("MatMul", ["X", "zeta_w1"], ["h0"]), helper.make_node("Add", ["h0", "alpha_b1"], ["h1"]),
             helper.make_node("Tanh", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "mid_w2"], ["Y"]),
             helper.make_node("ReduceSum", ["h"], ["S"], keepdims=0)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [5, 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [5, 3]),
                               helper.make_tensor_value_info("S", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(W1, "zeta_w1"), numpy_helper.from_array(B1, "alpha_b1"),
                               numpy_helper.from_array(W2, "mid_w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _torch(x, w1, b1, w2):
    h = torch.tanh(x @ w1 + b1)
    return h @ w2, h.sum()


@pytest.mark.parametrize("order", [["zeta_w1", "alpha_b1", "mid_w2"], ["mid_w2", "zeta_w1", "alpha_b1"]])
def test_gradients_equal_torch_autograd_in_any_weight_order(order):
    cls = TorchOrtFactory(_model(), order).create_class()
    assert issubclass(cls, TorchOrtFunction) and cls._weights_to_train == order
    values = {"zeta_w1": W1, "alpha_b1": B1, "mid_w2": W2}
    x0 = torch.from_numpy(RNG.standard_normal((5, 4)).astype(np.float32))
    mine = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    ref = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    xa, xb = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    y, s = cls.apply(xa, *(mine[k] for k in order))
    y_ref, s_ref = _torch(xb, ref["zeta_w1"], ref["alpha_b1"], ref["mid_w2"])
    np.testing.assert_allclose(y.detach().numpy(), y_ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    gy = torch.from_numpy(RNG.standard_normal((5, 3)).astype(np.float32))
    ((y * gy).sum() + 0.5 * s).backward()
    ((y_ref * gy).sum() + 0.5 * s_ref).backward()
    for k in values:
        np.testing.assert_allclose(mine[k].grad.numpy(), ref[k].grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(xa.grad.numpy(), xb.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_output_names_select_outputs_and_bad_names_are_errors():
    cls = TorchOrtFactory(_model(), ["zeta_w1"], output_names=["Y"]).create_class()
    w = torch.tensor(W1, requires_grad=True)
    y = cls.apply(torch.ones(5, 4), w)
    assert tuple(y.shape) == (5, 3)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (4, 6)
    with pytest.raises(ValueError, match="neither initializers nor inputs"):
        TorchOrtFactory(_model(), ["w1_typo"])
    with pytest.raises(ValueError, match="not graph outputs"):
        TorchOrtFactory(_model(), ["zeta_w1"], output_names=["Z"])
    with pytest.raises(ValueError):
        TorchOrtFactory(_model(), "zeta_w1")  # a string where a list belongs
    with pytest.raises(TypeError, match="takes 2 tensors"):
        cls.apply(torch.ones(5, 4))
    # a feed of another dtype: named, with the dtype the graph takes (onnxruntime's error named neither)
    with pytest.raises(TypeError, match=r"'X' is a torch.float64 tensor; the graph takes torch.float32"):
        cls.apply(torch.ones(5, 4, dtype=torch.float64), w)
    with pytest.raises(TypeError, match=r"'zeta_w1' is a torch.float16 tensor"):
        cls.apply(torch.ones(5, 4), w.detach().half())


def test_run_options_reach_every_run_and_device_index_is_checked():
    import onnxruntime as ort

    stop = ort.RunOptions()
    stop.terminate = True  # onnxruntime refuses a run whose options say terminate
    cls = TorchOrtFactory(_model(), ["zeta_w1"], run_options=stop).create_class()
    assert cls._run_options is stop
    with pytest.raises(Exception, match="terminate"):
        cls.apply(torch.ones(5, 4), torch.tensor(W1, requires_grad=True))
    stop.terminate = False  # the same object, read at each run
    y, _ = cls.apply(torch.ones(5, 4), torch.tensor(W1, requires_grad=True))
    assert tuple(y.shape) == (5, 3)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="device_index"):
            TorchOrtFactory(_model(), ["zeta_w1"], device_index=bad)
    with pytest.raises(TypeError, match="run_options"):
        TorchOrtFactory(_model(), ["zeta_w1"], run_options={"terminate": True})
    gpu = TorchOrtFactory(_model(), ["zeta_w1"], providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                          device_index=1)
    assert gpu._provider_options() == [{"device_id": "1", "use_tf32": "0"}, {}]  # torch's default: no TF32
    assert TorchOrtFactory(_model(), ["zeta_w1"])._provider_options() is None


def _returns_weight_and_input():
    """Y = X @ W, returning Y, the weight W and the input X as they are."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((3, 2)).astype(np.float32), "W")
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"]), helper.make_node("Relu", ["Y"], ["Z"])], "g",
        [info("X", TensorProto.FLOAT, [4, 3])],
        [info("Y", TensorProto.FLOAT, [4, 2]), info("W", TensorProto.FLOAT, [3, 2]),
         info("X", TensorProto.FLOAT, [4, 3]), info("Z", TensorProto.FLOAT, [4, 2])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), numpy_helper.to_array(w)


@pytest.mark.parametrize("output_names", [None, ["Z", "W", "Y", "Z", "X"]])
def test_outputs_that_are_weights_inputs_or_repeated_get_every_gradient(output_names):
    # An output that is a weight or an input as it is, or a name listed twice, is its own value:
    # torch sums the gradients of every use (this was silently dropped before).
    model, w_init = _returns_weight_and_input()
    names = output_names or ["Y", "W", "X", "Z"]
    cls = TorchOrtFactory(model, ["W"], output_names=output_names).create_class()
    x0 = torch.from_numpy(np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32))
    factors = [float(k + 2) for k in range(len(names))]  # a distinct factor per output

    x, w = x0.clone().requires_grad_(), torch.from_numpy(w_init.copy()).requires_grad_()
    outs = cls.apply(x, w)
    sum(f * o.sum() for f, o in zip(factors, outs)).backward()

    xr, wr = x0.clone().requires_grad_(), torch.from_numpy(w_init.copy()).requires_grad_()
    yr = xr @ wr
    ref = {"Y": yr, "W": wr, "X": xr, "Z": torch.relu(yr)}
    for name, out in zip(names, outs):
        torch.testing.assert_close(out, ref[name].detach(), rtol=1e-6, atol=1e-6)
    sum(f * ref[n].sum() for n, f in zip(names, factors)).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-6)


def test_a_default_dynamo_export_trains_its_linear_weights_by_torch_name(tmp_path):
    """torch.onnx.export's dynamo exporter (optimize=True, opset 18) folds each Linear weight into a
    transposed constant ``val_N``: the factory recovers it, trains it under its torch name and
    layout, and names the parameter when given the folded name."""
    import io

    import onnx

    from passes.autodiff import GradientError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x = torch.randn(2, 5, 4)  # 3-D: a MatMul by the weight's (folded) transpose, not a Gemm
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), f, input_names=["x"], output_names=["y"], opset_version=18)
    model = onnx.load_from_string(f.getvalue())
    assert "0.weight" not in {i.name for i in model.graph.initializer}  # folded by the exporter
    names = ["2.weight", "0.bias", "0.weight", "2.bias"]
    params = dict(net.named_parameters())
    weights = [params[n].detach().clone().requires_grad_(True) for n in names]
    cls = TorchOrtFactory(model, names, input_names=["x"], output_names=["y"]).create_class()
    (cls.apply(x, *weights) ** 2).sum().backward()
    (net(x) ** 2).sum().backward()
    for name, w in zip(names, weights, strict=True):
        torch.testing.assert_close(w.grad, params[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    folded = next(i.name for i in model.graph.initializer if i.name.startswith("val_"))
    with pytest.raises((GradientError, ValueError), match="train '"):
        TorchOrtFactory(model, [folded], input_names=["x"], output_names=["y"]).create_class()


def _classifier(labels_dim: str):
    """Gemm scores [N, 3] and SoftmaxCrossEntropyLoss over labels whose batch is named
    ``labels_dim`` (another name than the inputs' ``N``: only the loss relates them)."""
    nodes = [helper.make_node("Gemm", ["X", "w"], ["scores"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], ignore_index=-100)]
    graph = helper.make_graph(nodes, "clf", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4]),
                                             helper.make_tensor_value_info("labels", TensorProto.INT64, [labels_dim])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(W1[:, :3].copy(), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("labels_dim", ["N", "M"])
def test_labels_shapes_and_indices_are_checked_before_onnxruntime_runs(labels_dim, capfd):
    # a label batch of 6 against 8 inputs computed a loss from the first 6 rows; a negative
    # label was read; a wrong size or rank reached onnxruntime's error and its log line
    cls = TorchOrtFactory(_classifier(labels_dim), ["w"]).create_class()
    w = torch.tensor(W1[:, :3].copy(), requires_grad=True)
    x = torch.from_numpy(RNG.standard_normal((8, 4)).astype(np.float32))
    good = torch.tensor([0, 1, 2, -100, 0, 1, 2, 0])
    ref = torch.nn.functional.cross_entropy(x @ w, good)
    torch.testing.assert_close(cls.apply(x, good, w), ref)
    capfd.readouterr()
    with pytest.raises(ValueError, match="'labels'.*6|6.*'labels'") as info:  # as torch: a ValueError
        cls.apply(x, good[:6], w)
    assert "batch" in str(info.value)
    with pytest.raises(ValueError):
        torch.nn.functional.cross_entropy(x @ w, good[:6])
    for bad in (torch.tensor([0, 1, 2, 3, 0, 1, 2, 0]), torch.tensor([0, 1, -2, 0, 0, 1, 2, 0])):
        with pytest.raises(IndexError, match="'labels' holds"):
            cls.apply(x, bad, w)
        with pytest.raises(IndexError):
            torch.nn.functional.cross_entropy(x @ w, bad)
    with pytest.raises(RuntimeError, match="'X' has shape \\[8, 5\\]"):
        cls.apply(torch.zeros(8, 5), good, w)
    with pytest.raises(RuntimeError, match="'labels' has shape \\[8, 1\\]; the graph takes rank 1"):
        cls.apply(x, good[:, None], w)
    assert "onnxruntime" not in capfd.readouterr().err.lower()
