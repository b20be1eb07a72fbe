"""Default dynamo exports (``torch.onnx.export(m, args, path)``, optimize=True) of FRESH-INIT
models: what onnxscript's optimizer folds at init (zero biases dropped, equal-valued parameters
merged, identical calls merged by CSE, ``x*1`` removed) is given back or refused by name
(issue 34 section 4, issue 35 section 1).

Oracle: torch autograd on the same module and batch, float32, rel 1e-4 (abs 1e-5 x the
tensor's largest magnitude). The trained set must be every torch parameter on the loss path,
under its torch name (tied aliases resolved).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
import export_zoo as zoo  # noqa: E402 - imports torch
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gradgraph  # noqa: E402
from gradgraph.cli.main import main as cli_main  # noqa: E402
from passes.exports.refusal import SHOWN  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
VOCAB, BATCH = 64, 2


# ---- helpers -------------------------------------------------------------------------------


def export_default(module: nn.Module, batch: tuple, names: list[str], path: Path) -> Path:
    """``torch.onnx.export(module, batch, path)`` as the docs show (optimize=True)."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, batch, str(path), input_names=names, output_names=["loss"])
    return path


def gradgraph_grads(path: Path, feeds: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, {trained weight: gradient}) of the default trained set, run in onnxruntime."""
    model = gradgraph.build_gradient_graph(str(path), loss="loss")
    outputs = [o.name for o in model.graph.output]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in model.graph.input}
    got = dict(zip(outputs, session.run(outputs, {k: v for k, v in feeds.items() if k in inputs})))
    grads = {o[: -len("_grad")]: got[o] for o in outputs if o.endswith("_grad")}
    return float(got["loss"]), grads


def close(got: np.ndarray, want: np.ndarray) -> str | None:
    if got.shape != want.shape:
        return f"shape {got.shape} != torch {want.shape}"
    atol = ATOL * max(1.0, float(np.abs(want).max(initial=0.0)))
    if np.allclose(got, want, rtol=RTOL, atol=atol):
        return None
    return f"max abs err {np.abs(got - want).max():.3g} (max |torch| {np.abs(want).max():.3g})"


def assert_trains_like_torch(module: nn.Module, batch: tuple, names: list[str], path: Path) -> dict[str, np.ndarray]:
    """Every torch parameter on the loss path is trained, under its torch name, with torch's
    gradient; returns gradgraph's gradients."""
    module.train()
    aliases = zoo.param_aliases(module)
    export_default(module, batch, names, path)
    torch_loss, want = zoo.torch_loss_and_grads(module, batch)
    loss, got = gradgraph_grads(path, {n: t.numpy() for n, t in zip(names, batch)})
    canonical = {aliases.get(n, n) for n in got}
    assert canonical == set(want), (
        f"trained but not a torch parameter: {sorted(canonical - set(want))}; "
        f"torch parameters on the loss path not trained: {sorted(set(want) - canonical)}")
    assert len(canonical) == len(got), f"a parameter trained under two names: {sorted(got)}"
    assert close(np.float32(loss), np.float32(torch_loss)) is None, (loss, torch_loss)
    failures = [f"{n}: {err}" for n, g in sorted(got.items()) if (err := close(g, want[aliases.get(n, n)]))]
    assert not failures, f"{len(failures)} of {len(got)} gradients differ from torch:\n" + "\n".join(failures)
    return got


class CausalLM(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).logits
        shift = logits[:, :-1, :]
        return F.cross_entropy(shift.reshape(-1, shift.shape[-1]), labels[:, 1:].reshape(-1))


class MaskedLM(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, token_type_ids, attention_mask, labels):
        logits = self.model(input_ids=input_ids, token_type_ids=token_type_ids,
                            attention_mask=attention_mask, return_dict=True).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


class Seq2Seq(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                          use_cache=False, return_dict=True).loss


