"""The source tree's shape (README "Layout"): no source file over 600 lines outside tests, no import circle among
the project's modules, and ``tasks/`` holding the pipeline's stages and their parts only (the operations services
live in ``ops/``)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx

import tasks

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ml", "tasks", "faceops", "flows", "ops", "experiments", "benchmarks")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for every source module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs: at module level, in functions and classes; not under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the project modules it imports (``from a.b import c`` counts ``a.b.c`` when that is a module). A
    module importing its own package (``from ml.eval.metrics import …`` inside ``ml.eval.metrics.sets``) is not an
    edge: the package's ``__init__`` runs first either way."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                target = resolve(name)
                if target and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of more than one module that reach each other (networkx's strongly connected components; networkx
    comes with DVC)."""
    g = networkx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    return sorted(sorted(c) for c in networkx.strongly_connected_components(g) if len(c) > 1)


def test_circle_finder_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_do_not_count():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
                     "def f():\n    import z\n")
    assert [n.names[0].name for n in _runtime_imports(tree)] == ["TYPE_CHECKING", "y", "z"]


def test_no_source_file_over_600_lines():
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")] + list(ROOT.glob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by concern, as the README's layout describes): {long}"


def test_no_import_circles():
    circles = _circles(_import_graph(_modules()))
    assert not circles, f"modules that import each other, directly or around a loop (move the shared part down): {circles}"


def test_tasks_holds_stages_and_their_parts_only():
    modules = _modules()
    graph = _import_graph(modules)
    in_tasks = {m for m in modules if m.startswith("tasks.")}
    reached: set[str] = set()
    entries = [s.module for s in tasks.STAGES.values()]
    todo = entries + [f"{m}.__main__" for m in entries if f"{m}.__main__" in in_tasks]  # a stage package's command
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [m for m in graph[module] if m in in_tasks]
    assert set(entries) <= in_tasks
    strays = sorted(in_tasks - reached - {"tasks.common", "tasks.params"})
    assert not strays, f"tasks/ modules no stage uses (an operations service belongs in ops/): {strays}"
