"""The codebase's shape: no import circles between modules, or between kvbench's packages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# installed name -> folder (pyproject.toml's package-dir)
PACKAGES = {"kvbench": "kvbench", "kvbench.tracegen": "tracegen", "kvbench.replay": "replay",
            "kvbench.methods": "methods", "kvbench.analysis": "analysis"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _import_graph() -> dict[str, set[str]]:
    """Module -> the kvbench modules it imports anywhere (module level, functions, TYPE_CHECKING):
    a lazy import hides a circle from Python, not from a reader."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name not in modules:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            for target in targets:
                found = owner(target) if target.startswith("kvbench") else None
                if found is not None and found != name and not name.startswith(found + "."):  # not its own package
                    graph[name].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(_import_graph()) == []


def test_no_two_packages_import_each_other() -> None:
    def package(module: str) -> str:  # kvbench.tracegen, kvbench.model, kvbench.methods...
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module, imports in _import_graph().items():
        graph.setdefault(package(module), set()).update(package(i) for i in imports if package(i) != package(module))
    for node in {p for targets in graph.values() for p in targets}:
        graph.setdefault(node, set())
    assert _cycles(graph) == []


# docs/architecture.md's layers, bottom up: kvbench's second-level name -> layer
LAYERS = ["contracts", "model", "tracegen", "methods", "replay", "analysis", "experiment", "cli"]
CONTRACTS = {"kvbench", "kvbench.contracts", "kvbench.run_files"}


def _layer(module: str) -> int:
    if module in CONTRACTS:
        return 0
    if module == "kvbench.__main__":
        return LAYERS.index("cli")
    return LAYERS.index(module.split(".")[1])


def test_each_layer_imports_only_the_layers_below_it() -> None:
    upward = sorted(f"{module} -> {target}" for module, targets in _import_graph().items() for target in targets
                    if _layer(target) > _layer(module))
    assert upward == []


def test_the_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_MODULE_LINES = 440  # "about 400": a module past it holds more than one job; split it by job


def test_no_module_grows_past_about_400_lines() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert long == {}
