"""A sweep's plots: every variant's loss against steps and wall time (PNG, matplotlib);
a variant run under several seeds is drawn as their mean with a min-to-max band."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence

PLOTS = (("val_loss_vs_step.png", "validation", "step", "validation loss vs step"),
         ("val_loss_vs_time.png", "validation", "elapsed", "validation loss vs wall time"),
         ("train_loss_vs_step.png", "train", "step", "training loss vs step"))



def _mean_curve(runs: Sequence[list[dict]], split: str, x_key: str):
    """(x, mean, min, max) over the runs of `split`'s loss at each step all of them logged (x:
    x_key's mean); runs without such records are left out."""
    by_step = [{r["step"]: r for r in rows
                if r["split"] == split and x_key in r and math.isfinite(r["loss"])}
               for rows in runs]
    by_step = [steps for steps in by_step if steps]
    common = sorted(set.intersection(*map(set, by_step))) if by_step else []
    losses = [[steps[s]["loss"] for steps in by_step] for s in common]
    return ([statistics.fmean(steps[s][x_key] for steps in by_step) for s in common],
            [statistics.fmean(ys) for ys in losses], [min(ys) for ys in losses],
            [max(ys) for ys in losses])


def plot_curves(records: dict[str, list[list[dict]]], workdir: str) -> list[tuple[str, str]]:
    """PNG line charts of every variant's loss (see PLOTS); returns (path, title) pairs.
    `records`: per variant, the metrics records of each of its runs (one per seed); a variant
    with several runs is drawn as their mean with a band from their min to their max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = max(len(runs) for runs in records.values())
    written = []
    for filename, split, x_key, title in PLOTS:
        if seeds > 1:
            title += f" (mean of {seeds} seeds, band: min to max)"
        figure, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for name, runs in records.items():
            if len(runs) == 1:
                points = [(r[x_key], r["loss"]) for r in runs[0]
                          if r["split"] == split and x_key in r and math.isfinite(r["loss"])]
                xs, ys = zip(*points, strict=True) if points else ((), ())
            else:
                xs, ys, low, high = _mean_curve(runs, split, x_key)
            if xs:
                line, = ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3,
                                label=name)
                if len(runs) > 1:
                    ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2)
        ax.set_xlabel("step" if x_key == "step" else "wall time (s)")
        ax.set_ylabel(f"{split} loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        path = os.path.join(workdir, filename)
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        written.append((path, title))
    return written
