"""SGD with momentum, dampening, Nesterov and weight decay (torch.optim.SGD semantics).

Per weight ``w`` with gradient ``g`` and learning rate ``lr``:

1. ``d = g + weight_decay * w``;
2. with momentum: ``buf = d`` on the first step, else ``buf = momentum * buf + (1 - dampening) * d``;
   ``d = d + momentum * buf`` (Nesterov) or ``d = buf``;
3. ``w = w - lr * d``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.errors import GradientError
from passes.optimizer.base import StepScalars, check_number, optimizer_rule


@dataclasses.dataclass(frozen=True)
class SGDConfig:
    name: ClassVar[str] = "sgd"
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_number(self, "momentum", self.momentum, low=0.0, high=1.0, high_open=True)
        check_number(self, "dampening", self.dampening, low=0.0, high=1.0)
        check_number(self, "weight_decay", self.weight_decay, low=0.0)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise GradientError(f"SGDConfig.nesterov=True requires a momentum > 0 and zero dampening "
                                f"(got momentum={self.momentum!r}, dampening={self.dampening!r})")

    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()


@optimizer_rule(SGDConfig, fusable="elementwise")
def sgd_update(b: OpBuilder, cfg: SGDConfig, w: Var, g: Var, state: dict[str, Var],
               sc: StepScalars, lr_scale: float) -> tuple[Var, dict[str, Var]]:
    d = g + w * cfg.weight_decay if cfg.weight_decay else g
    new_state: dict[str, Var] = {}
    if cfg.momentum:
        running = state["momentum_buffer"] * cfg.momentum + d * (1.0 - cfg.dampening)
        buf = b.Where(sc.first_step, d, running)
        new_state["momentum_buffer"] = buf
        d = d + buf * cfg.momentum if cfg.nesterov else buf
    lr = sc.cast(sc.lr64(lr_scale), w.known_dtype)
    return w - lr * d, new_state
