"""SeedRandomOpsPass: every random node gets a seed attribute of its own.

An optimizer's common-subexpression elimination merges nodes of the same op, inputs and
attributes; onnxscript's (what ``torch.onnx.export(optimize=True)`` and gradgraph's ORTModule
run) does so for random ops too, so two training Dropouts of the same tensor (SimCSE, R-Drop:
one encoder run twice on one batch) became one, and their two "independent" masks one mask.
Random ops (``passes.cleanup.is_random``: Dropout in training mode, RandomUniform(Like),
RandomNormal(Like), Bernoulli, Multinomial, in every subgraph) without a ``seed`` get distinct
seeds drawn from ``seed`` (the caller's: gradgraph's ORTModule takes it from torch's
generator), which makes them differ for any such pass. A node that has a seed keeps it (the
model's author chose it; two nodes with the same seed and inputs are the same draw).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.cleanup import is_random
from passes.subgraphs import node_subgraphs


class SeedRandomOpsPass(InPlacePass):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed

    def call(self, model: ir.Model) -> PassResult:
        unseeded = [n for n in ir.traversal.RecursiveGraphIterator(model.graph)
                    if "seed" not in n.attributes and is_random(n) and not any(node_subgraphs(n))]
        if not unseeded:
            return PassResult(model, False)
        # distinct integers below 2**24: Dropout's seed is an int attribute, the random ops' a
        # float (onnxruntime truncates it to an integer), which holds these exactly
        seeds = np.random.default_rng(self.seed).choice(1 << 24, size=len(unseeded), replace=False)
        for node, seed in zip(unseeded, seeds):
            node.attributes["seed"] = (ir.AttrInt64("seed", int(seed)) if node.op_type == "Dropout"
                                       else ir.AttrFloat32("seed", float(seed)))
        return PassResult(model, True)
