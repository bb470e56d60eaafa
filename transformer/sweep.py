"""Sweeps: train an experiment's variants one after another and compare them in a report.

    python -m transformer.sweep --config=experiments/ablations/<name>.py --workdir=DIR \
        [--config.KEY=VALUE ...] [--only=NAME,...] [--seeds=N] [--baseline=NAME] \
        [--batched_seeds] [--report_only] [--print_launch]

An experiment file declares its variants next to `get_config()`, as config overrides:

    def get_sweep():
        return sweep.product(sweep.axis("model.position", ["rope", "alibi"]),
                             sweep.axis("model.num_heads", [2, 4]))

    def get_seeds():      # optional: the default of --seeds
        return 3

    def get_baseline():   # optional: the default of --baseline (else the first variant)
        return "position=rope,num_heads=2"

Every variant is checked (unknown keys, wrong types, invalid values) before anything trains.
Variant NAME trains in DIR/NAME like `transformer.train` would: rerunning the sweep resumes an
interrupted variant and skips finished ones; a variant that fails is reported and the sweep goes
on. At the end (or with `--report_only`) DIR/report.md compares the variants (final metrics,
params, tokens/s, wall time) and links PNG plots of the validation loss against steps and wall
time. `--print_launch` prints one `transformer.train` command per variant to run elsewhere
(e.g. one Cloud TPU VM each) instead of training here.

Seeds. With `--seeds=N` (N > 1) every variant runs N times, in DIR/NAME/seed_K with
config.seed = K for K = 0..N-1 (each such run is resumed and skipped like a variant). The seed
sets everything random in a run: the init (`jax.random.key(seed)`), the per-step randomness
such as dropout (that key folded with the step), the training data's order (each epoch's seeded
document order, window offset and window order; a mixture's source blocks; the MLM and span
corruption noise) and which validation windows `eval_steps` samples. So seed K feeds every
variant the same data, and the report compares variants seed by seed: mean ± std and a 95%
Student-t interval per metric, and each variant's difference from the baseline, paired by seed,
with its t interval. With one seed (the default) the runs keep the config's own seed, in DIR/NAME.

Batched seeds. With `--batched_seeds`, a variant's N seed runs train together as one jitted
program (transformer.batched): each still in DIR/NAME/seed_K, with what a separate run writes.

Windows. Each run saves its final validation pass's per-window losses (WORKDIR/val_windows.npz,
`evaluation.save_windows`); the report adds each variant's difference from the baseline over
those windows with a paired bootstrap interval (`window_bootstrap`), for runs whose windows are
the same (`window_pairs`), and a note for those that are not.
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

from transformer.training import checkpoint as checkpoint_lib
from transformer.training import evaluation

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
    if "wandb" in config:  # W&B groups a variant's seeds
        config.wandb.variant = variant.name.rsplit("/seed_", 1)[0]
    return config


def _experiment(config_file: str):
    """The experiment file as a module. `config_file` may carry get_config's argument
    ("file.py:bert"), which the sweep's functions ignore."""
    path = config_file.split(".py:", 1)[0] + ".py" if ".py:" in config_file else config_file
    spec = importlib.util.spec_from_file_location("sweep_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sweep(config_file: str) -> list[Variant]:
    """The variants of an experiment file's `get_sweep()`, checked for unique, usable names."""
    module = _experiment(config_file)
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


def load_options(config_file: str, seeds: int | None = None, baseline: str | None = None
                 ) -> tuple[int, str | None]:
    """(number of seeds, baseline variant): the command line's when given, else the experiment
    file's `get_seeds()` / `get_baseline()` if it has them, else 1 and None (the first)."""
    module = _experiment(config_file)
    where = "--seeds"
    if seeds is None and hasattr(module, "get_seeds"):
        seeds, where = module.get_seeds(), f"{config_file}: get_seeds()"
    seeds = 1 if seeds is None else seeds
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"{where}={seeds!r}: expected an int >= 1 (the number of seeds)")
    if baseline is None and hasattr(module, "get_baseline"):
        baseline = module.get_baseline()
    return seeds, baseline


def seed_variants(variants: Sequence[Variant], seeds: int) -> list[Variant]:
    """With seeds = N > 1, each variant NAME N times: "NAME/seed_K" setting seed=K, K = 0..N-1
    (the directory DIR/NAME/seed_K); with one seed, the variants themselves.

    >>> [v.name for v in seed_variants(named({"a": {}}), 2)]
    ['a/seed_0', 'a/seed_1']
    """
    if seeds == 1:
        return list(variants)
    for variant in variants:
        if "seed" in variant.overrides:
            raise ValueError(f"variant {variant.name!r} sets seed={variant.overrides['seed']!r} "
                             f"and --seeds={seeds} sets seeds 0..{seeds - 1}: expected one of "
                             "the two")
    return [Variant(f"{v.name}/seed_{k}", {**v.overrides, "seed": k})
            for v in variants for k in range(seeds)]


