"""Scaling laws from an IsoFLOP sweep: Chinchilla's approaches 2 and 3 (Hoffmann et al., 2022).

    python -m transformer.scaling --workdir=DIR [--config=experiments/scaling/isoflop.py]

DIR holds the sweep's runs (`transformer.sweep`, one directory per variant). The experiment
file declares the compute budgets as `BUDGETS`; every finished run's compute is recomputed as
C = flops_per_token(config, N) x tokens trained (`metrics.flops_per_token`; tokens =
steps x batch_size x seq_len; N = num_params) and the run joins the declared budget nearest to it
in log C. Fitted:

- Approach 2: per budget, a parabola of final val loss against ln N; its vertex gives N_opt(C)
  and L_min(C); D_opt(C) = C / flops_per_token(N_opt), the tokens the optimal model trains on
  (flops_per_token / N interpolated in ln N from the budget's runs: with C = 6 N D exactly it is
  C / (6 N_opt)). Then N_opt = k C^a and D_opt = k' C^b by least squares in log-log.
- Approach 3: L(N, D) = E + A / N^alpha + B / D^beta, fitted to every run by L-BFGS on the Huber
  loss (delta 1e-3) of ln L, from a grid of initialisations, parameterised as in the paper:
  ln L = LSE(a - alpha ln N, b - beta ln D, e) with A = e^a, B = e^b, E = e^e. Its
  compute-optimal exponents: a = beta / (alpha + beta), b = alpha / (alpha + beta).
- 95% percentile bootstrap intervals (fixed seeds) of the exponents: runs resampled with
  replacement (approach 2: within each budget).

It writes DIR/scaling.md (the runs, the per-budget optima, the exponents with their intervals
beside Chinchilla's) and DIR/isoflop.png, DIR/power_laws.png. Degenerate input (too few sizes,
budgets or runs, a parabola without a minimum) is one line and exit status 2.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from collections.abc import Sequence

import numpy as np

from transformer import sweep
from transformer.sweeps import definition, report

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "experiments", "scaling", "isoflop.py")
HUBER_DELTA = 1e-3
# Hoffmann et al. (2022): approach 2's exponents (Table 2) and approach 3's fit (eq. 10).
CHINCHILLA_APPROACH2 = {"a": 0.49, "b": 0.51}
CHINCHILLA_APPROACH3 = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
# The paper's grid of initialisations: alpha, beta, e, a, b.
PAPER_GRID = (np.arange(0, 2.01, 0.5), np.arange(0, 2.01, 0.5), np.arange(-1, 1.01, 0.5),
              np.arange(0, 25.1, 5), np.arange(0, 25.1, 5))
# A run joins the nearest declared budget only within this factor of it.
BUDGET_TOLERANCE = 1.5


# --- approach 2 -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parabola:
    """loss = c2 x^2 + c1 x + c0 with x = ln N; its vertex (ln N_opt, L_min); `inside`: the
    vertex lies within the sampled sizes."""

    coeffs: tuple[float, float, float]
    log_n_opt: float
    loss_min: float
    inside: bool

    @property
    def n_opt(self) -> float:
        return math.exp(self.log_n_opt)


def _check_finite(name: str, values) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"{name}={values.tolist()}: expected finite positive values")
    return values


def fit_parabola(num_params, loss, label: str = "parabola") -> Parabola:
    """Least-squares parabola of `loss` against ln `num_params` and its minimum. Raises a
    one-line ValueError for fewer than 3 sizes or a parabola that opens downward."""
    x = np.log(_check_finite(f"{label}: num_params", num_params))
    y = _check_finite(f"{label}: loss", loss)
    sizes = len(np.unique(x))
    if sizes < 3:
        raise ValueError(f"{label}: {len(x)} finished runs ({sizes} model sizes), expected at "
                         "least 3 model sizes for a parabola")
    c2, c1, c0 = np.polyfit(x, y, 2)
    if not c2 > 0:
        raise ValueError(f"{label}: the parabola of loss vs ln N opens downward (curvature "
                         f"{c2:.3g}), expected a positive curvature: it has no minimum")
    vertex = -c1 / (2 * c2)
    return Parabola((float(c2), float(c1), float(c0)), float(vertex),
                    float(c0 - c1 * c1 / (4 * c2)), bool(x.min() <= vertex <= x.max()))


@dataclasses.dataclass(frozen=True)
class Budget:
    """One compute budget's fit: its compute (geometric mean of its runs'), run count,
    parabola, N_opt and D_opt."""

    flops: float
    num_runs: int
    parabola: Parabola
    n_opt: float
    d_opt: float


@dataclasses.dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * x ** exponent."""

    exponent: float
    coefficient: float

    def __call__(self, x):
        return self.coefficient * np.asarray(x, np.float64) ** self.exponent


