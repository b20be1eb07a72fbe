"""The code layout keeps its shape: no module over ~600 lines but the listed ones, and no
import cycle between modules (a package's ``__init__`` re-exporting its modules aside)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 620
# Modules allowed past MAX_LINES, each with its reason.
LONG = {
    "passes/autodiff/rules/quant_signal.py": "a rule table (one short rule per op)",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("gradgraph", "passes"):
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def test_no_module_is_longer_than_the_limit_unless_listed() -> None:
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    over = {p: n for p, n in long.items() if n > MAX_LINES and p not in LONG}
    assert not over, f"modules over {MAX_LINES} lines (split them, or list them with a reason): {over}"
    assert all(p in long for p in LONG), "a listed long module no longer exists: drop it from LONG"


def test_no_import_cycle_between_modules() -> None:
    mods = _modules()
    graph = nx.DiGraph()
    for name, path in mods.items():
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target in mods and target != name and mods[target].name != "__init__.py":
                    graph.add_edge(name, target)
    # imports under ``if TYPE_CHECKING:`` are annotations only
    cycles = [c for c in nx.simple_cycles(graph) if not _type_checking_only(c, mods)]
    assert not cycles, f"import cycles: {cycles}"


def _type_checking_only(cycle: list[str], mods: dict[str, Path]) -> bool:
    for i, name in enumerate(cycle):
        target = cycle[(i + 1) % len(cycle)]
        tree = ast.parse(mods[name].read_text())
        guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(n.test)]
        inside = {id(x) for g in guarded for x in ast.walk(g)}
        edges = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 and (n.module == target or any(f"{n.module}.{a.name}" == target for a in n.names))]
        if edges and all(id(e) in inside for e in edges):
            return True
    return False
