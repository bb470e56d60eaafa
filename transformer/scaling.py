"""Scaling laws from an IsoFLOP sweep: Chinchilla's approaches 2 and 3 (Hoffmann et al., 2022).

    python -m transformer.scaling --workdir=DIR [--config=experiments/scaling/isoflop.py]

DIR holds the sweep's runs (`transformer.sweep`): DIR/NAME per variant, or with `--seeds`
DIR/NAME/seed_K per seed (read from the layout). The experiment file declares the compute
budgets as `BUDGETS`; every finished run's compute is recomputed as C = flops_per_token(config,
N) x tokens trained (`metrics.flops_per_token`; tokens = steps x batch_size x seq_len; N =
active_params, all but a mixture of experts' unrouted experts; model.vocab_size 0 resolved from
the run's tokenizer as training resolves it, `counted_config`) and the run joins the declared
budget nearest to it in log C. A T5 is counted as if its decoder read seq_len tokens too, an
overcount: a summary has no encoder/decoder split. A run whose val loss is not finite is left
out, and runs of the same size and budget (seeds, copies) are averaged into one; the report
and the terminal name both. Fitted:

- Approach 2 (`transformer.sweeps.isoflop`): per budget, a parabola of final val loss against
  ln N; its vertex gives N_opt(C) and L_min(C); D_opt(C) = C / flops_per_token(N_opt), the
  tokens the optimal model trains on (flops_per_token / N interpolated in ln N from the budget's
  runs: with C = 6 N D exactly it is C / (6 N_opt)). Then N_opt = k C^a and D_opt = k' C^b by
  least squares in log-log, over the budgets whose sizes bracket their optimum (the others are
  flagged as extrapolations and left out).
- Approach 3 (`transformer.sweeps.parametric`): L(N, D) = E + A / N^alpha + B / D^beta, fitted
  to every run by L-BFGS on the Huber loss (delta 1e-3) of ln L, from the paper's grid of
  initialisations. Its compute-optimal exponents: a = beta / (alpha + beta),
  b = alpha / (alpha + beta).
- 95% percentile bootstrap intervals (fixed seeds) of the exponents: approach 2 by a residual
  bootstrap of the parabolas at the measured sizes (none with 3 sizes per budget: the report
  says why), approach 3 by resampling the runs with replacement.

It writes DIR/scaling.md (the runs, the per-budget optima, the exponents with their intervals
beside Chinchilla's) and DIR/isoflop.png, DIR/power_laws.png. Degenerate input (too few sizes,
budgets or runs, a parabola without a minimum) is one line and exit status 2.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from transformer import sweep
from transformer.sweeps import definition, report
from transformer.sweeps.isoflop import (
    Approach2,
    Bootstrap,
    Budget,
    Interval,
    Parabola,
    PowerLaw,
    bootstrap_approach2,
    fit_approach2,
    fit_budget,
    fit_parabola,
    fit_power_law,
)
from transformer.sweeps.parametric import (
    HUBER_DELTA,
    PAPER_GRID,
    Parametric,
    bootstrap_parametric,
    fit_parametric,
    huber_objective,
    refit,
)

__all__ = ["BUDGET_TOLERANCE", "CHINCHILLA_APPROACH2", "CHINCHILLA_APPROACH3", "HUBER_DELTA",
           "PAPER_GRID", "Approach2", "Bootstrap", "Budget", "Interval", "Parabola",
           "Parametric", "PowerLaw", "Run", "average_duplicates", "bootstrap_approach2",
           "bootstrap_parametric", "fit_approach2", "fit_budget", "fit_parabola",
           "fit_parametric", "fit_power_law", "huber_objective", "load_runs",
           "nearest_budget", "refit", "write_report"]

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "experiments", "scaling", "isoflop.py")
# Hoffmann et al. (2022): approach 2's exponents (Table 2) and approach 3's fit (eq. 10).
CHINCHILLA_APPROACH2 = {"a": 0.49, "b": 0.51}
CHINCHILLA_APPROACH3 = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
# A run joins the nearest declared budget only within this factor of it.
BUDGET_TOLERANCE = 1.5


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


def counted_config(config, workdir: str | None = None, built: dict | None = None):
    """A copy of `config` whose model.vocab_size is the one its training uses: 0 (the default)
    becomes the tokenizer's (`inputs.get_tokenizer`: the one saved in `workdir`, else built as
    the run builds it), as `training.startup.resolve` fills it. `metrics.flops_per_token` reads
    it: an untied token table is a lookup, not a matmul, and each MTP module runs the head again
    (6 V D); left 0 the first is counted in 6 N and the second not at all. `built` caches the
    sizes of tokenizers built from the data (not saved), by data config, for one sweep's runs."""
    from transformer.data import inputs, tokenizers
    from transformer.utils import fileio

    config = copy.deepcopy(config)
    if config.model.vocab_size:
        return config
    saved = workdir and fileio.path(fileio.join(workdir, inputs.TOKENIZER_DIR)).joinpath(
        tokenizers.CONFIG_FILE).is_file()
    if saved or built is None:
        config.model.vocab_size = inputs.get_tokenizer(config, workdir).vocab_size
        return config
    key = config.data.to_json() + str(config.get("init_from", ""))  # what a build reads
    if key not in built:
        built[key] = inputs.get_tokenizer(config).vocab_size
    config.model.vocab_size = built[key]
    return config