def check_layout(workdir: str, names: Sequence[str], seeds: int) -> None:
    """Refuses a sweep directory whose runs were made with one seed when `seeds` > 1, or with
    several when it is 1 (the report would find no runs, and the layouts would mix)."""
    for name in names:
        directory = os.path.join(workdir, name)
        if seeds == 1 and os.path.isdir(os.path.join(directory, "seed_0")):
            raise ValueError(f"{directory} holds runs of several seeds (seed_0, ...): expected "
                             "--seeds=N (or get_seeds()) with their number")
        if seeds > 1 and os.path.exists(os.path.join(directory, _CONFIG_FILE)):
            raise ValueError(f"{directory} holds a run of one seed: expected --seeds=1, or "
                             f"another --workdir for --seeds={seeds}")


def check_baseline(baseline: str | None, names: Sequence[str]) -> str:
    """The baseline variant's name: `baseline` if it is one of `names`, the first if None."""
    if baseline is None:
        return names[0]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} (--baseline or get_baseline()): expected one of "
                         f"the variants {list(names)}")
    return baseline


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
               "checkpoint_every", "keep_checkpoints", "fresh_start", "data.prefetch",
               *(f"profile.{key}" for key in ("start_step", "num_steps", "all_hosts")),
               *(f"wandb.{key}" for key in ("project", "entity", "name", "mode", "variant"))}
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
    with (recorded at its first run), other than the harmless ones in _MAY_CHANGE. A key the
    record lacks was added to the code since: at its default it is what that run did (a new
    key's default keeps the old behaviour), so only another value is a change."""
    from transformer.configs import base_config

    path = os.path.join(directory, _CONFIG_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        saved = json.load(f)
    as_json = lambda config: json.loads(json.dumps(_flat_dict(config.to_dict()), default=str))
    current, defaults = as_json(config), as_json(base_config())
    return [f"{key}: trained with {saved.get(key)!r}, now {current.get(key)!r}"
            for key in sorted(set(saved) | set(current))
            if key not in _MAY_CHANGE and saved.get(key) != current.get(key)
            and not (key not in saved and key in defaults and current[key] == defaults[key])]


def run(configs: dict[str, ml_collections.ConfigDict], workdir: str,
        explicit: dict[str, set[str]] | None = None, batched: bool = False) -> bool:
    """Trains each variant in workdir/<name>, skipping finished ones. A variant's exception is
    written to its error.txt and the sweep goes on. Returns False if a signal stopped a
    variant (the sweep stops too; rerun to resume). `explicit`: per variant, the keys the
    command line and the variant set (an init_from=hf:DIR refuses ones that contradict DIR).
    `batched`: the seed runs NAME/seed_K of a variant train together (transformer.batched).

    Raises before training anything if a variant's settings differ from those its directory
    was trained with (an edited sweep must not mix results of two configs under one name).
    """
    for name, config in configs.items():
        changed = changed_settings(os.path.join(workdir, name), config)
        if changed:
            raise ValueError(f"variant {name!r} in {workdir} was trained with other settings ("
                             + "; ".join(changed) + "): expected the same settings; use another "
                             "--workdir or move that variant's directory away")
    names = list(configs)
    groups: dict[str, list[str]] = {}  # with `batched`, a variant's seed runs form one group
    for name in names:
        groups.setdefault(name.rsplit("/seed_", 1)[0] if batched else name, []).append(name)
    for group in groups.values():
        todo = [name for name in group
                if _announce(f"[{names.index(name) + 1}/{len(names)}] {name}", configs[name],
                             os.path.join(workdir, name))]
        if not todo:
            continue
        for name, result in _train(todo, configs, workdir, explicit or {}).items():
            header = f"[{names.index(name) + 1}/{len(names)}] {name}"
            error_file = os.path.join(workdir, name, "error.txt")
            if isinstance(result, Exception):
                message = f"{type(result).__name__}: {result}"
                print(f"{header}: failed: {message}", flush=True)
                if _is_main():
                    os.makedirs(os.path.dirname(error_file), exist_ok=True)
                    with open(error_file, "w") as f:
                        f.write(message + "\n\n" + "".join(traceback.format_exception(result)))
                continue
            if os.path.exists(error_file) and _is_main():
                os.remove(error_file)
            if result["summary"]["step"] < configs[name].steps:
                print(f"{header}: stopped at step {result['summary']['step']}; rerun the sweep "
                      "to resume", flush=True)
                return False
    return True


def _is_main() -> bool:
    import jax

    return jax.process_index() == 0


def _announce(header: str, config, directory: str) -> bool:
    """Prints what becomes of a run and writes its settings file; whether it is to train."""
    state = status(directory, config)
    if state == "finished":
        print(f"{header}: finished, skipped", flush=True)
        return False
    print(f"{header}: {'resuming' if state == 'partial' else 'training'} in {directory}",
          flush=True)
    if _is_main() and not os.path.exists(os.path.join(directory, _CONFIG_FILE)):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, _CONFIG_FILE), "w") as f:
            json.dump(_flat_dict(config.to_dict()), f, indent=1, default=str)
    return True


