"""CleanupPass: fold constants, remove identities, merge common subexpressions, drop dead code.

Each round runs the enabled steps in this order, and rounds repeat until one changes nothing
(at most ``max_rounds``), so a second run of the pass finds nothing to do:

1. ``FoldConstantNodesPass``: nodes computed from Constant nodes only become Constant nodes
   (never initializers: they may be trained; results over ``fold_max_elements`` stay);
2. ``IdentityEliminationPass``: Identity nodes go, graph output names stay;
3. ``CommonSubexpressionEliminationPass``: equal nodes on equal inputs merge, never random
   ones (training-mode Dropout, Random*, Bernoulli, Multinomial);
4. ``DeadCodeEliminationPass``: nodes whose outputs nothing reads go; initializers stay unless
   ``remove_unused_initializers``.

Steps 2 and 3 never remove a node whose ``gradgraph.stage`` mark is in ``keep_roles``
(recompute clones). Surviving nodes keep their marks. ``modified`` is computed by comparing
the model's structure before and after each step, not from the steps' own flags.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassBase, PassResult

from passes.cleanup._common import fingerprint
from passes.cleanup.cse import CommonSubexpressionEliminationPass
from passes.cleanup.dead_code import DeadCodeEliminationPass
from passes.cleanup.fold import FoldConstantNodesPass
from passes.cleanup.identity import IdentityEliminationPass
from passes.forward.fold_constants import FoldOptions
from passes.marks import Role


@dataclasses.dataclass(frozen=True)
class CleanupOptions:
    fold_constants: bool = True
    remove_identities: bool = True
    merge_common_subexpressions: bool = True
    remove_dead_code: bool = True
    # Nodes with these gradgraph.stage marks are never merged or removed by steps 2 and 3.
    keep_roles: tuple[str, ...] = (Role.RECOMPUTE.value,)
    # Largest folded result, in elements (shape-like arguments, not tensors).
    fold_max_elements: int = FoldOptions.max_elements
    # Nodes with a tensor attribute over this many elements are never merged.
    cse_max_tensor_elements: int = 16
    # Drop initializers nothing reads (a trainable weight off every path is state all the same).
    remove_unused_initializers: bool = False
    # Rounds of all steps before giving up on reaching a fixed point.
    max_rounds: int = 8


class CleanupPass(InPlacePass):
    def __init__(self, options: CleanupOptions | None = None) -> None:
        super().__init__()
        self.options = options or CleanupOptions()

    def steps(self) -> list[PassBase]:
        o = self.options
        steps: list[PassBase] = []
        if o.fold_constants:
            steps.append(FoldConstantNodesPass(o.fold_max_elements))
        if o.remove_identities:
            steps.append(IdentityEliminationPass(o.keep_roles))
        if o.merge_common_subexpressions:
            steps.append(CommonSubexpressionEliminationPass(o.keep_roles, o.cse_max_tensor_elements))
        if o.remove_dead_code:
            steps.append(DeadCodeEliminationPass(o.remove_unused_initializers))
        return steps

    def call(self, model: ir.Model) -> PassResult:
        steps = self.steps()
        modified = False
        for _ in range(self.options.max_rounds):
            changed = False
            for step in steps:
                before = fingerprint(model)
                model = step(model).model
                changed = changed or fingerprint(model) != before
            modified = modified or changed
            if not changed:
                break
        return PassResult(model, modified)
