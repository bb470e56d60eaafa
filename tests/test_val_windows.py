"""Per-window validation losses and the window bootstrap: the paired bootstrap against a float64
NumPy reference, a real training's val_windows.npz against its logged val_loss, and the sweep
report's window-bootstrap column (and its refusal of windows that differ); the real sweep's
column is checked in test_sweep_seeds.test_a_sweep_over_two_seeds_through_the_cli.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_sweep_seeds import fake_run, tables
from test_train import assert_succeeded, run_cli, tiny_flags

from transformer import sweep
from transformer.configs import base_config
from transformer.training import evaluation


def reference(variant, baseline, tokens, resamples=2000, seed=0, paired=True):
    """(observed, std, low, high) of the token-weighted mean loss difference, one resample at
    a time in float64; unpaired draws the two runs' windows independently."""
    rng = np.random.default_rng(seed)
    loss = lambda x, picks: x[picks].sum() / tokens[picks].sum()
    draws = []
    for _ in range(resamples):
        picks = rng.integers(0, len(tokens), len(tokens))
        other = picks if paired else rng.integers(0, len(tokens), len(tokens))
        draws.append(loss(variant, picks) - loss(baseline, other))
    low, high = np.quantile(draws, [0.025, 0.975])
    everything = np.arange(len(tokens))
    return loss(variant, everything) - loss(baseline, everything), np.std(draws, ddof=1), low, high


def synthetic(offset: float, windows: int = 300, seed: int = 1):
    """Per-window loss sums of a baseline and a variant offset by `offset` per token: the
    windows vary a lot (some are harder), the variant's noise around the baseline is small."""
    rng = np.random.default_rng(seed)
    tokens = np.full(windows, 16.0)
    tokens[-1] = 5.0  # a last, partial window
    hardness = rng.gamma(4.0, 1.0, windows)  # correlated: the same windows are hard for both
    base = (hardness + rng.normal(0, 0.05, windows)) * tokens
    variant = (hardness + offset + rng.normal(0, 0.05, windows)) * tokens
    as_windows = lambda x: {"loss_sum": x, "num_tokens": tokens, "fingerprint": "f"}
    return as_windows(variant), as_windows(base)


def test_the_window_bootstrap_matches_a_float64_reference():
    for offset, expected in ((0.05, "differs"), (0.0, "within noise")):
        variant, base = synthetic(offset)
        got = sweep.window_bootstrap([(variant, base)])
        want = reference(variant["loss_sum"], base["loss_sum"], base["num_tokens"])
        np.testing.assert_allclose([got.mean, got.std, got.low, got.high], want, rtol=1e-9)
        assert got.n == 1 and sweep.verdict(got) == expected, (offset, got)
        # The observed difference is the difference of the token-weighted mean losses.
        mean = lambda w: w["loss_sum"].sum() / w["num_tokens"].sum()
        assert got.mean == pytest.approx(mean(variant) - mean(base), rel=1e-12)
    # The same windows are hard for both runs: unpaired resampling is far wider, and misses
    # the effect that pairing finds.
    variant, base = synthetic(0.05)
    _, _, low, high = reference(variant["loss_sum"], base["loss_sum"], base["num_tokens"],
                                paired=False)
    got = sweep.window_bootstrap([(variant, base)])
    assert high - low > 5 * (got.high - got.low) and low < 0 < high
    # Several seeds: each resample averages the seeds' paired differences; padding rows (no
    # tokens) are left out.
    seeds = [synthetic(0.05, seed=1), synthetic(0.03, windows=200, seed=2)]
    padded = [({**v, "loss_sum": np.append(v["loss_sum"], 0.0),
                "num_tokens": np.append(v["num_tokens"], 0.0)},
               {**b, "loss_sum": np.append(b["loss_sum"], 0.0),
                "num_tokens": np.append(b["num_tokens"], 0.0)}) for v, b in seeds]
    got = sweep.window_bootstrap(padded)
    rng, draws = np.random.default_rng(0), np.zeros(2000)
    for v, b in seeds:
        tokens = b["num_tokens"]
        for i in range(2000):
            picks = rng.integers(0, len(tokens), len(tokens))
            draws[i] += (v["loss_sum"][picks].sum() - b["loss_sum"][picks].sum()) \
                / tokens[picks].sum() / 2
    observed = np.mean([v["loss_sum"].sum() / v["num_tokens"].sum()
                        - b["loss_sum"].sum() / b["num_tokens"].sum() for v, b in seeds])
    np.testing.assert_allclose([got.mean, got.std, got.low, got.high],
                               [observed, draws.std(ddof=1), *np.quantile(draws, [0.025, 0.975])],
                               rtol=1e-9)
    assert got.n == 2 and sweep.verdict(got) == "differs"


