"""torch.multinomial inside an ORTModule forward (issue 36 §6): its draws come from torch's
generator on every call, so ``torch.manual_seed`` repeats them (as rand / randn / bernoulli);
without replacement its samples are distinct, as torch's. Before, torchlib's ONNX Multinomial
drew in onnxruntime (seeded once per build: a seed did not repeat a call) and always with
replacement. Oracle: torch's semantics (repeat under a seed, distinct samples, the
distribution: frequencies of 6,000 draws within 0.03 of the probabilities, a fixed seed).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradgraph.torch import ORTModule  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROBS = [0.1, 0.0, 0.2, 0.7]


class Samples(torch.nn.Module):
    """One sample, all four categories without replacement, 3 with replacement, per row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, probs):
        p = torch.softmax(self.lin(x), -1)
        return (torch.multinomial(p, 1), torch.multinomial(p, 4), torch.multinomial(p, 3, replacement=True),
                torch.multinomial(probs, 1), torch.multinomial(probs, 3, replacement=True))


def test_multinomial_repeats_under_manual_seed_and_keeps_torchs_semantics():
    torch.manual_seed(0)
    model = ORTModule(Samples(), fallback="raise")
    x = torch.randn(2000, 4)
    probs = torch.tensor(PROBS).expand(2000, 4).contiguous()
    runs = []
    for seed in (1, 2, 1):
        torch.manual_seed(seed)
        with torch.no_grad():
            runs.append(model(x, probs))
    for k in range(5):
        assert torch.equal(runs[0][k], runs[2][k]), f"sample {k}: seed 1 twice gave two draws"
        assert not torch.equal(runs[0][k], runs[1][k]), f"sample {k}: two seeds gave one draw"
    one, every, again, fixed, fixed_again = runs[0]
    assert one.shape == (2000, 1) and again.shape == (2000, 3)
    assert (every.sort(-1).values == torch.arange(4)).all(), "without replacement: each category once"
    for drawn in (fixed.flatten(), fixed_again.flatten()):
        freq = np.bincount(drawn.numpy(), minlength=4) / drawn.numel()
        np.testing.assert_allclose(freq, PROBS, atol=0.03)  # category 1 (p = 0) never drawn
        assert freq[1] == 0
