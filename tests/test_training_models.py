"""Real models against torch.optim for 20 steps: a small CNN with BatchNorm and a tiny BERT."""

from __future__ import annotations

import fnmatch

import numpy as np
import pytest
import torch
from _training_models import assert_close_tensor, export_training, run_torch

from gradgraph import TrainingConfig, TrainingSession
from passes.autodiff import lookup
from passes.optimizers import AdamWConfig, LambConfig, ParamGroup, SGDConfig

STEPS = 20
LR = 0.01
CPU = ["CPUExecutionProvider"]


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.pool = torch.nn.MaxPool2d(2)
        self.head = torch.nn.Linear(6 * 4 * 4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.bn(self.conv(x))))
        return torch.nn.functional.cross_entropy(self.head(h.flatten(1)), y)


def _cnn_batches(n: int, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32),
             "y": rng.integers(0, 5, 4).astype(np.int64)} for _ in range(n)]


def _check(session: TrainingSession, module: torch.nn.Module, ours: list[float], ref: list[float]) -> None:
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    state = session.get_model_state()["full_precision"]
    for name, p in module.named_parameters():
        assert_close_tensor(state[name], p.detach().numpy(), name)


@pytest.mark.skipif(lookup("", "Conv", 17) is None, reason="no Conv gradient rule registered yet")
@pytest.mark.parametrize("accumulate,clip", [(1, None), (2, 0.5)])
def test_cnn_batchnorm_sgd_momentum(accumulate: int, clip: float | None) -> None:
    torch.manual_seed(0)
    module = SmallCNN()
    first = _cnn_batches(1)[0]
    model = export_training(module, (torch.from_numpy(first["x"]), torch.from_numpy(first["y"])), ["x", "y"])
    session = TrainingSession(model, TrainingConfig("loss", SGDConfig(momentum=0.9, weight_decay=1e-3),
                                                    accumulation_steps=accumulate, max_grad_norm=clip),
                              providers=CPU)
    assert set(session.artifacts.buffers) == {"bn.running_mean", "bn.running_var"}
    batches = _cnn_batches(STEPS * accumulate)
    ours = [session.train_step(f, lr=LR) for f in batches]
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
    _check(session, module, ours, run_torch(module, opt, batches, accumulate, clip))
    # Running statistics are updated by the training graph (torch uses the unbiased variance,
    # ONNX the biased one, so only the mean is compared tightly).
    state = session.get_model_state()["full_precision"]
    assert_close_tensor(state["bn.running_mean"], module.bn.running_mean.numpy(), "running_mean")
    np.testing.assert_allclose(state["bn.running_var"], module.bn.running_var.numpy(), rtol=0.1)
    # eval: BatchNorm in inference mode, deterministic
    evals = [session.eval_step(batches[0])["loss"] for _ in range(2)]
    assert evals[0] == evals[1]


def _tiny_bert() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=48, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(config)

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    return WithLoss()


def _bert_batches(n: int, seed: int = 5) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mask = np.ones((2, 8), np.int64)
        mask[1, 6:] = 0
        # ids from 1: torch's Embedding(padding_idx=0) gives row 0 no gradient, the ONNX
        # export (a plain Gather) does
        out.append({"input_ids": rng.integers(1, 64, (2, 8)).astype(np.int64), "attention_mask": mask,
                    "labels": rng.integers(0, 3, 2).astype(np.int64)})
    return out


# Adam normalises each gradient element by its own magnitude, so elements whose gradient is
# float noise (e.g. attention key biases, whose exact gradient is 0) turn rounding differences
# into lr-sized steps. A larger eps keeps the comparison about the graph, not that noise.
ADAM_EPS = 1e-4
NO_DECAY = ("*.bias", "*LayerNorm*")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "lamb"])
def test_tiny_bert(optimizer: str) -> None:
    module = _tiny_bert()
    module.train()
    first = _bert_batches(1)[0]
    model = export_training(module, tuple(torch.from_numpy(v) for v in first.values()), list(first))
    params = dict(module.named_parameters())
    no_decay = [p for n, p in params.items() if any(fnmatch.fnmatch(n, pat) for pat in NO_DECAY)]
    decay = [p for p in params.values() if all(p is not q for q in no_decay)]
    if optimizer == "sgd":
        cfg = SGDConfig(momentum=0.9, weight_decay=0.01)
        opt = torch.optim.SGD([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=LR,
                              momentum=0.9, weight_decay=0.01)
    else:
        cfg = AdamWConfig(weight_decay=0.01, eps=ADAM_EPS) if optimizer == "adamw" else LambConfig()
        opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=LR,
                                weight_decay=0.01, eps=ADAM_EPS)
    groups = (ParamGroup(NO_DECAY, {"weight_decay": 0.0}),)
    config = TrainingConfig("loss", cfg, groups=groups, accumulation_steps=2, max_grad_norm=1.0)
    session = TrainingSession(model, config, providers=CPU)
    initial = session.get_model_state()["full_precision"]
    for name, p in params.items():
        np.testing.assert_array_equal(initial[name], p.detach().numpy(), err_msg=name)
    batches = _bert_batches(STEPS * 2) if optimizer != "lamb" else _bert_batches(2) * STEPS
    ours = [session.train_step(f, lr=LR) for f in batches]
    assert np.all(np.isfinite(ours))
    if optimizer == "lamb":  # fits two repeated batches
        assert np.mean(ours[-4:]) < 0.95 * np.mean(ours[:4])
        return  # LAMB's numerics are checked against the float64 reference on the MLP
    ref = run_torch(module, opt, batches, accumulate=2, clip=1.0)
    _check(session, module, ours, ref)
