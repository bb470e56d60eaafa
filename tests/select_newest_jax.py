"""Chooses the tests of CI's newest-jax tier; writes tests/newest_jax_tests.txt.

    pip install coverage pytest-cov
    python tests/select_newest_jax.py

CI runs the whole suite under Python 3.11 (jax 0.10.2) and, beside it (.ci/newest_jax), in a
Python 3.12 venv with the newest jax, flax and libtpu, the tests this script lists
(`pytest @tests/newest_jax_tests.txt`): the fast tests that together run `SHARE` (99%) of the
lines of `transformer/` and `launch/` the whole fast tier runs, so that an API the newest JAX
moved or removed fails there.

It runs the fast tier once under coverage with one context per test (`--cov-context=test`),
itself loaded as a pytest plugin that times each shared (module-, class-, package- or
session-scoped) fixture and gives it a coverage context of its own. Then it picks greedily: the
test running the most lines not yet run per second, where a test's seconds are its own plus
those of the shared fixtures it needs that no test chosen before set up. (Charging a fixture to
whichever test happened to set it up would make the others sharing it look free, and the one
picked first pays it in the tier.) It stops once the chosen tests run SHARE of the lines, drops
the chosen tests the others make redundant, and prints, per file, the lines left to the suite
alone. Lines that importing the modules runs (no
test's context) count as run. Run it again after adding tests or code: a listed test that no
longer exists fails the tier (pytest: "not found"), and new code is not in it until then.
"""

from __future__ import annotations

import collections
import functools
import json
import operator
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "tests" / "newest_jax_tests.txt"
FLOOR = 0.005  # seconds: the least a test is charged, so that none is free
# A parameter id of plain characters names one case; others (messages with brackets, quotes,
# "|") are read differently by other pytest versions, so such a test is listed whole.
PLAIN_PARAMS = re.compile(r"^[\w.,=+-]*$")
# Slow tests the tier always runs: a CPU mesh of several devices runs its steps one at a time
# under jaxlib before 0.12 and asynchronously from 0.12 (placement.CPU_COLLECTIVES_STALL), a path
# the suite under Python 3.11 never takes. Running asynchronously changes when the host waits,
# not what a step computes, so the tier takes the two tests where waiting matters: 200
# independent steps streamed (the deadlock jaxlib 0.10.2 has), and the CLI training,
# evaluating, saving and resuming on 4 devices. The other mesh tests check the numbers. A
# third, the CLI on data x sequence, compiles a shard_map manual over two mesh axes (a nested
# pair of them failed a check of jax 0.12's and aborted the process, 2026-12-04).
CPU_MESH_TESTS = (
    "tests/test_sequence_parallel.py::test_the_cli_trains_on_a_data_by_sequence_mesh_as_on_one_device",
    "tests/test_sharding.py::test_a_cpu_mesh_runs_many_streamed_steps_to_the_same_results",
    "tests/test_vision.py::test_clip_shards_checkpoints_and_resumes_through_the_cli",
)
RECORD_DIR = "SELECT_NEWEST_JAX_RECORD"  # the environment variable naming where workers write
# The share of the fast tier's lines the tier runs. The last 1% cost nearly as much as the other
# 99% (2026-12-07: of the 643 tests listed before, 182 ran 125 lines no other one ran, a
# warning's text or a refusal's branch each, in 206 of the tier's 481 s): those lines run under
# the suite's jax only.
SHARE = 0.99


def listed_id(test: str) -> str:
    """The id the list names `test` by: itself, or its function where its parameters are not
    plain.

    >>> listed_id("tests/test_a.py::test_b[rope-2]"), listed_id("tests/test_a.py::test_c[x: [1]]")
    ('tests/test_a.py::test_b[rope-2]', 'tests/test_a.py::test_c')
    """
    function, bracket, params = test.partition("[")
    return test if not bracket or PLAIN_PARAMS.match(params[:-1]) else function


# ---- the plugin, loaded into the measuring run (and its xdist workers) by -p select_newest_jax