@dataclasses.dataclass(frozen=True)
class Approach2:
    budgets: tuple[Budget, ...]
    n_law: PowerLaw  # N_opt(C)
    d_law: PowerLaw  # D_opt(C)


def fit_power_law(x, y, label: str) -> PowerLaw:
    """Least squares of ln y against ln x; needs at least 2 distinct x."""
    x, y = _check_finite(f"{label}: x", x), _check_finite(f"{label}: y", y)
    if len(np.unique(x)) < 2:
        raise ValueError(f"{label}: {len(np.unique(x))} compute budget, expected at least 2 "
                         "compute budgets for a power law")
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return PowerLaw(float(slope), float(math.exp(intercept)))


def fit_budget(flops, num_params, tokens, loss, label: str) -> Budget:
    """Approach 2 at one budget: the parabola's N_opt, and D_opt = C / flops_per_token(N_opt)
    with ln(flops_per_token / N) = ln(C_i / (D_i N_i)) fitted linearly in ln N over the runs."""
    flops, n, tokens = (_check_finite(f"{label}: {name}", v) for name, v in
                        (("flops", flops), ("num_params", num_params), ("tokens", tokens)))
    parabola = fit_parabola(n, loss, label)
    budget = float(np.exp(np.mean(np.log(flops))))
    ratio = np.polyfit(np.log(n), np.log(flops / (tokens * n)), 1)
    per_param = float(np.exp(np.polyval(ratio, parabola.log_n_opt)))  # flops_per_token / N
    return Budget(budget, len(n), parabola, parabola.n_opt,
                  budget / (per_param * parabola.n_opt))


def fit_approach2(flops, num_params, tokens, loss, groups) -> Approach2:
    """Approach 2 over runs grouped by `groups` (each run's declared budget)."""
    flops, num_params, tokens, loss, groups = map(np.asarray, (flops, num_params, tokens, loss,
                                                               groups))
    budgets = []
    for group in sorted(set(groups.tolist())):
        pick = groups == group
        budgets.append(fit_budget(flops[pick], num_params[pick], tokens[pick], loss[pick],
                                  f"budget C={group:.3g}"))
    if len(budgets) < 2:
        raise ValueError(f"{len(budgets)} compute budget, expected at least 2 compute budgets "
                         "for the N_opt(C) and D_opt(C) power laws")
    c = [b.flops for b in budgets]
    return Approach2(tuple(budgets), fit_power_law(c, [b.n_opt for b in budgets], "N_opt(C)"),
                     fit_power_law(c, [b.d_opt for b in budgets], "D_opt(C)"))


@dataclasses.dataclass(frozen=True)
class Interval:
    """A fitted value and its bootstrap percentile interval [low, high]."""

    value: float
    low: float
    high: float

    def __contains__(self, x: float) -> bool:
        return self.low <= x <= self.high


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """Intervals by name, and how many resamples gave a fit (`used`) or none (`skipped`)."""

    intervals: dict[str, Interval]
    used: int
    skipped: int


def _intervals(fitted: dict[str, float], draws: list[dict[str, float]], level: float
               ) -> dict[str, Interval]:
    if not draws:
        raise ValueError("bootstrap: no resample could be fitted, expected at least one")
    q = [(1 - level) / 2, (1 + level) / 2]
    return {key: Interval(value, *map(float, np.quantile([d[key] for d in draws], q)))
            for key, value in fitted.items()}


def bootstrap_approach2(flops, num_params, tokens, loss, groups, resamples: int = 1000,
                        seed: int = 0, level: float = 0.95) -> Bootstrap:
    """Percentile intervals of a and b: each resample draws every budget's runs with
    replacement (redrawn, up to 100 times, until it has 3 sizes); resamples whose fit fails
    (a parabola without a minimum) are skipped and counted."""
    arrays = [np.asarray(v) for v in (flops, num_params, tokens, loss)]
    groups = np.asarray(groups)
    fit = fit_approach2(*arrays, groups)
    rng = np.random.default_rng(seed)
    members = [np.flatnonzero(groups == g) for g in sorted(set(groups.tolist()))]
    draws, skipped = [], 0
    for _ in range(resamples):
        picks = []
        for index in members:
            for _ in range(100):
                pick = rng.choice(index, len(index))
                if len(np.unique(arrays[1][pick])) >= 3:
                    break
            picks.append(pick)
        pick = np.concatenate(picks)
        try:
            result = fit_approach2(*(v[pick] for v in arrays), groups[pick])
        except ValueError:
            skipped += 1
            continue
        draws.append({"a": result.n_law.exponent, "b": result.d_law.exponent})
    return Bootstrap(_intervals({"a": fit.n_law.exponent, "b": fit.d_law.exponent}, draws,
                                level), len(draws), skipped)


