"""The package's import graph: no module imports, even lazily, one that imports it back.

Every ``aloader/*.py`` is parsed with :mod:`ast`; an edge is any import of a sibling module
(``from . import x``, ``from ._x import y``, ``import aloader._x``, ``from aloader import _x``)
at module level or inside a function. Imports under ``if TYPE_CHECKING:`` are left out: they
never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "aloader"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The sibling modules that ``tree`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module in {"aloader", None} or (
                node.module or ""
            ).startswith("aloader."):
                base = node.module or ""
                if node.level == 0:
                    base = base.removeprefix("aloader").removeprefix(".")
                if base:
                    found.add(base.split(".")[0])
                else:  # from . import x
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("aloader."):
                    found.add(alias.name.split(".")[1])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & modules


def _graph() -> dict[str, set[str]]:
    files = {path.stem: path for path in PACKAGE.glob("*.py")}
    modules = set(files)
    return {
        name: _imports(ast.parse(path.read_text(), str(path)), modules) - {name}
        for name, path in files.items()
    }


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
        "import aloader._c\n"
        "from aloader import _d\n"
        "from aloader._e import y\n"
        "def f():\n"
        "    from ._f import z\n"
        "if TYPE_CHECKING:\n"
        "    from ._g import w\n"
    )
    modules = {"_a", "_b", "_c", "_d", "_e", "_f", "_g", "_h"}
    assert _imports(ast.parse(source), modules) == {"_a", "_b", "_c", "_d", "_e", "_f"}


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    assert "_pipeline" in graph["_loader"]  # the parser reads the real package
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
