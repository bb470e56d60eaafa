"""Sweeps: train an experiment's variants one after another and compare them in a report.

    python -m transformer.sweep --config=experiments/ablations/<name>.py --workdir=DIR \
        [--config.KEY=VALUE ...] [--only=NAME,...] [--report_only] [--print_launch]

An experiment file declares its variants next to `get_config()`, as config overrides:

    def get_sweep():
        return sweep.product(sweep.axis("model.position", ["rope", "alibi"]),
                             sweep.axis("seed", [0, 1]))

Every variant is checked (unknown keys, wrong types, invalid values) before anything trains.
Variant NAME trains in DIR/NAME like `transformer.train` would: rerunning the sweep resumes an
interrupted variant and skips finished ones; a variant that fails is reported and the sweep goes
on. At the end (or with `--report_only`) DIR/report.md compares the variants (final metrics,
params, tokens/s, wall time) and links PNG plots of the validation loss against steps and wall
time. `--print_launch` prints one `transformer.train` command per variant to run elsewhere
(e.g. one Cloud TPU VM each) instead of training here.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections

from transformer import checkpoint as checkpoint_lib

PLOTS = (("val_loss_vs_step.png", "validation", "step", "validation loss vs step"),
         ("val_loss_vs_time.png", "validation", "elapsed", "validation loss vs wall time"),
         ("train_loss_vs_step.png", "train", "step", "training loss vs step"))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One run of a sweep: a name (its directory under the sweep's workdir) and the config
    overrides, keyed by dotted path ("model.position")."""

    name: str
    overrides: dict[str, Any]


def _value_name(value) -> str:
    return str(value) if not isinstance(value, float) else f"{value:g}"


def axis(key: str, values: Sequence, names: Sequence[str] | None = None) -> list[Variant]:
    """One variant per value of config key `key`, named `names[i]` or "<leaf>=<value>".

    >>> [v.name for v in axis("model.num_heads", [1, 4])]
    ['num_heads=1', 'num_heads=4']
    """
    if names is not None and len(names) != len(values):
        raise ValueError(f"axis {key!r}: {len(names)} names for {len(values)} values")
    leaf = key.rsplit(".", 1)[-1]
    names = names or [f"{leaf}={_value_name(v)}" for v in values]
    return [Variant(n, {key: v}) for n, v in zip(names, values, strict=True)]


def named(variants: dict[str, dict[str, Any]]) -> list[Variant]:
    """Variants given by name: {"post_ln": {"model.norm_placement": "post"}, ...}."""
    return [Variant(name, dict(overrides)) for name, overrides in variants.items()]


def _merge(parts: Iterable[Variant]) -> Variant:
    parts = list(parts)
    overrides: dict[str, Any] = {}
    for part in parts:
        for key, value in part.overrides.items():
            if key in overrides and overrides[key] != value:
                raise ValueError(f"variants {[p.name for p in parts]} set {key!r} twice, to "
                                 f"{overrides[key]!r} and {value!r}")
            overrides[key] = value
    return Variant(",".join(p.name for p in parts), overrides)


def product(*sweeps: Sequence[Variant]) -> list[Variant]:
    """Every combination of one variant from each sweep (names joined with ",").

    >>> [v.name for v in product(axis("seed", [0, 1]), named({"a": {}, "b": {}}))]
    ['seed=0,a', 'seed=0,b', 'seed=1,a', 'seed=1,b']
    """
    return [_merge(parts) for parts in itertools.product(*sweeps)]


def zipped(*sweeps: Sequence[Variant]) -> list[Variant]:
    """The i-th variants of equally long sweeps, merged (names joined with ",").

    >>> [v.name for v in zipped(axis("model.num_heads", [1, 8]),
    ...                         axis("model.num_kv_heads", [1, 2]))]
    ['num_heads=1,num_kv_heads=1', 'num_heads=8,num_kv_heads=2']
    """
    lengths = {len(s) for s in sweeps}
    if len(lengths) > 1:
        raise ValueError(f"zipped: expected sweeps of equal length, got lengths "
                         f"{[len(s) for s in sweeps]}")
    return [_merge(parts) for parts in zip(*sweeps, strict=True)]


