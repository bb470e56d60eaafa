"""CI's newest-jax tier runs the tests that tests/newest_jax_tests.txt names (chosen by
tests/select_newest_jax.py): a name that no longer exists makes that tier run nothing and fail,
20 minutes into CI. Checked here in a second, from the sources."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_every_test_the_newest_jax_tier_lists_exists():
    missing = []
    for line in (REPO / "tests" / "newest_jax_tests.txt").read_text().split():
        path, _, name = line.partition("::")
        function = name.split("[")[0].split(".")[-1]  # a parameter id; a doctest's dotted name
        source = REPO / path
        module = path.removesuffix(".py").replace("/", ".")  # a module docstring's doctest
        if not (source.is_file() and (
                name == module and ">>>" in source.read_text()
                or re.search(rf"^\s*(def|class) {re.escape(function)}\b",
                             source.read_text(), re.M))):
            missing.append(line)
    assert not missing, f"rerun tests/select_newest_jax.py; gone: {missing}"


def test_every_parametrised_case_the_tier_lists_is_collected(request):
    """A listed case whose parameter ids changed (`test_x[2.0]` after a second parameter was
    added) is "not found" too, and the function check above cannot see it: pytest collects
    the listed cases, in a subprocess, unless this session collected every one of them (the
    suite and the fast tier do: the listed cases are fast tests)."""
    import subprocess
    import sys

    cases = [line for line in (REPO / "tests" / "newest_jax_tests.txt").read_text().split()
             if "[" in line]
    if set(cases) <= {item.nodeid for item in request.session.items}:
        return
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *cases], cwd=REPO, capture_output=True, text=True, timeout=300)
    gone = [line for line in (result.stdout + result.stderr).splitlines()
            if "not found" in line]
    assert result.returncode == 0 and not gone, \
        f"rerun tests/select_newest_jax.py; {gone or result.stdout[-2000:]}"


def test_the_tier_runs_the_cpu_mesh_tests():
    """A CPU mesh runs its steps asynchronously only from jaxlib 0.12: the tier is where CI
    runs that path (select_newest_jax.CPU_MESH_TESTS)."""
    import select_newest_jax

    listed = set((REPO / "tests" / "newest_jax_tests.txt").read_text().split())
    missing = sorted(set(select_newest_jax.CPU_MESH_TESTS) - listed)
    assert not missing, f"rerun tests/select_newest_jax.py; not listed: {missing}"


def test_the_selection_charges_a_shared_fixture_to_the_first_test_that_needs_it():
    """Two tests sharing a 30 s module fixture look free when the fixture is charged to neither
    (as --durations charges it to whichever ran first); one 1 s test running the same lines
    costs less than either of them with the fixture."""
    import select_newest_jax

    lines = {"a": {("m.py", 1), ("m.py", 2)}, "b": {("m.py", 3)},
             "c": {("m.py", 1), ("m.py", 2), ("m.py", 3)},
             "fixture m.py::trained[0]": {("m.py", 4)}, "d": {("m.py", 5)}}
    tests = {"a": {"seconds": 0.1, "fixtures": {"m.py::trained[0]"}},
             "b": {"seconds": 0.1, "fixtures": {"m.py::trained[0]"}},
             "c": {"seconds": 1.0, "fixtures": set()},
             "d": {"seconds": 0.5, "fixtures": set()}}
    chosen, seconds = select_newest_jax.select(tests, {"m.py::trained[0]": 30.0}, lines)
    # the fixture's own line is run only through a or b: one of them, last, paying it once
    assert chosen[:2] == ["c", "d"] and chosen[2:] in (["a"], ["b"])
    assert seconds == pytest.approx(1.0 + 0.5 + 0.1 + 30.0)
    # three cheap tests picked first, then one running their lines and a fourth: they go
    lines = {"a": {("m.py", 1)}, "b": {("m.py", 2)}, "c": {("m.py", 3)},
             "d": {("m.py", n) for n in (1, 2, 3, 4)}, "e": {("m.py", 4)}}
    cheap = {t: {"seconds": 0.01 if t in "abc" else 1.0 if t == "d" else 10.0,
                 "fixtures": set()} for t in lines}
    assert select_newest_jax.select(cheap, {}, lines) == (["d"], pytest.approx(1.0))
    lines = {"a": {("m.py", 1), ("m.py", 2)}, "b": {("m.py", 3)},
             "c": {("m.py", 1), ("m.py", 2), ("m.py", 3)},
             "fixture m.py::trained[0]": {("m.py", 4)}, "d": {("m.py", 5)}}
    # at 80% of the 5 lines, the one line only the 30 s fixture runs is left out
    assert select_newest_jax.select(tests, {"m.py::trained[0]": 30.0}, lines, 0.8) == (
        ["c", "d"], pytest.approx(1.5))
