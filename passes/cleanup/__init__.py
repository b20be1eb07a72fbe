"""Graph cleanup: constant folding, identity removal, CSE and dead-code removal (see CleanupPass)."""

from passes.cleanup._common import RANDOM_OPS, is_random
from passes.cleanup.cleanup_pass import CleanupOptions, CleanupPass
from passes.cleanup.cse import CommonSubexpressionEliminationPass
from passes.cleanup.dead_code import DeadCodeEliminationPass
from passes.cleanup.fold import FoldConstantNodesPass
from passes.cleanup.identity import IdentityEliminationPass

__all__ = [
    "CleanupOptions",
    "CleanupPass",
    "CommonSubexpressionEliminationPass",
    "DeadCodeEliminationPass",
    "FoldConstantNodesPass",
    "IdentityEliminationPass",
    "RANDOM_OPS",
    "is_random",
]