def fixture_key(scope_nodeid: str, name: str, param_index: int) -> str:
    """One set-up of a shared fixture: the node it is shared over, its name, its parameter.

    >>> fixture_key("tests/test_a.py", "trained", 0)
    'tests/test_a.py::trained[0]'
    """
    return f"{scope_nodeid}::{name}[{param_index}]"


_record = {"fixtures": collections.Counter(), "tests": {}}
_phase = {"test": "", "when": "setup"}  # the test pytest is running, and which part of it
_setting_up = []  # shared fixtures being set up, innermost last: [key, start, nested seconds]


def _coverage():
    import coverage

    return coverage.Coverage.current()


def _shared_fixtures(item) -> list[str]:
    """Keys of the module-, class-, package- and session-scoped fixtures `item` needs."""
    parents = {"module": pytest.Module, "class": pytest.Class, "package": pytest.Package}
    indices = getattr(getattr(item, "callspec", None), "indices", {})
    info = getattr(item, "_fixtureinfo", None)  # a doctest item may have none
    keys = []
    for name in getattr(item, "fixturenames", ()):
        definitions = info.name2fixturedefs.get(name) if info else None
        scope = definitions[-1].scope if definitions else "function"
        if scope != "function":
            parent = item.getparent(parents[scope]) if scope in parents else None
            keys.append(fixture_key(parent.nodeid if parent else "", name, indices.get(name, 0)))
    return keys


@pytest.hookimpl(tryfirst=True)  # before the runner sets the fixtures up
def pytest_runtest_setup(item):
    _phase.update(test=item.nodeid, when="setup")
    _record["tests"][item.nodeid] = {"seconds": 0.0, "fixtures": _shared_fixtures(item)}


def pytest_runtest_call(item):
    _phase["when"] = "run"


def pytest_runtest_teardown(item):
    _phase["when"] = "teardown"


