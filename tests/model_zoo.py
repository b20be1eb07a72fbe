"""Tiny real models for gradient-correctness tests against torch autograd.

Every model is a ``nn.Module`` whose ``forward(*batch)`` returns a scalar loss, built with
a fixed seed from a config (random init, no hub downloads). ``export`` writes it to ONNX
with one of the two torch exporters and returns the ONNX initializer -> torch parameter map.

Modes:
    ``eval``      -- ``model.eval()`` (dropout off, BatchNorm uses running statistics).
    ``train_p0``  -- ``model.train()`` with every dropout probability 0 (BatchNorm uses batch
                     statistics, Dropout nodes stay in the graph in training mode).

Exporter traps handled here (torch 2.13, onnxscript 0.7.2):
    * dynamo: ``optimize=True`` (default) folds parameters into derived constants (Transpose(W)
      -> ``val_N``), drops zero biases and merges equal-valued initializers, so the export uses
      ``optimize=False``. Its torchlib writes BatchNorm in inference mode even in train mode;
      a custom translation keeps ``training_mode=1`` (see /work/shared/peer/export_models.py).
    * legacy: ``training=TrainingMode.TRAINING`` and ``do_constant_folding=False`` in train mode.
      In eval mode constant folding stays on (its default) for the transformers and the MLP, so
      parameters may appear transposed under ``onnx::MatMul_N`` names (the map finds them by
      value). For the CNN and the LSTM it is off: there folding derives new constants from
      several parameters (Conv+BatchNorm fusion; LSTM gate reordering and bias concatenation),
      which no parameter map can undo.
    * every parameter is perturbed with small noise before export, so that no two parameters are
      bit-identical (zero biases, LayerNorm ones) and the value-based map is unambiguous.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import numpy_helper

SEED = 1234
MODELS = ["mlp", "bert", "gpt2", "distilbert", "roberta", "t5", "vit", "cnn", "lstm"]
EXPORTERS = ["dynamo", "legacy"]
MODES = ["eval", "train_p0"]
LOSS = "loss"
VOCAB = 128
BATCH, SEQ = 2, 8


def _gen(offset: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


def _p(mode: str) -> float:
    """Dropout probability: 0 in train mode (deterministic), 0.1 in eval mode (inactive)."""
    return 0.0 if mode == "train_p0" else 0.1


# ---- models -------------------------------------------------------------------------------


class MLPLoss(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 5)
        self.drop = nn.Dropout(_p(mode))

    def forward(self, x, labels):
        h = self.drop(F.relu(self.fc1(x)))
        h = F.gelu(self.fc2(h))
        return F.cross_entropy(self.fc3(h), labels)


class MLMLoss(nn.Module):
    """Masked-LM cross-entropy (ignore_index=-100) on top of a transformers *ForMaskedLM."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


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


class Seq2SeqLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids, labels):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            decoder_input_ids=decoder_input_ids, use_cache=False,
                            return_dict=True).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class ImageClsLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        logits = self.model(pixel_values=pixel_values, return_dict=True).logits
        return F.cross_entropy(logits, labels)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


class ResNetLoss(nn.Module):
    """Conv+BN+ReLU+MaxPool stem, two residual blocks, global average pool, Linear head."""

    def __init__(self, mode: str):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, images, labels):
        h = self.layer2(self.layer1(self.stem(images)))
        return F.cross_entropy(self.fc(torch.flatten(self.pool(h), 1)), labels)


class LSTMLMLoss(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True, dropout=_p(mode))
        self.head = nn.Linear(24, VOCAB)

    def forward(self, input_ids, labels):
        h, _ = self.lstm(self.emb(input_ids))
        logits = self.head(h)[:, :-1, :]
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def _tokens(low: int = 0):
    g = _gen()
    return torch.randint(low, VOCAB, (BATCH, SEQ), generator=g, dtype=torch.int64)


