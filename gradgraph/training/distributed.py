"""Data-parallel training on ``torch.distributed``: gradient all-reduce and ZeRO stage 1.

Each rank runs the forward and gradient graph (:func:`gradgraph.training.build.gradient_model`)
on its shard of the batch. The gradients are all-reduced (summed, then divided by
``world_size * accumulation_steps``: the mean over the global batch, as one process on the
concatenated shards computes it) in flat buckets of about ``bucket_bytes``, clipped by their
global norm (``torch.nn.utils.clip_grad_norm_``'s formula, as the single-process graph does),
and checked for NaN/inf: a non-finite step is skipped on every rank alike. Then the optimizer
update (:func:`gradgraph.training.build.apply_model`) runs:

- ZeRO stage 0: every rank updates every weight (each keeps the whole optimizer state);
- ZeRO stage 1: the trained weights are partitioned across ranks (whole tensors, balanced by
  size); a rank keeps the optimizer state of its partition only, updates it, and each updated
  weight is broadcast from its owner (an all-gather).

With gradient accumulation, gradients add up locally over the micro-steps; with
``allreduce_post_accumulation=True`` they are all-reduced once per optimizer step, else after
every micro-step (the same numbers, more traffic). The all-reduce runs after the graph:
onnxruntime gives no hook inside a run to overlap it with the backward.

The collectives run on a gloo group of ``torch.distributed`` (the gradients are staged in host
memory, also with CUDA; a caller's NCCL group gets a gloo group beside it), initialised from
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when
the caller has not done it. A collective that fails (a rank died) or exceeds ``timeout_s``
raises :class:`DistributedError` instead of hanging. Before the first collective the ranks
compare their configuration (the training graph's hash, the options, the trained set; at the
first step the feeds' shapes; see :mod:`gradgraph.training.rank_agreement`) and stop with one
line naming the first difference.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradgraph.training.checkpoint import MICRO_STEP_KEY, CheckpointError
from gradgraph.training.rank_agreement import feed_shapes, first_difference, session_configuration
from passes.autodiff import GradientError


class DistributedError(GradientError):
    """A collective failed or timed out: another rank stopped, or the group is misconfigured."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Data-parallel settings; ``from_env()`` reads torchrun's ``WORLD_SIZE`` / ``RANK``."""

    world_size: int = 1
    rank: int = 0
    zero_stage: int = 0
    allreduce_post_accumulation: bool = True
    bucket_bytes: int = 25 << 20
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name, low in (("world_size", 1), ("rank", 0), ("bucket_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GradientError(f"DistributedConfig.{name} must be an integer >= {low}; got {value!r}")
        if not self.rank < self.world_size:
            raise GradientError(f"DistributedConfig.rank must be < world_size ({self.world_size}); "
                                f"got {self.rank}")
        if self.zero_stage not in (0, 1):
            raise GradientError(f"DistributedConfig.zero_stage must be 0 or 1 (ZeRO stage 1 "
                                f"partitions the optimizer state); got {self.zero_stage!r}")
        if not self.timeout_s > 0:
            raise GradientError(f"DistributedConfig.timeout_s must be > 0; got {self.timeout_s!r}")

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, **overrides: Any) -> DistributedConfig:
        """World size and rank from torchrun's environment (1 and 0 without it)."""
        env = {"world_size": int(os.environ.get("WORLD_SIZE", "1")), "rank": int(os.environ.get("RANK", "0"))}
        return cls(**{**env, **overrides})


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def ensure_process_group(config: DistributedConfig, device: str) -> Any:
    """Initialise torch.distributed from the environment unless the caller already did; returns
    the group the collectives use: gloo, since the gradients are staged in host memory (a
    caller's NCCL group gets a gloo group beside it)."""
    dist = _dist()
    if dist.is_initialized():
        if dist.get_world_size() != config.world_size or dist.get_rank() != config.rank:
            raise DistributedError(f"torch.distributed is initialised with world size "
                                   f"{dist.get_world_size()} and rank {dist.get_rank()}, the config says "
                                   f"{config.world_size} and {config.rank}")
        if dist.get_backend() == "gloo":
            return None
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=config.timeout_s))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DistributedError(f"data-parallel training needs {missing} in the environment (launch "
                               "with torchrun, or call torch.distributed.init_process_group first)")
    try:
        dist.init_process_group("gloo", rank=config.rank, world_size=config.world_size,
                                timeout=datetime.timedelta(seconds=config.timeout_s))
        # torch aborts a process that exits with a live gloo group ("terminate called ...")
        atexit.register(_destroy_group)
    except Exception as exc:  # noqa: BLE001 - the store and backends raise several types
        raise DistributedError(f"rank {config.rank}: could not join the process group of "
                               f"{config.world_size} ranks at {os.environ['MASTER_ADDR']}:"
                               f"{os.environ['MASTER_PORT']}: {exc}") from exc
    return None


