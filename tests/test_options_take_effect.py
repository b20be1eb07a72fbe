"""Every public option changes the outcome, or is refused (issue 35 §3).

One case per option of ``TrainingParameters``, the ``TrainingConfig`` groups
(``UpdateOptions``, ``GraphTransformerOptions``, ``CastPropagationConfig``,
``MixedPrecisionConfig``, ``LossScaleSettings``, ``DebugOptions`` / ``GraphSavePaths``,
``TrainingNames``), ``ORTTrainerOptions`` and ``TorchOrtFactory``. Each case sets one option
against a baseline on the bundled example model and checks what it must change:

- ``weights``: the weights after two training steps differ from the baseline's;
- ``graph``: the training graph differs (op types, inputs or outputs), built as for a device
  with every kernel (mixed precision and cast propagation keep nothing in fp32 for the CPU);
- ``file``: the file the option names is written;
- ``refused`` / ``warns``: an error / a warning naming the option.

A coverage test per class fails when an option is added without a case here.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import gradgraph
from gradgraph import TrainingConfig, TrainingParameters, TrainingSession
from gradgraph.training import options as opts
from gradgraph.training.build import build_training_artifacts
from gradgraph.training.options import CastStrategy
from passes.autodiff import GradientError
from passes.optimizer import AdamWConfig, ParamGroup, SGDConfig
from passes.optimizer.optimizer_pass import (
    FLOAT32_MAX,
    LossScaleSettings,
    TrainingNames,
    UpdateOptions,
)
from passes.recompute import RecomputeOptions

EXAMPLE = str(Path(gradgraph.__file__).parent / "examples" / "mlp.onnx")
CPU = ["CPUExecutionProvider"]
STEPS, LR = 2, 0.05


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((8, 16)).astype(np.float32),
            "labels": rng.integers(0, 4, 8).astype(np.int64)}


def _weights(parameters: TrainingParameters | TrainingConfig, model: Any = EXAMPLE,
             steps: int = STEPS) -> dict[str, np.ndarray]:
    session = TrainingSession(model, parameters, providers=CPU)
    for _ in range(steps):
        session.train_step(_feeds(), lr=LR)
    return session.get_model_state()["full_precision"]


def _graph(config: TrainingConfig, model: Any = EXAMPLE, session: bool = False) -> tuple[bytes, ...]:
    """The training, accumulation and eval graphs as bytes (the build is deterministic), the
    initial state and (``session``) the loss scale a session starts with."""
    artifacts = build_training_artifacts(model, config)
    graphs = [g.SerializeToString() for g in (artifacts.train, artifacts.accumulate, artifacts.eval)
              if g is not None]
    initial = sorted((k, np.asarray(v).tobytes()) for k, v in artifacts.initial.items())
    scale = TrainingSession(model, config, providers=CPU).loss_scale if session else None
    return (*graphs, repr(initial).encode(), repr(scale).encode())


def _variant() -> onnx.ModelProto:
    """The example with something for the clean-up passes (an Identity) and an erf-GELU for the
    contrib-op fusion in place of its Tanh."""
    proto = onnx.load(EXAMPLE)
    nodes = list(proto.graph.node)
    helper = onnx.helper
    const = [helper.make_node("Constant", [], [name], value=helper.make_tensor(name, 1, [], [v]))
             for name, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    gelu = [helper.make_node("Div", ["h2", "sqrt2"], ["g1"]), helper.make_node("Erf", ["g1"], ["g2"]),
            helper.make_node("Add", ["g2", "one"], ["g3"]), helper.make_node("Mul", ["h2", "g3"], ["g4"]),
            helper.make_node("Mul", ["g4", "half"], ["a2"])]
    identity = helper.make_node("Identity", ["a1"], ["a1_copy"])
    nodes[2].input[0] = "a1_copy"
    del proto.graph.node[:]
    proto.graph.node.extend(const + nodes[:2] + [identity] + nodes[2:3] + gelu + nodes[4:])
    onnx.checker.check_model(proto)
    return proto


def _differ(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    return [k for k in a if not np.array_equal(a[k], b[k])]


@dataclasses.dataclass(frozen=True)
class Case:
    """``option`` set by ``make(tmp_path)`` (a TrainingParameters or TrainingConfig) must have
    the effect ``expect`` against ``base``: "weights", "graph", "file:<name>", "refused:<regex>"
    or "warns:<regex>"."""

    option: str
    make: Callable[[Path], Any]
    expect: str
    base: Callable[[], Any] | None = None
    model: Callable[[], Any] = lambda: EXAMPLE


def _params(**props: Any) -> TrainingParameters:
    params = TrainingParameters()
    params.loss_output_name = "loss"
    for name, value in props.items():
        setattr(params, name, value)
    return params


def _with_state(params: TrainingParameters) -> TrainingParameters:
    session = TrainingSession(EXAMPLE, _params(), providers=CPU)
    session.train_step(_feeds(), lr=LR)
    params.set_optimizer_initial_state(session.get_optimizer_state())
    return params


UNSUPPORTED = {"use_fp16_moments": True, "world_size": 2, "world_rank": 1, "data_parallel_size": 2,
               "horizontal_parallel_size": 2, "pipeline_parallel_size": 2,
               "num_pipeline_micro_batches": 2, "deepspeed_zero_stage": 1, "enable_adasum": True,
               "allreduce_post_accumulation": True, "use_memory_efficient_gradient": True,
               "pipeline_cut_info_string": "a:b", "sliced_schema": {"x": [2, 8]},
               "sliced_axes": {"x": 0}, "sliced_tensor_names": ["x"]}
MP = {"use_mixed_precision": True}
# Cast propagation on a float32 graph: FLOOD_FILL moves existing casts (there are none),
# INSERT_AND_REDUCE converts the ops the level allows.
IAR = {"propagate_cast_ops_strategy": "INSERT_AND_REDUCE"}

PARAMETER_CASES = [
    Case("weights_to_train", lambda t: _params(weights_to_train={"fc1_weight"}), "weights"),
    Case("weights_not_to_train", lambda t: _params(weights_not_to_train={"fc1_weight"}), "weights"),
    Case("immutable_weights", lambda t: _params(immutable_weights={"fc1_weight": np.zeros((32, 16))}),
         "refused:immutable_weights"),
    Case("loss_output_name", lambda t: _params(loss_output_name="logits"), "refused:logits"),
    Case("training_optimizer_name", lambda t: _params(training_optimizer_name="SGDOptimizer"), "weights"),
    Case("lr_params_feed_name", lambda t: _params(lr_params_feed_name="my_lr"), "graph"),
    Case("optimizer_attributes_map", lambda t: _params(optimizer_attributes_map={"fc1_weight": {"alpha": 0.5}}),
         "weights"),
    Case("optimizer_int_attributes_map",
         lambda t: _params(optimizer_int_attributes_map={"fc1_weight": {"do_bias_correction": 0}}), "weights"),
    Case("gradient_accumulation_steps", lambda t: _params(gradient_accumulation_steps=2), "weights"),
    Case("enable_grad_norm_clip", lambda t: _params(enable_grad_norm_clip=False, max_grad_norm=1e-3),
         "warns:max_grad_norm=0.001 changes nothing", base=lambda: _params(max_grad_norm=1e-3)),
    Case("max_grad_norm", lambda t: _params(max_grad_norm=1e-3), "weights"),
    Case("set_gradients_as_graph_outputs", lambda t: _params(set_gradients_as_graph_outputs=True), "graph"),
    Case("model_after_graph_transforms_path",
         lambda t: _params(model_after_graph_transforms_path=str(t / "f.onnx")), "file:f.onnx"),
    Case("model_with_gradient_graph_path",
         lambda t: _params(model_with_gradient_graph_path=str(t / "f.onnx")), "file:f.onnx"),
    Case("model_with_training_graph_path",
         lambda t: _params(model_with_training_graph_path=str(t / "f.onnx")), "file:f.onnx"),
    Case("model_with_training_graph_after_optimization_path",
         lambda t: _params(model_with_training_graph_after_optimization_path=str(t / "f.onnx")), "file:f.onnx"),
    Case("propagate_cast_ops_level", lambda t: _params(**IAR, propagate_cast_ops_level=1), "graph",
         base=lambda: _params(**IAR)),
    Case("propagate_cast_ops_strategy", lambda t: _params(**IAR, propagate_cast_ops_level=1), "graph",
         base=lambda: _params(propagate_cast_ops_level=1)),
    Case("propagate_cast_ops_allow",
         lambda t: _params(**IAR, propagate_cast_ops_level=0, propagate_cast_ops_allow=["Relu", "Tanh"]),
         "graph", base=lambda: _params(**IAR, propagate_cast_ops_level=0)),
    Case("attn_dropout_recompute", lambda t: _params(attn_dropout_recompute=True),
         "warns:attn_dropout=True .*recomputed nothing"),
    Case("gelu_recompute", lambda t: _params(gelu_recompute=True), "warns:gelu=True .*recomputed nothing"),
    Case("transformer_layer_recompute", lambda t: _params(transformer_layer_recompute=True),
         "warns:transformer_layers=True .*recomputed nothing"),
    Case("number_recompute_layers", lambda t: _params(number_recompute_layers=1),
         "refused:number_recompute_layers.*needs transformer_layer_recompute"),
    # the variant's GELU leaves activations to recompute (since Relu's gradient reads its output,
    # the example's MLP stashes nothing a recompute could drop)
    Case("recompute_memory_budget", lambda t: _params(recompute_memory_budget=0, recompute_dims={"batch": 8}),
         "graph", base=lambda: _params(recompute_dims={"batch": 8}), model=_variant),
    Case("recompute_memory_budget of unsized activations", lambda t: _params(recompute_memory_budget=0),
         "warns:memory_budget=0: activations of symbolic size"),
    Case("recompute_dims", lambda t: _params(recompute_memory_budget=100, recompute_dims={"batch": 8}),
         "graph", base=lambda: _params(recompute_memory_budget=100), model=_variant),
    Case("recompute_dims without a budget", lambda t: _params(recompute_dims={"batch": 8}),
         "warns:recompute_dims size tensors"),
    Case("recompute_nothing_recomputed",
         lambda t: _params(gelu_recompute=True, recompute_nothing_recomputed="error"),
         "refused:gelu=True .*recomputed nothing"),
    Case("use_mixed_precision", lambda t: _params(**MP), "graph"),
    Case("loss_scale", lambda t: _params(**MP, loss_scale=128.0), "graph", base=lambda: _params(**MP)),
    Case("loss_scale without mixed precision", lambda t: _params(loss_scale=128.0),
         "refused:loss_scale is set but use_mixed_precision is False"),
    Case("mixed_precision_dtype without mixed precision", lambda t: _params(mixed_precision_dtype="bfloat16"),
         "warns:mixed_precision_dtype='bfloat16' changes nothing"),
    Case("propagate_cast_ops_allow without a level", lambda t: _params(propagate_cast_ops_allow=["Relu"]),
         "warns:propagate_cast_ops_allow / propagate_cast_ops_strategy change nothing"),
    Case("propagate_cast_ops_level on nothing to move", lambda t: _params(propagate_cast_ops_level=1),
         "warns:propagate_cast_ops level 1 changed nothing"),
    Case("max_grad_norm with SGD", lambda t: _params(training_optimizer_name="SGDOptimizer", max_grad_norm=0.5),
         "warns:max_grad_norm=0.5 changes nothing.*SGD is not clipped"),
    Case("recompute_nothing_recomputed without recompute", lambda t: _params(recompute_nothing_recomputed="error"),
         "warns:recompute_nothing_recomputed changes nothing"),
    Case("mixed_precision_dtype", lambda t: _params(**MP, mixed_precision_dtype="bfloat16"), "graph",
         base=lambda: _params(**MP)),
    Case("param_groups", lambda t: _params(param_groups=(ParamGroup(("fc1_*",), lr_scale=0.0),)), "weights"),
    Case("optimizer_initial_state", lambda t: _with_state(_params()), "weights"),
    *[Case(name, lambda t, n=name, v=value: _params(**{n: v}), f"refused:{name}")
      for name, value in UNSUPPORTED.items()],
]


def _check(case: Case, tmp_path: Path) -> None:
    kind, _, detail = case.expect.partition(":")
    base = case.base() if case.base is not None else _params()
    model = case.model()
    if kind == "refused":
        with pytest.raises((ValueError, NotImplementedError, GradientError), match=detail):
            _weights(case.make(tmp_path), model)
        return
    if kind == "warns":
        with pytest.warns(UserWarning, match=detail):
            _weights(case.make(tmp_path), model)
        return
    if kind == "file":
        _weights(case.make(tmp_path), model)
        onnx.checker.check_model(onnx.load(tmp_path / detail))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. mixed precision without a device
        if kind == "weights":
            changed = _differ(_weights(case.make(tmp_path), model), _weights(base, model))
            assert changed, f"{case.option}: the weights are those of the baseline"
            return
        made, plain = case.make(tmp_path), base
        made = made.to_config() if isinstance(made, TrainingParameters) else made
        plain = plain.to_config() if isinstance(plain, TrainingParameters) else plain
        session = case.option == "LossScaleSettings.init_scale"  # the scale a session starts with
        assert _graph(plain, model) == _graph(plain, model), "the build is not deterministic"
        assert _graph(made, model, session) != _graph(plain, model, session), \
            f"{case.option}: the training graph is the baseline's"


@pytest.mark.parametrize("case", PARAMETER_CASES, ids=lambda c: c.option)
def test_training_parameters_take_effect(case: Case, tmp_path: Path) -> None:
    _check(case, tmp_path)


def test_every_training_parameter_has_a_case() -> None:
    props = {k for k in vars(TrainingParameters()) if not k.startswith("_")}
    assert props == {c.option.split()[0] for c in PARAMETER_CASES}


# ---- the optimizer maps are per weight (issue 35 §4) ------------------------------------------


@pytest.mark.parametrize("prop,attrs", [("optimizer_attributes_map", {"alpha": 0.5, "lambda": 0.1}),
                                        ("optimizer_int_attributes_map", {"do_bias_correction": 0})])
def test_an_optimizer_map_changes_only_the_weight_it_names(prop: str, attrs: dict[str, Any]) -> None:
    """After one step (from the second on, every gradient depends on the changed weight)."""
    params = _params(enable_grad_norm_clip=False)  # the global norm would tie the weights together
    base = _weights(params, steps=1)
    changed = _differ(_weights(_params(enable_grad_norm_clip=False, **{prop: {"fc2_weight": attrs}}),
                               steps=1), base)
    assert changed == ["fc2_weight"]


def test_an_optimizer_map_naming_no_trained_weight_is_refused() -> None:
    with pytest.raises(GradientError, match=r"optimizer_attributes_map.*'fc2_wieght', which is no "
                                            r"trained weight \(did you mean 'fc2_weight'"):
        _weights(_params(optimizer_attributes_map={"fc2_wieght": {"alpha": 0.5}}))
    with pytest.raises(GradientError, match="'fc1_weight', which is no trained weight"):
        _weights(_params(weights_not_to_train={"fc1_weight"},
                         optimizer_int_attributes_map={"fc1_weight": {"do_bias_correction": 0}}))


@pytest.mark.parametrize("value,words", [
    ({"alpha": 0.9}, r"\{weight_name: \{attribute: value\}\}.*got 'alpha': 0.9 \(a flat map"),
    ([("w", {"alpha": 0.9})], r"\{weight_name: \{attribute: value\}\}.*got a list"),
    ({"fc1_weight": {"max_norm_clip": 1.0}}, "max_norm_clip.*max_grad_norm"),
    ({"fc1_weight": {"alpah": 0.9}}, "'alpah' .*does not apply"),
])
def test_a_malformed_optimizer_map_names_the_expected_shape(value: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _params(optimizer_attributes_map=value).to_config()


def test_data_parallel_size_says_how_to_run_data_parallel() -> None:
    with pytest.raises(NotImplementedError, match=r"--nproc N.*DistributedConfig\.from_env\(\)"):
        _params(data_parallel_size=2).to_config()


def test_a_weight_in_two_parameter_groups_warns_naming_both() -> None:
    groups = (ParamGroup(("fc1_*",), {"weight_decay": 0.0}), ParamGroup(("*_weight",), lr_scale=0.5))
    with pytest.warns(UserWarning, match=r"weights fc1_weight match parameter group 0 \['fc1_\*'\] and "
                                         r"group 1 \['\*_weight'\]: the first group that matches applies"):
        _graph(TrainingConfig("loss", AdamWConfig(), update=UpdateOptions(groups=groups)))


def test_unbounded_max_loss_scale_is_the_largest_float32() -> None:
    """inf: no cap. Kept as inf, a doubled float32 scale became inf, and inf / 2 stays inf:
    every later step overflowed and was skipped."""
    assert LossScaleSettings(max_loss_scale=math.inf).max_loss_scale == FLOAT32_MAX
    with pytest.raises(ValueError, match="init_scale must be a finite float32"):
        LossScaleSettings(init_scale=math.inf, max_loss_scale=math.inf)
    config = TrainingConfig("loss", SGDConfig(), mixed_precision=opts.MixedPrecisionConfig(
        "float16", LossScaleSettings(max_loss_scale=math.inf)))
    train = build_training_artifacts(EXAMPLE, config).train.graph
    caps = [onnx.numpy_helper.to_array(a.t) for n in train.node if n.op_type == "Constant"
            for a in n.attribute if a.name == "value"]
    assert any(c.size == 1 and float(c.reshape(-1)[0]) == FLOAT32_MAX for c in caps)
    assert not any(c.dtype.kind == "f" and np.isinf(c).any() for c in caps)


# ---- TrainingConfig and its groups ------------------------------------------------------------


def _config(**fields: Any) -> TrainingConfig:
    return TrainingConfig("loss", AdamWConfig(), **fields)


def _update(**fields: Any) -> TrainingConfig:
    return _config(update=UpdateOptions(**fields))


def _names(**fields: Any) -> TrainingConfig:
    """Accumulation, clipping and a loss scale: every name a training graph may hold is used."""
    return _config(update=UpdateOptions(accumulation_steps=2, max_grad_norm=1.0, names=TrainingNames(**fields)),
                   mixed_precision=opts.MixedPrecisionConfig("float16"))


def _mp(dtype: str = "float16", **fields: Any) -> TrainingConfig:
    return _config(mixed_precision=opts.MixedPrecisionConfig(dtype, **fields))


def _cast(**fields: Any) -> TrainingConfig:
    fields.setdefault("strategy", opts.CastStrategy.INSERT_AND_REDUCE)
    return _config(graph_transformer=opts.GraphTransformerOptions(
                       propagate_cast_ops=opts.CastPropagationConfig(**fields)))


def _saves(**fields: str) -> Callable[[Path], TrainingConfig]:
    return lambda t: _config(debug=opts.DebugOptions(opts.GraphSavePaths(
        **{k: str(t / v) for k, v in fields.items()})))


CONFIG_CASES = [
    Case("TrainingConfig.loss", lambda t: TrainingConfig("logits"), "refused:logits"),
    Case("TrainingConfig.optimizer", lambda t: TrainingConfig("loss", SGDConfig()), "weights",
         base=lambda: _config()),
    Case("TrainingConfig.weights_to_train", lambda t: _config(weights_to_train=("fc1_weight",)), "weights",
         base=lambda: _config()),
    Case("TrainingConfig.weights_not_to_train", lambda t: _config(weights_not_to_train=("fc1_weight",)),
         "weights", base=lambda: _config()),
    Case("TrainingConfig.loss_reduction", lambda t: TrainingConfig("logits", SGDConfig(), loss_reduction="mean"),
         "weights", base=lambda: TrainingConfig("logits", SGDConfig(), loss_reduction="sum")),
    Case("TrainingConfig.loss_reduction of a scalar", lambda t: _config(loss_reduction="mean"),
         "warns:loss reduction 'mean' changes nothing: the loss 'loss' is already a scalar"),
    Case("UpdateOptions.groups", lambda t: _update(groups=(ParamGroup(("fc1_*",), lr_scale=0.0),)),
         "weights", base=lambda: _config()),
    Case("UpdateOptions.accumulation_steps", lambda t: _update(accumulation_steps=2), "weights",
         base=lambda: _config()),
    Case("UpdateOptions.max_grad_norm", lambda t: _update(max_grad_norm=1e-3), "weights",
         base=lambda: _config()),
    Case("UpdateOptions.clip_eps", lambda t: _update(max_grad_norm=1e-3, clip_eps=1.0), "weights",
         base=lambda: _update(max_grad_norm=1e-3)),
    Case("UpdateOptions.keep_gradient_outputs", lambda t: _update(keep_gradient_outputs=True), "graph",
         base=lambda: _config()),
    Case("UpdateOptions.skip_non_finite", lambda t: _update(skip_non_finite=False), "graph",
         base=lambda: _config()),
    Case("UpdateOptions.loss_scale", lambda t: _update(loss_scale=LossScaleSettings()),
         "refused:update.loss_scale is set by mixed precision"),
    Case("UpdateOptions.names", lambda t: _names(learning_rate="lr2"), "graph", base=lambda: _config()),
    Case("UpdateOptions.select_in_graph", lambda t: _update(select_in_graph=False), "graph",
         base=lambda: _config()),
    Case("UpdateOptions.fuse_below", lambda t: _update(fuse_below=0), "graph", base=lambda: _config()),
    Case("UpdateOptions.guard_before_update", lambda t: _update(guard_before_update=True), "graph",
         base=lambda: _config()),
    Case("GraphTransformerOptions.cleanup",
         lambda t: _config(graph_transformer=opts.GraphTransformerOptions(cleanup=True)), "graph",
         base=lambda: _config(), model=_variant),
    Case("GraphTransformerOptions.contrib_ops",
         lambda t: _config(graph_transformer=opts.GraphTransformerOptions(contrib_ops=False)),
         "graph", base=lambda: _config(), model=_variant),
    Case("GraphTransformerOptions.propagate_cast_ops", lambda t: _cast(level=1), "graph",
         base=lambda: _config()),
    Case("GraphTransformerOptions.recompute",
         lambda t: _config(graph_transformer=opts.GraphTransformerOptions(
             recompute=RecomputeOptions(memory_budget=0, dims=(("batch", 8),)))), "graph",
         base=lambda: _config(), model=_variant),
    Case("CastPropagationConfig.strategy", lambda t: _cast(level=1), "graph",
         base=lambda: _cast(level=1, strategy=opts.CastStrategy.FLOOD_FILL)),
    Case("CastPropagationConfig.level", lambda t: _cast(level=1), "graph", base=lambda: _cast(level=0)),
    Case("CastPropagationConfig.allow", lambda t: _cast(level=0, allow=("Relu", "Tanh")), "graph",
         base=lambda: _cast(level=0)),
    Case("MixedPrecisionConfig.dtype", lambda t: _mp(), "graph", base=lambda: _config()),
    Case("MixedPrecisionConfig.loss_scaler", lambda t: _mp(loss_scaler=LossScaleSettings(dynamic=False)),
         "graph", base=lambda: _mp()),
    Case("MixedPrecisionConfig.scale_bfloat16", lambda t: _mp("bfloat16", scale_bfloat16=True), "graph",
         base=lambda: _mp("bfloat16")),
    Case("LossScaleSettings.init_scale", lambda t: _mp(loss_scaler=LossScaleSettings(init_scale=8.0)),
         "graph", base=lambda: _mp()),
    Case("LossScaleSettings.up_scale_window", lambda t: _mp(loss_scaler=LossScaleSettings(up_scale_window=3)),
         "graph", base=lambda: _mp()),
    Case("LossScaleSettings.min_loss_scale", lambda t: _mp(loss_scaler=LossScaleSettings(min_loss_scale=2.0)),
         "graph", base=lambda: _mp()),
    Case("LossScaleSettings.max_loss_scale", lambda t: _mp(loss_scaler=LossScaleSettings(max_loss_scale=2.0**20)),
         "graph", base=lambda: _mp()),
    Case("LossScaleSettings.dynamic", lambda t: _mp(loss_scaler=LossScaleSettings(dynamic=False)), "graph",
         base=lambda: _mp()),
    Case("DebugOptions.save_stages", lambda t: _config(debug=opts.DebugOptions(save_stages=str(t))),
         "file:04_training.onnx"),
    Case("GraphSavePaths.model_after_graph_transforms_path",
         _saves(model_after_graph_transforms_path="f.onnx"), "file:f.onnx"),
    Case("GraphSavePaths.model_with_gradient_graph_path",
         _saves(model_with_gradient_graph_path="f.onnx"), "file:f.onnx"),
    Case("GraphSavePaths.model_with_training_graph_path",
         _saves(model_with_training_graph_path="f.onnx"), "file:f.onnx"),
    Case("GraphSavePaths.model_with_training_graph_after_optimization_path",
         _saves(model_with_training_graph_after_optimization_path="f.onnx"), "file:f.onnx"),
    *[Case(f"TrainingNames.{f.name}", lambda t, n=f.name: _names(**{n: f"renamed_{n}"}), "graph",
           base=_names)
      for f in dataclasses.fields(TrainingNames)],
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.option)
def test_training_config_options_take_effect(case: Case, tmp_path: Path) -> None:
    _check(case, tmp_path)


@pytest.mark.parametrize("cls", [TrainingConfig, UpdateOptions, opts.GraphTransformerOptions,
                                 opts.CastPropagationConfig, opts.MixedPrecisionConfig,
                                 LossScaleSettings, opts.DebugOptions, opts.GraphSavePaths, TrainingNames])
def test_every_config_field_has_a_case(cls: type) -> None:
    covered = {c.option.split()[0] for c in CONFIG_CASES}
    fields = {f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)}
    missing = sorted(fields - covered)
    if cls is opts.DebugOptions:
        missing.remove("DebugOptions.graph_save_paths")  # its fields: GraphSavePaths.*
    if cls is TrainingConfig:  # each group's fields have cases of their own
        missing = [m for m in missing if m.split(".")[1] not in
                   ("update", "graph_transformer", "mixed_precision", "debug")]
    assert not missing


# ---- TorchOrtFactory ---------------------------------------------------------------------------


def _factory_model() -> onnx.ModelProto:
    """Y = tanh(X @ W + B) @ V with two graph inputs X and B, and a second output S = sum(tanh)."""
    return onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
    g (float[5,4] X, float[6] B) => (float[5,3] Y, float S) <float[4,6] W = {
        0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, 0.8, -0.9, 1.0, 0.1, 0.2,
        0.3, 0.4, 0.5, -0.6, 0.7, 0.8, 0.9, 1.0, 0.1, -0.2, 0.3, 0.4},
        float[6,3] V = {0.5, 0.1, -0.3, 0.2, 0.4, 0.6, -0.1, 0.3, 0.2, 0.9, -0.5, 0.1,
                        0.3, 0.3, 0.3, -0.2, 0.1, 0.7}> {
      m = MatMul(X, W)
      h0 = Add(m, B)
      h = Tanh(h0)
      Y = MatMul(h, V)
      S = ReduceSum<keepdims = 0>(h)
    }""")


