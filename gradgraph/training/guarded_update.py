"""The update run of a split step, applied only when it keeps every weight and state finite.

The gradient run (:mod:`gradgraph.training.step_split`) has already checked the loss, the
learning rate and the gradients. What is left is an update that overflows on finite inputs (a
learning rate of 1e30). :class:`GuardedUpdate` rules that out before writing anything, in one
of two ways:

- most steps: a proof from bounds (:mod:`gradgraph.training.update_bounds`, CPU sessions);
- otherwise: the update computed once without writing anything, and its results checked
  (:func:`step_split.finite_check`). That session is made the first time it is needed. It
  shares the update's arena: an arena of its own would keep another update's worth.

Then the update runs in place.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from gradgraph.training.ort_state import GraphRunner, StateStore, side_session_options
from gradgraph.training.step_split import FLAG, StepSplit, finite_check, reusable_inputs
from gradgraph.training.update_bounds import Interval, UpdateProof, array_bounds

PROOF_REMEASURE = 1024  # steps between measurements of the held values' bounds
PROOF_MAX_WAIT = 64  # the most steps checked before trying to prove an update finite again


class GuardedUpdate:
    """The update of ``split`` over the held values of ``store`` (see the module docstring).

    ``updated(name)`` names the output holding the next value of held input ``name``;
    ``inplace`` the held inputs the update may write over (step_split.writable_in_place)."""

    def __init__(self, split: StepSplit, store: StateStore, held: set[str], names: Any,
                 sess_options: ort.SessionOptions | None, providers: Sequence[Any],
                 provider_options: Sequence[dict[str, Any]] | None, inplace: Collection[str]) -> None:
        self.split, self.store = split, store
        self.updated: Callable[[str], str] = names.updated
        self._check_args = (held, names, side_session_options(sess_options), providers, provider_options)
        self._check: GraphRunner | None = None
        # The update's temporaries (a few tensors of one weight's size) stay in its arena
        # between steps: without the arena, the peak is the same and the step 1.46x slower
        # (AdamW on 4 x 64 MiB, interleaved in one process: fresh pages every step).
        self.runner = GraphRunner(split.update, held, names, side_session_options(sess_options), providers,
                                  provider_options, inplace=inplace,
                                  reuse=reusable_inputs(split.update, split.carried))
        self.held = [i.name for i in split.update.graph.input if i.name in store]
        # CPU: the bounds are read from the buffers themselves
        self.proof = UpdateProof(split.update) if store.device == "cpu" else None
        front = {o.name for o in split.gradients.graph.output}
        # held inputs of the update that the gradient run writes: read as they are at each step
        self.front_updated = [n for n in self.held if self.updated(n) in front]
        self.bounds: dict[str, Interval] | None = None  # of the held inputs, as they are now
        self.bounds_at: dict[str, int] = {}  # the store's version of each when it was measured
        self._wait = self._backoff = 0  # steps to check before trying to prove again
        self.proven = 0  # applied steps whose check run was skipped

    def check_runner(self) -> GraphRunner:
        """The session of the update's finite check (:func:`finite_check`), made once needed."""
        if self._check is None:
            self._check = GraphRunner(finite_check(self.split.update), *self._check_args)
        return self._check

    def apply(self, feeds: Mapping[str, Any], step: int) -> bool:
        """Run the update when it is finite (proven, or checked); whether it ran."""
        after = self.prove(feeds, step)
        self.bounds = None  # the held values are measured again, unless the update runs
        if after is None and not bool(self.check_runner().run(self.store, feeds, [FLAG])[FLAG]):
            return False  # the update would overflow: skipped
        self.runner.run(self.store, feeds, [])
        self.proven += after is not None
        self.bounds = after  # the proof's bounds of what the update wrote
        return True

    def prove(self, feeds: Mapping[str, Any], step: int) -> dict[str, Interval] | None:
        """The bounds of the held values the update reads, as they will be after it, when the
        update is proven finite from bounds (see update_bounds); else None. A held value set
        from outside since its bounds were taken (its version in the store changed), and every
        value each PROOF_REMEASURE steps, is measured again."""
        if self.proof is None:
            return None
        if self._wait > 0:
            self._wait -= 1
            return None
        versions = self.store.versions
        known = {} if self.bounds is None or step % PROOF_REMEASURE == 0 else dict(self.bounds)
        stale = [n for n in self.held if n not in known or self.bounds_at.get(n) != versions.get(n, 0)]
        for name in stale:
            known[name] = array_bounds(self.store.view(name))
            self.bounds_at[name] = versions.get(name, 0)
        bounds: dict[str, Interval] = dict(known)
        for name in self.front_updated:
            bounds[name] = array_bounds(self.store.view(name))
        for name, value in feeds.items():
            array = value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)
            bounds[name] = array_bounds(array)
        result = self.proof.prove(bounds)
        if result is None:
            if len(stale) == len(self.held):  # even fresh bounds prove nothing: check a while
                self._backoff = min(max(1, 2 * self._backoff), PROOF_MAX_WAIT)
                self._wait = self._backoff
            return None
        self._backoff = 0
        return {n: result.get(self.updated(n), b) for n, b in known.items()}
