"""The benchmarks' number helpers on made-up inputs (no benchmark runs): train_throughput's MFU
peak and cells and its breakdown rows, speculative_decode's turn-taking timer, cpu_kernels'
XLA option columns."""

import functools
import importlib.util
import pathlib
import sys
from unittest import mock

import pytest
from absl import flags

from transformer.training import metrics

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load(name: str):
    """benchmarks/`name`.py, its absl flags defined into a private FlagValues: the scripts share
    flag names ("repeats") that would clash in the global one."""
    sys.path.append(str(BENCHMARKS))  # their own imports (nanogpt_common, compile_time)
    private = flags.FlagValues()
    defines = {f: functools.partial(getattr(flags, f), flag_values=private)
               for f in dir(flags) if f.startswith("DEFINE")}
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.multiple(flags, **defines):
        spec.loader.exec_module(module)
    return module


def test_mfu_is_against_the_larger_of_the_runs_peak_and_the_host_best(monkeypatch):
    bench = load("train_throughput")
    monkeypatch.setattr(metrics, "cpu_peak", lambda *a, **k: (400e9, 90e9))
    assert bench.xla_mfu_peak(100e9) == (400e9, 400e9)  # this run read low: the cache wins
    monkeypatch.setattr(metrics, "cpu_peak", lambda *a, **k: (80e9, 80e9))
    assert bench.xla_mfu_peak(100e9) == (100e9, 80e9)


def test_an_mfu_above_100_percent_is_flagged():
    bench = load("train_throughput")
    assert bench.mfu_cell(57e9, 100e9) == "57%"
    assert bench.mfu_cell(100e9, 100e9) == "100%"
    assert bench.mfu_cell(114e9, 100e9) == "114% (peak measured under load)"


@pytest.mark.parametrize("ms", [-576.2, 0.0])
def test_a_difference_noise_outweighed_reads_within_noise(ms):
    bench = load("train_throughput")
    assert bench.part_row("ours: attention core in the step", ms, 3.2) == (
        "| ours: attention core in the step | within noise | 3.2 | - |")
    assert bench.part_row("forward", 20.0, 4.0) == "| forward | 20.0 | 4.0 | 200 |"
    assert bench.part_row("update", 5.0, 0.0) == "| update | 5.0 | 0.0 | - |"


def test_the_speculative_benchmark_takes_turns():
    bench = load("speculative_decode")
    calls = []
    sides = [lambda: calls.append("plain") or "p", lambda: calls.append("fast") or "f"]
    (plain_s, plain), (fast_s, fast) = bench.best_times(sides, repeats=3)
    assert calls == ["plain", "fast"] * 4  # one compile call each, then turns
    assert (plain, fast) == ("p", "f") and 0 <= plain_s < 1 and 0 <= fast_s < 1


def test_the_eigen_column_differs_from_training_only_in_the_dot_library():
    bench = load("cpu_kernels")
    training = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                "xla_multiheap_size_constraint_per_heap": 1 << 30}
    ynnpack, eigen = bench.dot_settings(training).values()
    assert ynnpack == training
    assert eigen == {**training, "xla_cpu_experimental_ynn_fusion_type": ""}