# --- approach 3 -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parametric:
    """L(N, D) = E + A / N^alpha + B / D^beta, and its final Huber objective."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float

    @property
    def a(self) -> float:
        """N_opt ∝ C^a."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """D_opt ∝ C^b."""
        return self.alpha / (self.alpha + self.beta)

    def loss(self, num_params, tokens):
        return self.E + self.A / np.asarray(num_params, np.float64) ** self.alpha + \
            self.B / np.asarray(tokens, np.float64) ** self.beta

    def values(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta,
                "a": self.a, "b": self.b}


def _terms(theta, log_n, log_d):
    """The three exponents of the LSE, [..., 3], for params theta = (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = np.moveaxis(np.asarray(theta, np.float64), -1, 0)
    return np.stack([a[..., None] - alpha[..., None] * log_n,
                     b[..., None] - beta[..., None] * log_d,
                     np.broadcast_to(e[..., None], np.broadcast_shapes(e[..., None].shape,
                                                                       log_n.shape))], -1)


def huber_objective(theta, log_n, log_d, log_loss, delta: float = HUBER_DELTA):
    """(sum of Huber(delta) of LSE - ln L, divided by delta; its gradient in theta)."""
    terms = _terms(theta, log_n, log_d)
    top = terms.max(-1, keepdims=True)
    weights = np.exp(terms - top)
    total = weights.sum(-1, keepdims=True)
    residual = (top + np.log(total))[..., 0] - log_loss
    huber = np.where(np.abs(residual) <= delta, 0.5 * residual ** 2,
                     delta * (np.abs(residual) - 0.5 * delta))
    slope = np.clip(residual, -delta, delta) / delta  # d huber / d residual, / delta
    w = weights / total
    grad = np.stack([w[..., 0], w[..., 1], w[..., 2], -w[..., 0] * log_n, -w[..., 1] * log_d],
                    -1) * slope[..., None]
    return huber.sum(-1) / delta, grad.sum(-2)


def _grid(grid) -> np.ndarray:
    """The initialisations (a, b, e, alpha, beta) of a grid given as (alpha, beta, e, a, b)."""
    return np.array([(a, b, e, alpha, beta)
                     for alpha, beta, e, a, b in itertools.product(*grid)], np.float64)


def fit_parametric(num_params, tokens, loss, delta: float = HUBER_DELTA, grid=PAPER_GRID,
                   starts: int = 32, extra=()) -> Parametric:
    """Approach 3: L-BFGS from the `starts` initialisations of `grid` (and any `extra`
    thetas) with the lowest Huber objective; the best result. Needs at least 5 runs."""
    from scipy import optimize

    n, d, y = (_check_finite(name, v) for name, v in
               (("num_params", num_params), ("tokens", tokens), ("loss", loss)))
    if len(n) < 5:
        raise ValueError(f"approach 3: {len(n)} finished runs, expected at least 5 for the "
                         "5 parameters of L(N, D)")
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(y)
    inits = _grid(grid)
    values, _ = huber_objective(inits, log_n, log_d, log_l, delta)
    inits = np.concatenate([np.asarray(extra, np.float64).reshape(-1, 5),
                            inits[np.argsort(values)[:starts]]])
    best = None
    for init in inits:
        result = optimize.minimize(huber_objective, init, args=(log_n, log_d, log_l, delta),
                                   jac=True, method="L-BFGS-B",
                                   options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-10})
        if np.all(np.isfinite(result.x)) and (best is None or result.fun < best.fun):
            best = result
    a, b, e, alpha, beta = best.x
    return Parametric(math.exp(e), math.exp(a), math.exp(b), float(alpha), float(beta),
                      float(best.fun * delta))


