"""transformer.scaling: Chinchilla approaches 2 and 3 recover known laws from synthetic losses
(no training), refuse degenerate sweeps in one line, and the command writes its report."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from transformer import scaling, sweep
from transformer.sweeps import definition

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENT = os.path.join(REPO, "experiments", "scaling", "isoflop.py")
# The law the synthetic losses follow, and the compute-optimal exponents it implies.
TRUE = {"E": 1.5, "A": 300.0, "B": 400.0, "alpha": 0.35, "beta": 0.3}
TRUE_A = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
TRUE_B = TRUE["alpha"] / (TRUE["alpha"] + TRUE["beta"])


def law(num_params, tokens):
    return TRUE["E"] + TRUE["A"] / np.asarray(num_params) ** TRUE["alpha"] + \
        TRUE["B"] / np.asarray(tokens) ** TRUE["beta"]


def optimal_params(flops):
    """The law's compute-optimal N at C = 6 N D (Hoffmann et al., eq. 4)."""
    g = (TRUE["alpha"] * TRUE["A"] / (TRUE["beta"] * TRUE["B"])) ** (
        1 / (TRUE["alpha"] + TRUE["beta"]))
    return g * (np.asarray(flops) / 6) ** TRUE_A


def synthetic(budgets=(1e15, 1e16, 1e17, 1e18, 1e19), sizes=7, span=1.5, noise=0.0, seed=0):
    """(flops, N, D, loss, groups): per budget, `sizes` models log-spaced over +-span (in ln N)
    around the optimum, D = C / (6 N), loss from the law times exp(noise x normal)."""
    flops = np.repeat(np.asarray(budgets, np.float64), sizes)
    n = optimal_params(flops) * np.tile(np.exp(np.linspace(-span, span, sizes)), len(budgets))
    d = flops / (6 * n)
    loss = law(n, d) * np.exp(noise * np.random.default_rng(seed).standard_normal(len(n)))
    return flops, n, d, loss, flops.copy()


def test_parametric_fit_recovers_the_law():
    flops, n, d, loss, _ = synthetic()
    fit = scaling.fit_parametric(n, d, loss)
    for key, value in TRUE.items():
        assert getattr(fit, key) == pytest.approx(value, rel=0.02), key
    assert fit.a == pytest.approx(TRUE_A, abs=0.005)
    assert fit.b == pytest.approx(TRUE_B, abs=0.005)
    assert fit.loss(n, d) == pytest.approx(loss, rel=1e-4)


def test_approach2_recovers_the_implied_exponents():
    flops, n, d, loss, groups = synthetic()
    fit = scaling.fit_approach2(flops, n, d, loss, groups)
    assert len(fit.budgets) == 5 and all(b.parabola.inside for b in fit.budgets)
    assert fit.n_law.exponent == pytest.approx(TRUE_A, abs=0.03)
    assert fit.d_law.exponent == pytest.approx(TRUE_B, abs=0.03)
    for budget in fit.budgets:  # each vertex near the law's optimum, and C = 6 N_opt D_opt
        assert budget.n_opt == pytest.approx(optimal_params(budget.flops), rel=0.15)
        assert 6 * budget.n_opt * budget.d_opt == pytest.approx(budget.flops, rel=1e-9)


def test_d_opt_uses_the_runs_flops_per_token():
    """With C = k N D (k = 8, not 6) the tokens of the optimal model are C / (8 N_opt)."""
    flops, n, _, loss, groups = synthetic(budgets=(1e15, 1e16))
    fit = scaling.fit_approach2(flops, n, flops / (8 * n), loss, groups)
    for budget in fit.budgets:
        assert budget.d_opt == pytest.approx(budget.flops / (8 * budget.n_opt), rel=1e-9)


def test_parabola_minimum_is_exact_without_noise():
    n = np.array([1e4, 3e4, 1e5, 3e5, 1e6])
    fit = scaling.fit_parabola(n, 2.0 + 0.3 * (np.log(n) - math.log(5e4)) ** 2)
    assert fit.n_opt == pytest.approx(5e4, rel=1e-9)
    assert fit.loss_min == pytest.approx(2.0, abs=1e-12)
    assert fit.inside
    outside = scaling.fit_parabola(n, 2.0 + 0.3 * (np.log(n) - math.log(5e6)) ** 2)
    assert outside.n_opt == pytest.approx(5e6, rel=1e-9) and not outside.inside


def test_bootstrap_intervals_contain_the_true_values():
    flops, n, d, loss, groups = synthetic(noise=0.003)
    boot2 = scaling.bootstrap_approach2(flops, n, d, loss, groups, resamples=300)
    assert boot2.used + boot2.skipped == 300 and boot2.used > 250
    for key, true in (("a", TRUE_A), ("b", TRUE_B)):
        interval = boot2.intervals[key]
        assert true in interval and interval.value in interval, (key, interval)
        assert interval.high - interval.low < 0.2, interval
    boot3 = scaling.bootstrap_parametric(n, d, loss, resamples=20)
    for key in ("alpha", "beta", "a", "b"):
        true = {**TRUE, "a": TRUE_A, "b": TRUE_B}[key]
        interval = boot3.intervals[key]
        assert true in interval and interval.low < interval.high, (key, interval)
    # The same seed, the same intervals.
    assert scaling.bootstrap_approach2(flops, n, d, loss, groups, resamples=300) == boot2


