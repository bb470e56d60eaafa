"""A sweep's report: each run's row (what its directory holds: status, final metrics, size,
speed), the tables of report.md (one seed, or statistics over seeds and the differences from the
baseline) and the plots it links."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

from transformer.sweeps.definition import Variant, check_baseline, flag_value, run_names
from transformer.sweeps.plots import plot_curves
from transformer.sweeps.statistics import (
    BOOTSTRAP_RESAMPLES,
    Estimate,
    estimate,
    finite,
    paired_difference,
    verdict,
    window_bootstrap,
    window_pairs,
)
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import evaluation, metrics, progress


def status(workdir: str, config) -> str:
    """finished | failed | partial | training | new: where the variant in `workdir` stands
    (training: it has logged metrics but saved no complete checkpoint yet, so is under way,
    or was stopped before its first and would start again from step 0)."""
    summary = os.path.join(workdir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            if not progress.unfinished(json.load(f), config.steps):
                return "finished"
    if os.path.exists(os.path.join(workdir, "error.txt")):
        return "failed"
    if checkpoint_lib.complete_steps(workdir):
        return "partial"
    log = os.path.join(workdir, "metrics.jsonl")
    return "training" if os.path.exists(log) and os.path.getsize(log) else "new"


def read_records(directory: str) -> list[dict]:
    """The records of `directory`'s metrics.jsonl, without a last line a killed run left
    half-written (`metrics.read_records`)."""
    return [record for _, record in
            metrics.read_records(os.path.join(directory, "metrics.jsonl"))]


def read_summary(directory: str) -> dict:
    path = os.path.join(directory, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:  # training writes it whole: damaged since
            raise ValueError(f"{path}: not JSON ({error}): expected the summary the run "
                             "wrote at its end") from None


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# Labeled tasks (fine-tuning) evaluate the held-out test split at the end of training.
TEST_COLUMNS = {"test_accuracy": "test acc", "test_macro_f1": "test macro-F1",
                "test_exact_match": "test exact match"}


def _median_speed(train: list[dict]) -> float | None:
    """Median tokens/s of the train records that timed a window of steps (the log of a run's
    first step, which compiles, times none)."""
    rates = [r["tokens_per_s"] for r in train if "tokens_per_s" in r]
    return statistics.median(rates) if rates else None


def variant_row(name: str, config, directory: str) -> dict[str, Any]:
    """One report row: final metrics, params, tokens/s (median over the logs) and wall time."""
    records, summary = read_records(directory), read_summary(directory)
    train = [r for r in records if r["split"] == "train"]
    validation = [r for r in records if r["split"] == "validation"]
    row = {"variant": name, "status": status(directory, config),
           "params": summary.get("num_params"),
           "active_params": summary.get("active_params", summary.get("num_params")),
           # Mixtures of experts: the last logged share of (token, expert) choices dropped.
           "moe_dropped": train[-1].get("moe_dropped") if train else None,
           "step": (train[-1]["step"] if train else 0),
           "train_loss": train[-1]["loss"] if train else None,
           "val_loss": validation[-1]["loss"] if validation else None,
           # (a diverged model's argmax accuracy, of NaN logits, is no measurement)
           "val_accuracy": validation[-1]["accuracy"] if validation and
           math.isfinite(validation[-1]["loss"]) else None,
           "val_bits_per_byte": validation[-1].get("bits_per_byte") if validation else None,
           # Mixtures of experts: max over mean tokens per expert (the worst layer's), averaged
           # over the logged steps and the last one.
           **({"moe_imbalance_mean": statistics.fmean(r["moe_imbalance"] for r in train),
               "moe_imbalance": train[-1]["moe_imbalance"]}
              if train and all("moe_imbalance" in r for r in train) else {}),
           "tokens_per_s": _median_speed(train),
           "elapsed": records[-1]["elapsed"] if records else None}
    for key, value in summary.items():  # length extrapolation: val_loss@L; labeled tasks
        if key.startswith("val_loss@") or key in TEST_COLUMNS:
            row[key] = value
    if row["status"] == "failed":
        with open(os.path.join(directory, "error.txt")) as f:
            row["error"] = f.readline().strip()
    # The final validation pass's windows (window bootstrap), if they are that step's.
    windows = evaluation.load_windows(directory) if row["status"] == "finished" else None
    row["windows"] = windows if windows and validation and \
        windows["step"] == validation[-1]["step"] else None
    return row


def _metric_columns(rows: Sequence[dict]) -> list[tuple[str, str, int]]:
    """(row key, header, digits) of the report's metric columns that the rows call for."""
    lengths = sorted({int(key.split("@")[1]) for row in rows for key in row
                      if key.startswith("val_loss@")})
    columns = [("train_loss", "train loss", 4), ("val_loss", "val loss", 4),
               ("val_accuracy", "val acc", 3)]
    if any(row["val_bits_per_byte"] is not None for row in rows):
        columns.append(("val_bits_per_byte", "val bits/byte", 4))
    columns += [(f"val_loss@{n}", f"val loss @{n}", 4) for n in lengths]
    columns += [(key, header, 2) for key, header in (
        ("moe_imbalance_mean", "max/mean load, mean over training"),
        ("moe_imbalance", "max/mean load, last")) if any(key in row for row in rows)]
    columns += [(key, header, 3) for key, header in TEST_COLUMNS.items()
                if any(key in row for row in rows)]
    return columns