def _train(names: list[str], configs, workdir: str, explicit: dict) -> dict[str, Any]:
    """Trains the runs `names` (several: one batched group); per run, train_and_evaluate's
    result or the exception it raised."""
    from transformer import batched, train

    directories = [os.path.join(workdir, name) for name in names]
    try:
        if len(names) == 1:
            return {names[0]: train.train_and_evaluate(configs[names[0]], directories[0],
                                                       explicit=explicit.get(names[0], ()))}
        return dict(zip(names, batched.train_seeds(
            [configs[name] for name in names], directories, explicit.get(names[0], ())),
            strict=True))
    except Exception as error:  # noqa: BLE001 - reported, and the other variants still run
        return dict.fromkeys(names, error)


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


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean over n seeds, its standard deviation (ddof=1) and its 95% Student-t confidence
    interval [low, high] = mean -/+ t(0.975, n - 1) * std / sqrt(n); None with one seed."""

    n: int
    mean: float
    std: float | None = None
    low: float | None = None
    high: float | None = None


def estimate(values: Sequence[float | None], level: float = 0.95) -> Estimate | None:
    """The Estimate of the values given (None ones left out); None when there are none."""
    import numpy as np
    from scipy import stats

    x = np.asarray([v for v in values if v is not None], np.float64)
    if len(x) == 0:
        return None
    if len(x) == 1:
        return Estimate(1, float(x[0]))
    mean, std = float(x.mean()), float(x.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, len(x) - 1)) * std / math.sqrt(len(x))
    return Estimate(len(x), mean, std, mean - half, mean + half)


def paired_difference(values: dict[int, float | None], baseline: dict[int, float | None]
                      ) -> Estimate | None:
    """The Estimate of variant minus baseline, seed by seed, over the seeds both have a value
    for (the same seed is the same data, so the pair differs only by the variant)."""
    seeds = [k for k in sorted(set(values) & set(baseline))
             if values[k] is not None and baseline[k] is not None]
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
    the same tokens per window."""
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
        else:
            pairs.append((mine, theirs))
    return pairs, notes



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
    columns += [(key, header, 3) for key, header in TEST_COLUMNS.items()
                if any(key in row for row in rows)]
    return columns


def _table_head(header: Sequence[str]) -> list[str]:
    return ["| " + " | ".join(header) + " |",
            "| " + " | ".join("---" if h in ("variant", "overrides", "status") else "---:"
                              for h in header) + " |"]