def _mlm_batch(low: int = 0):
    ids = _tokens(low)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, -2:] = 0  # some padding, so the attention mask matters
    labels = torch.full((BATCH, SEQ), -100, dtype=torch.int64)
    labels[:, 1::3] = ids[:, 1::3]
    return (ids, mask, labels), ["input_ids", "attention_mask", "labels"]


def _build_mlp(mode):
    g = _gen()
    x = torch.randn(4, 16, generator=g)
    y = torch.randint(0, 5, (4,), generator=g)
    return MLPLoss(mode), (x, y), ["x", "labels"]


def _build_bert(mode):
    from transformers import BertConfig, BertForMaskedLM

    p = _p(mode)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=p,
                     attention_probs_dropout_prob=p, attn_implementation="eager")
    batch, names = _mlm_batch()
    return MLMLoss(BertForMaskedLM(cfg)), batch, names


def _build_distilbert(mode):
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    p = _p(mode)
    cfg = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                           max_position_embeddings=16, dropout=p, attention_dropout=p,
                           attn_implementation="eager")
    batch, names = _mlm_batch()
    return MLMLoss(DistilBertForMaskedLM(cfg)), batch, names


def _build_roberta(mode):
    from transformers import RobertaConfig, RobertaForMaskedLM

    p = _p(mode)
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ + 4, hidden_dropout_prob=p,
                        attention_probs_dropout_prob=p, attn_implementation="eager")
    batch, names = _mlm_batch(low=3)  # no padding_idx (1) among the tokens
    return MLMLoss(RobertaForMaskedLM(cfg)), batch, names


def _build_gpt2(mode):
    from transformers import GPT2Config, GPT2LMHeadModel

    p = _p(mode)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0,
                     use_cache=False, attn_implementation="eager")
    ids = _tokens()
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    return CausalLMLoss(GPT2LMHeadModel(cfg)), (ids, mask, ids.clone()), [
        "input_ids", "attention_mask", "labels"]


def _build_t5(mode):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, dropout_rate=_p(mode), use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
    g = _gen(2)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, -2:] = 0
    labels = torch.randint(1, VOCAB, (BATCH, 6), generator=g)
    dec = torch.cat([torch.zeros(BATCH, 1, dtype=torch.int64), labels[:, :-1]], dim=1)
    return Seq2SeqLoss(T5ForConditionalGeneration(cfg)), (ids, mask, dec, labels), [
        "input_ids", "attention_mask", "decoder_input_ids", "labels"]


