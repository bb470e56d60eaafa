"""The package's import graph has no cycles and no arrow up: every module of transformer/ can be
read, and changed, below the ones that use it. Function-local imports count too (they only
hide a cycle from Python, not from a reader).

The rooms (sub-packages) sit on floors (`FLOORS`, the same table as docs/api.md's): a module
imports only from its own floor or the floors below it. The commands sit at the top."""

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


# room -> floor; "" is the top of transformer/ (the commands, configs), above every room
FLOORS = {"utils": 0, "parallel": 1, "nn": 2, "models": 3, "data": 4, "generation": 5, "hf": 6,
          "training": 7, "sweeps": 8, "": 9}
TOP_MODULES_AT_MOST = 16


def room(module: str) -> str:
    """transformer.nn.attention -> "nn"; transformer.train (a top-level module) -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or parts[1:] and parts[1] in FLOORS else ""


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports between rooms that do not go down (no two rooms share a floor)."""
    return sorted(f"{a} (floor {FLOORS[room(a)]}) -> {b} (floor {FLOORS[room(b)]})"
                  for a, bs in graph.items() for b in bs
                  if room(a) != room(b) and FLOORS[room(b)] >= FLOORS[room(a)])


def test_every_room_has_a_floor_and_no_import_goes_up():
    graph = import_graph()
    assert {room(m) for m in graph} <= set(FLOORS), {room(m) for m in graph} - set(FLOORS)
    assert not arrows_up(graph), "\n".join(arrows_up(graph))


def test_an_arrow_up_is_found(tmp_path):
    root = tmp_path / "transformer"
    for name, text in {"__init__.py": "", "nn/__init__.py": "", "hf/__init__.py": "",
                       "generation/__init__.py": "", "utils/__init__.py": "",
                       "nn/a.py": "from transformer.utils import b", "utils/b.py": "",
                       "hf/c.py": "import transformer.generation.d", "data/__init__.py": "",
                       "generation/d.py": "", "utils/e.py": "from transformer.nn import a",
                       "data/f.py": "from transformer.data import g\nimport transformer.hf.c",
                       "data/g.py": "",
                       "train.py": "from transformer.nn import a"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert arrows_up(import_graph(root)) == [
        "transformer.data.f (floor 4) -> transformer.hf.c (floor 6)",
        "transformer.utils.e (floor 0) -> transformer.nn.a (floor 2)"]


def test_the_code_rules_hold():
    """train.py under 400 lines, no module over 600 and no function of the package over 80
    (docstring included), at most 16 modules beside the rooms: the standing rules that keep
    each piece readable in one screen and the package's plan visible."""
    assert len((PACKAGE / "train.py").read_text().splitlines()) < 400
    big = [f"{path.relative_to(PACKAGE.parent)} ({n} lines)" for path in PACKAGE.rglob("*.py")
           if (n := len(path.read_text().splitlines())) > 600]
    assert not big, big
    assert len(list(PACKAGE.glob("*.py"))) <= TOP_MODULES_AT_MOST
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long