def apply(config: ml_collections.ConfigDict, variant: Variant) -> ml_collections.ConfigDict:
    """A copy of `config` with the variant's overrides (types checked by the config)."""
    config = copy.deepcopy(config)
    for key, value in variant.overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                node = None
                break
            node = node[part]
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            raise ValueError(f"variant {variant.name!r}: unknown config key {key!r}")
        try:
            node[leaf] = value
        except TypeError as error:
            raise ValueError(f"variant {variant.name!r}: {key}={value!r}: {error}") from None
    config.experiment = f"{config.experiment}/{variant.name}"
    return config


def load_sweep(config_file: str) -> list[Variant]:
    """The variants of an experiment file's `get_sweep()`, checked for unique, usable names.
    `config_file` may carry get_config's argument ("file.py:bert"), which get_sweep ignores."""
    path = config_file.split(".py:", 1)[0] + ".py" if ".py:" in config_file else config_file
    spec = importlib.util.spec_from_file_location("sweep_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"{config_file}: expected a get_sweep() function declaring the variants")
    variants = list(module.get_sweep())
    if not variants:
        raise ValueError(f"{config_file}: get_sweep() returned no variants")
    names = [v.name for v in variants]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"variant name {name!r} repeats: expected unique names")
        if not name or name.startswith(".") or os.sep in name:
            raise ValueError(f"variant name {name!r}: expected a non-empty directory name")
    return variants


def variant_configs(config, variants: Sequence[Variant], only: Sequence[str] = ()):
    """{name: config} of the selected variants (all if `only` is empty), each validated."""
    from transformer.configs import validate_config

    unknown = sorted(set(only) - {v.name for v in variants})
    if unknown:
        raise ValueError(f"--only {unknown}: expected variant names "
                         f"{[v.name for v in variants]}")
    configs = {}
    for variant in variants:
        if only and variant.name not in only:
            continue
        configs[variant.name] = apply(config, variant)
        try:
            validate_config(configs[variant.name])
        except ValueError as error:
            raise ValueError(f"variant {variant.name!r}: {error}") from None
    return configs


# --- running --------------------------------------------------------------------------------


