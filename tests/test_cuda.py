"""CUDA: ORTModule, TorchOrtFactory and the training session on a GPU, against PyTorch on the
same GPU (the oracle) and against the same session on the CPU.

Skipped unless torch sees a CUDA device and onnxruntime has the CUDAExecutionProvider
(the ``onnxruntime-gpu`` package); CI has no GPU, so these run where one is lent.

TF32 is off in torch for the whole module (and, following torch's flag, in onnxruntime's
kernels), so both sides compute in float32; what differs is the order of the GPU's
reductions (cuBLAS / cuDNN algorithms). Tolerances: losses rel 1e-4; gradients rel 1e-4 with
an absolute floor of 1e-5 x the largest reference gradient; parameters after 10 steps rel 1e-4,
abs 1e-5; BatchNorm's running statistics likewise.
"""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
model_zoo = pytest.importorskip("model_zoo")

from test_ortmodule import _train  # noqa: E402

from gradgraph.torch import ORTModule, TorchOrtFactory  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="needs a CUDA device and onnxruntime-gpu (CUDAExecutionProvider)")

RTOL, ATOL = 1e-4, 1e-5
DEVICE = torch.device("cuda:0")


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _train_on_gpu(name: str, optimizer: str, steps: int = 10) -> None:
    wrapped = _train(name, steps, optimizer, device="cuda:0", rtol=RTOL, atol=ATOL, fallback="raise")
    engines = [e for e in wrapped._engines.values() if e is not None]
    assert engines and all(e.device == DEVICE for e in engines)
    providers = engines[0].runner.forward.get_providers()
    assert providers[0] == "CUDAExecutionProvider", providers


@pytest.mark.parametrize("name,optimizer", [("mlp", "sgd"), ("cnn", "adamw"), ("bert", "adamw"),
                                            ("gpt2", "sgd")])
def test_ortmodule_trains_on_the_gpu_like_pytorch(name, optimizer):
    _train_on_gpu(name, optimizer)


def test_ortmodule_eval_and_a_new_sequence_length_on_the_gpu():
    ref, batch, _ = model_zoo.build("gpt2", "train_p0")
    ref.to(DEVICE).eval()
    mine = ORTModule(copy.deepcopy(ref), fallback="raise")
    for length in (batch[0].shape[1], batch[0].shape[1] // 2, batch[0].shape[1]):
        cut = tuple(t[:, :length].to(DEVICE) for t in batch)
        with torch.no_grad():
            want, got = ref(*cut), mine(*cut)
        assert got.device == DEVICE
        np.testing.assert_allclose(_np(got), _np(want), rtol=RTOL, atol=ATOL)
    assert len(mine._engines) == 2, "two sequence lengths, two graphs; the first one re-used"


def test_ortmodule_moves_between_cpu_and_gpu():
    ref, batch, _ = model_zoo.build("mlp", "train_p0")
    mine = ORTModule(copy.deepcopy(ref), fallback="raise")
    cpu_loss = mine(*batch)
    mine.to(DEVICE)
    gpu_loss = mine(*(t.to(DEVICE) for t in batch))
    assert gpu_loss.device == DEVICE
    np.testing.assert_allclose(gpu_loss.item(), cpu_loss.item(), rtol=RTOL)
    gpu_loss.backward()
    assert all(p.grad is not None and p.grad.device == DEVICE for p in mine.parameters())


def test_ortmodule_refuses_tensors_on_two_devices_with_their_names():
    ref, batch, _ = model_zoo.build("mlp", "train_p0")
    mine = ORTModule(ref.to(DEVICE), fallback="raise")
    with pytest.raises(RuntimeError, match="several devices.*input tensor 0 on cpu"):
        mine(*batch)  # the batch stayed on the CPU


def test_torch_ort_factory_on_cuda_tensors():
    from test_torch_factory import B1, W1, W2, _model, _torch

    order = ["mid_w2", "zeta_w1", "alpha_b1"]
    cls = TorchOrtFactory(_model(), order, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]).create_class()
    values = {"zeta_w1": W1, "alpha_b1": B1, "mid_w2": W2}
    rng = np.random.default_rng(3)
    x0 = torch.from_numpy(rng.standard_normal((5, 4)).astype(np.float32)).to(DEVICE)
    mine = {k: torch.tensor(v, device=DEVICE, requires_grad=True) for k, v in values.items()}
    ref = {k: torch.tensor(v, device=DEVICE, requires_grad=True) for k, v in values.items()}
    xa, xb = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    y, s = cls.apply(xa, *(mine[k] for k in order))
    assert y.device == DEVICE
    y_ref, s_ref = _torch(xb, ref["zeta_w1"], ref["alpha_b1"], ref["mid_w2"])
    gy = torch.from_numpy(rng.standard_normal((5, 3)).astype(np.float32)).to(DEVICE)
    ((y * gy).sum() + 0.5 * s).backward()
    ((y_ref * gy).sum() + 0.5 * s_ref).backward()
    for k in values:
        assert mine[k].grad.device == DEVICE
        np.testing.assert_allclose(_np(mine[k].grad), _np(ref[k].grad), rtol=RTOL, atol=ATOL, err_msg=k)
    np.testing.assert_allclose(_np(xa.grad), _np(xb.grad), rtol=RTOL, atol=ATOL)