def _apply(cls: Any, *tensors: Any) -> Any:
    torch = pytest.importorskip("torch")
    w = torch.tensor(onnx.numpy_helper.to_array(_factory_model().graph.initializer[0]), requires_grad=True)
    return cls.apply(*tensors, w)


def test_torch_ort_factory_arguments_take_effect(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    import onnxruntime as ort

    from gradgraph.torch import TorchOrtFactory

    x, b = torch.ones(5, 4), torch.arange(6, dtype=torch.float32) / 6
    plain = TorchOrtFactory(_factory_model(), ["W"]).create_class()
    y, s = _apply(plain, x, b)
    # input_names: the order apply takes the inputs in
    swapped = TorchOrtFactory(_factory_model(), ["W"], input_names=["B", "X"]).create_class()
    y2, _ = _apply(swapped, b, x)
    torch.testing.assert_close(y2, y)
    # output_names: which outputs, in which order
    only = TorchOrtFactory(_factory_model(), ["W"], output_names=["S"]).create_class()
    torch.testing.assert_close(_apply(only, x, b), s)
    # class_name
    assert TorchOrtFactory(_factory_model(), ["W"], class_name="MyFn").create_class().__name__ == "MyFn"
    # sess_options: the user's options reach the sessions (here: onnxruntime writes its graph)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    _apply(TorchOrtFactory(_factory_model(), ["W"], sess_options=so).create_class(), x, b)
    assert (tmp_path / "optimized.onnx").exists()
    # providers / provider_options reach the sessions
    given = [{"arena_extend_strategy": "kSameAsRequested"}]
    factory = TorchOrtFactory(_factory_model(), ["W"], providers=["CPUExecutionProvider"], provider_options=given)
    assert factory._provider_options() == given  # what the sessions are made with
    assert factory.create_class()._sess.get_providers() == ["CPUExecutionProvider"]
    # graph_builder_config: onnxruntime-training's, ignored with a warning
    with pytest.warns(UserWarning, match="graph_builder_config .* is ignored"):
        TorchOrtFactory(_factory_model(), ["W"], graph_builder_config=object())
    # device_index: refused where no GPU provider would use it, or against provider_options
    with pytest.raises(ValueError, match=r"device_index=1 selects the device of a GPU provider"):
        TorchOrtFactory(_factory_model(), ["W"], device_index=1)
    with pytest.raises(ValueError, match=r"device_index=1 and CUDAExecutionProvider's provider_options "
                                         r"device_id='0'"):
        TorchOrtFactory(_factory_model(), ["W"], providers=["CUDAExecutionProvider"],
                        provider_options=[{"device_id": "0"}], device_index=1)
    gpu = TorchOrtFactory(_factory_model(), ["W"], providers=["CUDAExecutionProvider"],
                          provider_options=[{"gpu_mem_limit": "1024"}], device_index=2)
    assert gpu._provider_options() == [{"device_id": "2", "gpu_mem_limit": "1024"}]
    # create_class: enable_logging logs the build, keep_models keeps the pre-gradient graph,
    # debug does both
    with caplog.at_level("INFO", logger="gradgraph.torch"):
        TorchOrtFactory(_factory_model(), ["W"]).create_class(enable_logging=True)
    assert "built; forward outputs" in caplog.text
    assert isinstance(TorchOrtFactory(_factory_model(), ["W"]).create_class(keep_models=True)
                      ._optimized_pre_grad_model, onnx.ModelProto)
    assert not hasattr(plain, "_optimized_pre_grad_model")
    caplog.clear()
    with caplog.at_level("INFO", logger="gradgraph.torch"):
        debug = TorchOrtFactory(_factory_model(), ["W"]).create_class(debug=True)
    assert "built; forward outputs" in caplog.text and hasattr(debug, "_optimized_pre_grad_model")


# ---- ORTTrainerOptions ---------------------------------------------------------------------------


@pytest.mark.parametrize("key,short", [("propagate_cast_ops_level", "level"),
                                       ("propagate_cast_ops_strategy", "strategy"),
                                       ("propagate_cast_ops_allow", "allow")])
def test_ort_trainer_options_reads_the_schemas_long_names(key: str, short: str) -> None:
    pytest.importorskip("torch")
    from gradgraph.torch.trainer_options import ORTTrainerOptions

    value = {"level": 2, "strategy": "INSERT_AND_REDUCE", "allow": ["Relu"]}[short]
    for given in (key, short):
        options = ORTTrainerOptions({"graph_transformer": {"propagate_cast_ops_config": {given: value}}})
        group = options.graph_transformer.propagate_cast_ops_config
        assert getattr(group, key) == getattr(group, short)
        assert getattr(group, short) == (value if short != "strategy" else CastStrategy.INSERT_AND_REDUCE)
        for path in (key, short):
            assert options.was_set(f"graph_transformer.propagate_cast_ops_config.{path}")
    with pytest.raises(ValueError, match=f"{key} and .*{short} are the same option"):
        ORTTrainerOptions({"graph_transformer": {"propagate_cast_ops_config": {key: value, short: value}}})


# ---- CLI: gradgraph build ------------------------------------------------------------------------


def _build_outcome(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Any, ...]:
    from gradgraph.cli.main import main as cli_main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli_main([*argv, "--save-stages", str(out)])
    printed = capsys.readouterr()
    stages = {p.name: p.read_bytes() for p in sorted(out.glob("*.onnx"))} if out.is_dir() else {}
    return code, stages, printed.err


def _variant_path(tmp_path: Path) -> str:
    path = tmp_path / "variant.onnx"
    onnx.save(_variant(), path)
    return str(path)


# (flag, its arguments, the arguments of the baseline it is compared with); {variant}: the
# example with an Identity and an erf-GELU
BUILD_FLAGS = [
    ("--weights", ["--weights", "fc1_weight"], []),
    ("--freeze", ["--freeze", "fc1_weight"], []),
    ("--reduce", ["--loss", "logits", "--reduce", "mean"], ["--loss", "logits", "--reduce", "sum"]),
    ("--optimizer", ["--optimizer", "sgd"], []),
    ("--adam-eps", ["--adam-eps", "1e-3"], []),
    ("--accumulate", ["--accumulate", "2"], []),
    ("--clip", ["--clip", "1.0"], []),
    ("--cleanup", ["{variant}", "--cleanup"], ["{variant}"]),
    ("--standard-ops", ["{variant}", "--standard-ops"], ["{variant}"]),
    ("--recompute", ["{variant}", "--recompute", "gelu"], ["{variant}"]),
    ("--memory-budget", ["{variant}", "--memory-budget", "0", "--dim", "batch=8"], ["{variant}", "--dim", "batch=8"]),
    ("--dim", ["{variant}", "--memory-budget", "100", "--dim", "batch=8"], ["{variant}", "--memory-budget", "100"]),
    ("--cast-level", ["--cast-level", "1", "--cast-strategy", "INSERT_AND_REDUCE"],
     ["--cast-strategy", "INSERT_AND_REDUCE"]),
    ("--cast-strategy", ["--cast-level", "1", "--cast-strategy", "INSERT_AND_REDUCE"], ["--cast-level", "1"]),
    ("--cast-allow", ["--cast-level", "0", "--cast-strategy", "INSERT_AND_REDUCE", "--cast-allow", "Relu"],
     ["--cast-level", "0", "--cast-strategy", "INSERT_AND_REDUCE"]),
    ("--mixed-precision", ["--mixed-precision", "float16"], []),
    ("--device", ["{variant}", "--mixed-precision", "float16", "--device", "cpu"],
     ["{variant}", "--mixed-precision", "float16"]),
]
BUILD_REFUSED = [
    ("--loss", ["--loss", "nope"], "nope"),
    ("--recompute-layers", ["--recompute-layers", "1"], "needs --recompute transformer_layers"),
]


def _argv(args: list[str], tmp_path: Path) -> list[str]:
    model = _variant_path(tmp_path) if "{variant}" in args else EXAMPLE
    args = [a for a in args if a != "{variant}"]
    loss = [] if "--loss" in args else ["--loss", "loss"]
    return ["build", model, *loss, *args]


@pytest.mark.parametrize("flag,args,base", BUILD_FLAGS, ids=[f[0] for f in BUILD_FLAGS])
def test_build_flags_take_effect(flag: str, args: list[str], base: list[str], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, stages, err = _build_outcome(_argv(args, tmp_path), tmp_path / "a", capsys)
    base_code, base_stages, _ = _build_outcome(_argv(base, tmp_path), tmp_path / "b", capsys)
    assert code == 0, err
    assert code == base_code == 0
    assert stages != base_stages, f"{flag}: the same stage models as without it"


@pytest.mark.parametrize("flag,args,words", BUILD_REFUSED, ids=[f[0] for f in BUILD_REFUSED])
def test_build_flags_refused(flag: str, args: list[str], words: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _build_outcome(_argv(args, tmp_path), tmp_path / "a", capsys)
    assert code != 0 and words in err


def test_every_build_flag_has_a_case() -> None:
    import argparse

    from gradgraph.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["build"]._actions for s in a.option_strings if s.startswith("--")}
    covered = {f[0] for f in BUILD_FLAGS + BUILD_REFUSED} | {
        "--help", "--save-stages",  # every case writes its stages there
        "--list-weights",  # test_build_list_weights_prints_the_weights
        "--verbose"}  # tests/test_export_folds.py::test_a_refusal_names_a_few_parameters_and_counts_the_rest
    assert flags == covered


def test_build_list_weights_prints_the_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gradgraph.cli.main import main as cli_main

    assert cli_main(["build", EXAMPLE, "--loss", "loss", "--list-weights"]) == 0
    printed = capsys.readouterr().out
    assert all(w in printed for w in ("fc1_weight", "fc3_bias"))


# ---- CLI: gradgraph train ------------------------------------------------------------------------

DATA = str(Path(gradgraph.__file__).parent / "examples" / "mlp_data.npz")


def _train_outcome(args: list[str], tmp_path: Path, name: str,
                   capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str, str]:
    """Exit status, the checkpoint's tensors, stdout and stderr of a short ``train`` run."""
    from safetensors.numpy import load_file

    from gradgraph.cli.main import main as cli_main

    folder = tmp_path / name
    model = _variant_path(tmp_path) if "{variant}" in args else EXAMPLE
    args = [a for a in args if a != "{variant}"]
    defaults = {"--loss": "loss", "--data": DATA, "--steps": "3", "--batch-size": "8",
                "--checkpoint-dir": str(folder)}
    argv = ["train", model, *[x for k, v in defaults.items() if k not in args for x in (k, v)], *args]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli_main(argv)
    printed = capsys.readouterr()
    checkpoint = Path(argv[argv.index("--checkpoint-dir") + 1]) / "checkpoint.safetensors"
    tensors = load_file(checkpoint) if checkpoint.exists() else {}
    return code, tensors, printed.out, printed.err


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# (flag, its arguments, the baseline's); the build flags (shared by train) are checked again
# through train: they change the trained weights, or (--save-stages) the stage models
TRAIN_FLAGS = [
    ("--data", ["--data", "{shuffled}"], []),
    ("--optimizer", ["--optimizer", "sgd"], []),
    ("--lr", ["--lr", "0.1"], []),
    ("--momentum", ["--optimizer", "sgd", "--momentum", "0.9"], ["--optimizer", "sgd"]),
    ("--weight-decay", ["--weight-decay", "0.5"], []),
    ("--no-decay", ["--weight-decay", "0.5", "--no-decay", "*_bias"], ["--weight-decay", "0.5"]),
    ("--steps", ["--steps", "4"], []),
    ("--batch-size", ["--batch-size", "16"], []),
    ("--schedule", ["--schedule", "cosine"], []),
    ("--warmup-steps", ["--schedule", "linear-warmup", "--warmup-steps", "2"],
     ["--schedule", "linear-warmup", "--warmup-steps", "1"]),
    ("--warmup-steps", ["--warmup-steps", "2"], []),
    ("--stop-at", ["--stop-at", "2"], []),
    ("--quiet", ["--quiet"], []),
    # the graph-transform flags train shares with build: the stage models differ
    *[(flag, [*args, "--save-stages", "{stages}"], [*base, "--save-stages", "{stages}"])
      for flag, args, base in BUILD_FLAGS if flag not in ("--weights", "--device")],
]


def _fill(args: list[str], tmp_path: Path, name: str) -> list[str]:
    if "{shuffled}" in args:
        data = dict(np.load(DATA))
        order = np.random.default_rng(0).permutation(len(data["x"]))
        np.savez(tmp_path / "shuffled.npz", **{k: v[order] for k, v in data.items()})
    return [str(tmp_path / "shuffled.npz") if a == "{shuffled}" else
            str(tmp_path / f"stages_{name}") if a == "{stages}" else a for a in args]


@pytest.mark.parametrize("flag,args,base", TRAIN_FLAGS, ids=[f[0] for f in TRAIN_FLAGS])
def test_train_flags_take_effect(flag: str, args: list[str], base: list[str], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, tensors, out, err = _train_outcome(_fill(args, tmp_path, "a"), tmp_path, "a", capsys)
    base_code, base_tensors, _, base_err = _train_outcome(_fill(base, tmp_path, "b"), tmp_path, "b", capsys)
    assert code == base_code == 0, err
    if "{stages}" in args:
        stages = {p.name: p.read_bytes() for p in sorted((tmp_path / "stages_a").glob("*.onnx"))}
        base_stages = {p.name: p.read_bytes() for p in sorted((tmp_path / "stages_b").glob("*.onnx"))}
        assert stages and stages != base_stages, f"{flag}: the same stage models as without it"
    elif flag == "--quiet":
        assert len(err) < len(base_err)
    else:
        assert tensors and not _same(tensors, base_tensors), f"{flag}: the same checkpoint as without it"


TRAIN_REFUSED = [
    ("--loss", ["--loss", "nope"], "nope"),
    ("--recompute-layers", ["--recompute-layers", "1"], "needs --recompute transformer_layers"),
    ("--nproc", ["--nproc", "0"], "--nproc"),
    ("--device", ["--device", "cuda"], "'CUDAExecutionProvider' is not available"),
]


@pytest.mark.parametrize("flag,args,words", TRAIN_REFUSED, ids=[f[0] for f in TRAIN_REFUSED])
def test_train_flags_refused(flag: str, args: list[str], words: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    import onnxruntime as ort

    if flag == "--device" and "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here: --device cuda runs")
    code, _, _, err = _train_outcome(args, tmp_path, "a", capsys)
    assert code == 2 and words in err


def test_train_checkpoint_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--checkpoint-dir writes the checkpoint; --resume continues it (bit-identical to one run);
    a folder holding one is refused without --resume or --overwrite; --overwrite starts afresh;
    --checkpoint-every writes checkpoints during the run; --max-skipped stops a diverging run."""
    code, full, _, _ = _train_outcome([], tmp_path, "full", capsys)
    assert code == 0 and full
    assert _train_outcome(["--stop-at", "2"], tmp_path, "part", capsys)[0] == 0
    code, _, _, err = _train_outcome([], tmp_path, "part", capsys)
    assert code == 2 and "--resume" in err and "--overwrite" in err
    code, resumed, _, _ = _train_outcome(["--resume"], tmp_path, "part", capsys)
    assert code == 0 and _same(resumed, full)
    assert _train_outcome(["--stop-at", "2"], tmp_path, "again", capsys)[0] == 0
    code, afresh, _, _ = _train_outcome(["--overwrite", "--steps", "3"], tmp_path, "again", capsys)
    assert code == 0 and _same(afresh, full)
    saves: list[str] = []
    original = TrainingSession.save_checkpoint
    monkeypatch.setattr(TrainingSession, "save_checkpoint",
                        lambda self, path, *a, **k: (saves.append(str(path)), original(self, path, *a, **k)))
    assert _train_outcome(["--checkpoint-every", "1"], tmp_path, "every", capsys)[0] == 0
    every = len(saves)
    assert _train_outcome([], tmp_path, "every_plain", capsys)[0] == 0
    assert every == 3 + 1 and len(saves) - every == 1  # after each step (and at the end) / at the end
    monkeypatch.undo()
    bad = dict(np.load(DATA))
    bad["x"][16:] = np.inf  # steps 3 on are not finite
    np.savez(tmp_path / "inf.npz", **bad)
    code, _, _, err = _train_outcome(["--data", str(tmp_path / "inf.npz"), "--max-skipped", "1",
                                      "--steps", "5"], tmp_path, "diverge", capsys)
    assert code == 3 and "1 steps in a row" in err
    code, _, _, err = _train_outcome(["--data", str(tmp_path / "inf.npz"), "--max-skipped", "2",
                                      "--steps", "5"], tmp_path, "diverge2", capsys)
    assert code == 3 and "2 steps in a row" in err


def test_every_train_flag_has_a_case() -> None:
    import argparse

    from gradgraph.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["train"]._actions for s in a.option_strings if s.startswith("--")}
    covered = {f[0] for f in TRAIN_FLAGS + TRAIN_REFUSED} | {
        "--help", "--list-weights", "--verbose",  # as build's (the same function)
        "--save-stages",  # the graph-transform cases compare the stage models it writes
        "--checkpoint-dir", "--checkpoint-every", "--resume", "--overwrite", "--max-skipped",
        # test_train_checkpoint_flags
        "--nproc"}  # tests/test_distributed.py::test_cli_nproc_2_is_one_process_with_twice_the_batch
    assert flags == covered


# ---- ORTModule ------------------------------------------------------------------------------------


def _ortmodule_run(tmp_path: Path, name: str, **kwargs: Any) -> dict[str, bytes]:
    """One training call of ORTModule on a small MLP with save_onnx: the graphs it wrote."""
    torch = pytest.importorskip("torch")
    from gradgraph.torch import DebugOptions, ORTModule

    torch.manual_seed(0)

    class Foldable(torch.nn.Module):
        """Something for the optimizer: a constant computed in the forward, shape arithmetic."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 8)

        def forward(self, x: Any) -> Any:
            y = self.lin(x) * (torch.ones(8) * 2.0 + 1.0)
            return y.reshape(y.shape[0] * 2, y.shape[1] // 2)

    module = Foldable()
    prefix = tmp_path / name
    mine = ORTModule(module, DebugOptions(save_onnx=True, onnx_prefix=str(prefix)), **kwargs)
    mine(torch.randn(3, 4)).sum().backward()
    return {p.name[len(name):]: p.read_bytes() for p in sorted(tmp_path.glob(f"{name}_*.onnx"))}


def test_ortmodule_arguments_take_effect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import onnxruntime as ort

    from gradgraph.torch import ORTModule

    # debug_options: save_onnx / onnx_prefix write the graphs (log_level: tests/test_ortmodule.py
    # test_debug_log_levels)
    plain = _ortmodule_run(tmp_path, "default")
    assert "_optimized_pre_grad_training.onnx" in plain
    # optimize: onnxscript's optimizer on the exported graph, or not
    unoptimized = _ortmodule_run(tmp_path, "unoptimized", optimize=False)
    key = "_optimized_pre_grad_training.onnx"
    assert unoptimized[key] != plain[key]
    # threads: onnxruntime's intra-op threads of every session
    seen: list[int] = []

    class Recording(ort.InferenceSession):
        def __init__(self, model: Any, sess_options: Any = None, *args: Any, **kwargs: Any) -> None:
            seen.append(sess_options.intra_op_num_threads if sess_options is not None else -1)
            super().__init__(model, sess_options, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Recording)
    _ortmodule_run(tmp_path, "one_thread", threads=1)
    assert seen and set(seen) == {1}
    seen.clear()
    _ortmodule_run(tmp_path, "default_threads")
    assert seen and set(seen) != {1}  # onnxruntime's default (0: one per core)
    monkeypatch.undo()
    # fallback: "warn" runs an unexportable module in PyTorch with a warning, "raise" refuses
    pool, x = torch.nn.AdaptiveMaxPool2d(3), torch.randn(1, 2, 7, 7)
    with pytest.warns(RuntimeWarning, match="adaptive_max_pool2d"):
        torch.testing.assert_close(ORTModule(pool, fallback="warn")(x), pool(x))
    with pytest.raises(Exception, match="adaptive_max_pool2d"):
        ORTModule(pool, fallback="raise")(x)
    # force_threads: more threads than cores only when forced
    import os

    many = (os.cpu_count() or 1) + 1
    with pytest.raises(ValueError, match="force_threads=True"):
        ORTModule(torch.nn.Linear(2, 2), threads=many)
    ORTModule(torch.nn.Linear(2, 2), threads=many, force_threads=True)


def test_every_ortmodule_argument_has_a_case() -> None:
    pytest.importorskip("torch")
    import inspect

    from gradgraph.torch import DebugOptions, ORTModule

    arguments = set(inspect.signature(ORTModule.__init__).parameters) - {"self", "module"}
    assert arguments == {"debug_options", "fallback", "optimize", "threads", "force_threads"}
    assert {f.name for f in dataclasses.fields(DebugOptions)} == {"save_onnx", "onnx_prefix", "log_level"}


# ---- ORTTrainerOptions: every option of the schema -------------------------------------------------

TRAINER_DESC = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
                "outputs": [("loss", [], True), ("logits", ["batch", 4])]}


def _trainer_outcome(options: dict[str, Any], tmp_path: Path, name: str, steps: int = 2) -> dict[str, Any]:
    """Two ORTTrainer steps on a small MLP (CPU): the weights, the trainer's state and the
    training graph it saved."""
    torch = pytest.importorskip("torch")
    from gradgraph.torch import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    saved = tmp_path / f"{name}_training.onnx"
    given = {**options, "device": {"id": "cpu", **options.get("device", {})}}
    debug = given.setdefault("debug", {})
    debug.setdefault("graph_save_paths", {}).setdefault("model_with_training_graph_path", str(saved))
    trainer = ORTTrainer(model, TRAINER_DESC, optim.AdamConfig(lr=0.05), torch.nn.CrossEntropyLoss(),
                         ORTTrainerOptions(given))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        trainer.train_step(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g))
    weights = {k: v.numpy().copy() for k, v in trainer.state_dict(pytorch_format=True).items()}
    return {"weights": weights, "graph": saved.read_bytes() if saved.exists() else b"",
            "state": repr(trainer.state_dict()["optimizer"].get("shared_optimizer_state", {}))}


def _scheduler() -> Any:
    from gradgraph.torch import optim

    return optim.LinearWarmupLRScheduler(total_steps=4, warmup=0.5)


def _scaler() -> Any:
    from gradgraph.torch import optim

    return optim.DynamicLossScaler(loss_scale=float(1 << 10))


# (option path, options, expected: "weights" / "graph" / "state" differ from the baseline's
# (``base`` options), "file:<name>", "refused:<regex>", "warns:<regex>")
TRAINER_CASES: list[tuple[str, Any, str, Any]] = [
    ("batch.gradient_accumulation_steps", {"batch": {"gradient_accumulation_steps": 2}}, "weights", {}),
    ("device.id", {"device": {"id": "cuda"}}, "refused:CUDAExecutionProvider", {}),
    ("device.mem_limit", {"device": {"mem_limit": 1 << 20}}, "warns:'device.mem_limit'", {}),
    ("distributed.local_rank", {"distributed": {"local_rank": 1}}, "warns:'distributed.local_rank'", {}),
    ("distributed.world_size", {"distributed": {"world_size": 2}}, "refused:MASTER_ADDR", {}),
    ("distributed.world_rank", {"distributed": {"world_rank": 1}}, "refused:world_rank'=1 must be <", {}),
    ("distributed.data_parallel_size", {"distributed": {"world_size": 2, "data_parallel_size": 1}},
     "refused:only data parallelism", {}),
    ("distributed.horizontal_parallel_size", {"distributed": {"horizontal_parallel_size": 2}},
     "refused:horizontal_parallel_size", {}),
    *[(f"distributed.pipeline_parallel.{key}", {"distributed": {"pipeline_parallel": {key: value}}},
       f"refused:{key}", {})
      for key, value in (("pipeline_parallel_size", 2), ("num_pipeline_micro_batches", 2),
                         ("pipeline_cut_info_string", "a"), ("sliced_schema", {"x": [2]}),
                         ("sliced_axes", {"x": 0}), ("sliced_tensor_names", ["x"]))],
    ("distributed.allreduce_post_accumulation", {"distributed": {"allreduce_post_accumulation": True}},
     "warns:change nothing in a single process", {}),
    ("distributed.deepspeed_zero_optimization.stage",
     {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}}, "warns:change nothing in a single process", {}),
    ("distributed.enable_adasum", {"distributed": {"enable_adasum": True}}, "refused:enable_adasum", {}),
    ("lr_scheduler", {"lr_scheduler": "{scheduler}"}, "weights", {}),
    ("mixed_precision.enabled", {"mixed_precision": {"enabled": True}}, "graph", {}),
    ("mixed_precision.loss_scaler", {"mixed_precision": {"enabled": True, "loss_scaler": "{scaler}"}},
     "state", {"mixed_precision": {"enabled": True}}),
    ("graph_transformer.attn_dropout_recompute", {"graph_transformer": {"attn_dropout_recompute": True}},
     "warns:attn_dropout=True .*recomputed nothing", {}),
    ("graph_transformer.gelu_recompute", {"graph_transformer": {"gelu_recompute": True}},
     "warns:gelu=True .*recomputed nothing", {}),
    ("graph_transformer.transformer_layer_recompute",
     {"graph_transformer": {"transformer_layer_recompute": True}}, "warns:transformer_layers=True", {}),
    ("graph_transformer.number_recompute_layers", {"graph_transformer": {"number_recompute_layers": 1}},
     "refused:needs 'graph_transformer.transformer_layer_recompute'", {}),
    ("graph_transformer.allow_layer_norm_mod_precision",
     {"graph_transformer": {"allow_layer_norm_mod_precision": True}}, "warns:allow_layer_norm_mod_precision", {}),
    ("graph_transformer.propagate_cast_ops_config.strategy",
     {"graph_transformer": {"propagate_cast_ops_config": {"strategy": "INSERT_AND_REDUCE", "level": 1}}},
     "graph", {"graph_transformer": {"propagate_cast_ops_config": {"strategy": "FLOOD_FILL", "level": 1}}}),
    ("graph_transformer.propagate_cast_ops_config.level",
     {"graph_transformer": {"propagate_cast_ops_config": {"strategy": "INSERT_AND_REDUCE", "level": 1}}},
     "graph", {"graph_transformer": {"propagate_cast_ops_config": {"strategy": "INSERT_AND_REDUCE", "level": 0}}}),
    ("graph_transformer.propagate_cast_ops_config.allow",
     {"graph_transformer": {"propagate_cast_ops_config": {"strategy": "INSERT_AND_REDUCE", "level": 0,
                                                          "allow": ["Tanh"]}}},
     "graph", {"graph_transformer": {"propagate_cast_ops_config": {"strategy": "INSERT_AND_REDUCE", "level": 0}}}),
    ("utils.frozen_weights", {"utils": {"frozen_weights": ["0.weight"]}}, "weights", {}),
    ("utils.grad_norm_clip", {"utils": {"grad_norm_clip": False}}, "graph", {}),
    ("utils.memory_efficient_gradient", {"utils": {"memory_efficient_gradient": True}},
     "refused:memory_efficient_gradient", {}),
    ("debug.deterministic_compute", {"debug": {"deterministic_compute": True}}, "session:deterministic", {}),
    ("debug.check_model_export", {"debug": {"check_model_export": True}}, "session:check", {}),
    *[(f"debug.graph_save_paths.{key}", {"debug": {"graph_save_paths": {key: "{file}"}}}, "file", {})
      for key in ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
                  "model_with_training_graph_after_optimization_path")],
    ("debug.graph_save_paths.model_with_training_graph_path",
     {"debug": {"graph_save_paths": {"model_with_training_graph_path": "{file}"}}}, "file", {}),
    ("_internal_use.enable_internal_postprocess", {"_internal_use": {"enable_internal_postprocess": False}},
     "cleanup", {}),
    ("_internal_use.extra_postprocess", {"_internal_use": {"extra_postprocess": "{postprocess}"}}, "graph", {}),
    ("_internal_use.onnx_opset_version", {"_internal_use": {"onnx_opset_version": 17}}, "graph", {}),
    ("_internal_use.enable_onnx_contrib_ops", {"_internal_use": {"enable_onnx_contrib_ops": False}},
     "graph:gelu", {}),
    ("provider_options", {"provider_options": {"CPUExecutionProvider": {"a": "b"}}}, "refused:provider_options", {}),
    ("session_options", {"session_options": "{session_options}"}, "file", {}),
]
_TRAINER_BASELINES: dict[str, dict[str, Any]] = {}
# Options without a switch to test.
TRAINER_ELSEWHERE = {"utils.run_symbolic_shape_infer": "shape inference always runs: nothing to switch"}


