"""Chinchilla's approach 3 (Hoffmann et al., 2022) on arrays, and its bootstrap intervals.

L(N, D) = E + A / N^alpha + B / D^beta, fitted to every run by L-BFGS on the Huber loss
(delta 1e-3) of ln L from the paper's grid of initialisations, parameterised as in the paper:
ln L = LSE(a - alpha ln N, b - beta ln D, e) with A = e^a, B = e^b, E = e^e. Its
compute-optimal exponents: a = beta / (alpha + beta), b = alpha / (alpha + beta). The bootstrap
refits every resample at once by damped Newton from the full fit's local optima.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from transformer.sweeps.isoflop import Bootstrap, finite_positive, intervals

HUBER_DELTA = 1e-3
# The paper's grid of initialisations: alpha, beta, e, a, b.
PAPER_GRID = (np.arange(0, 2.01, 0.5), np.arange(0, 2.01, 0.5), np.arange(-1, 1.01, 0.5),
              np.arange(0, 25.1, 5), np.arange(0, 25.1, 5))


@dataclasses.dataclass(frozen=True)
class Parametric:
    """L(N, D) = E + A / N^alpha + B / D^beta, and its final Huber objective. `optima`: the
    distinct local optima (thetas) that the fit's starts reached, best first."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    optima: tuple[tuple[float, ...], ...] = dataclasses.field(default=(), repr=False,
                                                              compare=False)

    @property
    def a(self) -> float:
        """N_opt ∝ C^a."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """D_opt ∝ C^b."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def theta(self) -> np.ndarray:
        """(a, b, e, alpha, beta) = (ln A, ln B, ln E, alpha, beta)."""
        return np.array([math.log(self.A), math.log(self.B), math.log(self.E), self.alpha,
                         self.beta])

    def loss(self, num_params, tokens):
        return self.E + self.A / np.asarray(num_params, np.float64) ** self.alpha + \
            self.B / np.asarray(tokens, np.float64) ** self.beta

    def values(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta,
                "a": self.a, "b": self.b}


def _parametric(theta, objective: float, optima=()) -> Parametric:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return Parametric(math.exp(e), math.exp(a), math.exp(b), alpha, beta, float(objective),
                      tuple(optima))


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


def _distinct(results, keep: int = 8) -> list[tuple[float, ...]]:
    """The thetas of the best `keep` distinct local optima among scipy results: apart in
    theta and in objective (starts that stalled on one plateau end at different thetas of
    nearly one objective)."""
    optima = []
    for result in sorted(results, key=lambda r: r.fun):
        if len(optima) < keep and all(np.abs(result.x - x).max() > 1e-4 and
                                      abs(result.fun - f) > 1e-6 * abs(f) for x, f in optima):
            optima.append((result.x, result.fun))
    return [tuple(map(float, x)) for x, _ in optima]


def fit_parametric(num_params, tokens, loss, delta: float = HUBER_DELTA, grid=PAPER_GRID,
                   starts: int = 32, extra=()) -> Parametric:
    """Approach 3: L-BFGS from the `starts` initialisations of `grid` (and any `extra`
    thetas) with the lowest Huber objective; the best result. Needs at least 5 runs."""
    from scipy import optimize

    n, d, y = (finite_positive(name, v) for name, v in
               (("num_params", num_params), ("tokens", tokens), ("loss", loss)))
    if len(n) < 5:
        raise ValueError(f"approach 3: {len(n)} finished runs, expected at least 5 for the "
                         "5 parameters of L(N, D)")
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(y)
    inits = _grid(grid)
    values, _ = huber_objective(inits, log_n, log_d, log_l, delta)
    inits = np.concatenate([np.asarray(extra, np.float64).reshape(-1, 5),
                            inits[np.argsort(values)[:starts]]])
    results = []
    for init in inits:
        result = optimize.minimize(huber_objective, init, args=(log_n, log_d, log_l, delta),
                                   jac=True, method="L-BFGS-B",
                                   options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-10})
        if np.all(np.isfinite(result.x)):
            results.append(result)
    best = min(results, key=lambda r: r.fun)
    return _parametric(best.x, best.fun * delta, _distinct(results))