class EncoderLM(nn.Module):
    """nn.TransformerEncoder (its layers are deep copies: equal at init) between an embedding
    and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.enc(self.emb(input_ids)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _ids(seq: int, low: int = 3) -> torch.Tensor:
    return torch.randint(low, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(7))


# Sizes: onnxscript folds a node whose inputs all are constants of at most 8192 elements. A
# position-embedding table of 512 x 32 is read whole at run time; a smaller one is folded to
# the rows read (refused: test_lookups_folded_to_the_rows_read_are_refused). T5's
# relative-position buckets (seq x seq) fold below 91 positions, hence its 96.
def _gpt2() -> tuple[nn.Module, tuple, list[str]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids(8)
    return CausalLM(GPT2LMHeadModel(cfg)), (ids, torch.ones_like(ids), ids.clone()), [
        "input_ids", "attention_mask", "labels"]


def _bert() -> tuple[nn.Module, tuple, list[str]]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=512, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    ids = _ids(8)
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]
    return MaskedLM(BertForMaskedLM(cfg)), (ids, types, torch.ones_like(ids), labels), [
        "input_ids", "token_type_ids", "attention_mask", "labels"]


def _t5() -> tuple[nn.Module, tuple, list[str]]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                   attn_implementation="eager")  # torch 2.13 cannot export T5's sdpa path
    ids = _ids(96)
    return Seq2Seq(T5ForConditionalGeneration(cfg)), (ids, torch.ones_like(ids), _ids(96, 1)), [
        "input_ids", "attention_mask", "labels"]


def _llama() -> tuple[nn.Module, tuple, list[str]]:
    module, batch, names = zoo.build("llama")
    return module, batch, names


def _encoder() -> tuple[nn.Module, tuple, list[str]]:
    ids = _ids(8, 0)
    return EncoderLM(), (ids, ids.clone()), ["input_ids", "labels"]


FRESH: dict[str, Callable[[], tuple[nn.Module, tuple, list[str]]]] = {
    "gpt2": _gpt2, "bert": _bert, "t5": _t5, "llama": _llama, "transformer_encoder": _encoder}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FRESH))
def test_fresh_default_export_trains_every_parameter(name: str, tmp_path: Path) -> None:
    if name != "transformer_encoder":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    module, batch, names = FRESH[name]()
    assert_trains_like_torch(module, batch, names, tmp_path / f"{name}.onnx")


# ---- merged calls (issue 35 section 1) -----------------------------------------------------


class ParallelBlock(nn.Module):
    """GPT-J / GPT-NeoX style: x + attn(ln_1(x)) + mlp(ln_2(x)). Fresh, ln_1 and ln_2 are equal
    (ones, zeros) and read the same x: onnxscript's CSE merges the two LayerNorm calls."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        return x + self.attn(h, h, h, need_weights=False)[0] + self.mlp(self.ln_2(x))


