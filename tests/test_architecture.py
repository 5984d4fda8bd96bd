"""The package's shape, read from its source: no import cycle, no import that runs upward in the layering, no module
longer than the house limit.

Every import statement counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``): a
function-level import is a dependency all the same, only a later one. The floors, bottom up, are those of
docs/architecture.md: comm -> collectives -> aggregation and nn -> sync -> strategy, with the install-time helpers
(``extras``, ``launch``) below them all and the package's ``__init__`` (the public facade) on top. A module may
import from its own subpackage and from the floors below it; nothing in the package imports the recipes, the
benchmarks or the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mpistrategy"
MAX_LINES = 600

#: the floor of each part of the package (the longest name that is a prefix of a module's name decides)
FLOORS = {
    "mpistrategy.extras": 0,
    "mpistrategy.launch": 0,
    "mpistrategy.comm": 1,
    "mpistrategy.collectives": 2,
    "mpistrategy.aggregation": 3,
    "mpistrategy.nn": 3,
    "mpistrategy.sync": 4,
    "mpistrategy.strategy": 5,
    "mpistrategy": 6,
}
#: names no module of the package may import (they live above it)
ABOVE_THE_PACKAGE = ("recipes", "benchmarks", "tests", "mpistrategy.recipes", "mpistrategy.conf")


def _module_names() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported_names(name: str, path: Path, modules: set[str]) -> set[str]:
    """What the import statements of module ``name`` (at ``path``) name: ``import a.b`` names ``a.b``; ``from a
    import c`` names ``a.c`` where that is one of ``modules``, else ``a``. Relative imports are resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            imported.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return imported


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    modules = _module_names()
    return {
        name: {target for target in _imported_names(name, path, set(modules)) if target in modules and target != name}
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in import order, the first repeated at the end), or ``None``."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for target in sorted(graph[module]):
            found = visit(target, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return None


def _part(module: str) -> str:
    return max((part for part in FLOORS if module == part or module.startswith(f"{part}.")), key=len)


def test_the_graph_is_read_from_the_source() -> None:
    """The reader finds known edges: a function-level import, a ``from package import submodule`` import."""
    graph = _import_graph()
    assert "mpistrategy.strategy.conventions" in graph["mpistrategy.strategy.registration"]
    assert "mpistrategy.strategy.mpi_ad" in graph["mpistrategy.strategy.registration"]  # inside a factory
    assert "mpistrategy.comm.communicator" in graph["mpistrategy"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_runs_upward() -> None:
    """A module imports from its own part of the package or from a lower floor (docs/architecture.md)."""
    upward = []
    for module, targets in sorted(_import_graph().items()):
        part = _part(module)
        for target in sorted(targets):
            if _part(target) != part and FLOORS[_part(target)] >= FLOORS[part]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not run downward:\n" + "\n".join(upward)


def test_nothing_above_the_package_is_imported() -> None:
    modules = _module_names()
    found = [
        f"{name} imports {target}"
        for name, path in modules.items()
        for target in sorted(_imported_names(name, path, set(modules)))
        if any(target == above or target.startswith(f"{above}.") for above in ABOVE_THE_PACKAGE)
    ]
    assert not found, found


def test_every_module_is_on_a_floor() -> None:
    """A new subpackage must be placed in FLOORS (and docs/architecture.md) before it can be checked."""
    unplaced = [name for name in _module_names() if name != "mpistrategy" and _part(name) == "mpistrategy"]
    assert not unplaced, f"modules outside the known parts of the package: {unplaced}"


def test_no_module_exceeds_the_line_limit() -> None:
    lengths = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines()) for path in _sources()}
    over = {name: lines for name, lines in lengths.items() if lines > MAX_LINES}
    assert not over, f"modules above {MAX_LINES} lines: {over}"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))