def _destroy_group() -> None:
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()


def partition(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """{weight: owner rank}: whole tensors, largest first onto the least-loaded rank."""
    load = [0] * world_size
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


class Collectives:
    """The all-reduce and broadcasts of one data-parallel session, with clear failures."""

    def __init__(self, config: DistributedConfig, group: Any = None) -> None:
        self.config = config
        self.group = group  # None: the default group
        self.seconds = 0.0  # spent in collectives (waiting for the slowest rank included)

    def _guard(self, what: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError and others
            raise DistributedError(
                f"rank {self.config.rank}: {what} failed: another rank stopped or did not answer "
                f"within {self.config.timeout_s:g} s ({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__})"
            ) from exc
        finally:
            self.seconds += time.perf_counter() - start

    def all_reduce_sum(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sum every array over the ranks, in flat buckets of about ``bucket_bytes`` per dtype."""
        import torch

        dist = _dist()
        out: dict[str, np.ndarray] = {}
        bucket: list[str] = []
        size = 0

        def flush() -> None:
            nonlocal bucket, size
            if not bucket:
                return
            flat = torch.from_numpy(np.concatenate([arrays[n].reshape(-1) for n in bucket]))
            self._guard("the gradient all-reduce", dist.all_reduce, flat, dist.ReduceOp.SUM, self.group)
            offset = 0
            for name in bucket:
                n = arrays[name].size
                out[name] = flat[offset:offset + n].numpy().reshape(arrays[name].shape)
                offset += n
            bucket, size = [], 0

        for dtype in sorted({a.dtype.str for a in arrays.values()}):
            for name in sorted(n for n, a in arrays.items() if a.dtype.str == dtype):
                bucket.append(name)
                size += arrays[name].nbytes
                if size >= self.config.bucket_bytes:
                    flush()
            flush()
        return out

    def all_true(self, flag: bool) -> bool:
        import torch

        value = torch.tensor([0 if flag else 1], dtype=torch.int64)
        dist = _dist()
        self._guard("the finite-step vote", dist.all_reduce, value, dist.ReduceOp.SUM, self.group)
        return int(value.item()) == 0

    def broadcast(self, array: np.ndarray, src: int) -> np.ndarray:
        import torch

        tensor = torch.from_numpy(np.array(array, copy=True))
        self._guard(f"the broadcast from rank {src}", _dist().broadcast, tensor, src, self.group)
        return tensor.numpy()

    def all_gather(self, value: object) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        gathered: list[Any] = [None] * self.config.world_size
        self._guard("the exchange of the ranks' configurations", _dist().all_gather_object,
                    gathered, value, self.group)
        return gathered

    def barrier(self) -> None:
        self._guard("the barrier", _dist().barrier, self.group)


def clip_coefficient(grads: Sequence[np.ndarray], max_norm: float, eps: float) -> float:
    """``min(1, max_norm / (norm + eps))`` over the global L2 norm (the graph's formula)."""
    total = float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float32), dtype=np.float32))
                              for g in grads)))
    return min(1.0, max_norm / (total + eps))


