"""rollq's import graph has no cycle: every import counts, at module level, under
``TYPE_CHECKING`` and inside functions (a function-level import hides a cycle from Python,
not from a reader, who still cannot read either module without the other)."""

from __future__ import annotations

import ast
from pathlib import Path

import rollq

ROOT = Path(rollq.__file__).parent

#: Import cycles tolerated, each as the sorted tuple of its modules (none today): a new cycle
#: fails the test, and one listed here that is gone fails it too (so the list only shrinks).
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The rollq modules that ``path`` imports (a package's ``__init__`` counts as imported
    only when it is named itself, not for each of its submodules)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # ``import rollq.x.y`` names rollq.x.y if it is one
                t = t.rpartition(".")[0]
            if t.startswith("rollq") and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def cycles(g: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; a
    package's ``__init__`` that re-exports its submodules is left out (importing a submodule
    runs its package first, but that is Python's order, not a dependency of the code)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: set[tuple[str, ...]] = set()
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def without_packages(g: dict[str, set[str]]) -> dict[str, set[str]]:
    packages = {m for m in g if (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()}
    return {m: {t for t in ts if t not in packages} for m, ts in g.items() if m not in packages}


def test_the_graph_sees_every_kind_of_import(tmp_path):
    g = graph()
    assert "rollq.keys" in g["rollq.shards"]  # module level, relative
    # function level: shards._carry_over imports weight sync's versions inside the function
    assert "rollq.weightsync.versions" in g["rollq.shards"]


def test_cycles_are_found():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == {("a", "b", "c")}


def test_rollq_has_no_import_cycle():
    found = cycles(without_packages(graph()))
    new = found - KNOWN_CYCLES
    assert not new, "import cycles: " + "; ".join(" <-> ".join(c) for c in sorted(new))
    gone = KNOWN_CYCLES - found
    assert not gone, f"KNOWN_CYCLES lists cycles that are gone: {sorted(gone)}"