class ParallelLM(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.h = nn.ModuleList(ParallelBlock(dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def test_fresh_parallel_residual_block_gets_torch_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = ParallelLM()
    ids = _ids(8, 0)
    path = tmp_path / "parallel.onnx"
    got = assert_trains_like_torch(module, (ids, ids.clone()), ["input_ids", "labels"], path)
    # the merge happened in the export (else this test proves nothing) and was split back
    graph = onnx.load(str(path), load_external_data=False).graph
    norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
    assert len(norms) == 3, "the exporter no longer merges ln_1 and ln_2: the test needs a new model"
    assert {"h.0.ln_2.weight", "h.0.ln_2.bias", "h.1.ln_2.weight", "h.1.ln_2.bias"} <= set(got)


def test_merged_call_without_a_lost_module_stays_merged(tmp_path: Path) -> None:
    """One module applied twice to one input: the calls merge, and no torch parameter is lost,
    so nothing is split (the merged node's gradient is torch's: both uses of one parameter)."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x, y):
            return F.mse_loss(self.a(self.ln(x)) + self.b(self.ln(x)), y)

    torch.manual_seed(0)
    got = assert_trains_like_torch(Twice(), (torch.randn(8, 16), torch.randn(8, 4)), ["x", "y"],
                                   tmp_path / "twice.onnx")
    assert not any("@merged" in name for name in got)


# ---- zero biases (issue 34 section 4) ------------------------------------------------------


class ZeroBiasConvs(nn.Module):
    """Conv1d, grouped Conv2d, ConvTranspose2d (groups) and a 2-D Linear (Gemm), every bias
    zero as many initialisations leave them; onnxscript's RemoveOptionalBiasFrom* drop them."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.ct = nn.ConvTranspose2d(8, 6, 2, stride=2, groups=2)
        self.fc = nn.Linear(6, 3)
        for module in (self.c1, self.c2, self.ct, self.fc):
            nn.init.zeros_(module.bias)

    def forward(self, x, labels):
        h = torch.tanh(self.c1(x))  # [B, 8, 16]
        h = torch.tanh(self.c2(h.reshape(-1, 8, 4, 4)))
        h = torch.tanh(self.ct(h)).mean((2, 3))
        return F.cross_entropy(self.fc(h), labels)


def test_zero_biases_dropped_by_the_optimizer_are_trained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = ZeroBiasConvs()
    batch = (torch.randn(3, 4, 16), torch.tensor([0, 2, 1]))
    path = tmp_path / "convs.onnx"
    got = assert_trains_like_torch(module, batch, ["x", "labels"], path)
    graph = onnx.load(str(path), load_external_data=False).graph
    kept = {i.name for i in graph.initializer}
    assert not {"c1.bias", "c2.bias", "ct.bias", "fc.bias"} & kept, "the exporter kept a zero bias"
    assert {"c1.bias", "c2.bias", "ct.bias", "fc.bias"} <= set(got)
    rows = {r.name: r for r in gradgraph.list_weights(str(path))}
    assert rows["ct.bias"].trained and "RemoveOptionalBiasFromConvTranspose" in rows["ct.bias"].reason


def test_calls_merged_into_one_of_several_lost_modules_get_documented_names(tmp_path: Path) -> None:
    """Three LayerNorms of one input in modules no path tells apart: the two merged calls get
    their own parameters named '<survivor parameter>@merged:<call>' with a warning, and
    torch's gradients (each clone serves the consumers of its own call)."""

    class Fan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_a, self.ln_b, self.ln_c = nn.LayerNorm(16), nn.LayerNorm(16), nn.LayerNorm(16)
            self.fa, self.fb, self.fc = nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x, y):
            return F.mse_loss(self.fa(self.ln_a(x)) * self.fb(self.ln_b(x)) + self.fc(self.ln_c(x)), y)

    torch.manual_seed(0)
    module = Fan()
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    path = export_default(module, batch, ["x", "y"], tmp_path / "fan.onnx")
    with pytest.warns(UserWarning, match=r"merged torch call %layer_norm_1 .*ln_b.*ln_c.*optimize=False"):
        _, got = gradgraph_grads(path, {"x": batch[0].numpy(), "y": batch[1].numpy()})
    _, want = zoo.torch_loss_and_grads(module, batch)
    for call, owner in (("layer_norm_1", "ln_b"), ("layer_norm_2", "ln_c")):
        for leaf in ("weight", "bias"):
            name = f"ln_a.{leaf}@merged:{call}"
            assert close(got[name], want[f"{owner}.{leaf}"]) is None, name
    assert close(got["ln_a.weight"], want["ln_a.weight"]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = {r.name: r for r in gradgraph.list_weights(str(path))}
    assert "merged into %layer_norm" in rows["ln_a.bias@merged:layer_norm_2"].reason
    assert not rows["ln_b.weight"].trained and "no node reads it" in rows["ln_b.weight"].reason


# ---- refusals ------------------------------------------------------------------------------


class Tables(nn.Module):
    """Eight learned position tables read at positions the model makes itself (``t[:8]``):
    onnxscript folds each to the rows read, and the other rows are not in the file."""

    def __init__(self, count: int = 8) -> None:
        super().__init__()
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(32, 4)) for _ in range(count))
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        h = x
        for table in self.tables:
            h = h + table[: x.shape[1]]
        return F.mse_loss(self.fc(h), y)


def test_a_refusal_names_a_few_parameters_and_counts_the_rest(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    batch = (torch.randn(2, 8, 4), torch.randn(2, 8, 4))
    path = export_default(Tables(), batch, ["x", "y"], tmp_path / "tables.onnx")
    with pytest.raises(gradgraph.GradientError) as raised:
        gradgraph.build_gradient_graph(str(path), loss="loss")
    message = str(raised.value)
    names = [f"tables.{i}" for i in range(8)]
    assert sum(f"'{n}'" in message for n in names) == SHOWN, message
    assert f"and {8 - SHOWN} more" in message and "--list-weights" in message
    assert "optimize=False" in message and "as a model input" in message
    assert "other exporter" not in message
    assert sorted(raised.value.parameters) == names  # type: ignore[attr-defined]
    # the CLI prints it on one line and exits 2; --list-weights of the same command lists all
    np.savez(tmp_path / "d.npz", x=batch[0].numpy(), y=batch[1].numpy())
    train = ["train", str(path), "--loss", "loss", "--data", str(tmp_path / "d.npz"), "--steps", "1",
             "--batch-size", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    assert cli_main(train) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"and {8 - SHOWN} more" in err
    # --verbose adds one line with every name
    assert cli_main(train + ["--verbose"]) == 2
    verbose = capsys.readouterr().err.splitlines()
    assert len(verbose) == 2 and verbose[1].endswith(", ".join(raised.value.parameters))  # type: ignore[attr-defined]
    assert cli_main(train + ["--list-weights"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in names) and "not in the export" in out
    # the advice to hold them fixed is one train can follow: the rest trains
    assert "--freeze" in err
    assert cli_main(train + ["--freeze", *names, "--quiet"]) == 0, capsys.readouterr().err
    assert cli_main(train + ["--freeze", *names[:-1], "--quiet", "--overwrite"]) == 2
    assert f"'{names[-1]}'" in capsys.readouterr().err


def test_a_model_without_a_loss_is_told_to_compute_it_in_forward(tmp_path: Path, capsys) -> None:
    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    x = torch.randn(6, 4)
    path = tmp_path / "logits.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(), (x,), str(path), input_names=["x"], output_names=["logits"])
    np.savez(tmp_path / "d.npz", x=x.numpy())
    assert cli_main(["train", str(path), "--loss", "logits", "--data", str(tmp_path / "d.npz"),
                     "--steps", "1", "--batch-size", "2", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    first = min(err.index(hint) for hint in ("--reduce", "reduce it", "seed_from_input"))
    assert 0 <= err.find("compute the loss in the model's forward") < first, err
    assert cli_main(["grad", str(path), "--loss", "loss", "-o", str(tmp_path / "g.onnx")]) == 2
    assert "compute the loss in the model's forward" in capsys.readouterr().err


def test_a_parameter_removed_as_x_times_1_is_listed_not_in_the_export(tmp_path: Path) -> None:
    """onnxscript's no-op rule removes ``h * scale`` for a 0-d scale of 1.0 with its record;
    the file cannot tell it from an unused parameter, so --list-weights says both."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.tensor(1.0))
            self.unused = nn.Parameter(torch.randn(3))

        def forward(self, x, y):
            return F.mse_loss(self.fc(x) * self.scale, y)

    torch.manual_seed(0)
    path = export_default(Scaled(), (torch.randn(4, 4), torch.randn(4, 4)), ["x", "y"], tmp_path / "s.onnx")
    assert "scale" not in {i.name for i in onnx.load(str(path), load_external_data=False).graph.initializer}
    rows = {r.name: r for r in gradgraph.list_weights(str(path))}
    for name in ("scale", "unused"):
        assert not rows[name].trained and "x*1" in rows[name].reason and "optimize=False" in rows[name].reason
    assert rows["fc.weight"].trained and rows["fc.bias"].trained


def test_a_merged_call_reading_another_parameters_initializer_is_split(tmp_path: Path) -> None:
    """``gate`` (ones) is registered first, so the exporter keeps it for ln_1.weight too; the
    merged LayerNorm reads ``gate``: its parameters are still ln_1's by its torch call, and the
    vanished call's are ln_2's."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Parameter(torch.ones(16))
            self.ln_1, self.ln_2 = nn.LayerNorm(16), nn.LayerNorm(16)
            self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x, y):
            return F.mse_loss(self.a(self.ln_1(x) * self.gate) + self.b(self.ln_2(x)), y)

    torch.manual_seed(0)
    path = tmp_path / "gated.onnx"
    got = assert_trains_like_torch(Gated(), (torch.randn(8, 16), torch.randn(8, 4)), ["x", "y"], path)
    kept = {i.name for i in onnx.load(str(path), load_external_data=False).graph.initializer}
    assert "gate" in kept and not {"ln_1.weight", "ln_2.weight", "ln_2.bias"} & kept, sorted(kept)
    assert {"ln_1.weight", "ln_2.weight", "ln_2.bias"} <= set(got)


def test_a_node_reading_the_survivor_and_the_merged_call_gets_both_back(tmp_path: Path) -> None:
    """``ln_a(x) * ln_b(x)``: after the merge the Mul reads one value twice; its recorded
    call says the second input was ln_b's."""

    class Product(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_a, self.ln_b = nn.LayerNorm(16), nn.LayerNorm(16)
            self.fc = nn.Linear(16, 4)

        def forward(self, x, y):
            return F.mse_loss(self.fc(self.ln_a(x) * self.ln_b(x)), y)

    torch.manual_seed(0)
    path = tmp_path / "product.onnx"
    got = assert_trains_like_torch(Product(), (torch.randn(8, 16), torch.randn(8, 4)), ["x", "y"], path)
    graph = onnx.load(str(path), load_external_data=False).graph
    assert sum(n.op_type == "LayerNormalization" for n in graph.node) == 1, "no merge: the test needs a new model"
    assert {"ln_b.weight", "ln_b.bias"} <= set(got)


def test_no_trained_parameter_advice_is_followable_by_train(tmp_path: Path, capsys) -> None:
    """``train`` has no --weights: the refusal points at --list-weights and says where naming
    the weights is possible."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4, 3] x) => (float loss) { sq = Mul(x, x) loss = ReduceSum <keepdims = 0> (sq) }""")
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((4, 3), np.float32))
    assert cli_main(["train", str(tmp_path / "m.onnx"), "--loss", "loss", "--data", str(tmp_path / "d.npz"),
                     "--steps", "1", "--batch-size", "4", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "no parameter" in err and "--list-weights" in err and "grad/check --weights" in err, err


def _merged_fixture(consumer_args: str) -> onnx.ModelProto:
    """A LayerNorm of module ``a`` that two merged calls of ``b`` and ``c`` vanished into, read
    by one Mul whose recorded call is ``consumer_args``; written as ONNX text with the metadata a
    dynamo export keeps."""
    import onnx_ir as ir

    model = ir.from_onnx_text("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 4] x) => (float loss) <float[4] a_weight = {1., 1., 1., 1.}, float[4] a_bias = {0., 0., 0., 0.}> {
            layer_norm = LayerNormalization <axis = -1> (x, a_weight, a_bias)
            mul = Mul(layer_norm, x)
            loss = ReduceSum <keepdims = 0> (mul)
        }""")
    for leaf in ("weight", "bias"):  # torch names have dots, which ONNX text does not take
        value = model.graph.initializers.pop(f"a_{leaf}")
        value.name = f"a.{leaf}"
        model.graph.register_initializer(value)
    model.graph.metadata_props["pkg.torch.export.ExportedProgram.graph_signature"] = "\n".join(
        f"p_{m}_{leaf}: PARAMETER target='{m}.{leaf}'" for m in "abc" for leaf in ("weight", "bias")
    ) + "\nx: USER_INPUT"
    fx = "pkg.torch.onnx.fx_node"
    norm, mul, _ = list(model.graph)
    norm.metadata_props[fx] = ("%layer_norm : [num_users=1] = call_function[target=torch.ops.aten.layer_norm"
                               ".default](args = (%x, [4], %p_a_weight, %p_a_bias, 1e-05, False), kwargs = {})")
    mul.metadata_props[fx] = ("%mul : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor]"
                              f"(args = ({consumer_args}), kwargs = {{}})")
    return ir.to_proto(model)


def test_a_merge_whose_uses_cannot_be_told_apart_is_refused_by_name() -> None:
    import onnx_ir as ir

    from passes.exports import SplitMergedCallsPass

    with pytest.raises(gradgraph.GradientError, match=r"%layer_norm_1.*%layer_norm_2.*optimize=False"):
        SplitMergedCallsPass()(ir.from_proto(_merged_fixture("%layer_norm_1, %layer_norm_2, %x")))
    # one recorded vanished call per input: split; b and c both lost, nothing tells which
    model = ir.from_proto(_merged_fixture("%layer_norm_1, %x"))
    split = SplitMergedCallsPass()
    with pytest.warns(UserWarning, match=r"modules \['b', 'c'\]"):
        assert split(model).modified and split.split == ["layer_norm_1"]
    assert {"a.weight@merged:layer_norm_1", "a.bias@merged:layer_norm_1"} <= set(model.graph.initializers)
    assert [n.inputs[0].name for n in model.graph if n.op_type == "Mul"] == ["layer_norm_1"]