def _fill_trainer(options: Any, tmp_path: Path, calls: list[str]) -> Any:
    """The options with their placeholders made: objects, files, a post-process hook."""
    if isinstance(options, dict):
        return {k: _fill_trainer(v, tmp_path, calls) for k, v in options.items()}
    if options == "{scheduler}":
        return _scheduler()
    if options == "{scaler}":
        return _scaler()
    if options == "{file}":
        return str(tmp_path / "asked.onnx")
    if options == "{postprocess}":
        return lambda model: (calls.append("extra_postprocess"), model)[1]
    if options == "{session_options}":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / "asked.onnx")
        return so
    return options


@pytest.mark.parametrize("case", TRAINER_CASES, ids=[c[0] for c in TRAINER_CASES])
def test_ort_trainer_options_take_effect(case: tuple[str, Any, str, Any], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    import onnxruntime as ort

    from gradgraph.torch import ORTTrainer

    path, options, expect, base = case
    kind, _, detail = expect.partition(":")
    if path == "device.id" and "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    calls: list[str] = []
    options = _fill_trainer(options, tmp_path, calls)
    if kind == "refused":
        with pytest.raises((ValueError, NotImplementedError, GradientError), match=detail):
            _trainer_outcome(options, tmp_path, "a")
        return
    if kind == "warns":
        with pytest.warns(UserWarning, match=detail):
            _trainer_outcome(options, tmp_path, "a")
        return
    if kind == "file":
        _trainer_outcome(options, tmp_path, "a")
        assert (tmp_path / "asked.onnx").exists()
        return
    if kind == "cleanup":  # the clean-up passes run by default, not with the option False
        import passes.cleanup

        made: list[bool] = []
        original_pass = passes.cleanup.CleanupPass

        class Counting(original_pass):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                made.append(True)
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(passes.cleanup, "CleanupPass", Counting)
        _trainer_outcome(options, tmp_path, "a")
        assert not made
        _trainer_outcome({}, tmp_path, "b")
        assert made
        return
    if kind == "session":
        seen: list[Any] = []

        class Recording(ort.InferenceSession):
            def __init__(self, model: Any, sess_options: Any = None, *args: Any, **kwargs: Any) -> None:
                seen.append(sess_options)
                super().__init__(model, sess_options, *args, **kwargs)

        monkeypatch.setattr(ort, "InferenceSession", Recording)
        if detail == "check":
            original = ORTTrainer._check_export
            monkeypatch.setattr(ORTTrainer, "_check_export",
                                lambda self, *a: (calls.append("check"), original(self, *a))[1])
        _trainer_outcome(options, tmp_path, "a")
        if detail == "deterministic":
            assert seen and all(s is not None and s.use_deterministic_compute for s in seen)
        else:
            assert calls == ["check"]
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if detail == "gelu":
            monkeypatch.setattr(pytest.importorskip("torch").nn, "Tanh", pytest.importorskip("torch").nn.GELU)
        mine = _trainer_outcome(options, tmp_path, "a")
        key = repr((base, detail))
        if key not in _TRAINER_BASELINES:  # the same baseline serves many cases
            _TRAINER_BASELINES[key] = _trainer_outcome(_fill_trainer(base, tmp_path, []), tmp_path, "b")
        theirs = _TRAINER_BASELINES[key]
    if path == "_internal_use.extra_postprocess":
        assert calls == ["extra_postprocess"]
        return
    if kind == "weights":
        assert _differ(mine["weights"], theirs["weights"]), f"{path}: the baseline's weights"
    else:
        assert mine[kind] and mine[kind] != theirs[kind], f"{path}: the baseline's {kind}"


def test_every_ort_trainer_option_has_a_case() -> None:
    pytest.importorskip("torch")
    from gradgraph.torch.trainer_options import SCHEMA

    def leaves(node: dict[str, Any], path: str = "") -> set[str]:
        out: set[str] = set()
        for key, rule in node["schema"].items():
            where = f"{path}.{key}".lstrip(".")
            group = rule["type"] == "dict" and isinstance(rule.get("schema"), dict) and "type" not in rule["schema"]
            out |= leaves(rule, where) if group else {where}
        return out

    assert leaves(SCHEMA) == {c[0] for c in TRAINER_CASES} | set(TRAINER_ELSEWHERE)


# ---- RecomputeOptions: the switches and the planner's heuristics ---------------------------------

RECOMPUTE_MODEL = """<ir_version: 9, opset_import: ["" : 20]>
g (float[B,64] x, float[64,64] w1, float[64,64] w2, float[64,64] w3) => (float loss) {
  h1 = MatMul(x, w1)
  t1 = Tanh(h1)
  s1 = Sigmoid(t1)
  p1 = Mul(s1, t1)
  h2 = MatMul(p1, w2)
  t2 = Tanh(h2)
  e2 = Exp(t2)
  h3 = MatMul(e2, w3)
  one = Constant<value = float {1.0}>()
  pos = Greater(e2, one)
  zero = Constant<value = float {0.0}>()
  r = Where(pos, h3, zero)
  loss = ReduceSum<keepdims = 0>(r)
}"""
GELU_INTO_MUL = """<ir_version: 9, opset_import: ["" : 20]>
g (float[4,8] x, float[8,16] w1) => (float loss) {
  h = MatMul(x, w1)
  a = Gelu(h)
  o = Mul(a, a)
  loss = ReduceSum<keepdims = 0>(o)
}"""
# Two layers told apart by node names in a scope the default pattern does not know (blk_N).
SCOPED = """<ir_version: 9, opset_import: ["" : 20]>
g (float[4,8] x, float[8,8] w0, float[8,8] w1, float[8,8] w2) => (float loss) {
  a0 = MatMul(x, w0)
  t0 = Tanh(a0)
  l0 = Mul(t0, t0)
  a1 = MatMul(l0, w1)
  t1 = Tanh(a1)
  l1 = Mul(t1, t1)
  a2 = MatMul(l1, w2)
  t2 = Tanh(a2)
  loss = ReduceSum<keepdims = 0>(t2)
}"""


def _recomputed(text: str, options: RecomputeOptions, scopes: bool = False) -> list[str]:
    """The forward nodes ``options`` recompute in the gradient graph of ``text``."""
    from passes.marks import RECOMPUTE_OF_KEY, Role, role_of
    from passes.recompute import RecomputePass

    proto = onnx.parser.parse_model(text)
    for index, node in enumerate(proto.graph.node):
        node.name = f"/blk_{index // 3}/{node.op_type}" if scopes else f"n{index}_{node.op_type}"
    weights = [i.name for i in proto.graph.input if i.name.startswith("w")]
    model = onnx_ir_from(gradgraph.build_gradient_graph(proto, "loss", weights))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        RecomputePass(options)(model)
    return sorted({n.metadata_props[RECOMPUTE_OF_KEY] for n in model.graph if role_of(n) == Role.RECOMPUTE})


def onnx_ir_from(proto: onnx.ModelProto) -> Any:
    import onnx_ir as ir

    return ir.from_proto(proto)


PLAN = RecomputeOptions(memory_budget=0, dims=(("B", 8),))
RECOMPUTE_CASES: list[tuple[str, Any, Any, str]] = [
    # (field, options, baseline options, model)
    ("gelu", RecomputeOptions(gelu=True, gelu_consumers=("Mul",)), RecomputeOptions(), GELU_INTO_MUL),
    ("gelu_consumers", RecomputeOptions(gelu=True, gelu_consumers=("Mul",)), RecomputeOptions(gelu=True),
     GELU_INTO_MUL),
    ("transformer_layers", RecomputeOptions(transformer_layers=True, layer_scope_pattern=r"blk_(\d+)$"),
     RecomputeOptions(), SCOPED),
    ("layer_scope_pattern", RecomputeOptions(transformer_layers=True, layer_scope_pattern=r"blk_(\d+)$"),
     RecomputeOptions(transformer_layers=True), SCOPED),
    ("number_recompute_layers", RecomputeOptions(transformer_layers=True, layer_scope_pattern=r"blk_(\d+)$",
                                                 number_recompute_layers=1),
     RecomputeOptions(transformer_layers=True, layer_scope_pattern=r"blk_(\d+)$"), SCOPED),
    ("memory_budget", PLAN, RecomputeOptions(), RECOMPUTE_MODEL),
    ("dims", PLAN, RecomputeOptions(memory_budget=0), RECOMPUTE_MODEL),
    ("unknown_bytes", RecomputeOptions(memory_budget=0, unknown_bytes=1000), RecomputeOptions(memory_budget=0),
     RECOMPUTE_MODEL),
    ("banned_ops", dataclasses.replace(PLAN, banned_ops=("Exp",)), PLAN, RECOMPUTE_MODEL),
    ("compute_intensive_ops", dataclasses.replace(PLAN, compute_intensive_ops=()), PLAN, RECOMPUTE_MODEL),
    ("recompute_compute_intensive", dataclasses.replace(PLAN, recompute_compute_intensive=True), PLAN,
     RECOMPUTE_MODEL),
    ("recompute_non_float", dataclasses.replace(PLAN, recompute_non_float=True), PLAN, RECOMPUTE_MODEL),
    ("max_recompute_chain", dataclasses.replace(PLAN, max_recompute_chain=1), PLAN, RECOMPUTE_MODEL),
    ("cost_weights", dataclasses.replace(PLAN, memory_budget=9000, cost_weights=(("Mul", 1000.0),)),
     dataclasses.replace(PLAN, memory_budget=9000), RECOMPUTE_MODEL),
    ("default_cost_weight", dataclasses.replace(PLAN, memory_budget=7000, default_cost_weight=100.0),
     dataclasses.replace(PLAN, memory_budget=7000), RECOMPUTE_MODEL),
]
# Fields whose effect another test shows.
RECOMPUTE_ELSEWHERE = {
    "attn_dropout": "tests/test_recompute.py::test_attention_dropout_recompute_reuses_the_mask",
    "nothing_recomputed": "tests/test_recompute_layers.py::test_an_option_matching_nothing_warns_or_raises",
    "layer_start_edges": "none: the reference's start edges (LayerNorm/Dropout with 4 forward consumers) "
                         "are only exercised at their default, on the tiny BERT export "
                         "(tests/test_recompute.py::test_tiny_bert_layers_found_by_the_reference_edges)",
}


@pytest.mark.parametrize("field,options,base,text", RECOMPUTE_CASES, ids=[c[0] for c in RECOMPUTE_CASES])
def test_recompute_options_take_effect(field: str, options: RecomputeOptions, base: RecomputeOptions,
                                       text: str) -> None:
    scopes = text is SCOPED
    assert _recomputed(text, options, scopes) != _recomputed(text, base, scopes), field


def test_every_recompute_option_has_a_case() -> None:
    fields = {f.name for f in dataclasses.fields(RecomputeOptions)}
    assert fields == {c[0] for c in RECOMPUTE_CASES} | set(RECOMPUTE_ELSEWHERE)
