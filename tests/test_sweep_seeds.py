"""Sweeps over seeds: the statistics (mean, std, Student-t intervals, seed-paired differences
from the baseline) against a float64 NumPy/SciPy reference, the report they make from per-seed
runs, and a real 2 variants x 2 seeds sweep through the CLI (layout, seeds that change the init
and the data, skipped and resumed runs, refusals).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import forkserver
import numpy as np
import pytest
from scipy import stats

from transformer import sweep
from transformer.configs import base_config
from transformer.sweeps import plots
from transformer.training import evaluation
from transformer.utils import keys

REPO = Path(__file__).resolve().parents[1]


def reference(values) -> tuple[float, float, float, float]:
    """(mean, std, low, high): float64, ddof=1, the 95% Student-t interval of the mean."""
    x = np.asarray(values, np.float64)
    mean, std = x.mean(), x.std(ddof=1)
    low, high = stats.t.interval(0.95, len(x) - 1, loc=mean, scale=std / np.sqrt(len(x)))
    return mean, std, low, high


BASE = [3.00, 3.20, 3.40, 3.10]                                 # the baseline's 4 seeds
SHIFTED = [b + d for b, d in zip(BASE, [0.05, 0.06, 0.04, 0.05], strict=True)]  # a real effect
NOISY = [b + d for b, d in zip(BASE, [0.05, -0.04, 0.02, -0.03], strict=True)]  # none


def test_estimate_matches_numpy_and_scipy():
    for values in (BASE, SHIFTED, [1.0, 2.0], [0.1, 0.5, 0.2, 0.9, 0.3, 0.7]):
        got = sweep.estimate(values)
        assert got.n == len(values)
        np.testing.assert_allclose([got.mean, got.std, got.low, got.high], reference(values),
                                   rtol=1e-12)
    # Missing values (a seed without the metric) are left out; one value has no interval.
    assert sweep.estimate([None, 2.0, None, 4.0]) == sweep.estimate([2.0, 4.0])
    assert sweep.estimate([5.0]) == sweep.Estimate(1, 5.0)
    assert sweep.estimate([None]) is None


def test_the_paired_difference_and_its_verdict():
    by_seed = dict(enumerate(BASE))
    shifted = sweep.paired_difference(dict(enumerate(SHIFTED)), by_seed)
    np.testing.assert_allclose([shifted.mean, shifted.std, shifted.low, shifted.high],
                               reference(np.subtract(SHIFTED, BASE)), rtol=1e-9)
    assert sweep.verdict(shifted) == "differs"
    # Unpaired, the two variants' intervals overlap widely: pairing by seed is what finds it.
    assert sweep.estimate(SHIFTED).low < sweep.estimate(BASE).high
    noisy = sweep.paired_difference(dict(enumerate(NOISY)), by_seed)
    np.testing.assert_allclose([noisy.mean, noisy.low, noisy.high],
                               np.array(reference(np.subtract(NOISY, BASE)))[[0, 2, 3]],
                               rtol=1e-9)
    assert noisy.low < 0 < noisy.high and sweep.verdict(noisy) == "within noise"
    # Only the seeds both have pair up; fewer than two pairs give no verdict.
    partial = sweep.paired_difference({0: SHIFTED[0], 2: SHIFTED[2], 3: None}, by_seed)
    assert partial.n == 2
    assert partial.mean == pytest.approx(np.mean([SHIFTED[0] - BASE[0], SHIFTED[2] - BASE[2]]))
    assert sweep.verdict(sweep.paired_difference({0: 1.0}, by_seed)) == "-"
    assert sweep.verdict(sweep.paired_difference({0: float("nan"), 1: 3.0}, by_seed)) == "-"
    assert sweep.verdict(sweep.Estimate(2, 0.0, 0.0, 0.0, 0.0)) == "within noise"


def fake_run(directory: Path, val_losses: list[float], final_train: float, steps: int = 4,
             failed: bool = False):
    """A run's files as training leaves them: metrics.jsonl (train and validation records at
    steps 2 and 4) and summary.json, or error.txt for a failed run."""
    directory.mkdir(parents=True)
    if failed:
        (directory / "error.txt").write_text("RuntimeError: boom\n\ntraceback")
        return
    records = []
    for i, (step, val) in enumerate(zip((2, 4), val_losses, strict=True)):
        records.append({"split": "train", "step": step, "loss": final_train + 1 - i,
                        "tokens_per_s": 1000.0, "elapsed": 10.0 * step})
        records.append({"split": "validation", "step": step, "loss": val, "accuracy": 0.5,
                        "elapsed": 10.0 * step + 1})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "summary.json").write_text(json.dumps({"step": steps, "num_params": 1234}))


def tables(report: str) -> list[dict[str, dict[str, str]]]:
    """Each markdown table of the report as {first cell: {header: cell}}."""
    found, lines = [], report.splitlines() + [""]
    start = None
    for i, line in enumerate(lines):
        if line.startswith("|") and start is None:
            start = i
        elif not line.startswith("|") and start is not None:
            rows = [[c.strip() for c in row.strip("|").split("|")] for row in lines[start:i]]
            found.append({cells[0]: dict(zip(rows[0], cells, strict=True)) for cells in rows[2:]})
            start = None
    return found


def test_the_report_over_seeds(tmp_path, monkeypatch):
    from transformer.sweeps import report as report_lib

    plotted = {}  # the runs each variant's mean curve is drawn over: its finished seeds
    monkeypatch.setattr(report_lib, "plot_curves", lambda runs, workdir: plotted.update(
        {name: len(rows) for name, rows in runs.items()}) or plots.plot_curves(runs, workdir))
    config = base_config()
    config.steps = 4
    variants = sweep.named({"base": {}, "shifted": {"model.num_heads": 4},
                            "noisy": {"model.num_heads": 2}})
    configs = sweep.variant_configs(config, variants)
    for k in range(4):
        fake_run(tmp_path / "base" / f"seed_{k}", [BASE[k] + 1, BASE[k]], 2.0 + k)
        fake_run(tmp_path / "shifted" / f"seed_{k}", [SHIFTED[k] + 1, SHIFTED[k]], 2.0 + k)
        fake_run(tmp_path / "noisy" / f"seed_{k}", [NOISY[k] + 1, NOISY[k]], 2.0 + k,
                 failed=k == 3)
    path = sweep.write_report(configs, variants, str(tmp_path), "t", seeds=4, baseline="base")
    report = Path(path).read_text()
    summary, differences, per_seed = tables(report)

    def cell(values):
        mean, std, low, high = reference(values)
        return f"{mean:.4f} ± {std:.4f} [{low:.4f}, {high:.4f}]"

    assert summary["base"]["val loss"] == cell(BASE)
    assert summary["shifted"]["val loss"] == cell(SHIFTED)
    assert summary["noisy"]["val loss"] == cell(NOISY[:3])  # the failed seed is left out
    assert summary["base"]["train loss"] == cell([2.0, 3.0, 4.0, 5.0])
    assert summary["noisy"]["seeds"] == "3/4"
    assert summary["noisy"]["status"] == "3 finished, 1 failed"
    assert summary["base"]["status"] == "finished" and summary["base"]["params"] == "1,234"
    assert summary["base"]["overrides"] == "(base)"

    mean, _, low, high = reference(np.subtract(SHIFTED, BASE))
    assert differences["shifted"]["val loss"] == f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] differs"
    mean, _, low, high = reference(np.subtract(NOISY, BASE)[:3])
    assert differences["noisy"]["val loss"] == \
        f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] within noise"
    assert differences["base"]["val loss"] == "baseline"
    assert "## Difference from the baseline `base`" in report

    assert per_seed["shifted/seed_2"]["val loss"] == f"{SHIFTED[2]:.4f}"
    assert per_seed["shifted/seed_2"]["overrides"] == "`model.num_heads=4`, `seed=2`"
    assert per_seed["noisy/seed_3"]["status"] == "failed"
    assert "- noisy/seed_3: RuntimeError: boom" in report
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png", "train_loss_vs_step.png"):
        assert (tmp_path / png).stat().st_size > 0 and f"]({png})" in report
    assert "(mean of 4 seeds, band: min to max)" in report
    assert plotted == {"base": 4, "shifted": 4, "noisy": 3}  # not the failed seed's

    # Another baseline flips the signs; an unknown one is refused.
    sweep.write_report(configs, variants, str(tmp_path), "t", seeds=4, baseline="shifted")
    flipped = tables((tmp_path / "report.md").read_text())[1]
    assert flipped["base"]["val loss"].startswith(f"{-np.mean(np.subtract(SHIFTED, BASE)):+.4f}")
    with pytest.raises(ValueError, match=r"baseline 'nope' \(--baseline or get_baseline\(\)\): "
                                         r"expected one of the variants "
                                         r"\['base', 'shifted', 'noisy'\]"):
        sweep.write_report(configs, variants, str(tmp_path), "t", seeds=4, baseline="nope")


def test_a_non_finite_seed_is_left_out_of_every_column_alike_and_named(tmp_path):
    """A finished seed whose final val loss is NaN (diverged) said "- ± - [-, -]" under
    seeds 2/2, its val acc was the other seed's alone as if a mean of two, and the difference
    a bare number from one pair. Non-finite counts as missing everywhere (the statistics, the
    paired differences, the window pairs); a cell over fewer than the finished seeds says its
    n, and a note names the run."""
    nan = float("nan")
    assert sweep.estimate([2.0, nan, 4.0, float("inf")]) == sweep.estimate([2.0, 4.0])
    assert sweep.estimate([nan]) is None
    assert sweep.paired_difference({0: 3.0, 1: nan, 2: 3.5}, {0: 2.0, 1: 2.0, 2: float("-inf")}
                                   ) == sweep.Estimate(1, 1.0)
    config = base_config()
    config.steps = 4
    variants = sweep.named({"base": {}, "diverged": {"model.num_heads": 4}})
    configs = sweep.variant_configs(config, variants)
    for k in range(3):
        fake_run(tmp_path / "base" / f"seed_{k}", [BASE[k] + 1, BASE[k]], 2.0 + k)
        fake_run(tmp_path / "diverged" / f"seed_{k}",
                 [SHIFTED[k] + 1, nan if k == 1 else SHIFTED[k]], 2.0 + k)
    report = open(sweep.write_report(configs, variants, str(tmp_path), "t", seeds=3,
                                     baseline="base")).read()
    summary, differences, per_seed = tables(report)
    mean, std, low, high = reference([SHIFTED[0], SHIFTED[2]])
    row = summary["diverged"]
    assert row["seeds"] == "3/3" and row["status"] == "finished"
    assert row["val loss"] == f"{mean:.4f} ± {std:.4f} [{low:.4f}, {high:.4f}] (n=2)"
    assert row["val acc"] == "0.500 ± 0.000 [0.500, 0.500] (n=2)"  # the same two seeds
    assert row["train loss"] == summary["base"]["train loss"]  # finite in all 3: no n
    assert "(n=" not in summary["base"]["val loss"]
    mean, _, low, high = reference(np.subtract(SHIFTED, BASE)[[0, 2]])
    assert differences["diverged"]["val loss"] == \
        f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] within noise (n=2)"
    assert differences["diverged"]["val acc"] == "+0.000 [+0.000, +0.000] within noise (n=2)"
    assert "(n=" not in differences["diverged"]["train loss"]
    assert per_seed["diverged/seed_1"]["val loss"] == "-"
    assert "\n- diverged/seed_1: val loss nan\n" in report
    # The same seed's windows, NaN where it diverged, are not paired either.
    windows = {"loss_sum": np.array([1.0, 2.0]), "num_tokens": np.array([4.0, 4.0]),
               "fingerprint": "f"}
    diverged = {**windows, "loss_sum": np.array([1.0, nan])}
    pairs, notes = sweep.window_pairs({0: windows, 1: diverged}, {0: windows, 1: windows})
    assert len(pairs) == 1 and notes == [
        "seed 1: non-finite window losses in its run (diverged?): not paired"]
    assert sweep.window_pairs({1: windows}, {1: diverged})[1] == [
        "seed 1: non-finite window losses in the baseline's (diverged?): not paired"]


def test_variants_trained_for_other_steps_or_tokens_than_the_baseline_are_named(tmp_path):
    """A difference from a baseline that trained another number of steps or tokens mixes the
    variant's effect with the budget's: a line under the difference table names them, with
    seeds and with one."""
    config = base_config()
    config.steps = 4
    variants = sweep.named({"base": {}, "heads": {"model.num_heads": 4}, "longer": {"steps": 8},
                            "shorter_rows": {"seq_len": 32}})
    configs = sweep.variant_configs(config, variants)
    tokens = 4 * config.batch_size * config.seq_len
    want = (f"Trained other steps or tokens than the baseline `base` (4 steps, {tokens:,} "
            f"tokens): longer (8 steps, {2 * tokens:,} tokens); shorter_rows (4 steps, "
            f"{4 * config.batch_size * 32:,} tokens).")
    for seeds, layout in ((2, [f"/seed_{k}" for k in range(2)]), (1, [""])):
        workdir = tmp_path / str(seeds)
        for name in configs:
            for k, suffix in enumerate(layout):
                fake_run(workdir / (name + suffix), [BASE[k] + 1, BASE[k]], 2.0,
                         steps=configs[name].steps)
        report = open(sweep.write_report(configs, variants, str(workdir), "t", seeds=seeds,
                                         baseline="base")).read().splitlines()
        differences = report.index(next(line for line in report if line.startswith(
            "| heads |") and line.count("|") < 10))  # the difference table's row
        assert report[differences + 3:differences + 5] == ["", want], seeds
    # With every variant at the baseline's steps and tokens, no line.
    del configs["longer"], configs["shorter_rows"]
    report = open(sweep.write_report(configs, variants[:2], str(tmp_path / "1"), "t")).read()
    assert "Trained other steps" not in report


def test_a_half_written_last_line_is_dropped_and_a_run_under_way_is_training(tmp_path, capsys):
    """A run killed mid-write leaves its metrics.jsonl's last line half-written: the report
    reads the records before it (as a resume does); a line that does not parse elsewhere is
    damage, named with its file and line. A run that has logged but saved no checkpoint is
    "training", one with no records "new"."""
    from transformer.sweeps import report as report_lib
    from transformer.training import metrics

    config = base_config()
    config.steps = 4
    variants = sweep.named({"base": {}, "other": {"model.num_heads": 4}})
    configs = sweep.variant_configs(config, variants)
    for k in range(2):
        fake_run(tmp_path / "base" / f"seed_{k}", [BASE[k] + 1, BASE[k]], 2.0 + k)
    fake_run(tmp_path / "other" / "seed_0", [SHIFTED[0] + 1, SHIFTED[0]], 2.0, steps=2)
    (tmp_path / "other" / "seed_1").mkdir()
    path = tmp_path / "base" / "seed_1" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines) + "\n" + lines[0][:40])  # killed writing a 5th record
    assert report_lib.read_records(str(path.parent)) == [json.loads(line) for line in lines]
    sweep.write_report(configs, variants, str(tmp_path), "t", seeds=2, baseline="base")
    per_seed = tables((tmp_path / "report.md").read_text())[2]
    assert per_seed["base/seed_1"]["val loss"] == f"{BASE[1]:.4f}"
    assert per_seed["base/seed_1"]["status"] == "finished"
    assert per_seed["other/seed_0"]["status"] == "training"
    assert per_seed["other/seed_0"]["steps"] == "4"  # its last train record's
    assert per_seed["other/seed_1"]["status"] == "new"

    path.write_text("\n".join([lines[0], lines[1][:40]] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}: line 2 is not a JSON record \(column "
                                         r"\d+: [^)]+\): expected a record a line, only the "
                                         r"last one half-written \(by a run killed "
                                         r"mid-write\)"):
        sweep.write_report(configs, variants, str(tmp_path), "t", seeds=2, baseline="base")
    # A resume still drops it (and what it logged past its checkpoint), says so, and goes on.
    capsys.readouterr()
    assert metrics.keep_records_up_to(str(path), 2) == [lines[0] + "\n"]
    assert capsys.readouterr().err.startswith(f"warning: {path}: line 2 is not a JSON record")


def test_mean_curves_over_seeds():
    runs = [[{"split": "validation", "step": 2, "loss": 4.0, "elapsed": 1.0},
             {"split": "validation", "step": 4, "loss": 3.0, "elapsed": 3.0},
             {"split": "train", "step": 4, "loss": 9.0, "elapsed": 3.0}],
            [{"split": "validation", "step": 2, "loss": 5.0, "elapsed": 2.0},
             {"split": "validation", "step": 4, "loss": float("nan"), "elapsed": 4.0}],
            []]  # a seed that has not logged yet is left out
    xs, mean, low, high = plots._mean_curve(runs, "validation", "elapsed")
    assert (xs, mean, low, high) == ([1.5], [4.5], [4.0], [5.0])  # step 4 is not finite in both
    assert plots._mean_curve(runs[:1], "validation", "step") == ([2, 4], [4.0, 3.0],
                                                                  [4.0, 3.0], [4.0, 3.0])


def test_seed_runs_names_options_and_refusals(tmp_path):
    variants = sweep.named({"a": {"model.num_heads": 2}, "b": {}})
    assert sweep.seed_variants(variants, 1) == variants
    assert sweep.seed_variants(variants, 2) == [
        sweep.Variant("a/seed_0", {"model.num_heads": 2, "seed": 0}),
        sweep.Variant("a/seed_1", {"model.num_heads": 2, "seed": 1}),
        sweep.Variant("b/seed_0", {"seed": 0}), sweep.Variant("b/seed_1", {"seed": 1})]
    configs = sweep.variant_configs(base_config(), sweep.seed_variants(variants, 2))
    assert configs["a/seed_1"].seed == 1 and configs["a/seed_1"].model.num_heads == 2
    assert configs["a/seed_1"].experiment.endswith("/a/seed_1")
    seeded = sweep.named({"a": {}, "s": {"seed": 3}})
    assert sweep.seed_variants(seeded, 1) == seeded  # one seed: a variant may set it
    with pytest.raises(ValueError, match=r"^variant 's' sets seed=3 and --seeds=2 sets seeds "
                                         r"0..1: expected one of the two$"):
        sweep.seed_variants(seeded, 2)
    commands = sweep.launch_commands("x.py", {}, sweep.seed_variants(variants[1:], 2), "/w")
    assert commands == ["python -m transformer.train --config=x.py --workdir=/w/b/seed_0 "
                        "--config.seed=0", "python -m transformer.train --config=x.py "
                        "--workdir=/w/b/seed_1 --config.seed=1"]

    plain, options = tmp_path / "plain.py", tmp_path / "options.py"
    plain.write_text("def get_sweep():\n    return []\n")
    options.write_text("def get_seeds():\n    return 3\n\ndef get_baseline():\n    return 'b'\n")
    assert sweep.load_options(str(plain)) == (1, None)
    assert sweep.load_options(str(options)) == (3, "b")
    assert sweep.load_options(f"{options}:arg", seeds=2, baseline="a") == (2, "a")
    for bad in (0, -1, "3", True):
        with pytest.raises(ValueError, match=rf"^--seeds={bad!r}: expected an int >= 1"):
            sweep.load_options(str(plain), seeds=bad)
    options.write_text("def get_seeds():\n    return 0\n")
    with pytest.raises(ValueError, match=r"options.py: get_seeds\(\)=0: expected an int >= 1"):
        sweep.load_options(str(options))
    (tmp_path / "one" / "a").mkdir(parents=True)
    (tmp_path / "one" / "a" / "sweep_config.json").write_text("{}")
    (tmp_path / "many" / "a" / "seed_0").mkdir(parents=True)
    sweep.check_layout(str(tmp_path / "one"), ["a", "b"], 1)
    sweep.check_layout(str(tmp_path / "many"), ["a", "b"], 3)
    with pytest.raises(ValueError, match=r"one/a holds a run of one seed: expected --seeds=1, "
                                         r"or another --workdir for --seeds=2$"):
        sweep.check_layout(str(tmp_path / "one"), ["a"], 2)
    with pytest.raises(ValueError, match=r"many/a holds runs of several seeds"):
        sweep.check_layout(str(tmp_path / "many"), ["a"], 1)
    for k in (1, 2):  # three seeds' runs: --seeds=2 would report on two of them
        (tmp_path / "many" / "a" / f"seed_{k}").mkdir()
    with pytest.raises(ValueError, match=r"many/a holds runs of seeds 0..2: expected --seeds=3 "
                                         r"\(--seeds=2 would rewrite the report"):
        sweep.check_layout(str(tmp_path / "many"), ["a"], 2)
    sweep.check_layout(str(tmp_path / "many"), ["a"], 3)
    assert sweep.check_baseline(None, ["a", "b"]) == "a"
    assert sweep.check_baseline("b", ["a", "b"]) == "b"


def test_a_sweep_definition_is_refused_in_one_line_naming_the_file_and_the_name(tmp_path,
                                                                              capsys):
    """get_sweep() returning no list of variants, a name that is no directory name, a name two
    values share: each refused in one line saying what to do; equal overrides warn."""
    def load(body: str):  # a file per body: a rewrite within a second may reuse stale bytecode
        experiment = tmp_path / str(len(list(tmp_path.iterdir()))) / "experiment.py"
        experiment.parent.mkdir()
        experiment.write_text(f"from transformer import sweep\n\ndef get_sweep():\n"
                              f"    return {body}\n")
        return [v.name for v in sweep.load_sweep(str(experiment))], experiment

    lists = "expected a list of variants \\(sweep.axis / named / product / zipped\\)$"
    for body, match in [
            ("None", rf"experiment.py: get_sweep\(\) returned None: {lists}"),
            ("sweep.named({'a': {}})[0]", r"get_sweep\(\) returned Variant\(name='a', .*: "
                                          + lists),
            ("[sweep.axis('seed', [0]), sweep.axis('steps', [5])]",
             r"experiment.py: get_sweep\(\)'s item 0 is \[Variant\(.*\)\]: expected a variant "
             r".*\(join sweeps with \+, or combine them with sweep.product / zipped\)$"),
            ("sweep.axis('data.path', ['corpora/a.txt', 'corpora/b.txt'])",
             r"experiment.py: variant name 'path=corpora/a.txt' contains the path separator '/': "
             r"expected one directory name under --workdir \(give sweep.axis names=\[...\], or "
             r"name the variants with sweep.named\)$"),
            ("sweep.named({'': {}})", r"variant name '': expected a non-empty string"),
            ("sweep.named({'..': {}, 'x': {}})", r"variant name '..' starts with '.': expected a "
                                                 r"directory name that does not"),
            ("sweep.axis('optimizer.learning_rate', [1e-3, 1.0000001e-3])",
             r"variant name 'learning_rate=0.001' repeats for optimizer.learning_rate=0.001 and "
             r"0.0010000001: expected unique names \(give sweep.axis names=\[...\], or name "
             r"the variants with sweep.named\)$"),
            ("sweep.axis('seed', [1, 1])", r"variant name 'seed=1' repeats: expected unique "
                                           r"names$")]:
        with pytest.raises(ValueError, match=match) as error:
            load(body)
        assert "\n" not in str(error.value)
    assert capsys.readouterr().err == ""

    # The same overrides under two names train alike: allowed, with one warning naming them.
    names, experiment = load("sweep.named({'a': {'optimizer.learning_rate': 1e-3}, 'c': {}, "
                             "'b': {'optimizer.learning_rate': 1e-3}})")
    assert names == ["a", "c", "b"]
    assert capsys.readouterr().err == (
        f"warning: {experiment}: variants ['a', 'b'] have the same overrides "
        "{'optimizer.learning_rate': 0.001} and train the same config (to repeat a run with "
        "other seeds, use --seeds=N)\n")
    assert load("sweep.axis('optimizer.learning_rate', [1e-3, 1.0000001e-3], "
                "names=['lr1', 'lr2'])")[0] == ["lr1", "lr2"]
    assert capsys.readouterr().err == ""


def test_only_rejoins_names_with_commas_and_runs_are_checked_before_anything(tmp_path,
                                                                             monkeypatch):
    """--only's comma-split pieces rejoin into product/zipped names; a relaunch or report of
    runs trained with other settings (eval_steps too), or past a lowered `steps`, is refused in
    one line naming the run; one without sweep_config.json is read from its checkpoint."""
    variants = sweep.product(sweep.axis("model.position", ["rope", "alibi"]),
                             sweep.axis("model.num_heads", [2, 4]))
    config = base_config()
    picked = sweep.variant_configs(config, variants, only="position=rope,num_heads=2,"
                                   "position=alibi,num_heads=4".split(","))
    assert list(picked) == ["position=rope,num_heads=2", "position=alibi,num_heads=4"]
    with pytest.raises(ValueError, match=r"^--only \['num_heads=8', 'position=rope'\]: expected "
                                         r"variant names \['position=rope,num_heads=2', .*\] \(a "
                                         r"name with commas is given whole, e\.g\. "
                                         r"--only=position=rope,num_heads=2\)$"):
        sweep.variant_configs(config, variants, only=["position=rope", "num_heads=8"])

    config.steps = 4
    variants = sweep.seed_variants(sweep.named({"a": {}}), 2)
    configs = sweep.variant_configs(config, variants)
    for k in range(2):
        fake_run(tmp_path / "a" / f"seed_{k}", [3.0, 2.0], 2.0)
        (tmp_path / "a" / f"seed_{k}" / "sweep_config.json").write_text(
            json.dumps(keys.dotted(configs[f"a/seed_{k}"].to_dict()), default=str))
    sweep.check_runs(configs, str(tmp_path))
    configs["a/seed_1"].eval_steps = 7
    with pytest.raises(ValueError, match=r"^variant 'a/seed_1' in .* other settings \(eval_steps: "
                                         r"trained with 20, now 7\)"):
        sweep.check_runs(configs, str(tmp_path))
    lower = sweep.variant_configs(config, variants)
    for run in lower.values():
        run.steps = 3
    with pytest.raises(ValueError, match=r"^variant 'a/seed_0' in .* has trained to step 4, now "
                                         r"steps=3: expected steps >= 4 \(steps may only grow\)"):
        sweep.check_runs(lower, str(tmp_path))
    for run in lower.values():
        run.steps = 8  # extending a sweep is allowed
    sweep.check_runs(lower, str(tmp_path))

    # A --print_launch run has no sweep_config.json: its checkpoint's (resolved) config counts.
    from transformer.training import checkpoint as checkpoint_lib

    (tmp_path / "a" / "seed_0" / "sweep_config.json").unlink()
    saved = sweep.variant_configs(config, variants)["a/seed_0"]
    saved.model.vocab_size = 179  # filled in by training from the tokenizer: no change
    monkeypatch.setattr(checkpoint_lib, "complete_steps", lambda directory: [4])
    monkeypatch.setattr(checkpoint_lib, "saved_run", lambda directory: (4, saved))
    run = sweep.variant_configs(config, variants)["a/seed_0"]
    assert sweep.changed_settings(str(tmp_path / "a" / "seed_0"), run) == []
    run.optimizer.learning_rate = 0.01
    assert sweep.changed_settings(str(tmp_path / "a" / "seed_0"), run) == [
        f"optimizer.learning_rate: trained with {saved.optimizer.learning_rate!r}, now 0.01"]


# --- through the command line -----------------------------------------------------------------

STEPS = 4
EXPERIMENT = textwrap.dedent(f"""
    from transformer import sweep
    from transformer.training import evaluation
    from transformer.configs import base_config


    def get_config():
        config = base_config()
        config.experiment = "seeds"
        config.update(steps={STEPS}, batch_size=2, seq_len=16, log_every=1, eval_every=2,
                      eval_steps=2, checkpoint_every={STEPS})
        config.model.update(num_layers=1, d_model=32, num_heads=2, d_ff=64, max_len=16)
        return config


    def get_sweep():
        return sweep.axis("model.position", ["rope", "alibi"])
