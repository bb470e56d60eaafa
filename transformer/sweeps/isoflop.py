"""Chinchilla's approach 2 (Hoffmann et al., 2022) on arrays, and its bootstrap interval.

Per compute budget, a least-squares parabola of final loss against ln N; its vertex gives
N_opt(C) and L_min(C), and D_opt(C) = C / flops_per_token(N_opt). Then N_opt = k C^a and
D_opt = k' C^b by least squares in log-log, over the budgets whose sizes bracket their optimum.
`transformer.scaling` runs it on a sweep's runs and writes the report.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def finite_positive(name: str, values) -> np.ndarray:
    """`values` as float64, refused in one line unless all finite and > 0."""
    values = np.asarray(values, np.float64)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"{name}={values.tolist()}: expected finite positive values")
    return values


@dataclasses.dataclass(frozen=True)
class Parabola:
    """loss = c2 x^2 + c1 x + c0 with x = ln N, and its vertex (ln N_opt, L_min). `beyond`:
    None when the sizes bracket the minimum, else "smallest" or "largest", the end of the
    sizes past which the optimum lies (the vertex is then an extrapolation)."""

    coeffs: tuple[float, float, float]
    log_n_opt: float
    loss_min: float
    beyond: str | None = None

    @property
    def inside(self) -> bool:
        return self.beyond is None

    @property
    def n_opt(self) -> float:
        return float(np.exp(self.log_n_opt))


def fit_parabola(num_params, loss, label: str = "parabola") -> Parabola:
    """Least-squares parabola of `loss` against ln `num_params` and its minimum. Raises a
    one-line ValueError for fewer than 3 sizes or a parabola that opens downward."""
    x = np.log(finite_positive(f"{label}: num_params", num_params))
    y = finite_positive(f"{label}: loss", loss)
    sizes = len(np.unique(x))
    if sizes < 3:
        raise ValueError(f"{label}: {len(x)} finished runs ({sizes} model sizes), expected at "
                         "least 3 model sizes for a parabola")
    c2, c1, c0 = np.polyfit(x, y, 2)
    if not c2 > 0:
        raise ValueError(f"{label}: the parabola of loss vs ln N opens downward (curvature "
                         f"{c2:.3g}), expected a positive curvature: it has no minimum")
    vertex = -c1 / (2 * c2)
    # A loss still falling at the largest size can put the vertex just inside the sizes: the
    # lowest loss at an end says the sizes do not bracket the optimum either.
    lowest = x[np.argmin(y)]
    beyond = ("largest" if vertex > x.max() else "smallest" if vertex < x.min() else
              "largest" if lowest == x.max() else "smallest" if lowest == x.min() else None)
    return Parabola((float(c2), float(c1), float(c0)), float(vertex),
                    float(c0 - c1 * c1 / (4 * c2)), beyond)


@dataclasses.dataclass(frozen=True)
class Budget:
    """One compute budget's fit: its compute (geometric mean of its runs'), run count, model
    sizes, parabola, N_opt, D_opt, and ln(flops_per_token / N) as a line in ln N."""

    flops: float
    num_runs: int
    sizes: tuple[float, ...]
    parabola: Parabola
    n_opt: float
    d_opt: float
    per_param: tuple[float, float]

    def log_tokens_at(self, log_n):
        """ln D = ln(C / flops_per_token(N)) at ln N (an array of them too)."""
        return math.log(self.flops) - np.polyval(self.per_param, log_n) - log_n


@dataclasses.dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * x ** exponent."""

    exponent: float
    coefficient: float

    def __call__(self, x):
        return self.coefficient * np.asarray(x, np.float64) ** self.exponent


@dataclasses.dataclass(frozen=True)
class Approach2:
    """Every budget's fit; the power laws over `fitted`, those whose sizes bracket N_opt."""

    budgets: tuple[Budget, ...]
    n_law: PowerLaw  # N_opt(C)
    d_law: PowerLaw  # D_opt(C)

    @property
    def fitted(self) -> tuple[Budget, ...]:
        return tuple(b for b in self.budgets if b.parabola.inside)


def fit_power_law(x, y, label: str) -> PowerLaw:
    """Least squares of ln y against ln x; needs at least 2 distinct x."""
    x, y = finite_positive(f"{label}: x", x), finite_positive(f"{label}: y", y)
    if len(np.unique(x)) < 2:
        raise ValueError(f"{label}: {len(np.unique(x))} compute budget, expected at least 2 "
                         "compute budgets for a power law")
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return PowerLaw(float(slope), float(math.exp(intercept)))


def fit_budget(flops, num_params, tokens, loss, label: str) -> Budget:
    """Approach 2 at one budget: the parabola's N_opt, and D_opt = C / flops_per_token(N_opt)
    with ln(flops_per_token / N) = ln(C_i / (D_i N_i)) fitted linearly in ln N over the runs."""
    flops, n, tokens = (finite_positive(f"{label}: {name}", v) for name, v in
                        (("flops", flops), ("num_params", num_params), ("tokens", tokens)))
    parabola = fit_parabola(n, loss, label)
    budget = float(np.exp(np.mean(np.log(flops))))
    ratio = np.polyfit(np.log(n), np.log(flops / (tokens * n)), 1)
    per_param = float(np.exp(np.polyval(ratio, parabola.log_n_opt)))  # flops_per_token / N
    return Budget(budget, len(n), tuple(np.unique(n).tolist()), parabola, parabola.n_opt,
                  budget / (per_param * parabola.n_opt), (float(ratio[0]), float(ratio[1])))


