"""kill -9 at random moments (3 trials of benchmarks/fault_injection.py): every resumed run ends
bitwise equal to an uninterrupted one, with each step's loss logged once and equal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    rows = _fault_injection().run(tmp_path, trials=3, steps=8, max_kills=1, seed=1,
                                  report=lambda line: None)
    assert sum(len(row["kills"]) for row in rows) >= 2, rows  # the kills really happened
    for row in rows:
        assert row["error"] == "", row
        assert row["params_equal"] and row["losses_equal"], row
