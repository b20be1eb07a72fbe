"""Real-model gradients against torch autograd (issue tests (c) and (d)).

For every model of ``model_zoo`` x exporter (dynamo, legacy) x mode (eval, train_p0):
the exported ONNX loss graph gets a gradient graph for every mapped parameter; that graph
must pass ``onnx.checker.check_model(full_check=True)``, run on stock onnxruntime CPU, and
give the gradient of every torch parameter within rel 1e-4 / abs 1e-5 (float32) of torch
autograd on the same batch. Parameters the exporter stores under another name or transposed
are mapped by value (``model_zoo._map_parameters``); a parameter that appears several times
(tied weights, transposed copies) gets the sum of its initializers' gradients.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import model_zoo as zoo  # noqa: E402 - imports torch

from gradgraph.api import build_gradient_graph  # noqa: E402
from passes.marks import STAGE_KEY, Role  # noqa: E402

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-4, 1e-5
# Share of torch parameters (those torch gives a gradient) that must be found in the export.
MIN_COVERAGE = 1.0
CASES = [(m, e, mode) for m in zoo.MODELS for e in zoo.EXPORTERS for mode in zoo.MODES]
IDS = [f"{m}-{e}-{mode}" for m, e, mode in CASES]


@dataclasses.dataclass
class Built:
    grad_model: onnx.ModelProto
    mapping: dict[str, str]  # ONNX initializer -> torch parameter
    initializers: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]  # ORT results: loss and "<init>_grad"
    torch_loss: float
    torch_grads: dict[str, np.ndarray]
    torch_values: dict[str, np.ndarray]


class _Cache:
    """One export + gradient graph + ORT run per case, shared by the tests of a session."""

    def __init__(self, root):
        self.root = root
        self.done: dict[tuple[str, str, str], Built | BaseException] = {}

    def get(self, model: str, exporter: str, mode: str) -> Built:
        key = (model, exporter, mode)
        if key not in self.done:
            try:
                self.done[key] = self._build(*key)
            except Exception as exc:  # noqa: BLE001 - re-raised by every test of the case
                self.done[key] = exc
        result = self.done[key]
        if isinstance(result, BaseException):
            raise result
        return result

    def _build(self, model: str, exporter: str, mode: str) -> Built:
        import torch

        torch.set_num_threads(2)
        path = str(self.root / f"{model}_{exporter}_{mode}.onnx")
        path, loss, mapping = zoo.export(model, exporter, mode, path)
        torch_loss, torch_grads, torch_values = zoo.torch_gradients(model, mode)
        forward = onnx.load(path)
        grad_model = build_gradient_graph(forward, loss, sorted(mapping), allow_unused=True)
        _, batch, names = zoo.build(model, mode)
        graph_inputs = {i.name for i in grad_model.graph.input}
        feeds = {n: t.numpy() for n, t in zip(names, batch) if n in graph_inputs}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        opts.log_severity_level = 3
        session = ort.InferenceSession(grad_model.SerializeToString(), opts,
                                       providers=["CPUExecutionProvider"])
        wanted = [loss] + [f"{name}_grad" for name in sorted(mapping)]
        outputs = dict(zip(wanted, session.run(wanted, feeds)))
        initializers = {t.name: onnx.numpy_helper.to_array(t) for t in forward.graph.initializer
                        if t.name in mapping}
        return Built(grad_model, mapping, initializers, outputs, torch_loss, torch_grads, torch_values)


@pytest.fixture(scope="session")
def zoo_cache(tmp_path_factory):
    return _Cache(tmp_path_factory.mktemp("model_zoo"))


def _oriented(built: Built, init: str, param: str) -> np.ndarray:
    """The gradient of initializer ``init`` in the layout of torch parameter ``param``."""
    grad = built.outputs[f"{init}_grad"]
    value, torch_value = built.initializers[init], built.torch_values[param]
    if value.shape == torch_value.shape and np.array_equal(value, torch_value):
        return grad
    assert value.ndim == 2 and np.array_equal(value.T, torch_value), (init, param)
    return grad.T


@pytest.mark.parametrize(("model", "exporter", "mode"), CASES, ids=IDS)
def test_gradient_graph_is_valid_and_runs(zoo_cache, model, exporter, mode):
    built = zoo_cache.get(model, exporter, mode)
    onnx.checker.check_model(built.grad_model, full_check=True)
    assert all(o.domain in ("", "ai.onnx") for o in built.grad_model.opset_import if o.version)
    assert all(n.domain in ("", "ai.onnx") for n in built.grad_model.graph.node)
    np.testing.assert_allclose(built.outputs[zoo.LOSS], built.torch_loss, rtol=RTOL, atol=ATOL)
    # The export keeps the mode: batch statistics in train mode, running statistics in eval
    # (the model's own nodes: the training-mode gradient applies an inference-mode one to dY).
    for node in built.grad_model.graph.node:
        backward = any(p.key == STAGE_KEY and p.value == Role.BACKWARD.value for p in node.metadata_props)
        if node.op_type == "BatchNormalization" and not backward:
            training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
            assert training == (mode == "train_p0"), node.name


@pytest.mark.parametrize(("model", "exporter", "mode"), CASES, ids=IDS)
def test_gradients_match_torch(zoo_cache, model, exporter, mode):
    built = zoo_cache.get(model, exporter, mode)
    by_param: dict[str, list[str]] = {}
    for init, param in built.mapping.items():
        by_param.setdefault(param, []).append(init)

    missing = sorted(set(built.torch_grads) - set(by_param))
    coverage = 1 - len(missing) / len(built.torch_grads)
    assert coverage >= MIN_COVERAGE, f"parameters not found in the export: {missing}"

    failures = []
    for param, inits in sorted(by_param.items()):
        got = sum(_oriented(built, init, param) for init in inits)
        expected = built.torch_grads.get(param)
        if expected is None:  # torch: not on the loss path
            expected = np.zeros_like(built.torch_values[param])
        if not np.allclose(got, expected, rtol=RTOL, atol=ATOL):
            err = np.abs(got - expected)
            worst = int(np.argmax(err - RTOL * np.abs(expected)))
            failures.append(f"{param} (from {inits}): max abs err {err.max():.3g}, worst element "
                            f"got {got.flat[worst]:.6g} expected {expected.flat[worst]:.6g}")
    assert not failures, f"{len(failures)}/{len(by_param)} gradients differ:\n" + "\n".join(failures)