def pytest_runtest_logreport(report):
    if report.nodeid in _record["tests"]:
        _record["tests"][report.nodeid]["seconds"] += report.duration


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Times a shared fixture's set-up (without the shared fixtures it sets up inside) and runs
    it under its own coverage context; the test that set it up is charged none of it."""
    if fixturedef.scope == "function":
        return (yield)
    key = fixture_key(request.node.nodeid, fixturedef.argname, request.param_index)
    cov = _coverage()
    if cov:
        cov.switch_context(f"fixture {key}")
    _setting_up.append([key, time.perf_counter(), 0.0])
    try:
        return (yield)
    finally:
        _, start, nested = _setting_up.pop()
        seconds = time.perf_counter() - start
        _record["fixtures"][key] += seconds - nested
        if _setting_up:
            _setting_up[-1][2] += seconds
            outer = f"fixture {_setting_up[-1][0]}"
        else:
            outer = f"{_phase['test']}|{_phase['when']}"
            if _phase["test"] in _record["tests"]:
                _record["tests"][_phase["test"]]["seconds"] -= seconds
        if cov:
            cov.switch_context(outer)


def pytest_sessionfinish(session):
    if directory := os.environ.get(RECORD_DIR):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(directory, f"{worker}.json").write_text(json.dumps(_record))


# ---- the selection

def measure(directory: Path) -> tuple[dict, dict]:
    """Runs the fast tier under coverage (pytest-cov combines the workers' data in
    `directory`/coverage); each test's own seconds and shared fixtures, each fixture's
    seconds."""
    command = [sys.executable, "-m", "pytest", "-m", "not slow", "-n", "2", "-q",
               "-p", "no:cacheprovider", "-p", "select_newest_jax", "--cov=transformer",
               "--cov=launch", "--cov-context=test", "--cov-report="]
    env = {**os.environ, "COVERAGE_FILE": str(directory / "coverage"), RECORD_DIR: str(directory),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"the fast tier failed:\n{result.stdout[-3000:]}")
    tests, fixtures = {}, {}
    for path in directory.glob("*.json"):
        record = json.loads(path.read_text())
        for key, seconds in record["fixtures"].items():  # set up on each worker that needed it
            fixtures[key] = max(fixtures.get(key, 0.0), seconds)
        for test, entry in record["tests"].items():
            merged = tests.setdefault(listed_id(test), {"seconds": 0.0, "fixtures": set()})
            merged["seconds"] += entry["seconds"]
            merged["fixtures"].update(entry["fixtures"])
    return tests, fixtures


def lines_by_context(data_file: Path) -> dict[str, set[tuple[str, int]]]:
    """(file, line) pairs each test (its setup, run and teardown) and each shared fixture
    ("fixture KEY") ran."""
    import coverage

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    out = collections.defaultdict(set)
    for filename in data.measured_files():
        name = str(Path(filename).resolve().relative_to(REPO))
        for line, contexts in data.contexts_by_lineno(filename).items():
            for context in contexts:
                if context.startswith("fixture "):
                    out[context].add((name, line))
                elif context:  # "": collection (module imports), not a test
                    test = context.rpartition("|")[0]
                    out[listed_id(test)].add((name, line))
    return out


def select(tests: dict, fixtures: dict, lines: dict, share: float = 1.0
           ) -> tuple[list[str], float]:
    """Greedy weighted set cover: `share` of the lines some test runs (with the shared fixtures
    it needs), the most new lines per second first; a fixture's seconds are paid by the first
    test chosen that needs it. The tests chosen, and their seconds in all."""
    numbering = {line: i for i, line in enumerate(sorted(set().union(*lines.values())))}

    def mask(context: str) -> int:
        bits = bytearray((len(numbering) + 7) // 8)
        for line in lines.get(context, ()):
            bits[numbering[line] >> 3] |= 1 << (numbering[line] & 7)
        return int.from_bytes(bits, "little")

    # A test's mask holds its fixtures' lines too: a paid fixture's lines are no longer left.
    masks = {t: mask(t) | any_of(mask(f"fixture {f}") for f in entry["fixtures"])
             for t, entry in tests.items()}
    left, paid, chosen, total = any_of(masks.values()), set(), [], 0.0
    allowed = left.bit_count() - int(share * left.bit_count())  # lines the tier may leave

    def cost(test: str) -> float:
        unpaid = tests[test]["fixtures"] - paid
        return max(tests[test]["seconds"] + sum(fixtures.get(f, 0.0) for f in unpaid), FLOOR)

    while left.bit_count() > allowed:
        test = max(masks, key=lambda t: (masks[t] & left).bit_count() / cost(t))
        if not masks[test] & left:
            break
        total += cost(test)
        chosen.append(test)
        paid |= tests[test]["fixtures"]
        left &= ~masks[test]
    # then, last chosen first, each test the others make redundant (no line of its own) goes
    for test in reversed(chosen[:]):
        others = any_of(masks[t] for t in chosen if t != test)
        if not masks[test] & ~others & any_of(masks.values()):
            chosen.remove(test)
            total -= tests[test]["seconds"]  # (a fixture it paid stays counted)
    return chosen, total


def any_of(masks) -> int:
    """The lines any of these masks holds."""
    return functools.reduce(operator.or_, masks, 0)


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        tests, fixtures = measure(Path(directory))
        lines = lines_by_context(Path(directory) / "coverage")
    chosen, kept = select(tests, fixtures, lines, SHARE)
    everything = sum(entry["seconds"] for entry in tests.values()) + sum(fixtures.values())
    OUTPUT.write_text("".join(f"{test}\n" for test in sorted({*chosen, *CPU_MESH_TESTS})))
    run = set().union(*(lines.get(t, set()) for t in chosen),
                      *(lines.get(f"fixture {f}", set()) for t in chosen
                        for f in tests[t]["fixtures"]))
    left = collections.Counter(name for name, _ in set().union(*lines.values()) - run)
    print(f"{len(chosen)} of {len(tests)} tests run {SHARE:.0%} of the lines the fast tier "
          f"runs; {kept:.0f} of {everything:.0f} s with the shared fixtures they need; with the "
          f"{len(CPU_MESH_TESTS)} CPU-mesh tests, wrote {OUTPUT.relative_to(REPO)}. Lines left "
          f"to the suite alone: " + ", ".join(f"{name} {n}" for name, n in left.most_common()))


if __name__ == "__main__":
    main()