def _overrides_cell(overrides: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={_flag_value(v)}`" for k, v in overrides.items()) or "(base)"


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


def _fmt_estimate(value: Estimate | None, digits: int = 4) -> str:
    """"mean ± std [low, high]" (the mean alone from one seed)."""
    if value is None:
        return "-"
    if value.std is None:
        return _fmt(value.mean, digits)
    return (f"{_fmt(value.mean, digits)} ± {_fmt(value.std, digits)} "
            f"[{_fmt(value.low, digits)}, {_fmt(value.high, digits)}]")


def _fmt_difference(value: Estimate | None, digits: int = 4) -> str:
    """"+mean [low, high] within noise|differs" (the mean alone from one pair of seeds)."""
    def signed(x):
        return f"{x:+.{digits}f}" if x is not None and math.isfinite(x) else "-"

    if value is None:
        return "-"
    if value.std is None:
        return signed(value.mean)
    return f"{signed(value.mean)} [{signed(value.low)}, {signed(value.high)}] {verdict(value)}"


def _seed_status(rows: Sequence[dict]) -> str:
    counts = {state: sum(row["status"] == state for row in rows)
              for state in dict.fromkeys(row["status"] for row in rows)}
    return "finished" if list(counts) == ["finished"] else \
        ", ".join(f"{count} {state}" for state, count in counts.items())


def _seed_tables(runs: dict[str, list[dict]], overrides: dict[str, dict], columns,
                 baseline: str) -> list[str]:
    """The statistics over the seeds (one line per variant), then each variant's difference
    from the baseline, paired by seed. Only finished seeds count."""
    seeds = len(next(iter(runs.values())))
    done = {name: {k: row for k, row in enumerate(rows) if row["status"] == "finished"}
            for name, rows in runs.items()}
    header = ["variant", "overrides", "params", "seeds"] + [title for _, title, _ in columns]
    lines = [f"{len(runs)} variants x {seeds} seeds, written {time.strftime('%Y-%m-%d %H:%M:%S')}."
             f" Run NAME/seed_K trained with seed=K (its init, dropout and data order): seed K "
             "gives every variant the same data. A metric is the mean ± std over the variant's "
             "finished seeds [its 95% confidence interval: Student t, n - 1 degrees of freedom]; "
             "tokens/s and wall time are means over those seeds.", ""]
    lines += _table_head(header + ["tokens/s", "wall time", "status"])
    for name, rows in runs.items():
        finished = list(done[name].values())
        speed, elapsed = (estimate([row[key] for row in finished])
                          for key in ("tokens_per_s", "elapsed"))
        cells = [name, _overrides_cell(overrides[name]),
                 f"{rows[0]['params']:,}" if rows[0]["params"] else "-", f"{len(finished)}/{seeds}"]
        cells += [_fmt_estimate(estimate([row.get(key) for row in finished]), digits)
                  for key, _, digits in columns]
        cells += [_fmt(speed.mean, 0) if speed else "-", _duration(elapsed and elapsed.mean),
                  _seed_status(rows)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"## Difference from the baseline `{baseline}`", "",
              "Each variant minus the baseline, seed by seed (same seed, same data), over the "
              "seeds both finished: the mean difference [its 95% t interval]. **within noise**: "
              "the interval includes 0, so other seeds could well reverse the sign; **differs**: "
              "it excludes 0.", ""]
    windows, notes = _window_cells({name: dict(enumerate(rows)) for name, rows in runs.items()},
                                   baseline)
    lines += _table_head(["variant"] + [title for _, title, _ in columns] + [WINDOW_COLUMN])
    for name in runs:
        cells = [name] + [
            "baseline" if name == baseline else _fmt_difference(paired_difference(
                {k: row.get(key) for k, row in done[name].items()},
                {k: row.get(key) for k, row in done[baseline].items()}), digits)
            for key, _, digits in columns]
        lines.append("| " + " | ".join(cells + [windows[name]]) + " |")
    return lines + _window_notes(notes)


WINDOW_COLUMN = "val loss (window bootstrap)"


def _window_cells(runs: dict[str, dict[int, dict]], baseline: str
                  ) -> tuple[dict[str, str], list[str]]:
    """Per variant, the window bootstrap cell of its val loss minus the baseline's (`runs`: per
    variant, its rows by seed); and a note for every run that could not be paired."""
    base = {k: row["windows"] for k, row in runs[baseline].items()}
    cells, notes = {baseline: "baseline"}, []
    for name, rows in runs.items():
        if name == baseline:
            continue
        pairs, refused = window_pairs({k: row["windows"] for k, row in rows.items()}, base)
        cells[name] = _fmt_difference(window_bootstrap(pairs)) if pairs else "-"
        notes += [f"- {name}, {note}" for note in refused]
    return cells, notes


def _window_notes(notes: list[str]) -> list[str]:
    lines = ["", f"`{WINDOW_COLUMN}`: the same difference of validation loss measured over the "
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
    return lines + _window_notes(notes)


def write_report(configs: dict[str, ml_collections.ConfigDict], variants: Sequence[Variant],
                 workdir: str, title: str, seeds: int = 1, baseline: str | None = None) -> str:
    """Writes workdir/report.md and the PNG plots; returns the report's path. With seeds > 1:
    statistics over the seeds and the differences from `baseline` (default: the first)."""
    overrides = {v.name: v.overrides for v in variants}
    if seeds == 1:
        runs = {name: [variant_row(name, config, os.path.join(workdir, name))]
                for name, config in configs.items()}
    else:
        runs = {name: [variant_row(f"{name}/seed_{k}", config,
                                   os.path.join(workdir, name, f"seed_{k}"))
                       for k in range(seeds)] for name, config in configs.items()}
        overrides.update({f"{name}/seed_{k}": {**overrides[name], "seed": k}
                          for name in configs for k in range(seeds)})
    rows = [row for variant_rows in runs.values() for row in variant_rows]
    columns = _metric_columns(rows)
    lines = [f"# {title}", ""]
    if seeds == 1:
        lines += [f"{len(rows)} variants, written {time.strftime('%Y-%m-%d %H:%M:%S')}. "
                  "Final metrics are the last logged; tokens/s is the median over the logs after "
                  "the first (which includes compiling); wall time sums the variant's runs "
                  "(resumes included).", ""] + _run_table(rows, overrides, columns)
        if len(runs) > 1:
            lines += _window_table(runs, configs, check_baseline(baseline, list(runs)))
    else:
        lines += _seed_tables(runs, overrides, columns, check_baseline(baseline, list(runs)))
        lines += ["", "## Per seed", "", "Final metrics are the last logged; tokens/s is the "
                  "median over the logs after the first (which includes compiling); wall time "
                  "sums the run's resumes.", ""] + _run_table(rows, overrides, columns)
    failed = [row for row in rows if row["status"] == "failed"]
    if failed:
        lines += ["", "Failed variants (see each one's error.txt):", ""]
        lines += [f"- {row['variant']}: {row['error']}" for row in failed]
    if any(key.startswith("val_loss@") for key, _, _ in columns):
        lines += ["", "`val loss @L`: validation loss with rows of L tokens, for a model trained "
                  "at the config's `seq_len` (length extrapolation); `-` where the model cannot "
                  "run at that length (learned positions beyond their table)."]
    plots = plot_curves({name: [_records(os.path.join(workdir, row["variant"])) for row in rows]
                         for name, rows in runs.items()}, workdir)
    lines += [""] + [f"![{title}]({os.path.basename(path)})" for path, title in plots]
    path = os.path.join(workdir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


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
    seeds, baseline = load_options(config_file, FLAGS.seeds, FLAGS.baseline)
    configs = variant_configs(FLAGS.config, variants, FLAGS.only or ())
    selected = [v for v in variants if v.name in configs]
    baseline = check_baseline(baseline, list(configs))
    cli_overrides = _flat_dict(config_flags.get_override_values(FLAGS["config"]))
    if seeds > 1 and "seed" in cli_overrides:
        raise ValueError(f"--config.seed={cli_overrides['seed']} and --seeds={seeds} sets seeds "
                         f"0..{seeds - 1}: expected one of the two")
    runs = variant_configs(FLAGS.config, seed_variants(selected, seeds))
    workdir = FLAGS.workdir or os.path.join("runs", FLAGS.config.experiment)
    check_layout(workdir, list(configs), seeds)
    if FLAGS.print_launch:
        for command in launch_commands(_config_arg(), cli_overrides,
                                       seed_variants(selected, seeds), workdir):
            print(command)
        return
    if not FLAGS.report_only:
        print(f"sweep {FLAGS.config.experiment}: {len(configs)} variants"
              + (f" x {seeds} seeds" if seeds > 1 else "") + f" in {workdir}: "
              + ", ".join(configs), flush=True)
        os.makedirs(workdir, exist_ok=True)
        explicit = {v.name: set(cli_overrides) | set(v.overrides)
                    for v in seed_variants(selected, seeds)}
        if not run(runs, workdir, explicit, batched=FLAGS.batched_seeds):
            sys.exit(0)  # stopped by a signal: the interrupted run saved a checkpoint
    if jax.process_index() == 0:
        path = write_report(configs, selected, workdir, f"Sweep: {FLAGS.config.experiment}",
                            seeds, baseline)
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

    from transformer.utils import cli

    config_flags.DEFINE_config_file("config", None, "Experiment file with get_config() and "
                                    "get_sweep().", lock_config=True)
    flags.mark_flag_as_required("config")
    flags.DEFINE_string("workdir", None, "Sweep directory (default runs/<experiment>); each "
                        "variant trains in WORKDIR/<variant>.")
    flags.DEFINE_list("only", None, "Run (and report) only these variants.")
    flags.DEFINE_integer("seeds", None, "Run every variant under seeds 0..N-1, in "
                         "WORKDIR/<variant>/seed_K (default: the file's get_seeds(), else 1: "
                         "WORKDIR/<variant> with the config's seed).")
    flags.DEFINE_string("baseline", None, "The variant the report compares the others with, "
                        "seed by seed (default: the file's get_baseline(), else the first).")
    flags.DEFINE_bool("batched_seeds", False, "Train a variant's seeds together, as one "
                      "jitted program over a leading seed axis (transformer.batched).")
    flags.DEFINE_bool("report_only", False, "Write the report from what has run; train nothing.")
    flags.DEFINE_bool("print_launch", False, "Print one train command per variant instead of "
                      "training (to run each on its own machine).")
    cli.run(main)