def test_training_session_on_cuda_matches_the_cpu():
    """The bundled MLP example, 20 AdamW steps: CUDA (TF32 off) against the CPU session."""
    from pathlib import Path

    import gradgraph

    root = Path(__file__).resolve().parents[1] / "gradgraph" / "examples"
    data = np.load(root / "mlp_data.npz")
    names = list(data.keys())
    losses = {}
    for where, providers in (("cpu", ["CPUExecutionProvider"]),
                             ("cuda", [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"])):
        config = gradgraph.TrainingConfig(loss="loss", optimizer=gradgraph.AdamWConfig(weight_decay=0.01))
        session = gradgraph.TrainingSession(str(root / "mlp.onnx"), config, providers=providers)
        losses[where] = [session.train_step({n: data[n][k * 16:(k + 1) * 16] for n in names}, lr=1e-3)
                         for k in range(20)]
    assert np.all(np.isfinite(losses["cuda"]))
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=RTOL)


class _ConvBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x, labels):
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return torch.nn.functional.cross_entropy(self.head(h), labels)


def test_training_session_with_batch_norm_on_cuda_matches_the_cpu():
    """Training-mode BatchNormalization (decomposed for CUDA) trains as on the CPU: losses and
    running statistics after 10 SGD steps."""
    from _training_models import export_training

    import gradgraph

    torch.manual_seed(0)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 3, 6, 6)).astype(np.float32)
    labels = rng.integers(0, 5, 16).astype(np.int64)
    model = export_training(_ConvBN(), (torch.from_numpy(x), torch.from_numpy(labels)), ["x", "labels"])
    results = {}
    for where, providers in (("cpu", ["CPUExecutionProvider"]),
                             ("cuda", [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"])):
        config = gradgraph.TrainingConfig(loss="loss", optimizer=gradgraph.SGDConfig(momentum=0.9))
        session = gradgraph.TrainingSession(model, config, providers=providers)
        losses = [session.train_step({"x": x, "labels": labels}, lr=0.05) for _ in range(10)]
        results[where] = losses, session.eval_step({"x": x, "labels": labels})
    assert np.all(np.isfinite(results["cuda"][0]))
    np.testing.assert_allclose(results["cuda"][0], results["cpu"][0], rtol=RTOL)
    for name, value in results["cpu"][1].items():  # eval mode: the running statistics at work
        np.testing.assert_allclose(results["cuda"][1][name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_ortmodule_dropout_noise_is_drawn_on_the_gpu_and_reused_by_the_backward():
    probe = ORTModule(torch.nn.Dropout(0.3).train().to(DEVICE), fallback="raise")
    x = torch.randn(64, 64, device=DEVICE, requires_grad=True)
    probe(x)  # the build
    torch.manual_seed(3)
    y = probe(x)
    torch.manual_seed(3)
    torch.testing.assert_close(probe(x), y, rtol=0, atol=0)  # torch's seed repeats the noise
    assert y.device == DEVICE
    (grad,) = torch.autograd.grad(y.sum(), x)
    noise = torch.where(x != 0, y / x, 0.0)
    assert bool(((noise == 0) | torch.isclose(noise, torch.tensor(1 / 0.7, device=DEVICE), rtol=1e-6)).all())
    torch.testing.assert_close(grad, noise, rtol=1e-6, atol=0)
    assert abs(float((y == 0).float().mean()) - 0.3) < 0.05  # 4096 Bernoulli(0.3): sd 0.007
