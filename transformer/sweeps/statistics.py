"""The statistics of a sweep's report: a metric over seeds (mean, std, Student-t interval),
a variant's difference from the baseline paired by seed, and the paired bootstrap over the
validation windows."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean over n seeds, its standard deviation (ddof=1) and its 95% Student-t confidence
    interval [low, high] = mean -/+ t(0.975, n - 1) * std / sqrt(n); None with one seed."""

    n: int
    mean: float
    std: float | None = None
    low: float | None = None
    high: float | None = None


def finite(value: float | None) -> bool:
    """Whether `value` is a measurement: not missing (None) and not non-finite (a diverged
    run's NaN or inf)."""
    return value is not None and math.isfinite(value)


def estimate(values: Sequence[float | None], level: float = 0.95) -> Estimate | None:
    """The Estimate of the values given, missing and non-finite ones left out (`finite`: its
    n counts the rest); None when none is left."""
    import numpy as np
    from scipy import stats

    x = np.asarray([v for v in values if finite(v)], np.float64)
    if len(x) == 0:
        return None
    if len(x) == 1:
        return Estimate(1, float(x[0]))
    mean, std = float(x.mean()), float(x.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, len(x) - 1)) * std / math.sqrt(len(x))
    return Estimate(len(x), mean, std, mean - half, mean + half)


def paired_difference(values: dict[int, float | None], baseline: dict[int, float | None]
                      ) -> Estimate | None:
    """The Estimate of variant minus baseline, seed by seed, over the seeds both have a finite
    value for (the same seed is the same data, so the pair differs only by the variant)."""
    seeds = [k for k in sorted(set(values) & set(baseline))
             if finite(values[k]) and finite(baseline[k])]
    return estimate([values[k] - baseline[k] for k in seeds])


def verdict(difference: Estimate | None) -> str:
    """"within noise" when the difference's interval includes 0, else "differs"; "-" without
    an interval (fewer than two seeds, or a non-finite value)."""
    if difference is None or difference.low is None or not (
            math.isfinite(difference.low) and math.isfinite(difference.high)):
        return "-"
    return "within noise" if difference.low <= 0 <= difference.high else "differs"


# The window bootstrap: resamples of the validation windows, the same for every variant.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def window_bootstrap(pairs: Sequence[tuple[dict, dict]], resamples: int = BOOTSTRAP_RESAMPLES,
                     level: float = 0.95, seed: int = BOOTSTRAP_SEED) -> Estimate:
    """Paired bootstrap of a variant's validation loss minus the baseline's over the windows.

    `pairs`: per seed, (variant's, baseline's) windows of the same validation pass (dicts with
    per-window "loss_sum" and "num_tokens", `evaluation.load_windows`). The loss of a run is its
    token-weighted mean over windows (its logged val_loss). Each resample draws the windows of
    every seed with replacement, the same draw for both runs of a seed (paired), and averages
    the seeds' differences (each seed weighs alike, as in the seed-paired t interval). Returns
    the observed difference, the resamples' std and their percentile interval [low, high].
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    observed, draws = [], np.zeros(resamples)
    for variant, baseline in pairs:
        loss = np.stack([np.asarray(w["loss_sum"], np.float64) for w in (variant, baseline)])
        tokens = np.asarray(baseline["num_tokens"], np.float64)
        keep = tokens > 0  # padding rows of a last batch read nothing
        loss, tokens = loss[:, keep], tokens[keep]
        observed.append(loss[0].sum() / tokens.sum() - loss[1].sum() / tokens.sum())
        for start in range(0, resamples, 256):  # blocks: [block, windows] indices at a time
            picks = rng.integers(0, len(tokens), (min(256, resamples - start), len(tokens)))
            diff = loss[0][picks].sum(1) - loss[1][picks].sum(1)
            draws[start:start + len(picks)] += diff / tokens[picks].sum(1) / len(pairs)
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return Estimate(len(pairs), float(np.mean(observed)), float(draws.std(ddof=1)), float(low),
                    float(high))


def window_pairs(variant: dict[int, dict | None], baseline: dict[int, dict | None]
                 ) -> tuple[list[tuple[dict, dict]], list[str]]:
    """(the seeds' (variant, baseline) windows that pair, notes on the seeds that do not).
    Windows pair when both runs saved them for the same rows: same fingerprint and count, and
    the same tokens per window; and neither run's window losses hold a non-finite value (a
    diverged run's, which the seed statistics leave out too)."""
    import numpy as np

    pairs, notes = [], []
    for k in sorted(set(variant) | set(baseline)):
        mine, theirs = variant.get(k), baseline.get(k)
        if mine is None or theirs is None:
            notes.append(f"seed {k}: no {'' if mine is None else 'baseline '}val_windows.npz "
                         "(unfinished, or trained before runs saved their windows)")
        elif (mine["fingerprint"], len(mine["num_tokens"])) != (theirs["fingerprint"],
                                                                len(theirs["num_tokens"])):
            notes.append(f"seed {k}: other validation windows than the baseline's "
                         f"({len(mine['num_tokens'])} windows, fingerprint "
                         f"{mine['fingerprint']}; the baseline: {len(theirs['num_tokens'])}, "
                         f"{theirs['fingerprint']}): not paired")
        elif not np.array_equal(mine["num_tokens"], theirs["num_tokens"]):
            notes.append(f"seed {k}: the windows' token counts differ from the baseline's: "
                         "not paired")
        elif not (np.isfinite(mine["loss_sum"]).all() and np.isfinite(theirs["loss_sum"]).all()):
            run = "its run" if not np.isfinite(mine["loss_sum"]).all() else "the baseline's"
            notes.append(f"seed {k}: non-finite window losses in {run} (diverged?): not paired")
        else:
            pairs.append((mine, theirs))
    return pairs, notes
