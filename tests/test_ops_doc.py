"""docs/OPS.md (the gradient status of every op of the newest opset) is what tools/gen_ops.py
writes from the rule registry now: a rule added or changed without regenerating it fails here."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gen_ops  # noqa: E402


def test_ops_doc_is_current() -> None:
    expected = gen_ops.render()
    current = gen_ops.OPS_MD.read_text(encoding="utf-8") if gen_ops.OPS_MD.exists() else ""
    assert current == expected, (
        "docs/OPS.md is stale (the gradient rules changed): run `python tools/gen_ops.py`")


def test_every_op_has_one_row() -> None:
    opset = gen_ops.newest_opset()
    rows = [gen_ops.row(s, opset) for s in gen_ops.default_domain_ops(opset)]
    names = [r["op"] for r in rows]
    assert names == sorted(set(names)) and {"Add", "ArgMax", "MatMul"} <= set(names)
    assert {r["status"] for r in rows} <= set(gen_ops.STATUSES)
    by_op = {r["op"]: r for r in rows}
    assert by_op["Add"]["status"] == gen_ops.DIFFERENTIATED and by_op["Add"]["inputs"] == "A, B"
    assert by_op["ArgMax"]["status"] == gen_ops.DECLARED and by_op["ArgMax"]["inputs"] == ""
    assert all(r["reason"] for r in rows if r["status"] == gen_ops.MISSING)


def test_check_flag(tmp_path: Path) -> None:
    stale = tmp_path / "OPS.md"
    stale.write_text("old\n", encoding="utf-8")
    assert gen_ops.main(["--check", "--output", str(stale)]) == 1
    assert gen_ops.main(["--output", str(stale)]) == 0
    assert gen_ops.main(["--check", "--output", str(stale)]) == 0