""")
NAMES = ["position=rope", "position=alibi"]


def run_sweep(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return forkserver.run([sys.executable, "-m", "transformer.sweep", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_sweep_over_two_seeds_through_the_cli(tmp_path):
    experiment, workdir = tmp_path / "seeds.py", tmp_path / "runs"
    experiment.write_text(EXPERIMENT)
    args = [f"--config={experiment}", f"--workdir={workdir}", "--seeds=2"]
    # alibi's seeds first stop at step 2, so the full sweep resumes them.
    first = run_sweep(*args, "--only=position=alibi", "--config.steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result = run_sweep(*args, "--baseline=position=alibi")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sweep seeds: 2 variants x 2 seeds in" in result.stdout
    for k in range(2):
        assert f"[{1 + k}/4] position=rope/seed_{k}: training in " in result.stdout
        assert f"[{3 + k}/4] position=alibi/seed_{k}: resuming in " in result.stdout
    assert sorted(os.listdir(workdir)) == sorted(
        NAMES + ["report.md", "val_loss_vs_step.png", "val_loss_vs_time.png",
                 "train_loss_vs_step.png"])
    for name in NAMES:
        assert sorted(os.listdir(workdir / name)) == ["seed_0", "seed_1"]
        for k in range(2):
            run = workdir / name / f"seed_{k}"
            assert json.loads((run / "summary.json").read_text())["step"] == STEPS
            saved = json.loads((run / "sweep_config.json").read_text())
            assert saved["seed"] == k and saved["experiment"] == f"seeds/{name}/seed_{k}"
        # Another seed: another init and another batch, so another first loss.
        first_losses = [records(workdir / name / f"seed_{k}")[0]["loss"] for k in range(2)]
        assert first_losses[0] != first_losses[1]
    # Resumed at step 2: alibi's runs log steps 1..4 once each.
    train_steps = [r["step"] for r in records(workdir / "position=alibi" / "seed_1")
                   if r["split"] == "train"]
    assert train_steps == [1, 2, 3, 4]

    report = (workdir / "report.md").read_text()
    summary, differences, per_seed = tables(report)
    assert sorted(summary) == sorted(NAMES) and summary["position=rope"]["seeds"] == "2/2"
    val = [[r["loss"] for r in records(workdir / "position=rope" / f"seed_{k}")
            if r["split"] == "validation"][-1] for k in range(2)]  # each seed's last, unrounded
    np.testing.assert_allclose([float(per_seed[f"position=rope/seed_{k}"]["val loss"])
                                for k in range(2)], val, atol=5.1e-5)  # printed to 4 places
    mean, std, low, high = reference(val)
    # The cell is computed from the unrounded losses (with 2 seeds the interval's half-width is
    # 12.7 / 2 |a - b|: the table's rounded losses would move it by up to 6e-4), shown rounded.
    got = summary["position=rope"]["val loss"].replace("±", "").replace("[", "").replace(
        "]", "").replace(",", "").split()
    np.testing.assert_allclose([float(x) for x in got], [mean, std, low, high], atol=5.1e-5)
    assert differences["position=alibi"]["val loss"] == "baseline"
    assert differences["position=rope"]["val loss"].endswith(("within noise", "differs"))
    # Every run saved its final validation windows: a seed's are the same for both variants
    # (another seed samples others), and the report pairs them by seed (the window bootstrap).
    saved = {(name, k): evaluation.load_windows(str(workdir / name / f"seed_{k}"))
             for name in NAMES for k in range(2)}
    for k in range(2):
        rope, alibi = saved["position=rope", k], saved["position=alibi", k]
        assert saved["position=rope", k]["step"] == STEPS == saved["position=alibi", k]["step"]
        assert rope["fingerprint"] == alibi["fingerprint"] and len(rope["loss_sum"]) == 2 * 2
    assert saved["position=rope", 0]["fingerprint"] != saved["position=rope", 1]["fingerprint"]
    want = sweep.window_bootstrap([(saved["position=rope", k], saved["position=alibi", k])
                                   for k in range(2)])
    # with seeds, the window interval carries no verdict: the seed interval gives it
    assert differences["position=rope"][sweep.SEEDS_WINDOW_COLUMN] == \
        f"{want.mean:+.4f} [{want.low:+.4f}, {want.high:+.4f}]"
    assert differences["position=alibi"][sweep.SEEDS_WINDOW_COLUMN] == "baseline"
    assert "Not paired over windows" not in report

    before = {name: [(workdir / name / f"seed_{k}" / "metrics.jsonl").read_text()
                     for k in range(2)] for name in NAMES}
    again = run_sweep(*args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count(": finished, skipped") == 4
    assert {name: [(workdir / name / f"seed_{k}" / "metrics.jsonl").read_text()
                   for k in range(2)] for name in NAMES} == before
    assert "## Difference from the baseline `position=rope`" in (workdir / "report.md").read_text()

    # The same directory with one seed would find no runs: refused, nothing written.
    single = run_sweep(f"--config={experiment}", f"--workdir={workdir}", "--report_only")
    assert single.returncode == 2
    assert single.stderr.strip().splitlines() == [
        f"error: {workdir / NAMES[0]} holds runs of several seeds (seed_0, ...): expected "
        "--seeds=N (or get_seeds()) with their number"]


@pytest.mark.slow
def test_seeds_with_a_seeded_variant_or_a_seed_flag_are_refused(tmp_path):
    experiment, workdir = tmp_path / "seeded.py", tmp_path / "runs"
    experiment.write_text(EXPERIMENT.replace('["rope", "alibi"]', '["rope"]') + textwrap.dedent(
        """
        def get_seeds():
            return 2
        """))
    result = run_sweep(f"--config={experiment}", f"--workdir={workdir}", "--config.seed=5")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --config.seed=5 and --seeds=2 sets seeds 0..1: expected one of the two"]
    result = run_sweep(f"--config={experiment}", f"--workdir={workdir}", "--seeds=3",
                       "--baseline=nope")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: baseline 'nope' (--baseline or get_baseline()): expected one of the variants "
        "['position=rope']"]
    seeded = tmp_path / "seeded_variant.py"
    seeded.write_text(EXPERIMENT.replace('sweep.axis("model.position", ["rope", "alibi"])',
                                         'sweep.named({"a": {}, "s": {"seed": 3}})'))
    result = run_sweep(f"--config={seeded}", f"--workdir={workdir}", "--seeds=2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: variant 's' sets seed=3 and --seeds=2 sets seeds 0..1: expected one of the two"]
    assert not workdir.exists()


@pytest.mark.slow
def test_a_refused_rerun_announces_nothing_first(tmp_path):
    """A rerun with other settings printed "sweep seeds: 2 variants x 2 seeds in ..." and then
    refused: the runs are checked before the sweep is announced."""
    experiment, workdir = tmp_path / "seeds.py", tmp_path / "runs"
    experiment.write_text(EXPERIMENT)
    namespace: dict = {}
    exec(compile(EXPERIMENT, str(experiment), "exec"), namespace)
    configs = sweep.variant_configs(namespace["get_config"](), sweep.seed_variants(
        sweep.load_sweep(str(experiment)), 2))
    for name, config in configs.items():  # as a first sweep leaves them
        fake_run(workdir / name, [3.0, 2.0], 2.0, steps=STEPS)
        (workdir / name / "sweep_config.json").write_text(
            json.dumps(keys.dotted(config.to_dict()), default=str))
    result = run_sweep(f"--config={experiment}", f"--workdir={workdir}", "--seeds=2",
                       "--config.eval_steps=1")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: variant 'position=rope/seed_0' in {workdir} was trained with other settings "
        "(eval_steps: trained with 2, now 1)"), lines


def test_a_run_another_sweep_trains_is_not_announced_as_training(tmp_path, monkeypatch, capsys):
    """Two sweeps on one folder: the second printed `[1/2] base: resuming in ...` and at once
    `skipped: ... in use by another training`, a resume that never happened. It looks at the
    run's lock first: the run it will skip gets the one line that says so."""
    from transformer.training import workdir as workdir_lib

    config = base_config()
    config.steps = 4
    configs = sweep.variant_configs(config, sweep.named({"base": {},
                                                         "other": {"model.num_heads": 4}}))

    def train(names, *_):  # as train.setup does first: take the run's lock
        results = {}
        for name in names:
            try:
                workdir_lib.Lock(str(tmp_path / name)).acquire().release()
                results[name] = {"summary": {"step": 4}}
            except workdir_lib.WorkdirBusy as busy:
                results[name] = busy
        return results

    monkeypatch.setattr(sweep, "_train", train)
    other_sweep = workdir_lib.Lock(str(tmp_path / "base")).acquire()
    try:
        assert sweep.run(configs, str(tmp_path)) is None
    finally:
        other_sweep.release()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"[1/2] base: skipped: workdir={tmp_path}/base "
                                                   "is in use by another training (pid "), lines
    assert lines[1] == f"[2/2] other: training in {tmp_path / 'other'}"
