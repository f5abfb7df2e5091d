"""The codebase's shape: no import circles between modules, or between kvbench's packages."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from paths import ROOT

# installed name -> folder (pyproject.toml's package-dir)
PACKAGES = {"kvbench": "kvbench", "kvbench.tracegen": "tracegen", "kvbench.replay": "replay",
            "kvbench.methods": "methods", "kvbench.analysis": "analysis"}
# Imports by computed name the source cannot show: a registry imports every module of its package
# (kvbench.methods.registry.SPECS_PACKAGE, kvbench.tracegen.tasks.registry.TASKS_PACKAGE). A
# method's implementation is imported from the dotted path in its spec, data handed to the
# worker, so no module depends on one.
DISCOVERS = {"kvbench.methods.registry": "kvbench.methods.specs",
             "kvbench.tracegen.tasks.registry": "kvbench.tracegen.tasks"}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _imported_names(name: str, path: Path) -> list[str]:
    """Every module name `name` (at `path`) imports: absolute and relative imports anywhere
    (module level, functions, TYPE_CHECKING) and importlib.import_module / __import__ of a
    literal name. A lazy import hides a circle from Python, not from a reader."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names += [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                names.append(node.args[0].value)
    return names


def _import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the kvbench modules it imports (`_imported_names`, plus `DISCOVERS`)."""
    modules = _modules(root)

    def owner(name: str) -> str | None:
        while name not in modules:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in _imported_names(name, path):
            found = owner(target) if target.startswith("kvbench") else None
            if found is not None and found != name and not name.startswith(found + "."):  # not its own package
                graph[name].add(found)
    for importer, package in DISCOVERS.items():
        if importer in graph:
            graph[importer] |= {m for m in modules if m.startswith(package + ".")}
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


def test_the_discovered_packages_are_the_registries() -> None:
    from kvbench.methods import registry
    from kvbench.tracegen.tasks import registry as tasks

    assert DISCOVERS == {registry.__name__: registry.SPECS_PACKAGE, tasks.__name__: tasks.TASKS_PACKAGE}


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
LAYERS = ["contracts", "model", "tracegen", "methods", "server", "replay", "analysis", "experiment", "cli"]
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


# docs/architecture.md's floors inside kvbench.methods, bottom up. A module imports only its own
# floor and the floors below; on the machinery floor a package imports only itself (the
# connector and the method families do not know each other).
METHOD_FLOORS = ["core", "api", "machinery", "methods", "registry"]
MACHINERY = ("kvbench.methods.connector", "kvbench.methods.delta", "kvbench.methods.precache")


def _method_floor(module: str) -> int:
    def within(package: str) -> bool:
        return module == package or module.startswith(package + ".")

    if module == "kvbench.methods" or within("kvbench.methods.core"):
        return METHOD_FLOORS.index("core")
    if within("kvbench.methods.api"):
        return METHOD_FLOORS.index("api")
    if any(within(p) for p in MACHINERY):
        return METHOD_FLOORS.index("machinery")
    if module == "kvbench.methods.registry":
        return METHOD_FLOORS.index("registry")
    return METHOD_FLOORS.index("methods")  # specs/ and the implementations beside them


def _floor_violations(graph: dict[str, set[str]]) -> list[str]:
    def machinery_package(module: str) -> str | None:
        return next((p for p in MACHINERY if module == p or module.startswith(p + ".")), None)

    found = []
    for module, targets in graph.items():
        if not module.startswith("kvbench.methods"):
            continue
        for target in sorted(t for t in targets if t.startswith("kvbench.methods")):
            if _method_floor(target) > _method_floor(module):
                found.append(f"{module} -> {target} (upward: {METHOD_FLOORS[_method_floor(module)]} -> "
                             f"{METHOD_FLOORS[_method_floor(target)]})")
            elif machinery_package(module) and machinery_package(target) not in (None, machinery_package(module)):
                found.append(f"{module} -> {target} (across the machinery floor)")
    return found


def test_methods_floors_import_only_downward() -> None:
    assert _floor_violations(_import_graph()) == []


def _planted(tmp_path: Path, module: str, line: str) -> dict[str, set[str]]:
    """The import graph of a copy of the tree with `line` added to `module` (a folder path)."""
    for folder in PACKAGES.values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    path = tmp_path / module
    path.write_text(path.read_text(encoding="utf-8") + "\n" + line + "\n", encoding="utf-8")
    return _import_graph(tmp_path)


def test_the_check_finds_a_planted_upward_import(tmp_path: Path) -> None:
    """The core reaching into the connector, lazily and relatively: a floor violation."""
    graph = _planted(tmp_path, "methods/core/store.py",
                     "def _late():\n    from ..connector import worker  # noqa\n    return worker")
    assert "kvbench.methods.connector.worker" in graph["kvbench.methods.core.store"]
    assert _floor_violations(graph) == ["kvbench.methods.core.store -> kvbench.methods.connector.worker "
                                        "(upward: core -> machinery)"]


def test_the_check_finds_a_planted_registry_loop(tmp_path: Path) -> None:
    """A spec that asks the registry (which imports every spec) for something: a circle, found
    through importlib too."""
    graph = _planted(tmp_path, "methods/specs/fullshared.py",
                     "import importlib\n_registry = importlib.import_module('kvbench.methods.registry')")
    assert ["kvbench.methods.registry", "kvbench.methods.specs.fullshared"] in _cycles(graph)
    assert any("upward: methods -> registry" in v for v in _floor_violations(graph))


def _table_after(heading: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table after `heading` in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows, started = [], False
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not set(cells[0]) <= set("-") and cells[0] not in ("layer", "floor"):
                rows.append(cells)
        elif started:
            break
    return rows


def test_the_architecture_doc_names_the_layers_and_floors_the_checks_enforce() -> None:
    """docs/architecture.md's two tables, in order, are LAYERS and METHOD_FLOORS: what it claims is
    what these tests check."""
    def layer_of(folder_cell: str) -> str:
        first = folder_cell.split("`")[1]
        parts = [p for p in first.removesuffix(".py").split("/") if p]
        return "contracts" if first.endswith(".py") else parts[-1]

    assert [layer_of(row[1]) for row in _table_after("## Layers")] == LAYERS
    assert [row[0] for row in _table_after("Inside `methods/`, floors")] == METHOD_FLOORS


PAPER_PACKAGE = "kvbench.analysis.paper"  # the KVCMAS paper's reproduction: values, renderers, fidelity analyses


def test_only_the_paper_command_knows_the_paper_package() -> None:
    """The general analysis (and everything else) does not import the paper's reproduction; the
    `kvbench paper` command is its one way in."""
    importers = sorted(module for module, targets in _import_graph().items()
                       if not module.startswith(PAPER_PACKAGE) and any(t.startswith(PAPER_PACKAGE) for t in targets))
    assert importers == ["kvbench.cli.paper"]


def test_no_module_outside_a_task_decides_by_a_tasks_name() -> None:
    """What kvbench needs to know of a task is the task's own attribute (uses_items,
    has_default_data, runs_model_code...): no comparison with a task's name outside the tasks
    (and the paper's tables, which are about its named benchmarks)."""
    from kvbench.tracegen.tasks.registry import all_tasks

    names = set(all_tasks())
    outside = {m: p for m, p in _modules().items()
               if not m.startswith(("kvbench.tracegen.tasks", PAPER_PACKAGE))}

    def constants(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return {c.value for c in node.elts if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        return set()

    found = []
    for module, path in outside.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = set().union(*(constants(side) for side in sides)) & names
                about_a_task = any("task" in ast.unparse(side) for side in sides if not constants(side))
                if named and about_a_task:  # (a model recipe may share a task's name)
                    found.append(f"{module}:{node.lineno} compares with {sorted(named)}")
    assert found == []