def test_windows_pair_only_when_they_are_the_same():
    variant, base = synthetic(0.05)
    other = {**base, "fingerprint": "g"}
    fewer = {k: v[:-1] if k != "fingerprint" else v for k, v in base.items()}
    counts = {**base, "num_tokens": base["num_tokens"][::-1]}
    pairs, notes = sweep.window_pairs({0: variant, 1: variant, 2: variant, 3: None, 4: variant},
                                      {0: base, 1: other, 2: fewer, 3: base, 4: counts})
    assert [p[1] for p in pairs] == [base]
    assert notes == [
        "seed 1: other validation windows than the baseline's (300 windows, fingerprint f; "
        "the baseline: 300, g): not paired",
        "seed 2: other validation windows than the baseline's (300 windows, fingerprint f; "
        "the baseline: 299, f): not paired",
        "seed 3: no val_windows.npz (unfinished, or trained before runs saved their windows)",
        "seed 4: the windows' token counts differ from the baseline's: not paired"]


@pytest.mark.slow
def test_a_training_saves_its_final_validation_windows(tmp_path):
    """A real 4-step run: val_windows.npz holds the final evaluation's windows, and their
    token-weighted mean is the val_loss logged at that step."""
    workdir = tmp_path / "run"
    assert_succeeded(run_cli("transformer.train", f"--workdir={workdir}", *tiny_flags(4),
                             "--config.eval_every=2", "--config.eval_steps=3",
                             logs=tmp_path / "logs"))
    validation = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().split("\n")
                  if line and json.loads(line)["split"] == "validation"]
    assert [r["step"] for r in validation] == [2, 4]
    saved = evaluation.load_windows(str(workdir))
    assert saved["step"] == 4 and len(saved["loss_sum"]) == 3 * 2  # eval_steps x batch_size
    assert np.all(saved["num_tokens"] == 16) and np.all(saved["loss_sum"] > 0)
    assert len(saved["fingerprint"]) == 16
    mean = saved["loss_sum"].sum() / saved["num_tokens"].sum()
    assert abs(mean - validation[-1]["loss"]) < 1e-6
    assert validation[-1]["num_tokens"] == saved["num_tokens"].sum()


def test_the_one_seed_report_has_the_window_bootstrap(tmp_path):
    """A report from two runs' files: the window bootstrap column, and a variant whose windows
    differ from the baseline's is not paired, with a note saying why."""
    config = base_config()
    config.steps = 4
    variants = sweep.named({"base": {}, "better": {"model.num_heads": 4},
                            "elsewhere": {"model.num_heads": 2}})
    configs = sweep.variant_configs(config, variants)
    better, base = synthetic(-0.05)
    for name, windows in (("base", base), ("better", better),
                          ("elsewhere", {**better, "fingerprint": "other"})):
        fake_run(tmp_path / name, [4.0, 3.0], 2.0)
        evaluation.save_windows(str(tmp_path / name), 4, evaluation.Windows(
            windows["loss_sum"], windows["num_tokens"], windows["fingerprint"]))
    report = open(sweep.write_report(configs, variants, str(tmp_path), "t")).read()
    differences = tables(report)[1]
    want = sweep.window_bootstrap([(better, base)])
    assert differences["better"][sweep.WINDOW_COLUMN] == \
        f"{want.mean:+.4f} [{want.low:+.4f}, {want.high:+.4f}] differs"
    assert differences["base"][sweep.WINDOW_COLUMN] == "baseline"
    assert differences["elsewhere"][sweep.WINDOW_COLUMN] == "-"
    assert "- elsewhere, seed 42: other validation windows than the baseline's (300 windows, " \
        "fingerprint other; the baseline: 300, f): not paired" in report.replace(
            f"seed {config.seed}", "seed 42")