@pytest.mark.parametrize("case, expected", [
    ("two_sizes", "budget C=1e+15: 2 finished runs (2 model sizes), expected at least 3 model "
                  "sizes for a parabola"),
    ("downward", "budget C=1e+15: the parabola of loss vs ln N opens downward"),
    ("one_budget", "1 compute budget, expected at least 2 compute budgets"),
    ("nan_loss", "budget C=1e+15: loss=[nan, "),
])
def test_approach2_refuses_degenerate_sweeps(case, expected):
    flops, n, d, loss, groups = synthetic(budgets=(1e15, 1e16), sizes=5)
    keep = np.ones(len(n), bool)
    if case == "two_sizes":
        keep[2:5] = False
    elif case == "downward":
        loss[:5] = 3.0 - 0.1 * (np.log(n[:5]) - np.log(n[2])) ** 2
    elif case == "one_budget":
        keep[5:] = False
    elif case == "nan_loss":
        loss[0] = np.nan
    with pytest.raises(ValueError) as error:
        scaling.fit_approach2(*(v[keep] for v in (flops, n, d, loss, groups)))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_approach3_and_budgets_refuse_degenerate_input():
    _, n, d, loss, _ = synthetic(budgets=(1e15,), sizes=4)
    with pytest.raises(ValueError, match=r"approach 3: 4 finished runs, expected at least 5"):
        scaling.fit_parametric(n, d, loss)
    with pytest.raises(ValueError, match=r"C=1e\+14 FLOPs is not within a factor 1.5 of any "
                                         r"declared budget \[1e\+15, 1e\+16\]"):
        scaling.nearest_budget(1e14, [1e15, 1e16], "run")
    assert scaling.nearest_budget(1.2e15, [1e15, 1e16]) == 1e15


def test_the_experiment_spends_each_budget():
    """Every variant's C = flops_per_token x tokens is within 1% of its declared budget (the
    fitter groups the runs by it), with short-run settings."""
    from transformer.training.metrics import flops_per_token

    module = definition.experiment_module(EXPERIMENT)
    configs = sweep.variant_configs(module.get_config(), definition.load_sweep(EXPERIMENT))
    assert len(configs) == len(module.BUDGETS) * len(module.SIZES) >= 12
    for name, config in configs.items():
        size = name.split("_", 1)[1]
        tokens = config.steps * config.batch_size * config.seq_len
        flops = flops_per_token(config, module.num_params(size)) * tokens
        budget = scaling.nearest_budget(flops, module.BUDGETS, name)
        assert flops == pytest.approx(budget, rel=0.01)
        assert name.startswith(f"C{budget:.2g}_".replace("+", ""))
        assert config.optimizer.warmup_steps <= 0.1 * config.steps
        assert config.eval_every == config.steps and config.keep_checkpoints == 1


def fake_sweep(root, skip=(), unfinished=()):
    """The experiment's sweep directory as if it had run: summary.json with the law's loss
    (C = flops_per_token x tokens, as the sweep spends it) for every variant but `skip`."""
    module = definition.experiment_module(EXPERIMENT)
    configs = sweep.variant_configs(module.get_config(), definition.load_sweep(EXPERIMENT))
    for name, config in configs.items():
        if name in skip:
            continue
        n = module.num_params(name.split("_", 1)[1])
        tokens = config.steps * config.batch_size * config.seq_len
        os.makedirs(root / name)
        summary = {"step": config.steps - (name in unfinished), "num_params": n,
                   "active_params": n, "val_loss": float(law(n, tokens))}
        (root / name / "summary.json").write_text(json.dumps(summary))
    return list(configs)


def run_scaling(workdir, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "transformer.scaling", f"--workdir={workdir}",
                           f"--config={EXPERIMENT}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_command_writes_the_report_and_plots(tmp_path):
    names = fake_sweep(tmp_path)
    unfinished = names[-1]
    summary = json.loads((tmp_path / unfinished / "summary.json").read_text())
    summary["step"] -= 1
    (tmp_path / unfinished / "summary.json").write_text(json.dumps(summary))
    result = run_scaling(tmp_path, "--resamples=50", "--parametric_resamples=3")
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "scaling.md").read_text()
    for text in ("## Approach 2", "## Approach 3", "| a (N_opt ∝ C^a) |", "| alpha |",
                 f"not finished, left out: {unfinished} (new)", "What this can and cannot",
                 "![IsoFLOP curves](isoflop.png)", "![Power laws](power_laws.png)"):
        assert text in report, text
    assert report.count("| C1e12_") == 5 and f"| {unfinished} |" not in report
    for png in ("isoflop.png", "power_laws.png"):
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
    # Approach 3 on the law's own losses: its exponents, read back from the report.
    alpha = float(report.split("| alpha | ")[1].split()[0])
    assert alpha == pytest.approx(TRUE["alpha"], rel=0.02)


@pytest.mark.slow
def test_the_command_refuses_a_budget_with_two_sizes_in_one_line(tmp_path):
    fake_sweep(tmp_path, skip={"C1e12_d32_l1", "C1e12_d48_l2", "C1e12_d64_l3"})
    result = run_scaling(tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: budget C=1e+12: 2 finished runs (2 model sizes), expected at least 3 model "
        "sizes for a parabola"]
    assert not (tmp_path / "scaling.md").exists()
