"""kill -9 at random moments (2 trials of benchmarks/fault_injection.py, which runs 20): every
resumed run ends bitwise equal to an uninterrupted one, with each step's loss logged once and
equal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import forkserver  # tests/
import pytest

pytestmark = pytest.mark.slow  # end-to-end runs through the CLI

REPO = Path(__file__).resolve().parent.parent


def _fault_injection():
    spec = importlib.util.spec_from_file_location(
        "fault_injection", REPO / "benchmarks" / "fault_injection.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kill_9_at_random_moments_resumes_to_the_same_bits(tmp_path):
    fault_injection = _fault_injection()
    fault_injection.popen = forkserver.Popen
    rows = fault_injection.run(tmp_path, trials=2, steps=8, max_kills=1, seed=1,
                               report=lambda line: None)
    # a kill lands unless the run finished first (its delay is drawn up to the reference's time)
    assert sum(len(row["kills"]) for row in rows) >= 1, rows
    for row in rows:
        assert row["error"] == "", row
        assert row["params_equal"] and row["losses_equal"], row