def _table_head(header: Sequence[str]) -> list[str]:
    return ["| " + " | ".join(header) + " |",
            "| " + " | ".join("---" if h in ("variant", "overrides", "status") else "---:"
                              for h in header) + " |"]


def _overrides_cell(overrides: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={flag_value(v)}`" for k, v in overrides.items()) or "(base)"


def _run_table(rows: Sequence[dict], overrides: dict[str, dict], columns) -> list[str]:
    """One line per run (a variant, or one seed of it): its final metrics, size and speed."""
    sparse = any(row["active_params"] != row["params"] for row in rows)  # mixtures of experts
    header = ["variant", "overrides", "params"] + ["active params", "moe dropped"] * sparse
    header += ["steps"] + [title for _, title, _ in columns] + ["tokens/s", "wall time", "status"]
    lines = _table_head(header)
    for row in rows:
        cells = [row["variant"], _overrides_cell(overrides[row["variant"]]),
                 f"{row['params']:,}" if row["params"] else "-"]
        if sparse:
            cells += [f"{row['active_params']:,}" if row["active_params"] else "-",
                      "-" if row["moe_dropped"] is None else f"{row['moe_dropped']:.1%}"]
        cells += [str(row["step"])] + [_fmt(row.get(key), digits) for key, _, digits in columns]
        cells += [_fmt(row["tokens_per_s"], 0) if row["tokens_per_s"] else "-",
                  _duration(row["elapsed"]), row["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fewer(value: Estimate | None, of: int | None) -> str:
    """" (n=K)" where the estimate is over K values, fewer than the `of` seeds it stands for
    (the others' missing or non-finite); else nothing."""
    return f" (n={value.n})" if value is not None and of is not None and value.n < of else ""


def _fmt_estimate(value: Estimate | None, digits: int = 4, of: int | None = None) -> str:
    """"mean ± std [low, high]" (the mean alone from one seed), " (n=K)" where K < `of`."""
    if value is None:
        return "-"
    if value.std is None:
        return _fmt(value.mean, digits) + _fewer(value, of)
    return (f"{_fmt(value.mean, digits)} ± {_fmt(value.std, digits)} "
            f"[{_fmt(value.low, digits)}, {_fmt(value.high, digits)}]" + _fewer(value, of))


def _fmt_difference(value: Estimate | None, digits: int = 4, verdicts: bool = True,
                    of: int | None = None) -> str:
    """"+mean [low, high] within noise|differs" (the mean alone from one pair of seeds; no
    verdict with `verdicts=False`), " (n=K)" where it pairs K < `of` seeds."""
    def signed(x):
        return f"{x:+.{digits}f}" if x is not None and math.isfinite(x) else "-"

    if value is None:
        return "-"
    if value.std is None:
        return signed(value.mean) + _fewer(value, of)
    cell = f"{signed(value.mean)} [{signed(value.low)}, {signed(value.high)}]"
    return (f"{cell} {verdict(value)}" if verdicts else cell) + _fewer(value, of)


def _nonfinite_notes(rows: Sequence[dict], columns) -> list[str]:
    """A note naming each finished run whose final value of a metric column is non-finite
    (diverged): the statistics leave it out, so the cells say their n."""
    lines = []
    for row in rows:
        bad = [f"{title} {row[key]}" for key, title, _ in columns
               if row.get(key) is not None and not finite(row[key])]
        if bad and row["status"] == "finished":
            lines.append(f"- {row['variant']}: " + ", ".join(bad))
    if not lines:
        return []
    return ["", "Non-finite final values (a diverged run?), left out of the statistics and "
            "differences above as missing values are (a non-finite val loss takes its val acc "
            "along); a cell over fewer of a variant's finished seeds says (n=K):", ""] + lines


def _budget_note(configs: dict[str, ml_collections.ConfigDict], baseline: str) -> list[str]:
    """A line naming the variants that train other steps, or other tokens (steps x batch_size
    x seq_len), than the baseline: their differences are not at equal training."""
    def budget(config):
        return config.steps, config.steps * config.batch_size * config.seq_len

    other = [f"{name} ({steps:,} steps, {tokens:,} tokens)"
             for name, (steps, tokens) in ((n, budget(c)) for n, c in configs.items())
             if (steps, tokens) != budget(configs[baseline])]
    if not other:
        return []
    steps, tokens = budget(configs[baseline])
    return ["", f"Trained other steps or tokens than the baseline `{baseline}` ({steps:,} "
            f"steps, {tokens:,} tokens): " + "; ".join(other) + "."]


def _seed_status(rows: Sequence[dict]) -> str:
    counts = {state: sum(row["status"] == state for row in rows)
              for state in dict.fromkeys(row["status"] for row in rows)}
    return "finished" if list(counts) == ["finished"] else \
        ", ".join(f"{count} {state}" for state, count in counts.items())


def _seed_tables(runs: dict[str, list[dict]], overrides: dict[str, dict], columns,
                 configs: dict[str, ml_collections.ConfigDict], baseline: str) -> list[str]:
    """The statistics over the seeds (one line per variant), then each variant's difference
    from the baseline, paired by seed. Only finished seeds count, and of those only finite
    values (a cell over fewer says its n)."""
    seeds = len(next(iter(runs.values())))
    done = {name: {k: row for k, row in enumerate(rows) if row["status"] == "finished"}
            for name, rows in runs.items()}
    header = ["variant", "overrides", "params", "seeds"] + [title for _, title, _ in columns]
    lines = [f"{len(runs)} variants x {seeds} seeds, written {time.strftime('%Y-%m-%d %H:%M:%S')}."
             f" Run NAME/seed_K trained with seed=K (its init, dropout and data order): seed K "
             "gives every variant the same data. A metric is the mean ± std over the variant's "
             "finished seeds [its 95% confidence interval: Student t, n - 1 degrees of freedom], "
             "(n=K) where only K of them have a finite value; "
             "tokens/s and wall time are means over those seeds.", ""]
    lines += _table_head(header + ["tokens/s", "wall time", "status"])
    for name, rows in runs.items():
        finished = list(done[name].values())
        speed, elapsed = (estimate([row[key] for row in finished])
                          for key in ("tokens_per_s", "elapsed"))
        cells = [name, _overrides_cell(overrides[name]),
                 f"{rows[0]['params']:,}" if rows[0]["params"] else "-", f"{len(finished)}/{seeds}"]
        cells += [_fmt_estimate(estimate([row.get(key) for row in finished]), digits,
                                of=len(finished)) for key, _, digits in columns]
        cells += [_fmt(speed.mean, 0) if speed else "-", _duration(elapsed and elapsed.mean),
                  _seed_status(rows)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"## Difference from the baseline `{baseline}`", "",
              "Each variant minus the baseline, seed by seed (same seed, same data), over the "
              "seeds both finished with a finite value: the mean difference [its 95% t interval], "
              "(n=K) where only K of those both finished. **within noise**: "
              "the interval includes 0, so other seeds could well reverse the sign; **differs**: "
              "it excludes 0.", ""]
    # The verdict is the seed interval's: the window interval holds the models fixed.
    windows, notes = _window_cells({name: dict(enumerate(rows)) for name, rows in runs.items()},
                                   baseline, verdicts=False)
    lines += _table_head(["variant"] + [title for _, title, _ in columns] + [SEEDS_WINDOW_COLUMN])
    for name in runs:
        both = len(set(done[name]) & set(done[baseline]))  # the seeds both finished
        cells = [name] + [
            "baseline" if name == baseline else _fmt_difference(paired_difference(
                {k: row.get(key) for k, row in done[name].items()},
                {k: row.get(key) for k, row in done[baseline].items()}), digits, of=both)
            for key, _, digits in columns]
        lines.append("| " + " | ".join(cells + [windows[name]]) + " |")
    lines += _budget_note(configs, baseline)
    lines += _nonfinite_notes([row for rows in runs.values() for row in rows], columns)
    return lines + _window_notes(notes, SEEDS_WINDOW_COLUMN) + [
        "", "With several seeds the verdict is the seed interval's alone: seeds can disagree "
        "in sign while every window interval excludes 0."]


WINDOW_COLUMN = "val loss (window bootstrap)"
# with seeds: the same measurement, no verdict (the seed interval gives it)
SEEDS_WINDOW_COLUMN = "val loss over windows, models fixed (no verdict)"


def _window_cells(runs: dict[str, dict[int, dict]], baseline: str, verdicts: bool = True
                  ) -> tuple[dict[str, str], list[str]]:
    """Per variant, the window bootstrap cell of its val loss minus the baseline's (`runs`: per
    variant, its rows by seed); and a note for every run that could not be paired."""
    base = {k: row["windows"] for k, row in runs[baseline].items()}
    cells, notes = {baseline: "baseline"}, []
    for name, rows in runs.items():
        if name == baseline:
            continue
        pairs, refused = window_pairs({k: row["windows"] for k, row in rows.items()}, base)
        cells[name] = _fmt_difference(window_bootstrap(pairs), verdicts=verdicts) \
            if pairs else "-"
        notes += [f"- {name}, {note}" for note in refused]
    return cells, notes


def _window_notes(notes: list[str], column: str = WINDOW_COLUMN) -> list[str]:
    lines = ["", f"`{column}`: the same difference of validation loss measured over the "
             "final evaluation's windows, with a 95% interval from "
             f"{BOOTSTRAP_RESAMPLES:,} paired bootstrap resamples of the windows (the same "
             "windows for both runs of a seed; with several seeds, each seed's difference and "
             "their mean). It holds the trained models fixed: it asks whether the difference on "
             "this validation set exceeds its sampling noise over windows, and leaves out "
             "seed-to-seed variation, so it is narrower and a lower bound on the uncertainty."]
    if notes:
        lines += ["", "Not paired over windows:", ""] + notes
    return lines


def _window_table(runs: dict[str, list[dict]], configs, baseline: str) -> list[str]:
    """One seed: each variant's val loss minus the baseline's, with its window bootstrap."""
    cells, notes = _window_cells({name: {configs[name].seed: rows[0]}
                                  for name, rows in runs.items()}, baseline)
    lines = ["", f"## Difference from the baseline `{baseline}`", ""]
    lines += _table_head(["variant", WINDOW_COLUMN])
    lines += [f"| {name} | {cells[name]} |" for name in runs]
    return lines + _budget_note(configs, baseline) + _window_notes(notes)


def write_report(configs: dict[str, ml_collections.ConfigDict], variants: Sequence[Variant],
                 workdir: str, title: str, seeds: int = 1, baseline: str | None = None) -> str:
    """Writes workdir/report.md and the PNG plots; returns the report's path. With seeds > 1:
    statistics over the seeds and the differences from `baseline` (default: the first)."""
    overrides = {v.name: v.overrides for v in variants}
    runs = {name: [variant_row(run, config, os.path.join(workdir, run))
                   for run in run_names(name, seeds)] for name, config in configs.items()}
    if seeds > 1:
        overrides.update({f"{name}/seed_{k}": {**overrides[name], "seed": k}
                          for name in configs for k in range(seeds)})
    rows = [row for variant_rows in runs.values() for row in variant_rows]
    columns = _metric_columns(rows)
    lines = [f"# {title}", ""]
    if seeds == 1:
        lines += [f"{len(rows)} variants, written {time.strftime('%Y-%m-%d %H:%M:%S')}. "
                  "Final metrics are the last logged; tokens/s is the median over the train logs "
                  "that timed training steps (compiling, evaluations and saves are in none); "
                  "wall time is the run's last logged `elapsed`: its starts (resumes) summed, "
                  "each without its start-up.", ""] + _run_table(rows, overrides, columns)
        if len(runs) > 1:
            lines += _window_table(runs, configs, check_baseline(baseline, list(runs)))
    else:
        lines += _seed_tables(runs, overrides, columns, configs,
                              check_baseline(baseline, list(runs)))
        lines += ["", "## Per seed", "", "Final metrics are the last logged; tokens/s is the "
                  "median over the train logs that timed training steps (compiling, evaluations "
                  "and saves are in none); wall time is the run's last logged `elapsed`: its "
                  "starts (resumes) summed, each without its start-up.",
                  ""] + _run_table(rows, overrides, columns)
    failed = [row for row in rows if row["status"] == "failed"]
    if failed:
        lines += ["", "Failed variants (see each one's error.txt):", ""]
        lines += [f"- {row['variant']}: {row['error']}" for row in failed]
    if any(key.startswith("val_loss@") for key, _, _ in columns):
        lines += ["", "`val loss @L`: validation loss with rows of L tokens, for a model trained "
                  "at the config's `seq_len` (length extrapolation); `-` where the model cannot "
                  "run at that length (learned positions beyond their table)."]
    # A variant's curves are its finished seeds' (as its tables), or while none has finished
    # its runs so far: an unfinished seed would cut the mean's curve at its last step.
    plots = plot_curves({name: [read_records(os.path.join(workdir, row["variant"])) for row in (
        [row for row in rows if row["status"] == "finished"] or rows)]
        for name, rows in runs.items()}, workdir)
    lines += [""] + [f"![{title}]({os.path.basename(path)})" for path, title in plots]
    path = os.path.join(workdir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
