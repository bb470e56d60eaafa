"""transformer.scaling: Chinchilla approaches 2 and 3 recover known laws from synthetic losses
(no training), refuse degenerate sweeps in one line, and the command writes its report."""

import json
import math
import os
import sys

import forkserver
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


@pytest.fixture(scope="module")
def noisy_fit():
    """(N, D, loss, approach 3's fit) of the law with 0.3% noise, fitted once for the tests."""
    _, n, d, loss, _ = synthetic(noise=0.003)  # N from 7e5 to 9e8
    return n, d, loss, scaling.fit_parametric(n, d, loss)


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


@pytest.mark.slow
def test_bootstrap_intervals_contain_the_true_values(noisy_fit):
    flops, n, d, loss, groups = synthetic(noise=0.003)
    boot2 = scaling.bootstrap_approach2(flops, n, d, loss, groups, resamples=300)
    assert boot2.used + boot2.skipped == 300 and boot2.used > 250
    for key, true in (("a", TRUE_A), ("b", TRUE_B)):
        interval = boot2.intervals[key]
        assert true in interval and interval.value in interval, (key, interval)
        assert interval.high - interval.low < 0.2, interval
    boot3 = scaling.bootstrap_parametric(n, d, loss, resamples=200, fit=noisy_fit[3])
    assert boot3.used == 200
    for key in ("alpha", "beta", "a", "b"):
        true = {**TRUE, "a": TRUE_A, "b": TRUE_B}[key]
        interval = boot3.intervals[key]
        assert true in interval and interval.low < interval.high, (key, interval)
    # The same seed, the same intervals.
    assert scaling.bootstrap_approach2(flops, n, d, loss, groups, resamples=300) == boot2


def test_approach2_interval_with_3_sizes_a_budget_is_unavailable_in_words():
    """A parabola through 3 runs leaves no residual: resampling them gave an interval of zero
    width; now there is none, and the report says why."""
    flops, n, d, loss, groups = synthetic(sizes=3, noise=0.01)
    boot = scaling.bootstrap_approach2(flops, n, d, loss, groups, resamples=200)
    assert boot.intervals == {} and boot.used == 0
    lines = scaling.approach2_section(scaling.fit_approach2(flops, n, d, loss, groups), boot)
    assert lines[-1] == (
        "No interval: every budget in the power laws has 3 sizes, so each parabola passes "
        "through its runs and leaves no residual to estimate the loss noise from: add a 4th "
        "size to a budget.")
    assert any(line.startswith("| a (N_opt ∝ C^a) | 0.") and "(no interval)" in line
               for line in lines)


def test_approach2_interval_covers_the_true_exponent_at_its_stated_rate():
    """4 sizes a budget (1 residual degree of freedom each) and noise: over 100 sweeps the 95%
    intervals of a and b have width and hold the law's exponents about 95% of the time."""
    covered = []
    for seed in range(100):
        flops, n, d, loss, groups = synthetic(sizes=4, noise=0.01, seed=seed)
        boot = scaling.bootstrap_approach2(flops, n, d, loss, groups, resamples=400, seed=seed)
        assert boot.used + boot.skipped == 400 and "from 5 degrees of freedom" in boot.note
        for key, true in (("a", TRUE_A), ("b", TRUE_B)):
            assert boot.intervals[key].high - boot.intervals[key].low > 0.01
            covered.append(true in boot.intervals[key])
    assert 0.9 <= np.mean(covered) <= 0.99, np.mean(covered)