def load_runs(workdir: str, config_file: str, config) -> tuple[list[Run], list[str]]:
    """(the finished runs of the experiment's variants in `workdir`, with runs of one size and
    budget averaged; a note per run left out or merged). Compute C = flops_per_token(config,
    N_active) x steps x batch_size x seq_len: N_active the summary's active_params (a mixture
    of experts' per token, as its MFU counts; num_params in a summary written before it had
    them, an overcount for a MoE), the config's vocab_size the run's (`counted_config`)."""
    from transformer.training.metrics import flops_per_token

    if not os.path.isdir(workdir):
        raise NotADirectoryError(f"--workdir={workdir}: expected the sweep's directory")
    module = definition.experiment_module(config_file)
    budgets = getattr(module, "BUDGETS", None)
    if not budgets:
        raise ValueError(f"{config_file}: expected BUDGETS, the sweep's compute budgets")
    variants = definition.load_sweep(config_file)
    seeds = definition.layout_seeds(workdir, [v.name for v in variants])  # NAME/seed_K, averaged
    configs = sweep.variant_configs(config, definition.seed_variants(variants, seeds))
    # C is counted from these configs: a run trained with other settings (an override the
    # sweep had and this command has not) is refused in one line, as the sweep's report does
    sweep.check_runs(configs, workdir)
    runs, notes, nonfinite, built = [], [], [], {}
    for name, variant in configs.items():
        directory = os.path.join(workdir, name)
        summary = report.read_summary(directory)
        row = report.variant_row(name, variant, directory)
        loss = row["val_loss"] if row["val_loss"] is not None else summary.get("val_loss")
        if row["status"] != "finished" or loss is None or not summary.get("num_params"):
            notes.append(f"not finished, left out: {name} ({row['status']})")
            continue
        if not math.isfinite(loss):
            nonfinite.append(f"{name} ({loss})")
            continue
        steps = int(summary["step"])
        tokens = float(steps * variant.batch_size * variant.seq_len)
        # a mixture of experts' active params, as its MFU counts them (older summaries lack
        # the key: all params, an overcount for a MoE)
        active = summary.get("active_params") or summary["num_params"]
        flops = flops_per_token(counted_config(variant, directory, built), active) * tokens
        runs.append(Run(name, int(summary["num_params"]), steps, tokens, flops, float(loss),
                        nearest_budget(flops, budgets, name)))
    if nonfinite:
        notes.append(f"non-finite val loss, left out: {', '.join(nonfinite)}")
    if not runs:
        raise ValueError(f"{workdir}: no finished runs with a finite val loss of "
                         f"{config_file}'s variants, expected the sweep's output "
                         "(python -m transformer.sweep ...)")
    runs, averaged = average_duplicates(runs)
    return runs, notes + averaged


