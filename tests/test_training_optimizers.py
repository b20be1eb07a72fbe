"""Optimizer graphs against torch.optim (and a float64 NumPy LAMB) on an MLP, 20 steps."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from _training_models import MLP, assert_close_tensor, export_training, mlp_batches, run_torch

from gradgraph import TrainingConfig, TrainingSession, build_training_artifacts
from passes.optimizers import AdamConfig, AdamWConfig, LambConfig, ParamGroup, SGDConfig

STEPS = 20
LR = 0.05
CPU = ["CPUExecutionProvider"]

CASES = {
    "sgd-momentum": (SGDConfig(momentum=0.9, dampening=0.1, weight_decay=0.01),
                     lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov": (SGDConfig(momentum=0.8, nesterov=True),
                     lambda p: torch.optim.SGD(p, lr=LR, momentum=0.8, nesterov=True)),
    "sgd-plain": (SGDConfig(), lambda p: torch.optim.SGD(p, lr=LR)),
    "adam": (AdamConfig(weight_decay=0.1), lambda p: torch.optim.Adam(p, lr=LR, weight_decay=0.1)),
    "adamw": (AdamWConfig(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05),
              lambda p: torch.optim.AdamW(p, lr=LR, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
}


def _mlp(seed: int = 0, dropout: float = 0.0) -> tuple[MLP, bytes]:
    torch.manual_seed(seed)
    module = MLP(dropout=dropout)
    feeds = mlp_batches(1)[0]
    model = export_training(module, (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])),
                            ["x", "y"], seed=seed)
    return module, model


def _compare(session: TrainingSession, module: torch.nn.Module, ours: list[float], ref: list[float]) -> None:
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    state = session.get_model_state()["full_precision"]
    for name, p in module.named_parameters():
        assert_close_tensor(state[name], p.detach().numpy(), name)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("accumulate,clip", [(1, None), (3, 0.05)])
def test_matches_torch(case: str, accumulate: int, clip: float | None) -> None:
    config, make_opt = CASES[case]
    module, model = _mlp()
    session = TrainingSession(model, TrainingConfig("loss", config, accumulation_steps=accumulate,
                                                    max_grad_norm=clip), providers=CPU)
    batches = mlp_batches(STEPS * accumulate)
    ours = [session.train_step(f, lr=LR) for f in batches]
    ref = run_torch(module, make_opt(module.parameters()), batches, accumulate, clip)
    _compare(session, module, ours, ref)
    assert session.step == STEPS


def test_param_groups_match_torch_groups() -> None:
    module, model = _mlp()
    groups = (ParamGroup(("*.bias",), {"weight_decay": 0.0}, lr_scale=0.5),)
    session = TrainingSession(model, TrainingConfig("loss", AdamWConfig(weight_decay=0.2), groups=groups),
                              providers=CPU)
    batches = mlp_batches(STEPS)
    ours = [session.train_step(f, lr=LR) for f in batches]
    decay = [p for n, p in module.named_parameters() if not n.endswith(".bias")]
    no_decay = [p for n, p in module.named_parameters() if n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": LR * 0.5}],
                            lr=LR, weight_decay=0.2)
    _compare(session, module, ours, run_torch(module, opt, batches))


def _lamb_reference(module: MLP, batches: list[dict], cfg: LambConfig, accumulate: int,
                    clip: float | None) -> tuple[list[float], dict[str, np.ndarray]]:
    """float64 NumPy LAMB (the semantics documented in passes/optimizers/lamb.py)."""
    params = dict(module.named_parameters())
    master = {n: p.detach().numpy().astype(np.float64) for n, p in params.items()}
    m = {n: np.zeros_like(w) for n, w in master.items()}
    v = {n: np.zeros_like(w) for n, w in master.items()}
    losses = []
    for t, start in enumerate(range(0, len(batches), accumulate), 1):
        grads = {n: np.zeros_like(w) for n, w in master.items()}
        for feeds in batches[start:start + accumulate]:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(torch.from_numpy(master[n].astype(np.float32)))
            loss = module(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"]))
            module.zero_grad()
            loss.backward()
            losses.append(loss.item())
            for n, p in params.items():
                grads[n] += p.grad.numpy().astype(np.float64) / accumulate
        if clip is not None:
            norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
            grads = {n: g * min(1.0, clip / (norm + 1e-6)) for n, g in grads.items()}
        for n, g in grads.items():
            m[n] = cfg.beta1 * m[n] + (1 - cfg.beta1) * g
            v[n] = cfg.beta2 * v[n] + (1 - cfg.beta2) * g * g
            m_hat, v_hat = m[n] / (1 - cfg.beta1 ** t), v[n] / (1 - cfg.beta2 ** t)
            u = m_hat / (np.sqrt(v_hat) + cfg.eps) + cfg.weight_decay * master[n]
            w_norm, u_norm = np.linalg.norm(master[n]), np.linalg.norm(u)
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            master[n] = master[n] - LR * ratio * u
    return losses, master


@pytest.mark.parametrize("accumulate,clip", [(1, None), (2, 0.05)])
def test_lamb_matches_float64_reference(accumulate: int, clip: float | None) -> None:
    cfg = LambConfig(weight_decay=0.01)
    module, model = _mlp()
    session = TrainingSession(model, TrainingConfig("loss", cfg, accumulation_steps=accumulate,
                                                    max_grad_norm=clip), providers=CPU)
    batches = mlp_batches(STEPS * accumulate)
    ours = [session.train_step(f, lr=LR) for f in batches]
    ref_losses, ref_weights = _lamb_reference(module, batches, cfg, accumulate, clip)
    np.testing.assert_allclose(ours, ref_losses, rtol=1e-5)
    state = session.get_model_state()["full_precision"]
    for name, w in ref_weights.items():
        assert_close_tensor(state[name], w, name)


def test_frozen_weights_unchanged() -> None:
    module, model = _mlp()
    session = TrainingSession(model, TrainingConfig("loss", AdamWConfig(),
                                                    weights_not_to_train=("fc1.weight", "fc1.bias")),
                              providers=CPU)
    before = session.get_model_state()["full_precision"]
    for f in mlp_batches(5):
        session.train_step(f, lr=LR)
    after = session.get_model_state()["full_precision"]
    assert np.array_equal(before["fc1.weight"], after["fc1.weight"])
    assert np.array_equal(before["fc1.bias"], after["fc1.bias"])
    assert not np.array_equal(before["fc2.weight"], after["fc2.weight"])
    assert "fc1.weight" not in session.get_optimizer_state()


def test_training_graphs_are_standard_onnx() -> None:
    _, model = _mlp()
    art = build_training_artifacts(model, TrainingConfig("loss", AdamWConfig(), accumulation_steps=2,
                                                         max_grad_norm=1.0))
    for proto in (art.train, art.accumulate, art.eval):
        onnx.checker.check_model(proto, full_check=True)
        assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}


def test_dropout_is_real_in_training_and_off_in_eval() -> None:
    _, model = _mlp(dropout=0.5)
    _, plain = _mlp(dropout=0.0)
    feeds = mlp_batches(1)[0]
    drop = TrainingSession(model, TrainingConfig("loss", SGDConfig()), providers=CPU)
    nodrop = TrainingSession(plain, TrainingConfig("loss", SGDConfig()), providers=CPU)
    # lr 0: the weights stay put, only dropout changes the loss
    train_drop = [drop.train_step(feeds, lr=0.0) for _ in range(3)]
    train_plain = nodrop.train_step(feeds, lr=0.0)
    assert all(abs(loss - train_plain) > 1e-6 for loss in train_drop)
    assert len(set(train_drop)) > 1
    evals = [float(drop.eval_step(feeds)["loss"]) for _ in range(3)]
    assert evals == [evals[0]] * 3
    assert evals[0] == pytest.approx(float(nodrop.eval_step(feeds)["loss"]), rel=1e-6)


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="onnxruntime has no CUDAExecutionProvider here")
def test_cuda_matches_cpu() -> None:
    _, model = _mlp()
    config = TrainingConfig("loss", AdamWConfig(), accumulation_steps=2, max_grad_norm=1.0)
    cpu = TrainingSession(model, config, providers=CPU)
    cuda = TrainingSession(model, config, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert cuda.store.device == "cuda"
    batches = mlp_batches(10)
    np.testing.assert_allclose([cuda.train_step(f, lr=LR) for f in batches],
                               [cpu.train_step(f, lr=LR) for f in batches], rtol=1e-5)
    for name, value in cpu.get_state().items():
        assert_close_tensor(cuda.get_state()[name], value, name)