def status(workdir: str, config) -> str:
    """finished | failed | partial | new: where the variant in `workdir` stands."""
    summary = os.path.join(workdir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            if json.load(f).get("step", 0) >= config.steps:
                return "finished"
    if os.path.exists(os.path.join(workdir, "error.txt")):
        return "failed"
    if checkpoint_lib.has_checkpoints(workdir):
        return "partial"
    return "new"


# Settings a variant may change between runs of a sweep without invalidating what it trained.
_MAY_CHANGE = {"experiment", "steps", "log_every", "eval_every", "eval_steps", "eval_seq_lens",
               "checkpoint_every", "keep_checkpoints", "fresh_start", "data.prefetch"}
_CONFIG_FILE = "sweep_config.json"


def _flat_dict(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat_dict(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def changed_settings(directory: str, config) -> list[str]:
    """The settings of `config` that differ from those the variant in `directory` was trained
    with (recorded at its first run), other than the harmless ones in _MAY_CHANGE."""
    path = os.path.join(directory, _CONFIG_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        saved = json.load(f)
    current = json.loads(json.dumps(_flat_dict(config.to_dict()), default=str))
    return [f"{key}: trained with {saved.get(key)!r}, now {current.get(key)!r}"
            for key in sorted(set(saved) | set(current))
            if key not in _MAY_CHANGE and saved.get(key) != current.get(key)]


def run(configs: dict[str, ml_collections.ConfigDict], workdir: str,
        explicit: dict[str, set[str]] | None = None) -> bool:
    """Trains each variant in workdir/<name>, skipping finished ones. A variant's exception is
    written to its error.txt and the sweep goes on. Returns False if a signal stopped a
    variant (the sweep stops too; rerun to resume). `explicit`: per variant, the keys the
    command line and the variant set (an init_from=hf:DIR refuses ones that contradict DIR).

    Raises before training anything if a variant's settings differ from those its directory
    was trained with (an edited sweep must not mix results of two configs under one name).
    """
    import jax

    from transformer import train

    for name, config in configs.items():
        changed = changed_settings(os.path.join(workdir, name), config)
        if changed:
            raise ValueError(f"variant {name!r} in {workdir} was trained with other settings ("
                             + "; ".join(changed) + "): expected the same settings; use another "
                             "--workdir or move that variant's directory away")
    for i, (name, config) in enumerate(configs.items()):
        directory = os.path.join(workdir, name)
        state = status(directory, config)
        header = f"[{i + 1}/{len(configs)}] {name}"
        if state == "finished":
            print(f"{header}: finished, skipped", flush=True)
            continue
        print(f"{header}: {'resuming' if state == 'partial' else 'training'} in {directory}",
              flush=True)
        error_file = os.path.join(directory, "error.txt")
        if jax.process_index() == 0 and not os.path.exists(os.path.join(directory, _CONFIG_FILE)):
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, _CONFIG_FILE), "w") as f:
                json.dump(_flat_dict(config.to_dict()), f, indent=1, default=str)
        try:
            result = train.train_and_evaluate(config, directory,
                                              explicit=(explicit or {}).get(name, ()))
        except Exception as error:  # noqa: BLE001 - reported, and the other variants still run
            message = f"{type(error).__name__}: {error}"
            print(f"{header}: failed: {message}", flush=True)
            if jax.process_index() == 0:
                os.makedirs(directory, exist_ok=True)
                with open(error_file, "w") as f:
                    f.write(message + "\n\n" + traceback.format_exc())
            continue
        if os.path.exists(error_file) and jax.process_index() == 0:
            os.remove(error_file)
        if result["summary"]["step"] < config.steps:
            print(f"{header}: stopped at step {result['summary']['step']}; rerun the sweep to "
                  "resume", flush=True)
            return False
    return True


def launch_commands(config_file: str, cli_overrides: dict[str, Any], variants: Sequence[Variant],
                    workdir: str) -> list[str]:
    """One `python -m transformer.train` command per variant: the command line's overrides,
    then the variant's (which win)."""
    commands = []
    for variant in variants:
        overrides = {**cli_overrides, **variant.overrides}
        args = [f"--config={config_file}", f"--workdir={os.path.join(workdir, variant.name)}"]
        args += [f"--config.{key}={_flag_value(value)}" for key, value in overrides.items()]
        commands.append(shlex.join(["python", "-m", "transformer.train", *args]))
    return commands


def _flag_value(value) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_flag_value(v) for v in value) + ("," if len(value) == 1 else "") \
            + ")"
    return str(value)


# --- the report -----------------------------------------------------------------------------


def _records(directory: str) -> list[dict]:
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(directory: str) -> dict:
    path = os.path.join(directory, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


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
    records, summary = _records(directory), _summary(directory)
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
           "val_accuracy": validation[-1]["accuracy"] if validation else None,
           "val_bits_per_byte": validation[-1].get("bits_per_byte") if validation else None,
           "tokens_per_s": _median_speed(train),
           "elapsed": records[-1]["elapsed"] if records else None}
    for key, value in summary.items():  # length extrapolation: val_loss@L; labeled tasks
        if key.startswith("val_loss@") or key in TEST_COLUMNS:
            row[key] = value
    if row["status"] == "failed":
        with open(os.path.join(directory, "error.txt")) as f:
            row["error"] = f.readline().strip()
    return row


def write_report(configs: dict[str, ml_collections.ConfigDict], variants: Sequence[Variant],
                 workdir: str, title: str) -> str:
    """Writes workdir/report.md and the PNG plots; returns the report's path."""
    overrides = {v.name: v.overrides for v in variants}
    rows = [variant_row(name, config, os.path.join(workdir, name))
            for name, config in configs.items()]
    lengths = sorted({int(key.split("@")[1]) for row in rows for key in row
                      if key.startswith("val_loss@")})
    bpb = any(row["val_bits_per_byte"] is not None for row in rows)
    sparse = any(row["active_params"] != row["params"] for row in rows)  # mixtures of experts
    header = ["variant", "overrides", "params"] + ["active params", "moe dropped"] * sparse
    header += ["steps", "train loss", "val loss", "val acc"]
    tests = [key for key in TEST_COLUMNS if any(key in row for row in rows)]
    header += ["val bits/byte"] * bpb + [f"val loss @{n}" for n in lengths]
    header += [TEST_COLUMNS[key] for key in tests]
    header += ["tokens/s", "wall time", "status"]
    lines = [f"# {title}", "",
             f"{len(rows)} variants, written {time.strftime('%Y-%m-%d %H:%M:%S')}. "
             "Final metrics are the last logged; tokens/s is the median over the logs after the "
             "first (which includes compiling); wall time sums the variant's runs (resumes "
             "included).", "",
             "| " + " | ".join(header) + " |",
             "| " + " | ".join("---" if h in ("variant", "overrides", "status") else "---:"
                               for h in header) + " |"]
    for row in rows:
        cells = [row["variant"],
                 ", ".join(f"`{k}={_flag_value(v)}`" for k, v in overrides[row["variant"]].items())
                 or "(base)",
                 f"{row['params']:,}" if row["params"] else "-"]
        if sparse:
            cells += [f"{row['active_params']:,}" if row["active_params"] else "-",
                      "-" if row["moe_dropped"] is None else f"{row['moe_dropped']:.1%}"]
        cells += [str(row["step"]),
                 _fmt(row["train_loss"]), _fmt(row["val_loss"]), _fmt(row["val_accuracy"], 3)]
        cells += [_fmt(row["val_bits_per_byte"])] * bpb
        cells += [_fmt(row.get(f"val_loss@{n}")) for n in lengths]
        cells += [_fmt(row.get(key), 3) for key in tests]
        cells += [_fmt(row["tokens_per_s"], 0) if row["tokens_per_s"] else "-",
                  _duration(row["elapsed"]), row["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [row for row in rows if row["status"] == "failed"]
    if failed:
        lines += ["", "Failed variants (see each one's error.txt):", ""]
        lines += [f"- {row['variant']}: {row['error']}" for row in failed]
    if lengths:
        lines += ["", "`val loss @L`: validation loss with rows of L tokens, for a model trained "
                  "at the config's `seq_len` (length extrapolation); `-` where the model cannot "
                  "run at that length (learned positions beyond their table)."]
    plots = plot_curves({name: _records(os.path.join(workdir, name)) for name in configs},
                        workdir)
    lines += [""] + [f"![{title}]({os.path.basename(path)})" for path, title in plots]
    path = os.path.join(workdir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def plot_curves(records: dict[str, list[dict]], workdir: str) -> list[tuple[str, str]]:
    """PNG line charts of every variant's loss (see PLOTS); returns (path, title) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for filename, split, x_key, title in PLOTS:
        figure, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for name, rows in records.items():
            points = [(r[x_key], r["loss"]) for r in rows
                      if r["split"] == split and x_key in r and math.isfinite(r["loss"])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 20 else None, markersize=3,
                        label=name)
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


# --- command line ---------------------------------------------------------------------------


def main(argv) -> None:
    import jax
    from absl import flags, logging
    from ml_collections import config_flags

    del argv
    logging.set_verbosity(logging.WARNING)
    FLAGS = flags.FLAGS
    config_file = config_flags.get_config_filename(FLAGS["config"])
    variants = load_sweep(config_file)
    configs = variant_configs(FLAGS.config, variants, FLAGS.only or ())
    selected = [v for v in variants if v.name in configs]
    workdir = FLAGS.workdir or os.path.join("runs", FLAGS.config.experiment)
    if FLAGS.print_launch:
        overrides = _flat_dict(config_flags.get_override_values(FLAGS["config"]))
        for command in launch_commands(_config_arg(), overrides, selected, workdir):
            print(command)
        return
    if not FLAGS.report_only:
        print(f"sweep {FLAGS.config.experiment}: {len(configs)} variants in {workdir}: "
              + ", ".join(configs), flush=True)
        os.makedirs(workdir, exist_ok=True)
        cli = set(_flat_dict(config_flags.get_override_values(FLAGS["config"])))
        if not run(configs, workdir, {v.name: cli | set(v.overrides) for v in selected}):
            sys.exit(0)  # stopped by a signal: the interrupted variant saved a checkpoint
    if jax.process_index() == 0:
        path = write_report(configs, selected, workdir, f"Sweep: {FLAGS.config.experiment}")
        with open(path) as f:
            print(f.read())
        print(f"report: {path}")


def _config_arg() -> str:
    """The --config argument as given (with a ":argument" suffix, if any)."""
    for arg in sys.argv[1:]:
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    raise ValueError("--config: expected an experiment file")


if __name__ == "__main__":
    from absl import flags
    from ml_collections import config_flags

    from transformer import cli

    config_flags.DEFINE_config_file("config", None, "Experiment file with get_config() and "
                                    "get_sweep().", lock_config=True)
    flags.mark_flag_as_required("config")
    flags.DEFINE_string("workdir", None, "Sweep directory (default runs/<experiment>); each "
                        "variant trains in WORKDIR/<variant>.")
    flags.DEFINE_list("only", None, "Run (and report) only these variants.")
    flags.DEFINE_bool("report_only", False, "Write the report from what has run; train nothing.")
    flags.DEFINE_bool("print_launch", False, "Print one train command per variant instead of "
                      "training (to run each on its own machine).")
    cli.run(main)
