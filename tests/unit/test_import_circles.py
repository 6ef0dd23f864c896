"""No circle of imports among the project's modules, `if TYPE_CHECKING` imports included: a
circle makes import order matter and hides which module is the lower one."""

from __future__ import annotations

import grimp
import pytest

pytestmark = pytest.mark.unit


def _circle(graph: grimp.ImportGraph, modules: set[str]) -> list[str] | None:
    """One circle of direct imports among `modules`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module) & modules):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(modules):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("plugin", "plugin_tools")
    assert _circle(graph, set(graph.modules)) is None


def test_the_check_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    assert _circle(graph, {"a", "b", "c"}) is None
    graph.add_import(importer="c", imported="a")
    assert _circle(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]