class DataParallelRunner:
    """The data-parallel step of a :class:`gradgraph.TrainingSession` (see the module docstring)."""

    def __init__(self, session: Any, config: DistributedConfig, sess_options: Any,
                 provider_options: Any) -> None:
        from gradgraph.training.build import apply_model, gradient_model
        from gradgraph.training.ort_state import GraphRunner

        if session.config.mixed_precision.scales_loss:
            raise NotImplementedError("data-parallel training with a scaled fp16 loss is not "
                                      "implemented yet (use bfloat16 or fp32)")
        self.session, self.config = session, config
        art, store, names = session.artifacts, session.store, session.names
        self.coll = Collectives(config, ensure_process_group(config, store.device))
        # before any other collective: a rank with other weights or options stops here, named
        self.agree(session_configuration(session, config.world_size, config.zero_stage,
                                         config.allreduce_post_accumulation))
        self.feeds_agreed = False
        sizes = {w: int(art.initial[w].size) for w in art.trained}
        self.owner = partition(sizes, config.world_size) if config.zero_stage == 1 else \
            {w: config.rank for w in art.trained}
        self.owned = [w for w in art.trained if self.owner[w] == config.rank]
        for w, states in art.optimizer_state.items():  # ZeRO-1: the partition's state only
            for s in states:
                if w not in self.owned:
                    store.values.pop(names.state(w, s), None)
        for w in art.trained:  # accumulation happens here, not in graph buffers
            store.values.pop(names.buffer(w), None)
        for name in art.params:  # every rank starts from rank 0's weights (as DDP)
            store.set(name, self.coll.broadcast(store.get(name), 0), owned=True)
        held = set(store.names())
        grad_proto, self.grad_outputs = gradient_model(art)
        if set(self.grad_outputs) != set(art.trained):
            raise GradientError(f"the gradient graph lacks gradients of "
                                f"{sorted(set(art.trained) - set(self.grad_outputs))}")
        args = (held, names, sess_options, session.providers, provider_options)
        self.gradients = GraphRunner(grad_proto, *args)
        self.apply = None
        self.grad_inputs: dict[str, str] = {}
        if self.owned:
            apply_proto, self.grad_inputs = apply_model(art, self.owned)
            self.apply = GraphRunner(apply_proto, *args)
        self.accumulated: dict[str, np.ndarray] | None = None

    def agree(self, parts: Mapping[str, str]) -> None:
        """Stop every rank with one :class:`DistributedError` line naming the first of
        ``parts`` (name -> value as text) in which a rank differs from rank 0
        (:mod:`gradgraph.training.rank_agreement`); a front end adds its own options."""
        difference = first_difference(self.coll.all_gather(dict(parts)))
        if difference is not None:
            raise DistributedError(difference)

    def train_step(self, feeds: Mapping[str, Any], lr: float, fetches: Sequence[str]) -> dict[str, np.ndarray]:
        session, config = self.session, self.config
        if not self.feeds_agreed:  # the batch each rank feeds: same names, shapes and dtypes
            self.agree(feed_shapes(feeds))
            self.feeds_agreed = True
        update = session.config.update
        steps = update.accumulation_steps
        applying = session.micro_step + 1 == steps
        wanted = list(dict.fromkeys(fetches))
        out = self.gradients.run(session.store, feeds, wanted + list(self.grad_outputs.values()))
        grads = {w: out.pop(g) for w, g in self.grad_outputs.items()}
        if not config.allreduce_post_accumulation:
            grads = self.coll.all_reduce_sum(grads)
        if self.accumulated is None:
            self.accumulated = grads
        else:
            self.accumulated = {w: self.accumulated[w] + grads[w] for w in grads}
        session.micro_step = 0 if applying else session.micro_step + 1
        if applying:
            total = self.accumulated
            self.accumulated = None
            if config.allreduce_post_accumulation:
                total = self.coll.all_reduce_sum(total)
            self._update(total, lr, steps, [out[n] for n in wanted[:1]])
        return out

    def _update(self, total: dict[str, np.ndarray], lr: float, steps: int,
                losses: list[np.ndarray]) -> None:
        session = self.session
        update, store = session.config.update, session.store
        scale = 1.0 / (self.config.world_size * steps)
        grads = {w: (g * np.asarray(scale, g.dtype)).astype(g.dtype, copy=False) for w, g in total.items()}
        local = all(bool(np.isfinite(g).all()) for g in grads.values()) and \
            all(bool(np.isfinite(v).all()) for v in losses)
        finite = self.coll.all_true(local)
        if finite and update.max_grad_norm is not None:
            coef = clip_coefficient(list(grads.values()), update.max_grad_norm, update.clip_eps)
            grads = {w: g * np.asarray(coef, g.dtype) for w, g in grads.items()}
        if finite:
            finite = self._apply(grads, lr)
        if finite:
            if self.config.zero_stage == 1:  # all-gather: each weight from its owner
                for w in session.artifacts.trained:
                    store.set(w, self.coll.broadcast(store.get(w), self.owner[w]), owned=True)
        for name in session.artifacts.buffers:  # running statistics: rank 0's (as DDP)
            store.set(name, self.coll.broadcast(store.get(name), 0), owned=True)
        session.last_step_finite = finite
        session.skipped_steps += not finite

    def _apply(self, grads: dict[str, np.ndarray], lr: float) -> bool:
        """Run the update of this rank's weights; True when every rank's update was finite. An
        update that was not (new weights or state NaN/inf: the graph kept the old values) on any
        rank is taken back on all, so that weights and step counters stay the same everywhere."""
        names, store = self.session.names, self.session.store
        local = True
        if self.apply is not None:
            feeds = {self.grad_inputs[w]: grads[w] for w in self.owned}
            feeds[names.learning_rate] = np.asarray(lr, np.float64).reshape(())  # the graph's dtype at binding
            wanted = [names.finite] if names.finite in self.apply.fetchable else []
            out = self.apply.run(store, feeds, wanted)
            local = bool(out[names.finite]) if wanted else True
        else:  # a rank owning no weight still counts the step
            store.set(names.step, np.asarray(store.get(names.step) + 1, np.int64))
        finite = self.coll.all_true(local)
        if not finite and local:  # the previous values are the swapped-out spares
            if self.apply is not None:
                for name in self.apply.updates:
                    store.swap(name)
            else:
                store.set(names.step, np.asarray(store.get(names.step) - 1, np.int64))
        return finite

    def checkpoint_state(self) -> dict[str, np.ndarray]:
        """What a checkpoint holds besides the store: the state at the last optimizer step.

        Mid-accumulation, the micro-steps since are not saved (each rank's partial sums are its
        own and would not survive a change of world size): ``micro_step`` 0, so a resumed run
        redoes them. With accumulation, zero buffers: a one-process session's layout."""

        session = self.session
        state = {MICRO_STEP_KEY: np.array(0, np.int64)}
        if session.config.update.accumulation_steps > 1:
            for w in session.artifacts.trained:
                state[session.names.buffer(w)] = np.zeros_like(session.artifacts.initial[w])
        return state

    def take_checkpoint(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A (merged) checkpoint's tensors this rank holds: other ranks' ZeRO-1 partitions left
        out (this rank's must all be there); the accumulation restarts."""
        self.accumulated = None

        if int(np.asarray(tensors.get(MICRO_STEP_KEY, 0)).reshape(-1)[0]) != 0:

            raise CheckpointError("the checkpoint was saved mid-accumulation by one process; a "
                                  "data-parallel run resumes from an optimizer step (save there)")
        held = set(self.session.store.names()) | {MICRO_STEP_KEY}
        missing = sorted(held - set(tensors))
        if missing:

            raise CheckpointError(f"the checkpoint lacks {missing[:4]} that rank {self.config.rank} "
                                  "holds (pass the checkpoints of every rank of the run)")
        return {k: v for k, v in tensors.items() if k in held}

    def mean_over_ranks(self, value: float) -> float:
        """The mean of a per-rank number (e.g. the loss of each rank's shard) over the ranks."""
        summed = self.coll.all_reduce_sum({"value": np.asarray([value], np.float64)})
        return float(summed["value"][0]) / self.config.world_size

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (ZeRO-1: its partition's)."""
        store, names = self.session.store, self.session.names
        return sum(int(np.prod(store.shape(names.state(w, s)))) * store.dtype(names.state(w, s)).itemsize
                   for w, states in self.session.artifacts.optimizer_state.items() for s in states
                   if names.state(w, s) in store)