def test_tokens_per_param_keep_their_significant_digits():
    """D/N printed with one decimal showed a run of 0.04 tokens a param as 0.0: three
    significant digits now, whole numbers from 1,000 (the runs table and approach 2's)."""
    import dataclasses

    runs = [scaling.Run("small", 1_000_000, 10, 40_000.0, 1e12, 3.0, 1e12),
            scaling.Run("mid", 100_000, 10, 2_000_000.0, 1e12, 3.0, 1e12),
            scaling.Run("big", 1_000, 10, 12_345_678.0, 1e12, 3.0, 1e12)]
    ratio = {line.split(" | ")[0][2:]: line.split(" | ")[6]
             for line in scaling._runs_table(runs)[2:]}
    assert ratio == {"small": "0.04", "mid": "20", "big": "12,346"}
    assert [scaling._ratio(v) for v in (999.4, 999.5, 1000.0)] == ["999", "1,000", "1,000"]
    flops, n, d, loss, groups = synthetic()
    fit = scaling.fit_approach2(flops, n, d, loss, groups)
    first = fit.budgets[0]
    fit = dataclasses.replace(fit, budgets=(dataclasses.replace(
        first, d_opt=0.0123 * first.n_opt),) + fit.budgets[1:])
    row = next(line for line in scaling.approach2_section(fit, scaling.Bootstrap({}, 0, 0))
               if line.startswith(f"| {first.flops:.3g} | "))
    assert row.split(" | ")[4] == "0.0123", row


def test_an_optimum_past_the_largest_size_is_flagged_and_left_out():
    """At the largest budget the sizes stop short of the optimum (the loss still falls at the
    largest size, yet the parabola's vertex lands inside the sizes): that budget is flagged
    and left out, and the power laws over the other four find the law's exponents."""
    flops, n, _, _, groups = synthetic(sizes=5)
    n[flops == 1e19] *= math.exp(-1.6)  # the largest size: 0.1 below the optimum in ln N
    d = flops / (6 * n)
    loss = law(n, d)
    fit = scaling.fit_approach2(flops, n, d, loss, groups)
    last = fit.budgets[-1]
    assert last.parabola.beyond == "largest" and last.n_opt < last.sizes[-1]
    assert [b.parabola.inside for b in fit.budgets] == [True] * 4 + [False]
    assert len(fit.fitted) == 4
    assert fit.n_law.exponent == pytest.approx(TRUE_A, abs=1e-3)
    assert fit.d_law.exponent == pytest.approx(TRUE_B, abs=1e-3)
    assert scaling.extrapolated(fit) == [
        f"- budget C=1e+19: the optimum lies past the largest size N={last.sizes[-1]:,.0f} "
        f"(parabola vertex N={last.n_opt:,.0f}): an extrapolation, left out of the power "
        "laws (add larger sizes)"]
    assert "| **past the largest size: left out** |" in \
        "\n".join(scaling.approach2_section(fit, scaling.Bootstrap({}, 0, 0)))
    boot = scaling.bootstrap_approach2(flops, n, d, loss * np.exp(
        0.003 * np.random.default_rng(0).standard_normal(len(n))), groups, resamples=300)
    assert TRUE_A in boot.intervals["a"] and TRUE_B in boot.intervals["b"]
    # With one budget left, no power law: refused in one line.
    keep = flops >= 1e18
    with pytest.raises(ValueError, match=r"^1 of 2 compute budgets bracket their optimum "
                                         r"\(C=1e\+19 past its largest size\), expected at least "
                                         r"2 for the N_opt\(C\) and D_opt\(C\) power laws"):
        scaling.fit_approach2(flops[keep], n[keep], d[keep], loss[keep], groups[keep])


def test_parametric_bootstrap_refits_as_the_grid_fit_does(noisy_fit):
    """The bootstrap refits its resamples at once by damped Newton from the full fit's optima;
    each refit is the fit the paper's grid and L-BFGS (fit_parametric, what every resample
    ran before) find on that resample, and on the full data it is the full fit."""
    n, d, loss, fit = noisy_fit
    picks = np.random.default_rng(1).integers(0, len(n), (2, len(n)))
    theta, objective = scaling.refit(n[picks], d[picks], loss[picks], fit.optima)
    for row, pick in enumerate(picks):
        grid = scaling.fit_parametric(n[pick], d[pick], loss[pick], starts=8)
        np.testing.assert_allclose(theta[row], grid.theta, rtol=1e-6, atol=1e-8)
        assert objective[row] == pytest.approx(grid.objective, rel=1e-9)
    theta, objective = scaling.refit(n[None], d[None], loss[None], fit.optima)
    # (two optimizers' stopping points: 4e-9 apart on an AVX2 Zen 3, closer on AVX-512)
    np.testing.assert_allclose(theta[0], fit.theta, rtol=1e-7)
    assert objective[0] == pytest.approx(fit.objective, rel=1e-12)