def _refuse_duplicates(num_params: np.ndarray, label: str) -> None:
    sizes, counts = np.unique(num_params, return_counts=True)
    if np.any(counts > 1):
        twice = ", ".join(f"N={n:.4g} ({c} runs)" for n, c in zip(sizes, counts, strict=True)
                          if c > 1)
        raise ValueError(f"{label}: {twice} of the same size, expected one run per model size "
                         "(average them first)")


def fit_approach2(flops, num_params, tokens, loss, groups) -> Approach2:
    """Approach 2 over runs grouped by `groups` (each run's declared budget). A budget whose
    sizes do not bracket its optimum is fitted but left out of the power laws; two runs of
    one size in a budget are refused."""
    flops, num_params, tokens, loss, groups = map(np.asarray, (flops, num_params, tokens, loss,
                                                               groups))
    budgets = []
    for group in sorted(set(groups.tolist())):
        pick, label = groups == group, f"budget C={group:.3g}"
        _refuse_duplicates(num_params[pick], label)
        budgets.append(fit_budget(flops[pick], num_params[pick], tokens[pick], loss[pick],
                                  label))
    if len(budgets) < 2:
        raise ValueError(f"{len(budgets)} compute budget, expected at least 2 compute budgets "
                         "for the N_opt(C) and D_opt(C) power laws")
    fitted = [b for b in budgets if b.parabola.inside]
    if len(fitted) < 2:
        past = ", ".join(f"C={b.flops:.3g} past its {b.parabola.beyond} size"
                         for b in budgets if not b.parabola.inside)
        raise ValueError(f"{len(fitted)} of {len(budgets)} compute budgets bracket their "
                         f"optimum ({past}), expected at least 2 for the N_opt(C) and D_opt(C) "
                         "power laws: add sizes past the optimum")
    c = [b.flops for b in fitted]
    return Approach2(tuple(budgets), fit_power_law(c, [b.n_opt for b in fitted], "N_opt(C)"),
                     fit_power_law(c, [b.d_opt for b in fitted], "D_opt(C)"))


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
    """Intervals by name (none when they cannot be computed: `note` says why), how many
    resamples gave a fit (`used`) or none (`skipped`), and what the resampling assumed."""

    intervals: dict[str, Interval]
    used: int
    skipped: int
    note: str = ""


def intervals(fitted: dict[str, float], draws: dict[str, np.ndarray], level: float
              ) -> dict[str, Interval]:
    """Percentile intervals at `level` of each key's draws, around its fitted value."""
    if not len(next(iter(draws.values()))):
        raise ValueError("bootstrap: no resample could be fitted, expected at least one")
    q = [(1 - level) / 2, (1 + level) / 2]
    return {key: Interval(value, *map(float, np.quantile(draws[key], q)))
            for key, value in fitted.items()}


def bootstrap_approach2(flops, num_params, tokens, loss, groups, resamples: int = 1000,
                        seed: int = 0, level: float = 0.95) -> Bootstrap:
    """Percentile intervals of a and b by a residual bootstrap at the measured sizes: each
    resample adds Gaussian noise to every fitted budget's parabola and refits parabolas and
    power laws. The noise scale is the parabolas' residual s, pooled over those budgets;
    each resample draws its own from s's sampling distribution (s^2 dof / chi^2_dof), so
    few residual degrees of freedom widen the interval as Student's t does. With 3 sizes in
    every budget no residual is left: no interval (`note` says so). Resamples with a
    parabola that opens downward are skipped and counted."""
    fit = fit_approach2(flops, num_params, tokens, loss, groups)
    groups, num_params, loss = np.asarray(groups), np.asarray(num_params), np.asarray(loss)
    runs = [np.flatnonzero(groups == g) for g in sorted(set(groups.tolist()))]
    budgets = [(b, np.log(num_params[i].astype(np.float64)), loss[i])
               for b, i in zip(fit.budgets, runs, strict=True) if b.parabola.inside]
    rss = sum(float(np.sum((y - np.polyval(b.parabola.coeffs, x)) ** 2)) for b, x, y in budgets)
    dof = sum(len(x) - 3 for _, x, _ in budgets)
    if dof == 0:
        return Bootstrap({}, 0, 0, "every budget in the power laws has 3 sizes, so each "
                         "parabola passes through its runs and leaves no residual to estimate "
                         "the loss noise from: add a 4th size to a budget")
    s = math.sqrt(rss / dof)
    rng = np.random.default_rng(seed)
    scale = np.sqrt(rss / rng.chisquare(dof, resamples))
    log_n, log_d, ok = [], [], np.ones(resamples, bool)
    for budget, x, _ in budgets:
        y = np.polyval(budget.parabola.coeffs, x)[:, None] + \
            scale * rng.standard_normal((len(x), resamples))
        c2, c1, _ = np.polyfit(x, y, 2)
        ok &= c2 > 0
        vertex = -c1 / (2 * np.where(c2 > 0, c2, 1.0))
        log_n.append(vertex)
        log_d.append(budget.log_tokens_at(vertex))
    log_c = np.log([b.flops for b, _, _ in budgets])
    draws = {key: np.polyfit(log_c, np.array(log_y)[:, ok], 1)[0] if ok.any() else []
             for key, log_y in (("a", log_n), ("b", log_d))}
    return Bootstrap(intervals({"a": fit.n_law.exponent, "b": fit.d_law.exponent}, draws,
                               level), int(ok.sum()), int((~ok).sum()),
                     f"residual s = {s:.3g} from {dof} degrees of freedom")