def _newton_terms(theta, log_n, log_d, log_loss, delta: float):
    """The Huber objective / delta, its gradient and Hessian for P problems at once: theta
    [P, 5], data [P, n] -> [P], [P, 5], [P, 5, 5]."""
    terms = _terms(theta, log_n, log_d)
    top = terms.max(-1, keepdims=True)
    w = np.exp(terms - top)
    total = w.sum(-1, keepdims=True)
    r = (top + np.log(total))[..., 0] - log_loss
    w = w / total
    inside = np.abs(r) <= delta
    f = np.where(inside, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum(-1) / delta
    slope = np.clip(r, -delta, delta) / delta
    # d terms / d theta per run: the rows (1, 0, 0, -ln N, 0), (0, 1, 0, 0, -ln D), (0, 0, 1,
    # 0, 0); the LSE's gradient is its softmax-weighted rows, its Hessian
    # rows' (diag(w) - w w^T) rows, as the terms are linear in theta.
    zero, one = np.zeros_like(log_n), np.ones_like(log_n)
    rows = np.stack([np.stack([one, zero, zero, -log_n, zero], -1),
                     np.stack([zero, one, zero, zero, -log_d], -1),
                     np.stack([zero, zero, one, zero, zero], -1)], -2)
    g = np.einsum("pnk,pnki->pni", w, rows)
    hessian = np.einsum("pn,pni,pnj->pij", inside / delta - slope, g, g) + \
        np.einsum("pn,pnk,pnki,pnkj->pij", slope, w, rows, rows)
    return f, np.einsum("pn,pni->pi", slope, g), hessian


def _newton(theta, log_n, log_d, log_loss, delta: float, iterations: int = 200):
    """Damped Newton from each theta [P, 5] on its own data [P, n]: (thetas, objectives).
    A problem stops, as scipy's L-BFGS-B does, once a step gains under 1e-15 of its
    objective, or no damping finds a lower one."""
    f, g, h = _newton_terms(theta, log_n, log_d, log_loss, delta)
    damping = np.full(len(theta), 1e-9)
    done = np.zeros(len(theta), bool)
    for _ in range(iterations):
        # |eigenvalues| plus damping: a descent direction even where the Hessian is not
        # positive definite (the Huber loss's linear part bends the LSE both ways).
        eigen, vectors = np.linalg.eigh(h)
        step = -np.einsum("pij,pj,pkj,pk->pi", vectors, 1 / (np.abs(eigen) + damping[:, None]),
                          vectors, g)
        new = _newton_terms(theta + step, log_n, log_d, log_loss, delta)
        better = ~done & np.isfinite(new[0]) & (new[0] <= f)
        done |= better & (f - new[0] <= 1e-15 * np.maximum(np.abs(f), 1)) | (damping > 1e8)
        theta = np.where(better[:, None], theta + step, theta)
        f, g, h = (np.where(better.reshape((-1,) + (1,) * (old.ndim - 1)), value, old)
                   for value, old in zip(new, (f, g, h), strict=True))
        damping = np.where(better, np.maximum(damping / 10, 1e-12), damping * 10)
        if done.all():
            break
    return theta, f


def refit(num_params, tokens, loss, starts, delta: float = HUBER_DELTA, chunk: int = 64):
    """Approach 3 on R datasets at once (rows of num_params, tokens, loss: [R, n]), by damped
    Newton from each of `starts` ([S, 5] thetas, the full fit's optima): the best per row as
    (thetas [R, 5], Huber objectives [R]); NaN where no start gave a finite fit."""
    log_n, log_d, log_l = (np.log(np.asarray(v, np.float64)) for v in (num_params, tokens,
                                                                       loss))
    starts = np.asarray(starts, np.float64).reshape(-1, 5)
    thetas, objectives = [], []
    for i in range(0, len(log_n), chunk):  # bounds the [P, n, 3, 5] arrays
        rows = slice(i, i + chunk)
        data = [np.repeat(v[rows], len(starts), 0) for v in (log_n, log_d, log_l)]
        theta, f = _newton(np.tile(starts, (len(data[0]) // len(starts), 1)), *data, delta)
        theta, f = theta.reshape(-1, len(starts), 5), f.reshape(-1, len(starts))
        f = np.where(np.all(np.isfinite(theta), -1), f, np.inf)
        best = np.argmin(f, -1)
        pick = np.arange(len(best))
        thetas.append(theta[pick, best])
        objectives.append(np.where(np.isfinite(f[pick, best]), f[pick, best] * delta, np.nan))
    return np.concatenate(thetas), np.concatenate(objectives)


def bootstrap_parametric(num_params, tokens, loss, resamples: int = 200, seed: int = 0,
                         level: float = 0.95, starts: int = 4, fit: Parametric | None = None
                         ) -> Bootstrap:
    """Percentile intervals of E, A, B, alpha, beta, a, b: runs resampled with replacement,
    all refitted at once (`refit`) from the full fit's best `starts` distinct local optima."""
    arrays = [np.asarray(v, np.float64) for v in (num_params, tokens, loss)]
    fit = fit or fit_parametric(*arrays)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(arrays[0]), (resamples, len(arrays[0])))
    starts = (fit.optima or (tuple(fit.theta),))[:starts]
    theta, objective = refit(*(v[picks] for v in arrays), starts)
    ok = np.isfinite(objective)
    a, b, e, alpha, beta = theta[ok].T
    draws = {"E": np.exp(e), "A": np.exp(a), "B": np.exp(b), "alpha": alpha, "beta": beta,
             "a": beta / (alpha + beta), "b": alpha / (alpha + beta)}
    count = len(starts)
    return Bootstrap(intervals(fit.values(), draws, level), int(ok.sum()), int((~ok).sum()),
                     "each refitted by damped Newton from the full fit's optimum" +
                     (f" and its {count - 1} other distinct local optima (the best result kept)"
                      if count > 1 else ""))
