"""Norms and distances at zero through ORTModule give torch's gradients (issue 36 §4).

torch's backward of ``cdist``, ``pdist``, ``norm`` / ``linalg.vector_norm`` / ``dist`` is 0 where a
norm is 0 (its subgradient), where the chain rule through ``(sum |d|^p)^(1/p)`` gives inf * 0 =
NaN; a plain ``sqrt(sum(x ** 2))`` keeps torch's NaN. The p = inf distances give every tied
coordinate the whole gradient, ``vector_norm(ord=inf)`` a share. torch.cdist and F.pdist have no
torchlib translation: gradgraph's (gradgraph.torch.translations.distance_translation) writes them.

Oracle: torch float64 autograd of the same module on the same inputs, at zero (zero rows,
equal rows, ties) and away from it, rel 1e-6 (float64 both sides; torchlib writes 1 / p in float32),
NaN where torch gives NaN.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from gradgraph.torch import ORTModule  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
INF = float("inf")
# float64 both sides; torchlib writes a norm's 1 / p as a float32 constant (rel 3e-8)
RTOL, ATOL = 1e-6, 1e-9


class Scaled(torch.nn.Module):
    """Each ``fn(x * scale)`` weighted by a fixed tensor and summed: one output per construct."""

    def __init__(self, fns: dict[str, Callable], columns: int) -> None:
        super().__init__()
        self.fns = fns
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, columns, dtype=torch.float64))

    def forward(self, x):
        outs = []
        for fn in self.fns.values():
            y = fn(x * self.scale)
            outs.append((y * torch.arange(1, y.numel() + 1, dtype=y.dtype).reshape(y.shape).cos()).sum())
        return tuple(outs)


def _at_zero(rows: int, columns: int, batch: tuple[int, ...] = ()) -> torch.Tensor:
    """Zero rows, repeated rows and tied coordinates (|2| twice), then ordinary rows."""
    base = [[0.0] * columns, [1.0, -2.0, 2.0, 0.5][:columns], [1.0, -2.0, 2.0, 0.5][:columns],
            [0.0] * columns, [3.0, 3.0, -1.0, 0.0][:columns]]
    rng = np.random.default_rng(1)
    table = base + [list(rng.standard_normal(columns)) for _ in range(max(0, rows - len(base)))]
    x = torch.tensor(table[:rows], dtype=torch.float64)
    return x.expand(*batch, rows, columns).clone()


def _check(fns: dict[str, Callable], rows: int = 5, columns: int = 4, batch: tuple[int, ...] = ()) -> None:
    """Each construct's value and gradients (of x and scale) through one ORTModule (one export,
    one backward per output), at zero and away from it, against torch's."""
    torch.manual_seed(0)
    ref = Scaled(fns, columns)
    mine = ORTModule(copy.deepcopy(ref), fallback="raise")
    away = torch.randn(*batch, rows, columns, dtype=torch.float64)
    for where, x in (("at zero", _at_zero(rows, columns, batch)), ("away from zero", away)):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback, no build warning
            outs = mine(xa)
        wants = ref(xb)
        for k, (name, out, want) in enumerate(zip(fns, outs, wants, strict=True)):
            what = f"{name} {where}"
            np.testing.assert_allclose(out.item(), want.item(), rtol=RTOL, err_msg=f"{what}: value")
            last = k == len(fns) - 1
            got = torch.autograd.grad(out, [xa, mine.module.scale], retain_graph=not last)
            expect = torch.autograd.grad(want, [xb, ref.scale], retain_graph=not last)
            for input_name, g, e in zip(("x", "scale"), got, expect, strict=True):
                np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=RTOL, atol=ATOL, equal_nan=True,
                                           err_msg=f"{what}: gradient of {input_name}")


def test_cdist_gradients_at_and_away_from_zero_are_torchs():
    # cdist(z, z) has a zero diagonal: p = 2 gave NaN gradients (and NaN weights after a step);
    # other p fell back (the TorchScript exporter's cdist ignored p); p = 0 (a count) has torch's
    # zero gradient, not none
    fns = {f"cdist(p={p})": (lambda z, p=p: torch.cdist(z, z, p=p)) for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, INF)}
    fns["cdist(z, z[:3], p=3), batched"] = lambda z: torch.cdist(z, z[..., :3, :], p=3.0)
    _check(fns, batch=(2,))


def test_cdist_of_many_rows_is_torchs():
    # more than 25 rows: torch computes |a|^2 - 2 a.b + |b|^2 (aten._euclidean_dist), its
    # gradient 0 where that is 0
    _check({"cdist, 30 rows": lambda z: torch.cdist(z, z.flip(-2))}, rows=30, columns=3)


def test_pdist_gradients_at_and_away_from_zero_are_torchs():
    _check({f"pdist(p={p})": (lambda z, p=p: F.pdist(z, p=p)) for p in (0.0, 1.0, 2.0, 3.0, INF)})


def test_norms_at_and_away_from_zero_are_torchs():
    # linalg.vector_norm(ord=3) gave NaN at a zero row (Pow(sum, 1/3)'s gradient is inf there)
    _check({"vector_norm": lambda z: torch.linalg.vector_norm(z, dim=-1),
            "vector_norm(3)": lambda z: torch.linalg.vector_norm(z, ord=3, dim=-1),
            "vector_norm(0.5)": lambda z: torch.linalg.vector_norm(z, ord=0.5, dim=-1),
            "vector_norm(inf)": lambda z: torch.linalg.vector_norm(z, ord=INF, dim=-1),
            "norm(p=3, keepdim)": lambda z: torch.norm(z, p=3, dim=1, keepdim=True),
            "norm()": lambda z: torch.norm(z[:1]),
            "dist(p=3)": lambda z: torch.dist(z[0], z[3], p=3),
            "matrix_norm(fro)": lambda z: torch.linalg.matrix_norm(z[:2])})


def test_a_plain_sqrt_of_a_sum_of_squares_keeps_torchs_nan_at_zero():
    # torch's sqrt has no norm's subgradient: NaN at zero, not changed by the norms' convention
    # (a module of its own: the backward of one output of several multiplies the others'
    # local gradients by a zero, and 0 * inf would reach the norms above)
    _check({"sqrt(sum(z ** 2))": lambda z: torch.sqrt(torch.sum(z ** 2, -1)),
            "z.pow(2).sum().sqrt()": lambda z: z.pow(2).sum(-1).sqrt()})
