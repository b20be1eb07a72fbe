"""Write docs/OPS.md: the gradient status of every default-domain op of ONNX's newest opset.

    python tools/gen_ops.py            # rewrite docs/OPS.md
    python tools/gen_ops.py --check    # exit 1 (and say so) if docs/OPS.md is stale

One row per op of the newest opset the installed ``onnx`` knows (deprecated ops, which no
longer belong to it, are left out), read from the gradient rule registry
(``passes.autodiff``): the opsets its rules cover, the inputs they differentiate (names
from the op's newest schema) and a status: ``differentiated``, ``non-differentiable
(declared)`` (registered with ``non_differentiable``: a stop-gradient edge) or ``missing``.
``tests/test_ops_doc.py`` fails while the file differs from what this script writes.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from passes.autodiff import GradRule, lookup, registered_rules  # noqa: E402
from passes.autodiff.registry import _no_gradient  # noqa: E402

OPS_MD = ROOT / "docs" / "OPS.md"

DIFFERENTIATED = "differentiated"
DECLARED = "non-differentiable (declared)"
MISSING = "missing"
# Why an op has no rule yet, where there is more to say than that.
MISSING_REASONS = {
    "SequenceMap": "not written yet: a body graph mapped over sequence elements needs reverse-mode "
                   "through the body, as Loop and Scan have",
    "DynamicQuantizeLinear": "not written yet: its float output y_scale depends on the min/max of x "
                             "(QuantizeLinear with a given scale is differentiated, straight-through)",
}
STATUSES = (DIFFERENTIATED, DECLARED, MISSING)

FLOAT_TYPE_STRS = tuple(f"tensor({t})" for t in ("float", "double", "float16", "bfloat16"))
GRAPH_ATTRS = (onnx.defs.OpSchema.AttrType.GRAPH, onnx.defs.OpSchema.AttrType.GRAPHS)


def newest_opset() -> int:
    return onnx.defs.onnx_opset_version()


@functools.cache
def _history() -> tuple[onnx.defs.OpSchema, ...]:
    """Every version of every default-domain op's schema."""
    return tuple(s for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx"))


def default_domain_ops(opset: int) -> list[onnx.defs.OpSchema]:
    """The newest schema (at ``opset``) of every non-deprecated default-domain op, by name."""
    names = {s.name for s in _history()}
    schemas = []
    for name in sorted(names):
        try:
            schema = onnx.defs.get_schema(name, opset, "")
        except onnx.defs.SchemaError:
            continue
        if not schema.deprecated:
            schemas.append(schema)
    return schemas


def _first_version(name: str) -> int:
    return min(s.since_version for s in _history() if s.name == name)


def _rules_of(name: str) -> list[GradRule]:
    return sorted((r for r in registered_rules() if r.domain in ("", "ai.onnx") and r.op_type == name),
                  key=lambda r: r.since)


def _range_text(rule: GradRule, first: int) -> str:
    lo = max(rule.since, first)
    if rule.until is None:
        return f"{lo}+"
    return f"{lo}" if lo == rule.until else f"{lo}-{rule.until}"


def _can_be_float(schema: onnx.defs.OpSchema, formal: onnx.defs.OpSchema.FormalParameter) -> bool:
    allowed = [formal.type_str]
    for constraint in schema.type_constraints:
        if constraint.type_param_str == formal.type_str:
            allowed = list(constraint.allowed_type_strs)
    return any(t in s for s in allowed for t in FLOAT_TYPE_STRS)


def _input_label(formal: onnx.defs.OpSchema.FormalParameter) -> str:
    variadic = formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    return f"{formal.name}..." if variadic else formal.name


def differentiated_inputs(schema: onnx.defs.OpSchema, rule: GradRule) -> str:
    """The schema's names of the float inputs ``rule`` passes a gradient to."""
    if rule.fn is _no_gradient or rule.diff_inputs == ():
        return ""
    formals = list(schema.inputs)
    picked: list[str] = []
    for index, formal in enumerate(formals):
        variadic = formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic
        if rule.diff_inputs is None or index in rule.diff_inputs or (
                variadic and any(i >= index for i in rule.diff_inputs)):
            if _can_be_float(schema, formal):
                picked.append(_input_label(formal))
    if rule.diff_inputs is None and any(a.type in GRAPH_ATTRS for a in schema.attributes.values()):
        picked.append("(values its subgraphs capture)")
    return ", ".join(picked)


def row(schema: onnx.defs.OpSchema, opset: int) -> dict[str, str]:
    rules = _rules_of(schema.name)
    first = _first_version(schema.name)
    ranges = ", ".join(_range_text(r, first) for r in rules)
    rule = lookup("", schema.name, opset)
    if rule is None:
        status = MISSING
        reason = MISSING_REASONS.get(schema.name, "no rule yet") if not rules else \
            f"no rule at opset {opset} (rules cover {ranges})"
        inputs = ""
    elif rule.fn is _no_gradient or rule.diff_inputs == ():
        status, reason, inputs = DECLARED, "", ""
    else:
        status, reason, inputs = DIFFERENTIATED, "", differentiated_inputs(schema, rule)
    return {"op": schema.name, "since": str(schema.since_version), "ranges": ranges,
            "inputs": inputs, "status": status, "reason": reason}


def render(opset: int | None = None) -> str:
    opset = newest_opset() if opset is None else opset
    rows = [row(s, opset) for s in default_domain_ops(opset)]
    counts = collections.Counter(r["status"] for r in rows)
    lines = [
        f"# Gradient status of the ONNX operators (opset {opset})",
        "",
        "Generated by `tools/gen_ops.py` from the gradient rule registry (`passes.autodiff`);",
        "do not edit by hand. Regenerate with `python tools/gen_ops.py`;",
        "`python tools/gen_ops.py --check` exits 1 while this file is stale",
        "(`tests/test_ops_doc.py` runs the same comparison).",
        "",
        f"One row per operator of the default domain (`ai.onnx`) at opset {opset}, the newest the",
        "installed onnx knows; deprecated operators are left out.",
        "",
        "- *Newest version*: the opset of the operator's newest schema.",
        "- *Rule opsets*: the opsets the registered rules cover (`13+`: 13 and later), clipped to",
        "  the opsets where the operator exists; gradgraph itself needs opset 13 or later.",
        "- *Differentiated inputs*: the float inputs (schema names; `...` marks a variadic one)",
        f"  the rule at opset {opset} passes a gradient to; the others are stop-gradient edges.",
        "- *Status*: `differentiated` (a gradient rule), `non-differentiable (declared)` (no",
        "  gradient flows to any input: integer, boolean or string outputs, piecewise-constant",
        "  or random ops; a trained value whose only way to the loss runs through one is an",
        "  error), or `missing` (building a gradient through it raises \"no gradient rule\").",
        "",
        f"{len(rows)} operators: "
        + ", ".join(f"{counts[s]} {s}" for s in STATUSES) + ".",
        "",
        "| Op | Newest version | Rule opsets | Differentiated inputs | Status | Reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["op"], r["since"], r["ranges"] or "-", r["inputs"] or "-", r["status"],
                 r["reason"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file differs from what would be written")
    parser.add_argument("--output", type=Path, default=OPS_MD, help="default: docs/OPS.md")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run `python tools/gen_ops.py`", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