def average_duplicates(runs: Sequence[Run]) -> tuple[list[Run], list[str]]:
    """(the runs with those of one size and budget, such as seeds or copies, merged into one
    of their mean steps, tokens, compute and loss; a note per merge naming them)."""
    groups: dict[tuple[float, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.budget, r.num_params), []).append(r)
    merged, notes = [], []
    for (budget, n), same in groups.items():
        if len(same) == 1:
            merged.append(same[0])
            continue
        loss = float(np.mean([r.loss for r in same]))
        merged.append(Run(" + ".join(r.name for r in same), n,
                          round(np.mean([r.steps for r in same])),
                          float(np.mean([r.tokens for r in same])),
                          float(np.mean([r.flops for r in same])), loss, budget))
        notes.append(f"{len(same)} runs of N={n:,} at C={budget:.3g} averaged into one (val "
                     f"loss {', '.join(f'{r.loss:.4f}' for r in same)} -> {loss:.4f}): "
                     f"{', '.join(r.name for r in same)}")
    return merged, notes


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
    inside = np.array([b.parabola.inside for b in fit.budgets])
    for ax, law, label in ((axes[0], fit.n_law, "N_opt"), (axes[1], fit.d_law, "D_opt")):
        values = np.array([getattr(b, label.lower()) for b in fit.budgets])
        ax.loglog(c[inside], values[inside], "o")
        if not inside.all():
            ax.loglog(c[~inside], values[~inside], "x", label="past the sizes: left out")
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


def _ratio(value: float) -> str:
    """Tokens per param: 3 significant digits (a small ratio is not 0.0), whole above 1,000."""
    return f"{value:,.0f}" if abs(float(f"{value:.3g}")) >= 1000 else f"{value:.3g}"


