"""ORTTrainer's state: ``state_dict`` / ``load_state_dict`` in the reference's layouts,
``save_checkpoint`` / ``load_checkpoint``, ``save_as_onnx``, and the frozen and tracked values
they carry (:class:`TrainerState`, a base of :class:`gradgraph.torch.trainer.ORTTrainer`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir
import torch

from gradgraph.training.checkpoint import CheckpointError, read_checkpoints, write_checkpoint
from gradgraph.training.session import MICRO_STEP_KEY, TrainingSession

if TYPE_CHECKING:
    from gradgraph.torch.optim import TrainStepInfo, _OptimizerConfig
    from gradgraph.torch.trainer_options import ORTTrainerOptions

# gradgraph's optimizer state names -> the reference's state_dict names
_STATE_NAMES = {"exp_avg": "Moment_1", "exp_avg_sq": "Moment_2", "momentum_buffer": "Momentum"}
_ACCUMULATION = "Gradient_Accumulation_Buffer"
_CHECKPOINT_KIND = "ORTTrainer"

def _names_by_tensor(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, list[str]]:
    """Each tensor's names (a tied weight has several), by the tensor's identity."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in named:
        names_of.setdefault(id(tensor), []).append(name)
    return names_of


class TrainerState:
    """The state half of ORTTrainer; the trainer builds the session it reads."""

    if TYPE_CHECKING:  # set and defined by ORTTrainer
        optim_config: _OptimizerConfig
        options: ORTTrainerOptions
        _session: TrainingSession | None
        _onnx_model: onnx.ModelProto | None
        _pending: Callable[[], None] | None
        _torch_model: torch.nn.Module | None
        _torch_names: dict[str, str]
        _train_step_info: TrainStepInfo

        def _build(self, model: onnx.ModelProto) -> None: ...
        def _frozen_graph_names(self) -> set[str]: ...
        def _batches_tracked(self) -> dict[str, int]: ...
        def _set_batches_tracked(self, counts: Mapping[str, Any]) -> None: ...

    def _require(self, what: str) -> TrainingSession | None:
        if self._session is None:
            warnings.warn(f"ORTTrainer.{what}: the training session is not built yet (run train_step "
                          "or eval_step once first)", RuntimeWarning, stacklevel=3)
        return self._session

    def _as_module_state(self, by_torch: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The keys of the module's own ``state_dict()`` (a tied weight under each of its names,
        no non-persistent buffer), each with the graph's value where the graph holds it under
        any of its names, else the module's: loadable with ``strict=True``."""
        assert self._torch_model is not None
        module = self._torch_model
        names_of = _names_by_tensor([*module.named_parameters(remove_duplicate=False),
                                     *module.named_buffers(remove_duplicate=False)])
        state = {}
        for key, tensor in module.state_dict(keep_vars=True).items():
            value = next((by_torch[a] for a in [key, *names_of.get(id(tensor), [])] if a in by_torch), None)
            state[key] = (torch.from_numpy(np.array(value)) if value is not None
                          else tensor.detach().clone())
        return state

    def _frozen_values(self) -> dict[str, np.ndarray]:
        """``utils.frozen_weights`` as the graph holds them (its constants): part of the model's
        state, saved and loaded with it."""
        if self._onnx_model is None:
            return {}
        frozen = self._frozen_graph_names()
        return {i.name: onnx.numpy_helper.to_array(i) for i in self._onnx_model.graph.initializer
                if i.name in frozen}

    def _take_frozen(self, state: dict[str, Any]) -> None:
        """Remove the frozen weights from a state being loaded and apply them: before the first
        step to the module (the export reads them); after it, where they differ from the graph's
        constants, the session is rebuilt with them (its other state carried over)."""
        frozen = self._frozen_graph_names()
        given = {n: np.asarray(state.pop(n)) for n in list(state) if n in frozen}
        if not given:
            return
        if self._session is None:
            assert self._torch_model is not None  # an ONNX model's session exists from the start
            self._set_module_weights(given)
            return
        current = self._frozen_values()
        changed = {n: v for n, v in given.items()
                   if n in current and (v.shape != current[n].shape or not np.array_equal(v, current[n]))}
        wrong = [n for n, v in changed.items() if v.shape != current[n].shape or v.dtype != current[n].dtype]
        if wrong:
            raise CheckpointError(f"frozen weight(s) {wrong} of the state have another shape or dtype "
                                  "than the model's")
        if not changed:
            return
        assert self._onnx_model is not None and self._session is not None
        model = onnx.ModelProto()
        model.CopyFrom(self._onnx_model)
        for init in model.graph.initializer:
            if init.name in changed:
                init.CopyFrom(onnx.numpy_helper.from_array(changed[init.name], init.name))
        if self._torch_model is not None:
            self._set_module_weights(changed)
        carried = self._session.get_state()
        self._build(model)
        self._session.load_state(carried, strict=False)

    def _set_module_weights(self, values: Mapping[str, np.ndarray]) -> None:
        """Copy ``values`` (by ONNX weight name) into the torch module's parameters of that shape."""
        assert self._torch_model is not None
        params = dict(self._torch_model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for n, value in values.items():
                param = params.get(self._torch_names.get(n, n))
                if param is not None and tuple(param.shape) == value.shape:
                    param.copy_(torch.from_numpy(value.copy()))

    def state_dict(self, pytorch_format: bool = False) -> dict[str, Any]:
        """The reference's layout (see ORTTrainer.txt); ``pytorch_format``: {torch name: tensor}."""
        session = self._require("state_dict")
        if session is None:
            return {}
        weights = {**session.get_model_state()["full_precision"], **self._frozen_values()}
        if pytorch_format:  # constants of the graph (frozen weights) too
            assert self._onnx_model is not None
            inits = {i.name: i for i in self._onnx_model.graph.initializer}
            fixed = {n: onnx.numpy_helper.to_array(inits[n]) for n in self._torch_names
                     if n not in weights and n in inits}
            by_torch = {self._torch_names.get(n, n): v for n, v in {**fixed, **weights}.items()}
            if self._torch_model is None:
                return {n: torch.from_numpy(np.array(v)) for n, v in by_torch.items()}
            return self._as_module_state(by_torch)
        names, state = session.names, session.get_state()
        optimizer: dict[str, Any] = {}
        for w, kinds in session.artifacts.optimizer_state.items():
            if not all(names.state(w, k) in state for k in kinds):
                continue  # ZeRO-1: another rank's partition
            entry = {_STATE_NAMES.get(k, k): state[names.state(w, k)] for k in kinds}
            if self.optim_config.name == "AdamOptimizer":
                entry["Update_Count"] = state[names.step]
            if names.buffer(w) in state:
                entry[_ACCUMULATION] = state[names.buffer(w)]
            optimizer[w] = entry
        for w in session.artifacts.trained:
            if w not in optimizer and names.buffer(w) in state:
                optimizer[w] = {_ACCUMULATION: state[names.buffer(w)]}
        dist = session.distributed if session.data_parallel is not None else None
        shared = {"step": state[names.step]}
        for key in (names.loss_scale, names.stable_steps):
            if key in state:
                shared[key] = state[key]
        optimizer["shared_optimizer_state"] = shared
        opts = self.options
        return {
            "model": {"full_precision": weights},
            "optimizer": optimizer,
            "trainer_options": {
                "mixed_precision": opts.mixed_precision.enabled,
                "zero_stage": dist.zero_stage if dist else 0,
                "world_rank": dist.rank if dist else 0, "world_size": dist.world_size if dist else 1,
                "optimizer_name": self.optim_config.name,
                "data_parallel_size": dist.world_size if dist else 1,
                "horizontal_parallel_size": 1},
            "train_step_info": {"optimization_step": self._train_step_info.optimization_step,
                                "step": self._train_step_info.step,
                                "micro_step": int(state[MICRO_STEP_KEY])},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load a ``state_dict()`` (before the first step: kept and loaded once the session exists)."""
        if not isinstance(state_dict, Mapping) or "model" not in state_dict:
            raise CheckpointError("ORTTrainer.load_state_dict: expected the dict state_dict() returns "
                                  "(with a 'model' entry)")
        if self._session is None:
            self._take_frozen(dict(state_dict["model"].get("full_precision", {})))  # before the export
            self._pending = lambda: self.load_state_dict(state_dict, strict)
            return
        flat: dict[str, Any] = dict(state_dict["model"].get("full_precision", {}))
        self._take_frozen(flat)
        session = self._session
        assert session is not None
        names = session.names
        reverse = {v: k for k, v in _STATE_NAMES.items()}
        for w, entry in state_dict.get("optimizer", {}).items():
            if w == "shared_optimizer_state":
                for key, value in entry.items():
                    flat[names.step if key == "step" else key] = value
                continue
            for key, value in entry.items():
                if key == "Update_Count":
                    continue
                flat[names.buffer(w) if key == _ACCUMULATION else names.state(w, reverse.get(key, key))] = value
        info = state_dict.get("train_step_info", {})
        flat[MICRO_STEP_KEY] = np.array(info.get("micro_step", 0), np.int64)
        if strict and "optimizer" not in state_dict:
            strict = False  # a model-only state (include_optimizer_states=False): weights only
            self._check_complete(flat, session.artifacts.params)
        elif session.data_parallel is not None:  # this rank's part (ZeRO-1), accumulation restarts
            flat = session.data_parallel.take_checkpoint(flat)
        session.load_state(flat, strict=strict)
        self._train_step_info.optimization_step = int(info.get("optimization_step", session.step))
        self._train_step_info.step = int(info.get("step", self._train_step_info.optimization_step))

    @staticmethod
    def _check_complete(flat: Mapping[str, Any], params: Sequence[str]) -> None:
        missing = [p for p in params if p not in flat]
        if missing:
            raise CheckpointError(f"ORTTrainer: the state lacks model weights {missing[:4]}")

    def save_checkpoint(self, path: str | os.PathLike, user_dict: Mapping[str, Any] | None = None,
                        include_optimizer_states: bool = True) -> None:
        """Write the state (and ``user_dict``, JSON-serialisable) to ``path``, a new file, atomically."""
        if Path(path).exists():
            raise FileExistsError(f"ORTTrainer.save_checkpoint: {str(path)!r} exists (the reference "
                                  "never overwrites a checkpoint); remove it or choose another path")
        session = self._require("save_checkpoint")
        if session is None:
            raise RuntimeError("ORTTrainer.save_checkpoint: nothing to save before the first "
                               "train_step or eval_step")
        state = session.get_state()
        micro_step = int(state[MICRO_STEP_KEY])
        if not include_optimizer_states:
            state = {n: state[n] for n in session.artifacts.params}
        state.update(self._frozen_values())  # the graph's constants: part of the model
        info = self._train_step_info
        meta = {"kind": _CHECKPOINT_KIND, "optimizer": self.optim_config.name,
                "step": session.step, "micro_step": micro_step,
                "optimization_step": info.optimization_step, "train_step": info.step,
                "include_optimizer_states": include_optimizer_states, "user": dict(user_dict or {}),
                "num_batches_tracked": self._batches_tracked()}
        write_checkpoint(path, state, meta)

    def load_checkpoint(self, *paths: str | os.PathLike, strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint of ``save_checkpoint``; returns its ``user_dict``."""
        if len(paths) == 1 and isinstance(paths[0], (list, tuple)):
            paths = tuple(paths[0])  # load_checkpoint([p1, p2]) as load_checkpoint(p1, p2)
        tensors, meta = read_checkpoints(list(paths))  # several: the ranks of one run, merged
        where = f"checkpoint {str(paths[0]) if len(paths) == 1 else [str(p) for p in paths]!r}"
        if meta.get("kind") != _CHECKPOINT_KIND:
            raise CheckpointError(f"{where} was not written by ORTTrainer.save_checkpoint")
        if strict and meta.get("optimizer") != self.optim_config.name and meta.get("include_optimizer_states"):
            raise CheckpointError(f"{where} holds {meta.get('optimizer')} state; this trainer uses "
                                  f"{self.optim_config.name} (load with strict=False for the weights)")
        if not meta.get("include_optimizer_states", True) or \
                (not strict and meta.get("optimizer") != self.optim_config.name):
            params = set(self._session.artifacts.params) if self._session is not None else None
            frozen = self._frozen_graph_names()
            state = {"model": {"full_precision": {k: v for k, v in tensors.items() if k != MICRO_STEP_KEY
                                                  and (params is None or k in params or k in frozen)}}}
            self._load_weights_only(state, where)
        else:
            self._load_flat(tensors, meta, strict, where)
        self._set_batches_tracked(meta.get("num_batches_tracked", {}))  # once the state has loaded
        return dict(meta.get("user", {}))

    def _load_weights_only(self, state: dict[str, Any], where: str) -> None:
        try:
            self.load_state_dict(state, strict=True)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from exc

    def _load_flat(self, tensors: dict[str, np.ndarray], meta: Mapping[str, Any], strict: bool,
                   where: str) -> None:
        info = {"optimization_step": meta.get("optimization_step", 0), "step": meta.get("train_step", 0)}
        tensors = dict(tensors)
        if self._session is None:
            self._take_frozen(dict(tensors))  # before the export
            self._pending = lambda: self._load_flat(tensors, meta, strict, where)
            return
        self._take_frozen(tensors)
        try:
            if self._session.data_parallel is not None:
                tensors = self._session.data_parallel.take_checkpoint(tensors)
            self._session.load_state(tensors, strict=strict)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from exc
        self._train_step_info.optimization_step = int(info["optimization_step"])
        self._train_step_info.step = int(info["step"])

    def save_as_onnx(self, path: str | os.PathLike) -> None:
        """The training model (forward, gradient, optimizer) with the current state as initializers.

        It is the session's graph: its ``X.out`` outputs are the next values of ``X`` when its
        ``step_finite`` output is true (they carry ``gradgraph.valid_if = step_finite``); a
        runtime keeps ``X`` otherwise, as the session does. ``gradgraph build`` writes graphs
        that make that choice themselves."""
        session = self._session
        if session is None:
            raise RuntimeWarning("ORTTrainer.save_as_onnx: no model yet; run train_step or eval_step "
                                 "once first")
        if not str(path) or Path(path).is_dir():
            raise ValueError(f"ORTTrainer.save_as_onnx: {str(path)!r} is not a file path")
        from gradgraph.io import save_model

        # The state wrapped in place (views of the session's buffers, no copy) as initializers
        # of the held inputs; external data for a model over 1 GiB (gradgraph.io.save_model).
        model = ir.from_proto(session.artifacts.train)
        state = session.get_state_views()
        for value in model.graph.inputs:
            if value.name in state:
                value.const_value = ir.Tensor(np.asarray(state[value.name]), name=value.name)
                model.graph.register_initializer(value)
        save_model(model, path)