@pytest.mark.parametrize("case, expected", [
    ("two_sizes", "budget C=1e+15: 2 finished runs (2 model sizes), expected at least 3 model "
                  "sizes for a parabola"),
    ("downward", "budget C=1e+15: the parabola of loss vs ln N opens downward"),
    ("one_budget", "1 compute budget, expected at least 2 compute budgets"),
    ("nan_loss", "budget C=1e+15: loss=[nan, "),
    ("duplicate", "budget C=1e+15: N=6.657e+05 (2 runs) of the same size, expected one run per "
                  "model size (average them first)"),
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
    elif case == "duplicate":
        n[1] = n[0]
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
    # A command line's batch size (or length, or steps) would spend another budget, and the
    # variants' own values win: refused, not dropped.
    for key, value in (("batch_size", 2), ("seq_len", 32), ("steps", 3)):
        with pytest.raises(ValueError, match=rf"^--config.{key}={value}: the sweep's variant"):
            definition.check_overrides({key: value}, definition.load_sweep(EXPERIMENT))
    definition.check_overrides({"seed": 1}, definition.load_sweep(EXPERIMENT))  # its own


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


def test_load_runs_leaves_out_non_finite_losses_and_averages_duplicates(tmp_path):
    """A run with a NaN val loss is left out with a note, not fitted; a second run of the same
    size and budget (another seed, a copied directory) is averaged with the first."""
    fake_sweep(tmp_path)
    summary = json.loads((tmp_path / "C2.5e12_d48_l2" / "summary.json").read_text())
    summary["val_loss"] = float("nan")
    (tmp_path / "C2.5e12_d48_l2" / "summary.json").write_text(json.dumps(summary))
    twice = tmp_path / "twice.py"  # the experiment with a second run of its first variant
    twice.write_text(f"from transformer.sweeps import definition\n"
                     f"base = definition.experiment_module({EXPERIMENT!r})\n"
                     "BUDGETS, get_config = base.BUDGETS, base.get_config\n\n\n"
                     "def get_sweep():\n"
                     "    first = base.get_sweep()[0]\n"
                     "    again = definition.Variant('C1e12_d32_l1_again', first.overrides)\n"
                     "    return base.get_sweep() + [again]\n")
    (tmp_path / "C1e12_d32_l1_again").mkdir()
    summary = json.loads((tmp_path / "C1e12_d32_l1" / "summary.json").read_text())
    first = summary["val_loss"]
    (tmp_path / "C1e12_d32_l1_again" / "summary.json").write_text(
        json.dumps({**summary, "val_loss": first + 0.02}))
    runs, notes = scaling.load_runs(str(tmp_path), str(twice),
                                    definition.experiment_module(EXPERIMENT).get_config())
    assert len(runs) == 19 and "C2.5e12_d48_l2" not in {r.name for r in runs}
    merged = next(r for r in runs if r.name == "C1e12_d32_l1 + C1e12_d32_l1_again")
    assert merged.loss == pytest.approx(first + 0.01, rel=1e-12)
    assert notes == [
        "non-finite val loss, left out: C2.5e12_d48_l2 (nan)",
        f"2 runs of N={merged.num_params:,} at C=1e+12 averaged into one (val loss "
        f"{first:.4f}, {first + 0.02:.4f} -> {first + 0.01:.4f}): C1e12_d32_l1, "
        "C1e12_d32_l1_again"]
    flops, n, d, loss, budgets = (np.array([getattr(r, k) for r in runs]) for k in
                                  ("flops", "num_params", "tokens", "loss", "budget"))
    assert len(scaling.fit_approach2(flops, n, d, loss, budgets).budgets) == 4


def test_runs_trained_with_other_settings_are_refused_before_their_flops_are_counted(tmp_path):
    """C is counted from the experiment's config (and this command's overrides): a run the sweep
    trained with another FLOP-changing setting (tie_embeddings, 17% of C here) is refused in
    one line, as the sweep's report refuses it (probe p4 of stop 110: C came out silently
    17% off)."""
    names = fake_sweep(tmp_path)
    module = definition.experiment_module(EXPERIMENT)
    configs = sweep.variant_configs(module.get_config(), definition.load_sweep(EXPERIMENT))
    assert sweep._record(configs[names[0]], str(tmp_path / names[0]))  # what the sweep saves
    runs, _ = scaling.load_runs(str(tmp_path), EXPERIMENT, module.get_config())
    assert len(runs) == len(names)  # the same settings: counted
    untied = module.get_config()
    untied.model.tie_embeddings = not configs[names[0]].model.tie_embeddings
    with pytest.raises(ValueError, match=rf"^variant '{names[0]}' in .* was trained with other "
                       r"settings \(model.tie_embeddings: trained with True, now False\)"):
        scaling.load_runs(str(tmp_path), EXPERIMENT, untied)


def test_a_mixture_of_experts_run_is_charged_the_flops_its_mfu_counts(tmp_path):
    """A MoE run's C is the FLOPs a token its own MFU counts (`metrics.model_flops_per_token`:
    of the params a token passes through, 1 of 8 experts) x its tokens, not all its experts';
    a summary written before active_params was logged falls back on num_params."""
    import types

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from transformer.models import build_model
    from transformer.training import metrics
    from transformer.training import state as state_lib

    first = definition.experiment_module(EXPERIMENT).get_sweep()[0]
    moe = definition.Variant("moe", {**first.overrides, "model.moe.num_experts": 8,
                                     "model.moe.top_k": 1,
                                     "model.vocab_size": 256})  # 0: the tokenizer's
    base = definition.experiment_module(EXPERIMENT).get_config()
    config = sweep.variant_configs(base, [moe])["moe"]
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    state = types.SimpleNamespace(params=nn.unbox(jax.eval_shape(
        build_model(config.model).init, jax.random.key(0), tokens)["params"]))
    n, active = state_lib.num_params(state), state_lib.active_params(state, config)
    assert active < n / 2  # 7 of 8 experts' MLPs skipped
    logged = metrics.model_flops_per_token(config, state, {"inputs": tokens})
    c = logged * config.steps * config.batch_size * config.seq_len
    experiment = tmp_path / "moe.py"
    experiment.write_text(f"from transformer.sweeps import definition\n"
                          f"base = definition.experiment_module({EXPERIMENT!r})\n"
                          f"BUDGETS, get_config = ({c!r},), base.get_config\n\n\n"
                          f"def get_sweep():\n    return [definition.{moe!r}]\n")
    (tmp_path / "moe").mkdir()
    summary = {"step": config.steps, "num_params": n, "active_params": active, "val_loss": 3.0}
    (tmp_path / "moe" / "summary.json").write_text(json.dumps(summary))
    [run], _ = scaling.load_runs(str(tmp_path), str(experiment), base)
    assert run.flops == pytest.approx(c, rel=1e-12) and run.num_params == n
    del summary["active_params"]  # an older summary: all its params, as before
    (tmp_path / "moe" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="is not within a factor 1.5 of any declared budget"):
        scaling.load_runs(str(tmp_path), str(experiment), base)


@pytest.mark.parametrize("overrides, model", [
    ({"model.tie_embeddings": False}, {"tie_embeddings": False}),
    ({"model.mtp.depth": 1}, {"mtp": {"depth": 1}})], ids=["untied", "mtp"])
def test_an_untied_or_mtp_run_is_charged_the_flops_its_training_counts(tmp_path, overrides,
                                                                       model):
    """With model.vocab_size 0 (the tokenizer's) in the variant, C is the run's own
    `metrics.model_flops_per_token` (vocab filled in by `startup.resolve`) x its tokens: an
    untied token table is a lookup, not 6 V D matmul FLOPs, and an MTP module runs the head again
    (6 V D); the experiment's steps_for spends a budget at that count too."""
    import types

    import flax.linen as nn
    import jax

    from transformer.data import inputs, tokenizers
    from transformer.models import build_model, family_of
    from transformer.training import metrics, startup
    from transformer.training import state as state_lib

    module = definition.experiment_module(EXPERIMENT)
    variant = definition.Variant("v", {**module.get_sweep()[0].overrides, **overrides})
    config = sweep.variant_configs(module.get_config(), [variant])["v"]
    assert config.model.vocab_size == 0
    trained = config.copy_and_resolve_references()
    startup.resolve(trained, None)  # training's own vocab_size
    config_vocab = trained.model.vocab_size
    args = family_of(trained).init_args(state_lib.example_batch(trained))
    state = types.SimpleNamespace(params=nn.unbox(jax.eval_shape(
        build_model(trained.model).init, jax.random.key(0), *args)["params"]))
    n = state_lib.num_params(state)
    per_token = metrics.model_flops_per_token(trained, state, {"inputs": args[0]})
    tokens = config.steps * config.batch_size * config.seq_len
    experiment = tmp_path / "v.py"
    experiment.write_text(f"from transformer.sweeps import definition\n"
                          f"base = definition.experiment_module({EXPERIMENT!r})\n"
                          f"BUDGETS, get_config = ({per_token * tokens!r},), base.get_config\n\n\n"
                          f"def get_sweep():\n    return [definition.{variant!r}]\n")
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "summary.json").write_text(json.dumps(
        {"step": config.steps, "num_params": n, "active_params": n, "val_loss": 3.0}))
    [run], _ = scaling.load_runs(str(tmp_path), str(experiment), module.get_config())
    assert run.flops == pytest.approx(per_token * tokens, rel=1e-12)
    # A run directory's saved tokenizer (a real run's, with its first checkpoint) is the one read.
    # (another vocabulary than the one built from the data; the config's sentinel count, which a
    # saved tokenizer must have)
    saved = tokenizers.build_tokenizer("char", ["a saved tokenizer"],
                                       num_sentinels=config.data.num_sentinels)
    inputs.save_tokenizer(saved, str(tmp_path / "v"))
    trained.model.vocab_size = saved.vocab_size
    assert trained.model.vocab_size != config_vocab
    [run], _ = scaling.load_runs(str(tmp_path), str(experiment), module.get_config())
    assert run.flops == pytest.approx(metrics.flops_per_token(trained, n) * tokens, rel=1e-12)
    # The experiment's step count for such a size spends the budget at the training's count.
    module.SIZES["v"] = {**module.SIZES["d32_l1"], **model}
    assert module.num_params("v") == n
    steps = module.steps_for(1e12, "v")
    assert steps * config.batch_size * config.seq_len * per_token == pytest.approx(1e12, rel=1e-3)


def run_scaling(workdir, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return forkserver.run([sys.executable, "-m", "transformer.scaling", f"--workdir={workdir}",
                           f"--config={EXPERIMENT}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_command_writes_the_report_and_plots(tmp_path):
    names = fake_sweep(tmp_path)
    unfinished, nan = names[-1], names[1]
    for name, key, value in ((unfinished, "step", -1), (nan, "val_loss", math.nan)):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        summary[key] = summary[key] + value if key == "step" else value
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    result = run_scaling(tmp_path, "--resamples=50", "--parametric_resamples=3")
    assert result.returncode == 0, result.stderr
    assert f"warning: not finished, left out: {unfinished} (new); non-finite val loss, left " \
           f"out: {nan} (nan)\n" in result.stderr
    report = (tmp_path / "scaling.md").read_text()
    for text in ("## Approach 2", "## Approach 3", "| a (N_opt ∝ C^a) |", "| alpha |",
                 f"- not finished, left out: {unfinished} (new)",
                 f"- non-finite val loss, left out: {nan} (nan)", "What this can and cannot",
                 "![IsoFLOP curves](isoflop.png)", "![Power laws](power_laws.png)"):
        assert text in report, text
    assert report.count("| C1e12_") == 4 and f"| {unfinished} |" not in report
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
    assert result.stderr.strip().splitlines() == [  # why the budget lacks sizes, then no fit
        "warning: not finished, left out: C1e12_d32_l1 (new); not finished, left out: "
        "C1e12_d48_l2 (new); not finished, left out: C1e12_d64_l3 (new)",
        "error: budget C=1e+12: 2 finished runs (2 model sizes), expected at least 3 model "
        "sizes for a parabola"]
    assert not (tmp_path / "scaling.md").exists()


def test_a_sweep_over_seeds_fits_as_one_run_of_the_seeds_mean_loss(tmp_path):
    """The sweep with --seeds=2 (DIR/NAME/seed_K, the law's loss +- an offset per seed, one
    metrics.jsonl ending in a line half-written by a kill) gives the runs and fit of the
    sweep of one seed whose losses are the seeds' mean; a missing seed is named, a directory
    mixing the layouts refused in one line."""
    one, two = tmp_path / "one", tmp_path / "two"
    names = fake_sweep(one)
    for i, name in enumerate(names):
        summary = json.loads((one / name / "summary.json").read_text())
        for k, sign in enumerate((1, -1)):
            (two / name / f"seed_{k}").mkdir(parents=True)
            (two / name / f"seed_{k}" / "summary.json").write_text(json.dumps(
                {**summary, "val_loss": summary["val_loss"] + sign * 0.01 * (1 + i % 3)}))
    torn = two / names[0] / "seed_1"
    loss = json.loads((torn / "summary.json").read_text())["val_loss"]
    record = json.dumps({"split": "validation", "step": 1, "loss": loss, "accuracy": 0.5,
                         "elapsed": 1.0})
    (torn / "metrics.jsonl").write_text(record + "\n" + record[:30])
    config = definition.experiment_module(EXPERIMENT).get_config()
    runs1, notes1 = scaling.load_runs(str(one), EXPERIMENT, config)
    runs2, notes2 = scaling.load_runs(str(two), EXPERIMENT, config)
    assert notes1 == [] and len(runs1) == len(runs2) == 20 and len(notes2) == 20
    assert notes2[0].endswith(f": {names[0]}/seed_0, {names[0]}/seed_1")
    for a, b in zip(runs1, runs2, strict=True):
        assert b.name == f"{a.name}/seed_0 + {a.name}/seed_1"
        assert (b.num_params, b.steps, b.tokens, b.flops, b.budget) == \
            (a.num_params, a.steps, a.tokens, a.flops, a.budget)
        assert b.loss == pytest.approx(a.loss, rel=1e-12)
    fits = [scaling.fit_approach2(*scaling._columns(runs)) for runs in (runs1, runs2)]
    assert fits[1].n_law.exponent == pytest.approx(fits[0].n_law.exponent, rel=1e-9)
    assert fits[1].d_law.exponent == pytest.approx(fits[0].d_law.exponent, rel=1e-9)

    (two / names[1] / "seed_1" / "summary.json").unlink()
    runs, notes = scaling.load_runs(str(two), EXPERIMENT, config)
    assert len(runs) == 20 and f"not finished, left out: {names[1]}/seed_1 (new)" in notes
    (two / names[2] / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"^{two / names[2]} holds a run of one seed: "):
        scaling.load_runs(str(two), EXPERIMENT, config)