def _runs_table(runs: Sequence[Run]) -> list[str]:
    lines = ["| run | budget C | params N | steps | tokens D | C (FLOPs) | D/N | val loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(runs, key=lambda r: (r.budget, r.num_params)):
        lines.append(f"| {r.name} | {r.budget:.3g} | {r.num_params:,} | {r.steps:,} | "
                     f"{r.tokens:,.0f} | {r.flops:.3g} | {_ratio(r.tokens / r.num_params)} | "
                     f"{r.loss:.4f} |")
    return lines


def approach2_section(fit: Approach2, boot: Bootstrap) -> list[str]:
    """The report's approach 2: each budget's optimum, the exponents and their intervals."""
    lines = ["## Approach 2: IsoFLOP parabolas", "",
             "Per budget: a least-squares parabola of final val loss in ln N; N_opt at its "
             "vertex, D_opt = C / flops_per_token(N_opt) (the tokens that model trains on "
             "with C), L_min its loss. The power laws are fitted over the "
             f"{len(fit.fitted)} of {len(fit.budgets)} budgets whose sizes bracket their "
             "optimum.", "",
             "| budget C | runs | N_opt | D_opt | D_opt/N_opt | L_min | vertex |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for b in fit.budgets:
        where = "inside" if b.parabola.inside else \
            f"**past the {b.parabola.beyond} size: left out**"
        lines.append(f"| {b.flops:.3g} | {b.num_runs} | {b.n_opt:,.0f} | {b.d_opt:,.0f} | "
                     f"{_ratio(b.d_opt / b.n_opt)} | {b.parabola.loss_min:.4f} | {where} |")
    fitted = {"a": fit.n_law.exponent, "b": fit.d_law.exponent}
    shown = {k: _interval(boot.intervals[k]) if boot.intervals else f"{v:.3f} (no interval)"
             for k, v in fitted.items()}
    lines += ["", "| exponent | fitted [95% bootstrap interval] | Chinchilla (approach 2) |",
              "| --- | ---: | ---: |",
              f"| a (N_opt ∝ C^a) | {shown['a']} | {CHINCHILLA_APPROACH2['a']:.2f} |",
              f"| b (D_opt ∝ C^b) | {shown['b']} | {CHINCHILLA_APPROACH2['b']:.2f} |", ""]
    if not boot.intervals:
        return lines + [f"No interval: {boot.note}."]
    return lines + [
        f"Intervals: percentiles of {boot.used:,} resamples of a residual bootstrap (seed 0): "
        "each adds Gaussian noise to every fitted budget's parabola at its measured sizes "
        f"and refits parabolas and power laws. The noise is the parabolas' pooled {boot.note}, "
        "its scale redrawn per resample from its sampling distribution (so few degrees of "
        f"freedom widen the interval, as Student's t does); {boot.skipped} resamples with a "
        "parabola that opens downward left out. They cover the losses' scatter about the "
        "parabolas (taken alike at every budget), not a parabola's misfit to the true curve."]


def approach3_section(fit: Parametric, boot: Bootstrap) -> list[str]:
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
              f"replacement, seed 0), {boot.note}; {boot.skipped} without a finite fit left "
              "out. Chinchilla's a and b here follow from its rounded alpha and beta (the "
              "paper's Table 2 gives 0.46 and 0.54 for approach 3)."]
    return lines


def extrapolated(fit: Approach2) -> list[str]:
    """A warning per budget whose sizes do not bracket its optimum."""
    return [f"- budget C={b.flops:.3g}: the optimum lies past the {b.parabola.beyond} size "
            f"N={(max if b.parabola.beyond == 'largest' else min)(b.sizes):,.0f} (parabola "
            f"vertex N={b.n_opt:,.0f}): an extrapolation, left out of the power laws (add "
            f"{'larger' if b.parabola.beyond == 'largest' else 'smaller'} sizes)"
            for b in fit.budgets if not b.parabola.inside]


CAVEATS = (
    "What this can and cannot show. These are tiny character-level models (thousands to a "
    "million params) trained for minutes on one small embedded corpus, with one seed per run "
    "(or a few, averaged, from --seeds), one learning rate and schedule for every size, and "
    "a few budgets spanning about one decade of compute. Each point's loss carries seed "
    "noise comparable to the differences between neighbouring sizes, and the larger budgets "
    "repeat the corpus (the embedded one is about 5 M characters: the smallest model reads "
    "it about 20 times at 1.5e13 FLOPs), "
    "which Chinchilla's single-epoch data never did; small models also spend a larger share "
    "of their FLOPs on embeddings and attention than the 6N rule assumes. So the exponents "
    "are a check that the pipeline recovers a sensible trade-off (a and b near 0.5 would say "
    "params and tokens should grow together), not a measurement comparable to Hoffmann et "
    "al.'s: read the intervals, which at this scale are wide, and do not extrapolate the "
    "power laws beyond the budgets measured. Approach 3's E, A, B depend on the tokenizer and "
    "corpus (nats per character here, per subword token there) and are not comparable at "
    "all; only its exponents are.")


def write_report(workdir: str, runs: Sequence[Run], notes: Sequence[str], title: str,
                 resamples2: int = 1000, resamples3: int = 200) -> str:
    """Fits both approaches and their bootstraps; writes DIR/scaling.md and the plots.
    `notes`: the runs left out or averaged (load_runs), listed under the warnings."""
    flops, num_params, tokens, loss, budgets = _columns(runs)
    fit2 = fit_approach2(flops, num_params, tokens, loss, budgets)
    boot2 = bootstrap_approach2(flops, num_params, tokens, loss, budgets, resamples2)
    fit3 = fit_parametric(num_params, tokens, loss)
    boot3 = bootstrap_parametric(num_params, tokens, loss, resamples3, fit=fit3)
    plot_isoflops(runs, fit2, os.path.join(workdir, "isoflop.png"))
    plot_power_laws(fit2, os.path.join(workdir, "power_laws.png"))
    warnings = extrapolated(fit2) + [f"- {note}" for note in notes]
    lines = [f"# Scaling laws: {title}", "",
             f"{len(runs)} finished runs in {len(fit2.budgets)} compute budgets, written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}. C = flops_per_token x tokens "
             "(transformer.training.metrics.flops_per_token: 6 N_matmul + 12 L d T), D = tokens "
             "trained, N = params, loss = the final validation loss (nats per token).", ""]
    if warnings:
        lines += ["**Warnings**", ""] + warnings + [""]
    lines += ["## Runs", ""] + _runs_table(runs) + [""]
    lines += approach2_section(fit2, boot2) + [""] + approach3_section(fit3, boot3)
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
    runs, notes = load_runs(FLAGS.workdir, config_file, FLAGS.config)
    if notes:  # also in the report's warnings; here as one line, before a fit that may fail
        print(f"warning: {'; '.join(notes)}", file=sys.stderr)  # for want of these runs
    path = write_report(FLAGS.workdir, runs, notes, FLAGS.config.experiment,
                        FLAGS.resamples, FLAGS.parametric_resamples)
    with open(path) as f:
        print(f.read())
    print(f"report: {path}")


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "The sweep's experiment file "
                                    "(get_config, get_sweep and BUDGETS).", lock_config=True)
    flags.DEFINE_string("workdir", None, "The sweep's directory (a run per variant and seed).",
                        required=True)
    flags.DEFINE_integer("resamples", 1000, "Bootstrap resamples for approach 2.", lower_bound=1)
    flags.DEFINE_integer("parametric_resamples", 200, "Bootstrap resamples for approach 3.",
                         lower_bound=1)


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(main, _define_flags)
