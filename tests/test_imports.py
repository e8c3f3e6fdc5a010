"""The package's import graph: no cycle, and imports run one way between the wings.

Every module under ``aloader/`` is parsed with :mod:`ast`; an edge is any import of another
module of the package (``from . import x``, ``from ..io._http import y``, ``import
aloader.io._http``, ``from aloader import _x``) at module level or inside a function. Imports
under ``if TYPE_CHECKING:`` are left out: they never run. A module is named by its dotted path
inside the package (``pipeline._plan``, ``_util``).

The wings (folders named for their jobs) and what each may import, top to bottom; the base
(the package's own top-level modules) imports no wing, and the package's entry points
(``__init__``, ``__main__``, ``_cli``, ``_demo``) may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "aloader"

BASE = ""
# wing -> the wings it may import (itself and the base always).
ALLOWED: dict[str, set[str]] = {
    "data": set(),
    "io": set(),
    "serve": set(),
    "pipeline": {"data"},
    "streams": {"pipeline", "data"},
    "sources": {"io", "streams", "pipeline", "data"},
    "workers": {"pipeline", "streams", "data"},
    "loader": {"data", "io", "pipeline", "streams", "sources", "workers"},
}
ENTRY_POINTS = {"__init__", "__main__", "_cli", "_demo"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(package: str, level: int, module: str | None) -> str:
    """The dotted target (inside aloader) of ``from <level dots><module> import ...`` written
    in a module whose package is ``package`` (dotted, "" for aloader itself)."""
    parts = package.split(".") if package else []
    if level:
        parts = parts[: len(parts) - (level - 1)]
    elif module is not None:  # absolute: aloader.x.y
        return module.removeprefix("aloader").removeprefix(".")
    return ".".join([*parts, *(module.split(".") if module else [])])


def _imports(tree: ast.AST, modules: set[str], package: str = "") -> set[str]:
    """The modules of ``modules`` that ``tree`` (a module in ``package``) imports, outside
    ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def add(target: str, names: list[str]) -> None:
        if target in modules:
            found.add(target)
            return
        for name in names:  # from . import _x / from .io import _http
            candidate = f"{target}.{name}" if target else name
            if candidate in modules:
                found.add(candidate)
        if not any((f"{target}.{n}" if target else n) in modules for n in names):
            # from .io._http import x, where the module is a package's attribute
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            absolute = node.level == 0
            if not absolute or node.module == "aloader" or (node.module or "").startswith(
                "aloader."
            ):
                target = _resolve(package, node.level, node.module)
                add(target, [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("aloader."):
                    add(alias.name.removeprefix("aloader."), [])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = {_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = _imports(tree, modules, package) - {name}
    return graph


def _wing(module: str) -> str:
    head = module.split(".")[0]
    return head if head in ALLOWED else BASE


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (found := walk(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)) is not None:
            return found
    return None


def test_the_parser_sees_every_kind_of_import() -> None:
    source = (
        "from . import _a\n"
        "from ._b import x\n"
        "import aloader.io._c\n"
        "from aloader import _d\n"
        "from aloader.io._e import y\n"
        "def f():\n"
        "    from ..io._f import z\n"
        "if TYPE_CHECKING:\n"
        "    from ._g import w\n"
    )
    modules = {"data._a", "data._b", "io._c", "_d", "io._e", "io._f", "data._g", "_h"}
    assert _imports(ast.parse(source), modules, "data") == {
        "data._a", "data._b", "io._c", "_d", "io._e", "io._f",
    }


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    assert "pipeline._plan" in graph["loader._dataloader"]  # the parser reads the real package
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_module_lives_in_a_wing_or_the_base() -> None:
    for path in PACKAGE.iterdir():
        if path.is_dir() and not path.name.startswith((".", "__")):
            assert path.name in ALLOWED or path.name in ENTRY_POINTS, path.name


def test_imports_run_one_way_between_the_wings() -> None:
    wrong = []
    for module, targets in sorted(_graph().items()):
        if module.split(".")[0] in ENTRY_POINTS:
            continue
        wing = _wing(module)
        allowed = {wing, BASE} | ALLOWED.get(wing, set()) if wing else {BASE}
        wrong += [f"{module} -> {t}" for t in sorted(targets) if _wing(t) not in allowed]
    assert not wrong, "imports against the wings' order:\n" + "\n".join(wrong)
