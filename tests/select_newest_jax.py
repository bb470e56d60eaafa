"""Chooses the tests of CI's newest-jax tier; writes tests/newest_jax_tests.txt.

    pip install coverage pytest-cov
    python tests/select_newest_jax.py

CI runs the whole suite under Python 3.11 (jax 0.10.2) and, beside it (.ci/newest_jax), in a
Python 3.12 venv with the newest jax, flax and libtpu, the tests this script lists
(`pytest @tests/newest_jax_tests.txt`): the fast tests that together run every line of
`transformer/` and `launch/` the whole fast tier runs, so that an API the newest JAX moved or
removed fails there.

It runs the fast tier once under coverage with one context per test (`--cov-context=test`) and
with each test's time (`--durations=0`), then picks greedily: the test running the most lines
not yet run per second, until none is left. Lines that importing the modules runs (no test's
context) count as run. Run it again after adding tests or code: a listed test that no longer
exists fails the tier (pytest: "not found"), and new code is not in it until then.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "tests" / "newest_jax_tests.txt"
DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(.+)$")
FLOOR = 0.005  # seconds: pytest leaves out of --durations the phases shorter than this
# A parameter id of plain characters names one case; others (messages with brackets, quotes,
# "|") are read differently by other pytest versions, so such a test is listed whole.
PLAIN_PARAMS = re.compile(r"^[\w.,=+-]*$")
# Slow tests the tier always runs: a CPU mesh of several devices runs its steps one at a time
# under jaxlib before 0.12 and asynchronously from 0.12 (placement.CPU_COLLECTIVES_STALL), a path
# the suite under Python 3.11 never takes. Running asynchronously changes when the host waits,
# not what a step computes, so the tier takes the two tests where waiting matters: 200
# independent steps streamed (the deadlock jaxlib 0.10.2 has), and the CLI training,
# evaluating, saving and resuming on 4 devices. The other mesh tests check the numbers.
CPU_MESH_TESTS = (
    "tests/test_sharding.py::test_a_cpu_mesh_runs_many_streamed_steps_to_the_same_results",
    "tests/test_vision.py::test_clip_shards_checkpoints_and_resumes_through_the_cli",
)


def listed_id(test: str) -> str:
    """The id the list names `test` by: itself, or its function where its parameters are not
    plain.

    >>> listed_id("tests/test_a.py::test_b[rope-2]"), listed_id("tests/test_a.py::test_c[x: [1]]")
    ('tests/test_a.py::test_b[rope-2]', 'tests/test_a.py::test_c')
    """
    function, bracket, params = test.partition("[")
    return test if not bracket or PLAIN_PARAMS.match(params[:-1]) else function


def measure(data_file: Path) -> dict[str, float]:
    """Runs the fast tier under coverage (pytest-cov combines the workers' data in
    `data_file`); each test's seconds (setup + call + teardown)."""
    command = [sys.executable, "-m", "pytest", "-m", "not slow", "-n", "2", "-q",
               "-p", "no:cacheprovider", "--cov=transformer", "--cov=launch",
               "--cov-context=test", "--cov-report=", "--durations=0"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "COVERAGE_FILE": str(data_file)})
    if result.returncode != 0:
        sys.exit(f"the fast tier failed:\n{result.stdout[-3000:]}")
    seconds = collections.Counter()
    for line in result.stdout.splitlines():
        if match := DURATION.match(line):
            seconds[listed_id(match.group(3).strip())] += float(match.group(1))
    return seconds


def lines_by_test(data_file: Path) -> dict[str, set[tuple[str, int]]]:
    """(file, line) pairs each test's contexts (setup, run, teardown) ran."""
    import coverage

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    out = collections.defaultdict(set)
    for filename in data.measured_files():
        name = str(Path(filename).resolve().relative_to(REPO))
        for line, contexts in data.contexts_by_lineno(filename).items():
            for context in contexts:
                if context:  # "": collection (module imports), not a test
                    test = context.removesuffix("|setup").removesuffix("|run").removesuffix(
                        "|teardown")
                    out[listed_id(test)].add((name, line))
    return out


def select(lines: dict[str, set], seconds: dict[str, float]) -> list[str]:
    """Greedy weighted set cover: every line some test runs, the most new lines per second
    first."""
    left = set().union(*lines.values())
    chosen = []
    while left:
        test = max(lines, key=lambda t: len(lines[t] & left) / max(seconds.get(t, 0), FLOOR))
        gain = lines[test] & left
        if not gain:
            break
        chosen.append(test)
        left -= gain
    return chosen


def main() -> None:
    data_file = REPO / ".coverage.newest_jax"
    seconds = measure(data_file)
    lines = lines_by_test(data_file)
    chosen = select(lines, seconds)
    total, kept = sum(seconds.values()), sum(seconds.get(t, FLOOR) for t in chosen)
    OUTPUT.write_text("".join(f"{test}\n" for test in sorted({*chosen, *CPU_MESH_TESTS})))
    data_file.unlink()
    print(f"{len(chosen)} of {len(lines)} tests run every line the fast tier runs "
          f"({len(set().union(*lines.values())):,}); {kept:.0f} of {total:.0f} s; "
          f"with the {len(CPU_MESH_TESTS)} CPU-mesh tests, wrote {OUTPUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
