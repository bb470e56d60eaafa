"""The package's import graph has no cycles: every module of transformer/ can be read, and
changed, below the ones that use it. Function-local imports count too (they only hide a cycle
from Python, not from a reader)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "transformer"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its body}."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:  # `from pkg import module` names a module
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in paths else node.module)
        graph[name] = {m for m in edges if m in paths and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" after
    path: list[str] = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "transformer.train" in graph and "transformer.models" in graph["transformer.train"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("source, cycle", [
    ({"a.py": "import pkg.b", "b.py": "def f():\n    from pkg import a"}, True),
    ({"a.py": "from pkg import b", "b.py": "import os"}, False),
    ({"__init__.py": "from pkg.a import x", "a.py": "from pkg import b", "b.py": "import pkg"},
     True),
])
def test_a_cycle_is_found_also_through_function_local_imports(tmp_path, source, cycle):
    root = tmp_path / "pkg"
    root.mkdir()
    for name, text in source.items():
        (root / name).write_text(text)
    found = find_cycle(import_graph(root))
    assert (found is not None) == cycle, found


def test_the_code_rules_hold():
    """train.py under 400 lines and no function of the package over 80 (docstring included):
    the standing rules that keep each piece readable in one screen."""
    assert len((PACKAGE / "train.py").read_text().splitlines()) < 400
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long
