"""Models nobody here wrote, exported the way users export them (issue 7, "Done when").

Every model is a ``nn.Module`` whose ``forward(*batch)`` returns a scalar loss, built from a
config with a fixed seed (random init, no downloads, dropout 0). Parameters are NOT perturbed:
the exports keep what a user's export holds (all-ones norm weights, zero biases), so the
exporter's merges and folds show up as they do for users.

Models (``MODELS``):
    ``llama``     -- transformers LlamaForCausalLM, tiny: rotary embeddings, grouped-query
                     attention (4 heads, 2 kv heads), RMSNorm, SiLU MLP; causal-LM loss.
    ``albert``    -- transformers AlbertForMaskedLM, tiny: one layer group shared by 2 layers,
                     factorized embeddings, tied decoder; masked-LM loss (ignore_index -100).
    ``mobilenet`` -- depthwise-separable CNN: Conv2d(groups=C) + BatchNorm2d + ReLU6, zero
                     padding, global average pool, Linear, cross-entropy; in eval mode.
    ``mobilenet_train`` -- the same module in train mode (BatchNorm uses batch statistics).
    ``mha``       -- nn.Embedding(padding_idx=0) + learned positions + nn.MultiheadAttention
                     (batch_first) with a float -inf causal mask + LayerNorm + GELU MLP + head;
                     the batch holds padding tokens, so torch gives the padding row no gradient.

Ways (``WAYS``):
    ``dynamo``       -- ``torch.onnx.export(m, args, path)`` as the docs show (optimize=True).
    ``dynamo_noopt`` -- the same with ``optimize=False``.
    ``legacy``       -- ``dynamo=False``; eval mode with the defaults (constant folding on);
                        train mode with ``training=TRAINING, do_constant_folding=False``.
Only ``input_names`` and ``output_names=["loss"]`` are added to what a user writes.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 4321
MODELS = ["llama", "albert", "mobilenet", "mobilenet_train", "mha"]
WAYS = ["dynamo", "dynamo_noopt", "legacy"]
LOSS = "loss"
VOCAB = 64
BATCH, SEQ = 2, 8
PAD = 0  # padding_idx of the mha model's embedding


def _gen(offset: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


# ---- models -------------------------------------------------------------------------------


class CausalLMLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        # attention_mask explicit: with None, transformers 5.x runs a packed-sequence check
        # (torch.diff) that the legacy exporter cannot export.
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            return_dict=True).logits
        shift = logits[:, :-1, :]
        return F.cross_entropy(shift.reshape(-1, shift.shape[-1]), labels[:, 1:].reshape(-1))


class MLMLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6())


class DepthwiseSeparable(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.dw = _conv_bn(cin, cin, 3, stride, groups=cin)
        self.pw = _conv_bn(cin, cout, 1, 1)

    def forward(self, x):
        return self.pw(self.dw(x))


class MobileNetLoss(nn.Module):
    """MobileNet-v1 style: stem conv, depthwise-separable blocks, global average pool, Linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = _conv_bn(3, 8, 3, 2)
        self.blocks = nn.Sequential(DepthwiseSeparable(8, 16, 1), DepthwiseSeparable(16, 32, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, classes)

    def forward(self, images, labels):
        h = self.pool(self.blocks(self.stem(images)))
        return F.cross_entropy(self.fc(torch.flatten(h, 1)), labels)


class MHABlockLoss(nn.Module):
    """Pre-LN decoder block with nn.MultiheadAttention and a causal -inf mask; next-token loss."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, max_len: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, dim))
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        t = input_ids.shape[1]
        h = self.embed(input_ids) + self.pos[:t]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.ln1(h)
        a, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        h = h + a
        h = h + self.mlp(self.ln2(h))
        logits = self.head(self.ln_f(h))[:, :-1, :]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


# ---- builders -----------------------------------------------------------------------------


def _tokens(low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, (BATCH, SEQ), generator=_gen(), dtype=torch.int64)


def _build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attention_dropout=0.0, tie_word_embeddings=False, use_cache=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    ids = _tokens(low=3)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    return CausalLMLoss(LlamaForCausalLM(cfg)), (ids, mask, ids.clone()), [
        "input_ids", "attention_mask", "labels"]


def _build_albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                       num_hidden_groups=1, num_attention_heads=4, intermediate_size=64,
                       max_position_embeddings=32, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                       pad_token_id=0, bos_token_id=2, eos_token_id=3, attn_implementation="eager")
    ids = _tokens(low=4)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, -2:] = 0  # some padding, so the attention mask matters
    labels = torch.full((BATCH, SEQ), -100, dtype=torch.int64)
    labels[:, 1::3] = ids[:, 1::3]
    return MLMLoss(AlbertForMaskedLM(cfg)), (ids, mask, labels), ["input_ids", "attention_mask", "labels"]


def _build_mobilenet():
    g = _gen(2)
    x = torch.randn(4, 3, 16, 16, generator=g)
    x[:, :, :5, :] = 0.0  # letterboxed images: zero bands, so that (in eval mode, with BN beta 0
    x[:, :, :, :3] = 0.0  # and running mean 0) many ReLU6 inputs sit exactly at the kink 0
    y = torch.randint(0, 10, (4,), generator=g)
    module = MobileNetLoss()
    with torch.no_grad():  # non-trivial running variance; running mean 0 as in a fresh model
        for mod in module.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_var.copy_(1.0 + 0.2 * torch.rand(mod.running_var.shape, generator=g))
    return module, (x, y), ["images", "labels"]


def _build_mha():
    ids = _tokens()
    ids[0, 2] = ids[1, 5] = ids[1, 6] = PAD  # the padding row is looked up
    return MHABlockLoss(), (ids, ids.clone()), ["input_ids", "labels"]


_BUILDERS = {"llama": _build_llama, "albert": _build_albert, "mobilenet": _build_mobilenet,
             "mobilenet_train": _build_mobilenet, "mha": _build_mha}
TRAIN_MODE = frozenset({"mobilenet_train"})


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]:
    """(module, batch, input names): the same weights and batch on every call."""
    torch.manual_seed(SEED)
    module, batch, names = _BUILDERS[name]()
    module.train(name in TRAIN_MODE)
    return module, batch, names


# ---- export -------------------------------------------------------------------------------


def export(name: str, how: str, path: str | os.PathLike) -> str:
    """Export model ``name`` the way ``how`` (one of ``WAYS``) to ``path``; returns ``path``.

    dynamo exports are saved the way ``torch.onnx.export(m, args, path)`` saves them: the
    weights go to ``<path>.data`` (external data, the default). Warnings and exporter chatter
    are swallowed.
    """
    module, batch, names = build(name)
    path = str(path)
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        if how in ("dynamo", "dynamo_noopt"):
            torch.onnx.export(module, batch, path, input_names=names, output_names=[LOSS],
                              optimize=how == "dynamo")
        elif how == "legacy":
            train = name in TRAIN_MODE
            torch.onnx.export(module, batch, path, input_names=names, output_names=[LOSS],
                              dynamo=False, do_constant_folding=not train,
                              training=torch.onnx.TrainingMode.TRAINING if train
                              else torch.onnx.TrainingMode.EVAL)
        else:
            raise ValueError(f"how must be one of {WAYS}, not {how!r}")
    return path


class ExportCache:
    """Each (model, way) exported once per pytest session; a failed export re-raises its error."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.done: dict[tuple[str, str], str | BaseException] = {}

    def get(self, name: str, how: str) -> str:
        key = (name, how)
        if key not in self.done:
            try:
                self.done[key] = export(name, how, self.root / f"{name}-{how}.onnx")
            except Exception as exc:  # noqa: BLE001 - re-raised by every user of the export
                self.done[key] = exc
        result = self.done[key]
        if isinstance(result, BaseException):
            raise result
        return result


# ---- torch references ---------------------------------------------------------------------


def torch_loss_and_grads(module: nn.Module, batch) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, {param: grad}) of one forward/backward; parameters without a grad are left out."""
    for p in module.parameters():
        p.grad = None
    loss = module(*batch)
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in module.named_parameters()
             if p.grad is not None}
    return float(loss.detach()), grads


def torch_grads(module: nn.Module, batch) -> dict[str, np.ndarray]:
    """{parameter name: gradient} from torch autograd (parameters with no grad left out).

    Tied parameters appear once, under the first name ``named_parameters`` gives them.
    A train-mode module's BatchNorm running statistics are updated, as in training.
    """
    return torch_loss_and_grads(module, batch)[1]


def reaching_params(module: nn.Module, batch) -> set[str]:
    """Names of the parameters on the loss path (autograd gives them a gradient)."""
    return set(torch_grads(module, batch))


def param_aliases(module: nn.Module) -> dict[str, str]:
    """Every name of every parameter -> the name ``named_parameters()`` reports (tied weights).

    ALBERT's decoder is tied to the word embeddings: torch reports
    ``model.albert.embeddings.word_embeddings.weight``, dynamo exports name the one initializer
    after the last alias, ``model.predictions.decoder.weight``.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases[name] = first.setdefault(id(p), name)
    return aliases


def parameter_values(module: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


def buffer_values(module: nn.Module) -> dict[str, np.ndarray]:
    return {n: b.detach().numpy().copy() for n, b in module.named_buffers()}


def batch_feeds(name: str) -> dict[str, np.ndarray]:
    _, batch, names = build(name)
    return {n: t.numpy() for n, t in zip(names, batch)}


__all__ = ["BATCH", "LOSS", "MODELS", "PAD", "SEQ", "TRAIN_MODE", "WAYS", "ExportCache",
           "batch_feeds", "buffer_values", "build", "export", "param_aliases", "parameter_values",
           "reaching_params", "torch_grads", "torch_loss_and_grads"]
