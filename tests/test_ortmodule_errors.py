"""ORTModule raises torch's exception for index values torch refuses, before onnxruntime runs
(issue 36 §5): ONNX's Gather reads a negative index from the end and onnxruntime's loss kernels
do not check a target, so a negative embedding id, class label or ``torch.gather`` index
computed silently. Oracle: the same call in plain PyTorch (its exception type and message).
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from gradgraph.torch import ORTModule  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Indexed(torch.nn.Module):
    """Embedding ids, a torch.gather index, cross-entropy / nll labels and labels shifted as
    HF's causal LMs shift them (through a Pad) in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 5)

    def forward(self, ids, labels, pick, tokens):
        scores = self.lin(self.emb(ids))
        picked = torch.gather(scores, 1, pick[:, None]).sum()
        shifted = F.pad(tokens, (0, 1), value=-100)[1:]  # HF's causal-LM loss shifts its labels so
        return (F.cross_entropy(scores, labels) + F.nll_loss(F.log_softmax(scores, -1), labels) + picked
                + F.cross_entropy(scores, shifted))


def _torch_error(module: torch.nn.Module, *args) -> BaseException:
    with pytest.raises(Exception) as info:
        module(*args)
    return info.value


def test_index_values_torch_refuses_raise_torchs_exception_naming_the_input(capfd):
    # a negative id, label or gather index computed a loss silently (Gather wrapped, the loss
    # kernels read any target); those past the end reached onnxruntime's error and log line
    torch.manual_seed(0)
    ref = Indexed()
    mine = ORTModule(copy.deepcopy(ref), fallback="raise")
    ids, labels, pick, tokens = (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 4]), torch.tensor([0, 2, 4]),
                                 torch.tensor([3, 1, 2]))
    mine(ids, labels, pick, tokens).backward()  # built for this signature
    capfd.readouterr()
    cases = {"negative id": ((torch.tensor([1, -2, 3]), labels, pick, tokens), "'ids'"),
             "negative label": ((ids, torch.tensor([0, -3, 4]), pick, tokens), "'labels'"),
             "negative gather index": ((ids, labels, torch.tensor([0, -1, 4]), tokens), "'pick'"),
             "id past the end": ((torch.tensor([1, 2, 10]), labels, pick, tokens), "'ids'"),
             "label past the end": ((ids, torch.tensor([0, 5, 4]), pick, tokens), "'labels'"),
             "negative shifted label": ((ids, labels, pick, torch.tensor([3, -5, 2])), "'tokens'")}
    for bad, (args, name) in cases.items():
        want = _torch_error(ref, *args)
        with pytest.raises(type(want)) as got:
            mine(*args)
        assert type(got.value) is type(want) and str(got.value).startswith(str(want)), (bad, got.value, want)
        assert f"input {name} holds" in str(got.value), (bad, got.value)
    assert "onnxruntime" not in capfd.readouterr().err.lower()
    out, expect = mine(ids, labels, pick, tokens), ref(ids, labels, pick, tokens)  # still in onnxruntime
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    assert all(e is not None for e in mine._engines.values())


def test_a_negative_index_torch_reads_from_the_end_gives_torchs_result():
    class Rows(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(6, 3))

        def forward(self, idx):
            return self.table[idx].sum(0)

    torch.manual_seed(0)
    ref = Rows()
    mine = ORTModule(copy.deepcopy(ref), fallback="raise")
    for idx in (torch.tensor([0, 2]), torch.tensor([-1, 2]), torch.tensor([-6, 5])):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out = mine(idx)
        want = ref(idx)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(mine.module.table.grad, ref.table.grad)
