"""The layering of the source, read from its imports (module level, as ``ast`` sees them): no
import cycle, and no module of ``klpenalty.ops`` importing a module above ``ops`` (only
``klpenalty._validation``, the argument checks, lies below it)."""

from __future__ import annotations

import ast
from pathlib import Path

import klpenalty

ROOT = Path(klpenalty.__file__).parent.parent  # src/


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (ROOT / "klpenalty").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the klpenalty modules its top-level statements import."""
    edges = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        out = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        edges[name] = {t for t in out if t in mods and t != name}
    return edges


def test_no_import_cycle():
    edges = _edges(_modules())
    state: dict[str, int] = {}
    cycles = []

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles


def test_ops_imports_nothing_above_it():
    edges = _edges(_modules())
    up = sorted(
        (m, t) for m, ts in edges.items() if m.startswith("klpenalty.ops")
        for t in ts if not t.startswith("klpenalty.ops") and t != "klpenalty._validation"
    )
    assert not up, up


def test_the_check_sees_the_imports():
    """The graph holds known arrows (so an empty result above is not a parser failing)."""
    edges = _edges(_modules())
    assert "klpenalty.ops.contract" in edges["klpenalty.ops.engine"]
    assert "klpenalty.ops.dispatch" in edges["klpenalty.functional"]
    assert "klpenalty.ops.streaming.threshold" in edges["klpenalty.ops.streaming"]
