"""The dependency direction (DESIGN.md): no import cycle between our modules, drafter training
above the engine (only the CLI and bench/ import it), and torch out of the policy package and the
ingress process (they run where no model is loaded)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("policies", "workers", "training", "router", "bench")


def module_graph() -> dict[str, set[str]]:
    """Our modules and the modules of ours each imports, at any depth of its code (a function-level
    import is still a dependency)."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = module_graph()
    assert "router.cli" in graph and "workers.engine" in graph["workers.routing"]  # the walk sees imports
    assert cycles(graph) == []


def test_the_walk_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_cli_is_a_leaf_and_only_it_imports_bench() -> None:
    graph = module_graph()
    assert not [name for name, deps in graph.items() if "router.cli" in deps]
    assert not [name for name, deps in graph.items()
                if not name.startswith("bench") and name != "router.cli" and any(d.startswith("bench") for d in deps)]


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_training_builds_on_workers_and_only_the_cli_and_bench_import_it() -> None:
    graph = module_graph()
    assert "workers.target" in graph["training.trainer"]  # the walk sees training's imports
    importers = sorted(name for name, deps in graph.items()
                       if not in_package(name, "training") and any(in_package(d, "training") for d in deps))
    assert [name for name in importers if name != "router.cli" and not in_package(name, "bench")] == []


@pytest.mark.parametrize("module", [
    "policies.selector", "policies.controller", "policies.outlook", "policies.classifier", "policies.stats",
    "policies.batching", "router.app",
])
def test_no_torch_where_no_model_runs(module: str) -> None:
    """The policy package and the ingress (router.app, which imports the worker's deployment
    module for its wire types) must not pull torch in."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False", proc.stderr
