"""CI's newest-jax tier runs the tests that tests/newest_jax_tests.txt names (chosen by
tests/select_newest_jax.py): a name that no longer exists makes that tier run nothing and fail,
20 minutes into CI. Checked here in a second, from the sources."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_test_the_newest_jax_tier_lists_exists():
    missing = []
    for line in (REPO / "tests" / "newest_jax_tests.txt").read_text().split():
        path, _, name = line.partition("::")
        function = name.split("[")[0].split(".")[-1]  # a parameter id; a doctest's dotted name
        source = REPO / path
        if not (source.is_file() and re.search(rf"^\s*(def|class) {re.escape(function)}\b",
                                                source.read_text(), re.M)):
            missing.append(line)
    assert not missing, f"rerun tests/select_newest_jax.py; gone: {missing}"


def test_the_tier_runs_the_cpu_mesh_tests():
    """A CPU mesh runs its steps asynchronously only from jaxlib 0.12: the tier is where CI
    runs that path (select_newest_jax.CPU_MESH_TESTS)."""
    import select_newest_jax

    listed = set((REPO / "tests" / "newest_jax_tests.txt").read_text().split())
    missing = sorted(set(select_newest_jax.CPU_MESH_TESTS) - listed)
    assert not missing, f"rerun tests/select_newest_jax.py; not listed: {missing}"
