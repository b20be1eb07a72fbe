"""Shared fixtures of the training tests: small torch models exported for training, and the
references they are compared with: torch.optim, and a float64 NumPy LAMB."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import numpy as np
import onnx
import torch

from passes.optimizer import AdamConfig, AdamWConfig, LambConfig, ParamGroup, SGDConfig, resolve

RTOL = 1e-5
PERTURB = 0.01
# One configuration of each optimizer's every option that changes its update (momentum,
# dampening, Nesterov, weight decay coupled or decoupled, betas, eps, HF's decay order, LAMB's
# trust-ratio bound): the fused-update tests and the update-proof tests run over these.
OPTIMIZER_CASES = {
    "sgd": SGDConfig(momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov": SGDConfig(momentum=0.8, nesterov=True),
    "adam": AdamConfig(weight_decay=0.1),
    "adamw": AdamWConfig(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05),
    "adamw-hf": AdamWConfig(weight_decay=0.05, decay_after_update=True),
    "lamb": LambConfig(weight_decay=0.01, ratio_max=5.0),
}


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


def torch_param_groups(module: torch.nn.Module, groups: tuple[ParamGroup, ...], lr: float) -> list[dict]:
    """torch.optim param groups mirroring gradgraph's ``groups`` (first match wins; override
    names are torch's, e.g. ``weight_decay``). Parameters with ``requires_grad=False`` are left out."""
    buckets: list[list[torch.nn.Parameter]] = [[] for _ in range(len(groups) + 1)]
    for name, p in module.named_parameters():
        if p.requires_grad:
            buckets[next((i for i, g in enumerate(groups) if g.matches(name)), len(groups))].append(p)
    out = [{"params": ps, **dict(g.overrides), "lr": lr * g.lr_scale} for g, ps in zip(groups, buckets)]
    return [g for g in out + [{"params": buckets[-1]}] if g["params"]]


def torch_optimizer(cfg: Any, params: Any, lr: float) -> torch.optim.Optimizer:
    """The torch.optim optimizer with gradgraph config ``cfg``'s hyper-parameters."""
    if isinstance(cfg, SGDConfig):
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, dampening=cfg.dampening,
                               nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if isinstance(cfg, AdamWConfig) else torch.optim.Adam
    return cls(params, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def lamb_reference(module: torch.nn.Module, batches: list[dict], cfg: LambConfig, lr: float,
                   accumulate: int = 1, clip: float | None = None,
                   groups: tuple[ParamGroup, ...] = ()) -> tuple[list[float], dict[str, np.ndarray]]:
    """float64 LAMB with the semantics documented in passes/optimizers/lamb.py: gradients by torch
    autograd on a float64 copy of ``module``, mean over micro-batches, clipping and the update in
    NumPy float64. Parameters with ``requires_grad=False`` stay frozen. Returns the losses and
    the copy's final ``state_dict`` (running statistics included)."""
    ref = copy.deepcopy(module).double()
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    m = {n: np.zeros(p.shape) for n, p in params.items()}
    v = {n: np.zeros(p.shape) for n, p in params.items()}
    losses = []
    for t, start in enumerate(range(0, len(batches), accumulate), 1):
        ref.zero_grad(set_to_none=False)
        for feeds in batches[start:start + accumulate]:
            loss = ref(*[torch.from_numpy(x).double() if x.dtype.kind == "f" else torch.from_numpy(x)
                         for x in feeds.values()])
            (loss / accumulate).backward()
            losses.append(loss.item())
        grads = {n: p.grad.numpy().copy() for n, p in params.items()}
        if clip is not None:
            norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
            grads = {n: g * min(1.0, clip / (norm + 1e-6)) for n, g in grads.items()}
        for n, g in grads.items():
            c, lr_scale = resolve(cfg, groups, n)
            w = params[n].detach().numpy()
            m[n] = c.beta1 * m[n] + (1 - c.beta1) * g
            v[n] = c.beta2 * v[n] + (1 - c.beta2) * g * g
            m_hat, v_hat = m[n], v[n]
            if c.bias_correction:
                m_hat, v_hat = m_hat / (1 - c.beta1 ** t), v_hat / (1 - c.beta2 ** t)
            u = m_hat / (np.sqrt(v_hat) + c.eps) + c.weight_decay * w
            w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(u)
            ratio = np.clip(w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0, c.ratio_min, c.ratio_max)
            with torch.no_grad():
                params[n].copy_(torch.from_numpy(w - lr * lr_scale * ratio * u))
    return losses, {n: t.detach().numpy() for n, t in ref.state_dict().items()}


def reference_training(module: torch.nn.Module, cfg: Any, batches: list[dict], lr: float,
                       accumulate: int = 1, clip: float | None = None,
                       groups: tuple[ParamGroup, ...] = ()) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same training as a gradgraph session with ``cfg``: torch.optim (float32) for SGD and
    Adam(W), the float64 NumPy reference for LAMB. Returns the losses and the final state_dict."""
    if isinstance(cfg, LambConfig):
        return lamb_reference(module, batches, cfg, lr, accumulate, clip, groups)
    opt = torch_optimizer(cfg, torch_param_groups(module, groups, lr), lr)
    losses = run_torch(module, opt, batches, accumulate, clip)
    return losses, {n: t.detach().numpy() for n, t in module.state_dict().items()}
