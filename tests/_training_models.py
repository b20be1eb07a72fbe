"""Shared fixtures of the training tests: small torch models exported for training, and the
comparison loop against torch.optim."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import torch

RTOL = 1e-5
PERTURB = 0.01


def export_training(module: torch.nn.Module, args: tuple, input_names: list[str],
                    seed: int = 0) -> bytes:
    """Perturb the parameters (so equal initializers are not merged), export in training mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * PERTURB)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, input_names=input_names,
                          output_names=["loss"], opset_version=17)
    # Tracing in training mode updates BatchNorm statistics: take what the model holds.
    held = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load_from_string(f.getvalue()).graph.initializer}
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if name in held and tuple(held[name].shape) == tuple(tensor.shape):
                tensor.copy_(torch.from_numpy(held[name].copy()))
    return f.getvalue()


class MLP(torch.nn.Module):
    def __init__(self, n_in: int = 6, hidden: int = 16, n_out: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(n_in, hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.fc2(self.drop(torch.tanh(self.fc1(x))))
        return torch.nn.functional.cross_entropy(logits, y)


def mlp_batches(steps: int, batch: int = 8, n_in: int = 6, n_out: int = 4, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((batch, n_in)).astype(np.float32),
             "y": rng.integers(0, n_out, batch).astype(np.int64)} for _ in range(steps)]


def assert_close_tensor(ours: np.ndarray, ref: np.ndarray, name: str, rtol: float = RTOL) -> None:
    """Elementwise within ``rtol`` of the tensor's largest magnitude."""
    scale = max(float(np.abs(ref).max()), 1e-12)
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=rtol * scale, err_msg=name)


def run_torch(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict],
              accumulate: int = 1, clip: float | None = None) -> list[float]:
    """torch reference: mean of micro-batch gradients, optional global norm clipping."""
    losses = []
    for start in range(0, len(batches), accumulate):
        for feeds in batches[start:start + accumulate]:
            loss = module(*[torch.from_numpy(v) for v in feeds.values()])
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses
