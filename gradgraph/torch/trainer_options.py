"""``ORTTrainerOptions``: the ORTTrainer options schema, validated, with defaults, read as attributes.

The schema is onnxruntime-training's (``../shared/api-reference/ORTTrainer.txt``): groups
``batch``, ``device``, ``distributed``, ``lr_scheduler``, ``mixed_precision``,
``graph_transformer``, ``utils``, ``debug``, ``_internal_use``, ``provider_options``,
``session_options``. Construction validates the whole dict: an unknown key, a value of the wrong
type or out of range raises ``ValueError`` naming its dotted key path
(``'batch.gradient_accumulation_steps' must be an integer >= 1; got 0``). Defaults are filled
in, and every value reads as an attribute: ``opts.mixed_precision.enabled``.

gradgraph's departures, where the reference's value cannot apply:

- ``_internal_use.onnx_opset_version`` defaults to 18 and accepts up to the newest opset onnx
  ships (the dynamo exporter writes opset 18 and above; the reference allowed 12-14);
- ``graph_transformer.propagate_cast_ops_config`` takes the keys ``strategy`` / ``level`` /
  ``allow`` (the documented names) and their long forms ``propagate_cast_ops_*`` (the schema's
  own names), given or read: ``opts.graph_transformer.propagate_cast_ops_config.level`` and
  ``....propagate_cast_ops_level`` are the same value.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import onnx

from gradgraph.training.options import CastStrategy
from gradgraph.validate import close_matches


def _opt(kind: str, default: Any, **rules: Any) -> dict[str, Any]:
    return {"type": kind, "default": default, **rules}


def _group(**schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "dict", "schema": schema}


_STRING_LIST = {"type": "list", "schema": {"type": "string"}}

SCHEMA: dict[str, Any] = _group(
    batch=_group(gradient_accumulation_steps=_opt("integer", 1, min=1)),
    device=_group(id=_opt("string", "cuda", pattern=r"cpu|cuda(:\d+)?", words="'cpu', 'cuda' or 'cuda:N'"), mem_limit=_opt("integer", 0, min=0)),
    distributed=_group(
        world_rank=_opt("integer", 0, min=0),
        world_size=_opt("integer", 1, min=1),
        local_rank=_opt("integer", 0, min=0),
        data_parallel_size=_opt("integer", 1, min=1),
        horizontal_parallel_size=_opt("integer", 1, min=1),
        pipeline_parallel=_group(
            pipeline_parallel_size=_opt("integer", 1, min=1),
            num_pipeline_micro_batches=_opt("integer", 1, min=1),
            pipeline_cut_info_string=_opt("string", ""),
            sliced_schema=_opt("dict", {}, keysrules={"type": "string"},
                               valuesrules={"type": "list", "schema": {"type": "integer"}}),
            sliced_axes=_opt("dict", {}, keysrules={"type": "string"}, valuesrules={"type": "integer"}),
            sliced_tensor_names=_opt("list", [], schema={"type": "string"}),
        ),
        allreduce_post_accumulation=_opt("boolean", False),
        deepspeed_zero_optimization=_group(stage=_opt("integer", 0, min=0, max=1)),
        enable_adasum=_opt("boolean", False),
    ),
    lr_scheduler=_opt("optim.lr_scheduler", None, nullable=True),
    mixed_precision=_group(enabled=_opt("boolean", False),
                           loss_scaler=_opt("amp.loss_scaler", None, nullable=True)),
    graph_transformer=_group(
        attn_dropout_recompute=_opt("boolean", False),
        gelu_recompute=_opt("boolean", False),
        transformer_layer_recompute=_opt("boolean", False),
        number_recompute_layers=_opt("integer", 0, min=0),
        allow_layer_norm_mod_precision=_opt("boolean", False),
        propagate_cast_ops_config=_group(
            strategy=_opt("PropagateCastOpsStrategy", CastStrategy.FLOOD_FILL),
            level=_opt("integer", 1, min=-1),
            allow=_opt("list", [], schema={"type": "string"}),
        ),
    ),
    utils=_group(
        frozen_weights=_opt("list", [], schema={"type": "string"}),
        grad_norm_clip=_opt("boolean", True),
        memory_efficient_gradient=_opt("boolean", False),
        run_symbolic_shape_infer=_opt("boolean", False),
    ),
    debug=_group(
        deterministic_compute=_opt("boolean", False),
        check_model_export=_opt("boolean", False),
        graph_save_paths=_group(
            model_after_graph_transforms_path=_opt("string", ""),
            model_with_gradient_graph_path=_opt("string", ""),
            model_with_training_graph_path=_opt("string", ""),
            model_with_training_graph_after_optimization_path=_opt("string", ""),
        ),
    ),
    _internal_use=_group(
        enable_internal_postprocess=_opt("boolean", True),
        extra_postprocess=_opt("callable", None, nullable=True),
        onnx_opset_version=_opt("integer", 18, min=12, max=onnx.defs.onnx_opset_version()),
        enable_onnx_contrib_ops=_opt("boolean", True),
    ),
    provider_options=_opt("dict", {}, keysrules={"type": "string"}, valuesrules={"type": "dict"}),
    session_options=_opt("SessionOptions", None, nullable=True),
)

# documented short names <- their long forms in the schema text
_ALIASES = {"graph_transformer.propagate_cast_ops_config": {
    "propagate_cast_ops_strategy": "strategy", "propagate_cast_ops_level": "level",
    "propagate_cast_ops_allow": "allow"}}

_TYPE_WORDS = {"integer": "an integer", "string": "a string", "boolean": "a bool (True or False)",
               "list": "a list", "dict": "a dict", "callable": "a callable (model -> model)",
               "optim.lr_scheduler": "a learning-rate scheduler from gradgraph.torch.optim "
                                     "(e.g. LinearWarmupLRScheduler(total_steps=...))",
               "amp.loss_scaler": "a loss scaler from gradgraph.torch.optim (e.g. DynamicLossScaler())",
               "PropagateCastOpsStrategy": "a PropagateCastOpsStrategy (gradgraph.CastStrategy or "
                                           "one of 'NONE', 'INSERT_AND_REDUCE', 'FLOOD_FILL')",
               "SessionOptions": "an onnxruntime.SessionOptions"}


def _fail(path: str, rule: dict[str, Any], value: Any, extra: str = "") -> ValueError:
    what = _TYPE_WORDS.get(rule["type"], rule["type"])
    if "min" in rule and "max" in rule:
        what += f" in [{rule['min']}, {rule['max']}]"
    elif "min" in rule:
        what += f" >= {rule['min']}"
    return ValueError(f"ORTTrainerOptions: {path!r} must be {what}{extra}; got {value!r}")


def _check_type(path: str, rule: dict[str, Any], value: Any) -> Any:
    kind = rule["type"]
    if value is None:
        if rule.get("nullable"):
            return None
        raise _fail(path, rule, value)
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, rule, value)
        if value < rule.get("min", value) or value > rule.get("max", value):
            raise _fail(path, rule, value)
    elif kind == "string" and not isinstance(value, str):
        raise _fail(path, rule, value)
    elif kind == "string" and "pattern" in rule and not re.fullmatch(rule["pattern"], value):
        raise ValueError(f"ORTTrainerOptions: {path!r} must be {rule['words']}; got {value!r}")
    elif kind == "boolean" and not isinstance(value, bool):
        raise _fail(path, rule, value)
    elif kind == "callable" and not callable(value):
        raise _fail(path, rule, value)
    elif kind == "list":
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise _fail(path, rule, value)
        return [_check_type(f"{path}[{i}]", rule["schema"], v) for i, v in enumerate(value)] \
            if "schema" in rule else list(value)
    elif kind == "dict":
        if not isinstance(value, Mapping):
            raise _fail(path, rule, value)
        out = {}
        for k, v in value.items():
            if "keysrules" in rule:
                _check_type(f"{path} key", rule["keysrules"], k)
            out[k] = _check_type(f"{path}.{k}", rule["valuesrules"], v) if "valuesrules" in rule else v
        return out
    elif kind == "PropagateCastOpsStrategy":
        return _strategy(path, rule, value)
    elif kind in ("optim.lr_scheduler", "amp.loss_scaler", "SessionOptions"):
        _check_instance(path, rule, value)
    return value


def _strategy(path: str, rule: dict[str, Any], value: Any) -> CastStrategy:
    try:
        if isinstance(value, str):
            return CastStrategy[value.upper()]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError
        return CastStrategy(int(value))
    except (KeyError, ValueError, TypeError):
        raise _fail(path, rule, value) from None


def _check_instance(path: str, rule: dict[str, Any], value: Any) -> None:
    kind = rule["type"]
    if kind == "SessionOptions":
        import onnxruntime as ort

        expected: type = ort.SessionOptions
    else:
        from gradgraph.torch import optim

        expected = optim._LRScheduler if kind == "optim.lr_scheduler" else optim.LossScaler
    if not isinstance(value, expected):
        raise _fail(path, rule, value)


def _validate(path: str, schema: dict[str, Any], given: Any) -> dict[str, Any]:
    """The group's values with defaults filled in; a ValueError names the first bad key path."""
    if not isinstance(given, Mapping):
        raise ValueError(f"ORTTrainerOptions: {path or 'options'!r} must be a dict of options, got "
                         f"{type(given).__name__}")
    bad_keys = [k for k in given if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"ORTTrainerOptions: {path or 'options'!r} has a key that is not a string: "
                         f"{bad_keys[0]!r}")
    aliases = _ALIASES.get(path, {})
    both = [k for k in given if k in aliases and aliases[k] in given]
    if both:
        raise ValueError(f"ORTTrainerOptions: {path}.{both[0]} and {path}.{aliases[both[0]]} are "
                         f"the same option; give one")
    given = {aliases.get(k, k): v for k, v in given.items()}
    fields = schema["schema"]
    for key in given:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            hint = close_matches(str(key), fields)
            raise ValueError(f"ORTTrainerOptions: unknown option {where!r}{hint}; "
                             f"{path or 'the top level'} has {sorted(fields)}")
    out: dict[str, Any] = {}
    for key, rule in fields.items():
        where = f"{path}.{key}" if path else key
        if rule["type"] == "dict" and "schema" in rule:
            out[key] = _validate(where, rule, given.get(key, {}))
        elif key in given:
            out[key] = _check_type(where, rule, given[key])
        else:
            default = rule["default"]
            out[key] = type(default)(default) if isinstance(default, (list, dict)) else default
    return out