def bootstrap_parametric(num_params, tokens, loss, resamples: int = 200, seed: int = 0,
                         level: float = 0.95, starts: int = 4, fit: Parametric | None = None
                         ) -> Bootstrap:
    """Percentile intervals of E, A, B, alpha, beta, a, b: runs resampled with replacement,
    each refitted from the full fit's optimum and the `starts` best grid points."""
    arrays = [np.asarray(v, np.float64) for v in (num_params, tokens, loss)]
    fit = fit or fit_parametric(*arrays)
    theta = [math.log(fit.A), math.log(fit.B), math.log(fit.E), fit.alpha, fit.beta]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        pick = rng.integers(0, len(arrays[0]), len(arrays[0]))
        draws.append(fit_parametric(*(v[pick] for v in arrays), starts=starts,
                                    extra=[theta]).values())
    return Bootstrap(_intervals(fit.values(), draws, level), len(draws), 0)


# --- the sweep's runs -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """A finished run of the sweep: params, steps, tokens trained, compute, final val loss and
    the declared budget it joins."""

    name: str
    num_params: int
    steps: int
    tokens: float
    flops: float
    loss: float
    budget: float


def nearest_budget(flops: float, budgets: Sequence[float], name: str = "run") -> float:
    """The declared budget nearest to `flops` in log; refused beyond BUDGET_TOLERANCE."""
    budget = min(budgets, key=lambda b: abs(math.log(flops / b)))
    if abs(math.log(flops / budget)) > math.log(BUDGET_TOLERANCE):
        raise ValueError(f"{name}: C={flops:.3g} FLOPs is not within a factor "
                         f"{BUDGET_TOLERANCE} of any declared budget "
                         f"[{', '.join(f'{b:.3g}' for b in budgets)}]: expected "
                         "the experiment file's BUDGETS to match its runs")
    return budget


def load_runs(workdir: str, config_file: str, config) -> tuple[list[Run], list[str]]:
    """(the finished runs of the experiment's variants in `workdir`, the names of the others).
    Compute C = flops_per_token(config, N) x steps x batch_size x seq_len."""
    from transformer.training.metrics import flops_per_token

    if not os.path.isdir(workdir):
        raise NotADirectoryError(f"--workdir={workdir}: expected the sweep's directory")
    module = definition.experiment_module(config_file)
    budgets = getattr(module, "BUDGETS", None)
    if not budgets:
        raise ValueError(f"{config_file}: expected BUDGETS, the sweep's compute budgets")
    configs = sweep.variant_configs(config, definition.load_sweep(config_file))
    runs, missing = [], []
    for name, variant in configs.items():
        directory = os.path.join(workdir, name)
        summary = report.read_summary(directory)
        row = report.variant_row(name, variant, directory)
        loss = row["val_loss"] if row["val_loss"] is not None else summary.get("val_loss")
        if row["status"] != "finished" or loss is None or not summary.get("num_params"):
            missing.append(f"{name} ({row['status']})")
            continue
        steps = int(summary["step"])
        tokens = float(steps * variant.batch_size * variant.seq_len)
        flops = flops_per_token(variant, summary["num_params"]) * tokens
        runs.append(Run(name, int(summary["num_params"]), steps, tokens, flops, float(loss),
                        nearest_budget(flops, budgets, name)))
    if not runs:
        raise ValueError(f"{workdir}: no finished runs of {config_file}'s variants, expected "
                         "the sweep's output (python -m transformer.sweep ...)")
    return runs, missing


def _columns(runs: Sequence[Run]):
    return tuple(np.array([getattr(r, key) for r in runs], np.float64)
                 for key in ("flops", "num_params", "tokens", "loss", "budget"))


# --- the report -------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_isoflops(runs: Sequence[Run], fit: Approach2, path: str) -> None:
    """Loss vs N per budget, with each budget's parabola and its minimum."""
    plt = _plt()
    figure, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    groups = sorted({r.budget for r in runs})
    for group, budget in zip(groups, fit.budgets, strict=True):
        mine = [r for r in runs if r.budget == group]
        points = ax.scatter([r.num_params for r in mine], [r.loss for r in mine], s=18,
                            label=f"C={budget.flops:.2g}")
        x = np.linspace(min(math.log(r.num_params) for r in mine) - 0.3,
                        max(math.log(r.num_params) for r in mine) + 0.3, 100)
        ax.plot(np.exp(x), np.polyval(budget.parabola.coeffs, x), color=points.get_facecolor()[0])
        ax.plot([budget.n_opt], [budget.parabola.loss_min], marker="*", markersize=10,
                color=points.get_facecolor()[0])
    ax.set_xscale("log")
    ax.set_xlabel("params N")
    ax.set_ylabel("final validation loss")
    ax.set_title("IsoFLOP curves (parabolas in ln N; star: N_opt)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_power_laws(fit: Approach2, path: str) -> None:
    """N_opt(C) and D_opt(C) with their fitted power laws, log-log."""
    plt = _plt()
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    c = np.array([b.flops for b in fit.budgets])
    line = np.geomspace(c.min() / 1.5, c.max() * 1.5, 50)
    for ax, law, values, label in ((axes[0], fit.n_law, [b.n_opt for b in fit.budgets], "N_opt"),
                                   (axes[1], fit.d_law, [b.d_opt for b in fit.budgets], "D_opt")):
        ax.loglog(c, values, "o")
        ax.loglog(line, law(line), label=f"{label} ∝ C^{law.exponent:.3f}")
        ax.set_xlabel("compute C (FLOPs)")
        ax.set_ylabel(label + (" (params)" if label == "N_opt" else " (tokens)"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    figure.suptitle("Approach 2: compute-optimal model size and tokens")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _interval(value: Interval, spec: str = ".3f") -> str:
    return f"{value.value:{spec}} [{value.low:{spec}}, {value.high:{spec}}]"


def _runs_table(runs: Sequence[Run]) -> list[str]:
    lines = ["| run | budget C | params N | steps | tokens D | C (FLOPs) | D/N | val loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(runs, key=lambda r: (r.budget, r.num_params)):
        lines.append(f"| {r.name} | {r.budget:.3g} | {r.num_params:,} | {r.steps:,} | "
                     f"{r.tokens:,.0f} | {r.flops:.3g} | {r.tokens / r.num_params:.1f} | "
                     f"{r.loss:.4f} |")
    return lines


def _approach2_lines(fit: Approach2, boot: Bootstrap) -> list[str]:
    lines = ["## Approach 2: IsoFLOP parabolas", "",
             "Per budget: a least-squares parabola of final val loss in ln N; N_opt at its "
             "vertex, D_opt = C / flops_per_token(N_opt) (the tokens that model trains on "
             "with C), L_min its loss.", "",
             "| budget C | runs | N_opt | D_opt | D_opt/N_opt | L_min | vertex |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for b in fit.budgets:
        lines.append(f"| {b.flops:.3g} | {b.num_runs} | {b.n_opt:,.0f} | {b.d_opt:,.0f} | "
                     f"{b.d_opt / b.n_opt:.1f} | {b.parabola.loss_min:.4f} | "
                     f"{'inside' if b.parabola.inside else '**outside the sampled sizes**'} |")
    a, b = boot.intervals["a"], boot.intervals["b"]
    lines += ["", "| exponent | fitted [95% bootstrap interval] | Chinchilla (approach 2) |",
              "| --- | ---: | ---: |",
              f"| a (N_opt ∝ C^a) | {_interval(a)} | {CHINCHILLA_APPROACH2['a']:.2f} |",
              f"| b (D_opt ∝ C^b) | {_interval(b)} | {CHINCHILLA_APPROACH2['b']:.2f} |", "",
              f"Intervals: percentiles of {boot.used:,} bootstrap resamples (each budget's runs "
              f"drawn with replacement, seed 0); {boot.skipped} resamples without a fit (a "
              "parabola with no minimum) left out."]
    return lines


def _approach3_lines(fit: Parametric, boot: Bootstrap) -> list[str]:
    names = {"E": "E", "A": "A", "B": "B", "alpha": "alpha", "beta": "beta",
             "a": "a = beta/(alpha+beta)", "b": "b = alpha/(alpha+beta)"}
    chinchilla = Parametric(**CHINCHILLA_APPROACH3, objective=0.0).values()
    lines = ["## Approach 3: parametric loss L(N, D) = E + A/N^alpha + B/D^beta", "",
             f"Fitted to every run: L-BFGS on the Huber loss (delta {HUBER_DELTA:g}) of ln L, "
             "from the paper's grid of initialisations (the best by initial loss).", "",
             "| parameter | fitted [95% bootstrap interval] | Chinchilla (approach 3) |",
             "| --- | ---: | ---: |"]
    for key, label in names.items():
        spec = ".4g" if key in ("A", "B") else ".3f"
        lines.append(f"| {label} | {_interval(boot.intervals[key], spec)} | "
                     f"{chinchilla[key]:{spec}} |")
    lines += ["", f"Intervals: percentiles of {boot.used} bootstrap resamples of the runs (with "
              "replacement, seed 0), each refitted from the full fit's optimum and the best "
              "grid points. Chinchilla's a and b here follow from its rounded alpha and beta "
              "(the paper's Table 2 gives 0.46 and 0.54 for approach 3)."]
    return lines


CAVEATS = (
    "What this can and cannot show. These are tiny character-level models (thousands to a "
    "million params) trained for minutes on one small embedded corpus, with one seed per run, "
    "one learning rate and schedule for every size, and a few budgets spanning about one "
    "decade of compute. Each point's loss carries seed noise comparable to the differences "
    "between neighbouring sizes, and the larger budgets repeat the corpus (the embedded one "
    "is about 5 M characters: the smallest model reads it about 20 times at 1.5e13 FLOPs), "
    "which Chinchilla's single-epoch data never did; small models also spend a larger share "
    "of their FLOPs on embeddings and attention than the 6N rule assumes. So the exponents "
    "are a check that the pipeline recovers a sensible trade-off (a and b near 0.5 would say "
    "params and tokens should grow together), not a measurement comparable to Hoffmann et "
    "al.'s: read the intervals, which at this scale are wide, and do not extrapolate the "
    "power laws beyond the budgets measured. Approach 3's E, A, B depend on the tokenizer and "
    "corpus (nats per character here, per subword token there) and are not comparable at "
    "all; only its exponents are.")


def write_report(workdir: str, runs: Sequence[Run], missing: Sequence[str], title: str,
                 resamples2: int = 1000, resamples3: int = 200) -> str:
    """Fits both approaches and their bootstraps; writes DIR/scaling.md and the plots."""
    flops, num_params, tokens, loss, budgets = _columns(runs)
    fit2 = fit_approach2(flops, num_params, tokens, loss, budgets)
    boot2 = bootstrap_approach2(flops, num_params, tokens, loss, budgets, resamples2)
    fit3 = fit_parametric(num_params, tokens, loss)
    boot3 = bootstrap_parametric(num_params, tokens, loss, resamples3, fit=fit3)
    plot_isoflops(runs, fit2, os.path.join(workdir, "isoflop.png"))
    plot_power_laws(fit2, os.path.join(workdir, "power_laws.png"))
    warnings = [f"- budget C={b.flops:.3g}: the parabola's minimum N={b.n_opt:,.0f} lies "
                "outside the sampled sizes (an extrapolation: add sizes on that side)"
                for b in fit2.budgets if not b.parabola.inside]
    warnings += [f"- not finished, left out: {name}" for name in missing]
    lines = [f"# Scaling laws: {title}", "",
             f"{len(runs)} finished runs in {len(fit2.budgets)} compute budgets, written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}. C = flops_per_token x tokens "
             "(transformer.training.metrics.flops_per_token: 6 N_matmul + 12 L d T), D = tokens "
             "trained, N = params, loss = the final validation loss (nats per token).", ""]
    if warnings:
        lines += ["**Warnings**", ""] + warnings + [""]
    lines += ["## Runs", ""] + _runs_table(runs) + [""]
    lines += _approach2_lines(fit2, boot2) + [""] + _approach3_lines(fit3, boot3)
    lines += ["", "## Reading these numbers", "", CAVEATS, "",
              "![IsoFLOP curves](isoflop.png)", "", "![Power laws](power_laws.png)"]
    path = os.path.join(workdir, "scaling.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# --- command line -----------------------------------------------------------------------------


def main(argv) -> None:
    from absl import flags
    from ml_collections import config_flags

    del argv
    FLAGS = flags.FLAGS
    config_file = config_flags.get_config_filename(FLAGS["config"])
    runs, missing = load_runs(FLAGS.workdir, config_file, FLAGS.config)
    path = write_report(FLAGS.workdir, runs, missing, FLAGS.config.experiment,
                        FLAGS.resamples, FLAGS.parametric_resamples)
    with open(path) as f:
        print(f.read())
    print(f"report: {path}")


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "The sweep's experiment file "
                                    "(get_config, get_sweep and BUDGETS).", lock_config=True)
    flags.DEFINE_string("workdir", None, "The sweep's directory (one run per variant).",
                        required=True)
    flags.DEFINE_integer("resamples", 1000, "Bootstrap resamples for approach 2.", lower_bound=1)
    flags.DEFINE_integer("parametric_resamples", 200, "Bootstrap resamples for approach 3.",
                         lower_bound=1)


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(main, _define_flags)