def _build_vit(mode):
    from transformers import ViTConfig, ViTForImageClassification

    p = _p(mode)
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=p,
                    attention_probs_dropout_prob=p, num_labels=10, attn_implementation="eager")
    g = _gen()
    x = torch.randn(BATCH, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    return ImageClsLoss(ViTForImageClassification(cfg)), (x, y), ["pixel_values", "labels"]


def _build_cnn(mode):
    g = _gen()
    x = torch.randn(BATCH, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    return ResNetLoss(mode), (x, y), ["images", "labels"]


def _build_lstm(mode):
    ids = _tokens()
    return LSTMLMLoss(mode), (ids, ids.clone()), ["input_ids", "labels"]


_BUILDERS = {
    "mlp": _build_mlp, "bert": _build_bert, "gpt2": _build_gpt2, "distilbert": _build_distilbert,
    "roberta": _build_roberta, "t5": _build_t5, "vit": _build_vit, "cnn": _build_cnn,
    "lstm": _build_lstm,
}


def build(model_name: str, mode: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]:
    """(module, batch, input names): same seed, same perturbation, same batch on every call."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    torch.manual_seed(SEED)
    module, batch, names = _BUILDERS[model_name](mode)
    g = _gen(7)
    with torch.no_grad():
        for p in module.parameters():  # no two parameters bit-identical (zero biases, LN ones)
            p.add_(0.02 * torch.randn(p.shape, generator=g))
        for mod in module.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):  # non-trivial running stats
                mod.running_mean.copy_(0.1 * torch.randn(mod.running_mean.shape, generator=g))
                mod.running_var.copy_(1.0 + 0.2 * torch.rand(mod.running_var.shape, generator=g))
    module.train(mode == "train_p0")
    return module, batch, names


def torch_gradients(model_name: str, mode: str) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(loss, {param: grad}, {param: value}) from torch autograd on the model's fixed batch.

    Parameters that get no gradient (not on the loss path) are left out of the grad dict.
    """
    module, batch, _ = build(model_name, mode)
    values = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    loss = module(*batch)
    loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.numpy().copy() for n, p in module.named_parameters() if p.grad is not None}
    return float(loss), grads, values


def _bn_train_translation():
    """aten._native_batch_norm_legit_functional with training_mode=1: torchlib (onnxscript
    0.7.2) writes inference BatchNorm for a train-mode module; the front end's translation
    keeps batch statistics."""
    from gradgraph.torch.export import bn_train_translation

    return bn_train_translation()


# Legacy eval-mode constant folding would merge several parameters into derived constants.
_NO_FOLDING = frozenset({"cnn", "lstm"})


def _has_bn(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def _map_parameters(proto: onnx.ModelProto, values: dict[str, np.ndarray]) -> dict[str, str]:
    """ONNX initializer name -> torch parameter name, by name, else by (possibly transposed) value.

    Parameters are perturbed with random noise, so exact value equality identifies them; a
    parameter that an exporter stored transposed (legacy constant folding of Transpose(W)) is
    mapped too -- the comparison finds the orientation by value.
    """
    by_bytes: dict[tuple, str] = {}
    for name, v in values.items():
        by_bytes.setdefault((v.shape, v.tobytes()), name)
        if v.ndim == 2:
            t = np.ascontiguousarray(v.T)
            by_bytes.setdefault((t.shape, t.tobytes()), name)
    mapping: dict[str, str] = {}
    for init in proto.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        arr = numpy_helper.to_array(init)
        if init.name in values and np.array_equal(arr, values[init.name]):
            mapping[init.name] = init.name
            continue
        found = by_bytes.get((arr.shape, np.ascontiguousarray(arr).tobytes()))
        if found is not None:
            mapping[init.name] = found
    return mapping


def export(model_name: str, exporter: str, mode: str, path: str) -> tuple[str, str, dict[str, str]]:
    """Export ``model_name`` in ``mode`` with ``exporter`` to ``path``.

    Returns (path, loss output name, {ONNX initializer name: torch parameter name}).
    """
    module, batch, names = build(model_name, mode)
    values = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            table = _bn_train_translation() if mode == "train_p0" and _has_bn(module) else None
            program = torch.onnx.export(module, batch, None, input_names=names, output_names=[LOSS],
                                        dynamo=True, optimize=False, custom_translation_table=table)
            program.save(path, external_data=False)
        elif exporter == "legacy":
            training = (torch.onnx.TrainingMode.TRAINING if mode == "train_p0"
                        else torch.onnx.TrainingMode.EVAL)
            fold = mode == "eval" and model_name not in _NO_FOLDING
            torch.onnx.export(module, batch, path, input_names=names, output_names=[LOSS],
                              dynamo=False, training=training, do_constant_folding=fold)
        else:
            raise ValueError(f"exporter must be one of {EXPORTERS}, not {exporter!r}")
    proto = onnx.load(path)
    return path, LOSS, _map_parameters(proto, values)


def export_with_feeds(model_name: str, exporter: str, mode: str, path: str) -> dict[str, np.ndarray]:
    """Export as :func:`export` does and return the model's fixed batch as feeds by input name."""
    export(model_name, exporter, mode, path)
    _, batch, names = build(model_name, mode)
    return {n: t.numpy() for n, t in zip(names, batch)}