class _Group:
    """A validated option group: values as attributes (nested groups too)."""

    def __init__(self, values: dict[str, Any], path: str) -> None:
        self._values = values
        self._path = path

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        name = _ALIASES.get(self.__dict__.get("_path", ""), {}).get(name, name)  # a long form
        if values is None or name not in values:
            raise AttributeError(f"ORTTrainerOptions has no option "
                                 f"{(self.__dict__.get('_path', '') + '.' + name).lstrip('.')!r}")
        value = values[name]
        return _Group(value, f"{self._path}.{name}".lstrip(".")) if isinstance(value, dict) and \
            name in _groups_at(self._path) else value

    def to_dict(self) -> dict[str, Any]:
        return self._values

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._values!r})"


def _groups_at(path: str) -> set[str]:
    """Keys under ``path`` that are option groups (not dict-valued options)."""
    node = SCHEMA
    for part in [p for p in path.split(".") if p]:
        node = node["schema"][part]
    return {k for k, r in node["schema"].items() if r["type"] == "dict" and "schema" in r and
            isinstance(r["schema"], dict) and "type" not in r["schema"]}


class ORTTrainerOptions(_Group):
    """``ORTTrainerOptions(options={})``: validated on construction (see the module docstring)."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"ORTTrainerOptions takes a dict of options (e.g. {{'batch': "
                             f"{{'gradient_accumulation_steps': 4}}}}), got {type(options).__name__}")
        given = dict(options or {})
        super().__init__(_validate("", SCHEMA, given), "")
        self._given = given
        pipeline = self._values["distributed"]["pipeline_parallel"]
        for key in ("sliced_schema", "sliced_axes", "sliced_tensor_names"):
            if pipeline[key]:
                raise NotImplementedError(f"ORTTrainerOptions 'distributed.pipeline_parallel.{key}'="
                                          f"{pipeline[key]!r}: pipeline-parallel tensor slicing is not "
                                          "implemented; leave it empty")
        device = self._values["device"]
        if device["id"] == "cpu" and (device["mem_limit"] or self.was_set("distributed.local_rank")):
            warnings.warn("ORTTrainerOptions 'device.mem_limit' (CUDA's arena limit) and "
                          "'distributed.local_rank' (the CUDA device of a rank) change nothing with "
                          "device.id 'cpu'", UserWarning, stacklevel=2)
        graph = self._values["graph_transformer"]
        if graph["number_recompute_layers"] and not graph["transformer_layer_recompute"]:
            raise ValueError(f"ORTTrainerOptions 'graph_transformer.number_recompute_layers'="
                             f"{graph['number_recompute_layers']} sets how many transformer layers are "
                             "recomputed: it needs 'graph_transformer.transformer_layer_recompute' True")
        if self._values["graph_transformer"]["allow_layer_norm_mod_precision"]:
            warnings.warn("ORTTrainerOptions 'graph_transformer.allow_layer_norm_mod_precision'=True "
                          "changes nothing: gradgraph's mixed precision keeps LayerNorm statistics "
                          "in fp32", UserWarning, stacklevel=2)

    def was_set(self, path: str) -> bool:
        """Whether the user gave ``path`` (a dotted key) rather than leaving its default."""
        node: Any = self._given
        where = ""
        for part in path.split("."):
            if not isinstance(node, Mapping):
                return False
            names = {part, *(k for k, v in _ALIASES.get(where, {}).items() if part in (k, v)),
                     _ALIASES.get(where, {}).get(part, part)}
            found = [n for n in names if n in node]
            if not found:
                return False
            node = node[found[0]]
            where = f"{where}.{part}".lstrip(".")
        return True
