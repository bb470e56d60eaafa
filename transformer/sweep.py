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
on, and exits 1 after writing the report. A rerun (and `--report_only`) refuses a run trained
with other settings (its sweep_config.json, else its checkpoint's config) or past `steps`,
which may only grow. Two sweeps may share DIR: each skips (exit status 0) the runs the other
holds; one whose settings for a run differ from those the other recorded (sweep_config.json,
created once, compared as each run starts) skips it and refuses to write the report. At the
end (or with `--report_only`) DIR/report.md compares the variants (final metrics,
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

The definition, statistics, report and plots live in transformer.sweeps (re-exported here as
`sweep.NAME` for experiment files); this module runs the variants and is the command.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import ml_collections

from transformer.sweeps import definition, report

# The sweep API that experiment files and scripts use as `sweep.NAME`.
from transformer.sweeps.definition import (  # noqa: F401
    Variant,
    apply,
    axis,
    check_baseline,
    check_layout,
    check_overrides,
    launch_commands,
    load_options,
    load_sweep,
    named,
    product,
    seed_variants,
    zipped,
)
from transformer.sweeps.plots import plot_curves  # noqa: F401
from transformer.sweeps.report import (  # noqa: F401
    SEEDS_WINDOW_COLUMN,
    WINDOW_COLUMN,
    status,
    variant_row,
    write_report,
)
from transformer.sweeps.statistics import (  # noqa: F401
    Estimate,
    estimate,
    paired_difference,
    verdict,
    window_bootstrap,
    window_pairs,
)
from transformer.training import progress
from transformer.training import workdir as workdir_lib
from transformer.utils import keys


def variant_configs(config, variants: Sequence[Variant], only: Sequence[str] = ()):
    """{name: config} of the selected variants (all if `only` is empty), each validated."""
    from transformer.configs import validate_config

    names = [v.name for v in variants]
    only = only_names(only, names)
    unknown = sorted(set(only) - set(names))
    if unknown:
        example = next((name for name in names if "," in name), None)
        raise ValueError(f"--only {unknown}: expected variant names {names}" + (
            f" (a name with commas is given whole, e.g. --only={example})" if example else ""))
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


def only_names(pieces: Sequence[str], names: Sequence[str]) -> list[str]:
    """--only's names: the flag splits on commas, which sweep.product and sweep.zipped put in
    names, so consecutive pieces that join (with ",") into a variant name are one name again
    (the longest such join first). A piece that joins into none is left as it is.

    >>> only_names(["a=1", "b=2", "c"], ["a=1,b=2", "a=1", "c"])
    ['a=1,b=2', 'c']
    """
    pieces, selected, i = list(pieces), [], 0
    while i < len(pieces):
        end = next((j for j in range(len(pieces), i, -1)
                    if ",".join(pieces[i:j]) in names), i + 1)
        selected.append(",".join(pieces[i:end]))
        i = end
    return selected


# --- running ----------------------------------------------------------------------------


# Settings a variant may change between runs of a sweep without invalidating what it trained.
# `steps` may only grow (`check_runs`). Not `eval_steps`: it sets how many validation windows
# the val loss averages, and the report compares the runs' val losses as equals.
_MAY_CHANGE = {"experiment", "steps", "log_every", "eval_every", "eval_seq_lens",
               "checkpoint_every", "keep_checkpoints", "fresh_start", "data.prefetch",
               *(f"profile.{key}" for key in ("start_step", "num_steps", "all_hosts")),
               *(f"wandb.{key}" for key in ("project", "entity", "name", "mode", "variant"))}


# The keys training fills in when 0 (startup.resolve): a checkpoint's config has the value.
_RESOLVED = ("model.vocab_size", "model.num_classes")


def _as_json(config) -> dict[str, Any]:
    return json.loads(json.dumps(keys.dotted(config.to_dict()), default=str))


def trained_settings(directory: str) -> dict[str, Any] | None:
    """The dotted settings the run in `directory` trained with: its sweep_config.json, else
    (a run a --print_launch command trained) its latest checkpoint's resolved config with
    "resolved": True; None for a run with neither."""
    path = os.path.join(directory, definition.CONFIG_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    from transformer.training import checkpoint as checkpoint_lib

    if not checkpoint_lib.complete_steps(directory):
        return None
    return {**_as_json(checkpoint_lib.saved_run(directory)[1]), "resolved": True}


def changed_settings(directory: str, config) -> list[str]:
    """The settings of `config` that differ from those the variant in `directory` was trained
    with (`trained_settings`), other than the harmless ones in _MAY_CHANGE. A key the
    record lacks was added to the code since: at its default it is what that run did (a new
    key's default keeps the old behaviour), so only another value is a change. Against a
    checkpoint's resolved config, a key training fills in (`_RESOLVED` at 0; the model keys
    and sentinel count an init_from source gives) is no change."""
    from transformer.configs import base_config

    saved = trained_settings(directory)
    if saved is None:
        return []
    current, defaults = _as_json(config), _as_json(base_config())
    if saved.pop("resolved", False):
        filled = {key for key in _RESOLVED if not current.get(key)}
        filled |= {key for key in saved if key.startswith("model.")
                   or key == "data.num_sentinels"} if current.get("init_from") else set()
        saved = {key: value for key, value in saved.items() if key not in filled}
        current = {key: value for key, value in current.items() if key not in filled}
    return [f"{key}: trained with {saved.get(key)!r}, now {current.get(key)!r}"
            for key in sorted(set(saved) | set(current))
            if key not in _MAY_CHANGE and saved.get(key) != current.get(key)
            and not (key not in saved and key in defaults and current[key] == defaults[key])]


def trained_step(directory: str) -> int:
    """The step the run in `directory` has trained to: its summary's or its latest complete
    checkpoint's, whichever is later (0 for none)."""
    from transformer.training import checkpoint as checkpoint_lib

    return max([report.read_summary(directory).get("step", 0),
                *checkpoint_lib.complete_steps(directory)])


def check_runs(configs: dict[str, ml_collections.ConfigDict], workdir: str) -> None:
    """Refuses, in one line naming the run, runs in workdir/<name> trained with other settings
    than `configs` (an edited sweep must not mix results of two configs under one name) or
    past their `steps` (`steps` may grow, to extend a sweep, but a lower one would leave the
    longer runs "finished" beside shorter ones). Before anything trains or is reported."""
    for name, config in configs.items():
        directory = os.path.join(workdir, name)
        changed = changed_settings(directory, config)
        if changed:
            raise ValueError(f"variant {name!r} in {workdir} was trained with other settings ("
                             + "; ".join(changed) + "): expected the same settings; use another "
                             "--workdir or move that variant's directory away")
        step = trained_step(directory)
        if step > config.steps:
            raise ValueError(f"variant {name!r} in {workdir} has trained to step {step}, now "
                             f"steps={config.steps}: expected steps >= {step} (steps may only "
                             "grow); use another --workdir or move that variant's directory away")


# run()'s status when a run failed (its error.txt) or was refused (`_settings_refusal`).
FAILED = 1


def run(configs: dict[str, ml_collections.ConfigDict], workdir: str,
        explicit: dict[str, set[str]] | None = None, batched: bool = False) -> int | None:
    """Trains each variant in workdir/<name>, skipping finished ones and ones another command
    is training (`WorkdirBusy`). A variant's exception is written to its error.txt and the
    sweep goes on; so it does past a run that another sweep on this workdir has since given
    other settings (`_settings_refusal`: skipped, saying why). Returns None when every
    variant is done or held by another command, FAILED when one failed or was refused, and
    if a signal stopped a variant (the sweep stops too; rerun to resume), the exit status a
    stopped training gives, 128 + the signal. `explicit`: per variant, the keys the
    command line and the variant set (an init_from=hf:DIR refuses ones that contradict DIR).
    `batched`: the seed runs NAME/seed_K of a variant train together (transformer.batched).

    Raises before training anything if a variant's directory was trained with other settings
    or past its steps (`check_runs`).
    """
    check_runs(configs, workdir)
    names = list(configs)
    groups: dict[str, list[str]] = {}  # with `batched`, a variant's seed runs form one group
    for name in names:
        groups.setdefault(name.rsplit("/seed_", 1)[0] if batched else name, []).append(name)
    failed = False
    for group in groups.values():
        states = {name: _announce(f"[{names.index(name) + 1}/{len(names)}] {name}", name,
                                  configs[name], workdir) for name in group}
        failed |= "refused" in states.values()
        todo = [name for name in group if states[name] == "train"]
        if not todo:
            continue
        for name, result in _train(todo, configs, workdir, explicit or {}).items():
            header = f"[{names.index(name) + 1}/{len(names)}] {name}"
            error_file = os.path.join(workdir, name, "error.txt")
            if isinstance(result, workdir_lib.WorkdirBusy):  # another sweep is training it
                print(f"{header}: skipped: {result}", flush=True)
                continue
            if isinstance(result, Exception):
                failed = True
                message = f"{type(result).__name__}: {result}"
                print(f"{header}: failed: {message}", flush=True)
                if _is_main():
                    os.makedirs(os.path.dirname(error_file), exist_ok=True)
                    with open(error_file, "w") as f:
                        f.write(message + "\n\n" + "".join(traceback.format_exception(result)))
                continue
            if os.path.exists(error_file) and _is_main():
                os.remove(error_file)
            if progress.unfinished(result["summary"], configs[name].steps):
                print(f"{header}: stopped at step {result['summary']['step']}; rerun the sweep "
                      "to resume", flush=True)
                from transformer import train

                return train.stopped_status(result)
    return FAILED if failed else None


def _is_main() -> bool:
    import jax

    return jax.process_index() == 0


def _announce(header: str, name: str, config, workdir: str) -> str:
    """Prints what becomes of run `name` and records its settings (`_settings_refusal`):
    "train", "finished" or "refused"."""
    directory = os.path.join(workdir, name)
    refusal = _settings_refusal(name, config, workdir)
    if refusal:
        print(f"{header}: skipped: {refusal}", flush=True)
        return "refused"
    state = report.status(directory, config)
    if state == "finished":
        print(f"{header}: finished, skipped", flush=True)
        return "finished"
    if not _held_elsewhere(directory):  # else its training is refused, and `run` says skipped
        print(f"{header}: {'resuming' if state == 'partial' else 'training'} in {directory}",
              flush=True)
    return "train"


def _settings_refusal(name: str, config, workdir: str) -> str | None:
    """Why this sweep may not train run `name` now (`check_runs`' line: another sweep on the
    workdir gave it other settings since this one started), else None, with `config` recorded
    as the run's sweep_config.json if it had none and is unfinished. The file is created whole
    and never replaced (`_record`), and compared once it exists: of two sweeps that give a run
    different settings, only the first to record them trains it, whichever then takes its
    lock. Process 0 decides, for every process."""
    from transformer.training import placement

    refusal = None
    if _is_main():
        directory = os.path.join(workdir, name)
        try:
            check_runs({name: config}, workdir)
            if report.status(directory, config) != "finished" and not _record(config, directory):
                check_runs({name: config}, workdir)  # another sweep's file may be there now
        except ValueError as error:
            refusal = str(error)
    if placement.agreed(refusal is not None):
        return refusal or f"variant {name!r}: refused on process 0 (trained with other settings)"
    return None


def _record(config, directory: str) -> bool:
    """Writes `config` as directory's sweep_config.json unless it has one; whether it did. The
    file appears whole or not at all: a temporary file hard-linked into place, which fails
    where another sweep's appeared first; where the filesystem has no hard links (gcsfuse),
    the file itself is created exclusively."""
    path = os.path.join(directory, definition.CONFIG_FILE)
    if os.path.exists(path):
        return False
    os.makedirs(directory, exist_ok=True)
    text = json.dumps(keys.dotted(config.to_dict()), indent=1, default=str)
    temporary = os.path.join(directory, f".sweep_config.{os.getpid()}.{secrets.token_hex(4)}")
    with open(temporary, "x") as f:  # (the user's umask, as the run's other files)
        f.write(text)
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    except OSError:  # no hard links here
        try:
            with open(path, "x") as f:
                f.write(text)
        except FileExistsError:
            return False
    finally:
        os.remove(temporary)
    return True


def _held_elsewhere(directory: str) -> bool:
    """Whether another training (another sweep's) holds `directory` now: its lock, taken and
    given back at once on process 0 (the one that takes it to train) of a local directory (a
    bucket's lease takes seconds to take). Only what is printed depends on it."""
    if not _is_main() or not os.path.isdir(directory):
        return False
    try:
        workdir_lib.Lock(directory).acquire().release()
    except workdir_lib.WorkdirBusy:
        return True
    return False


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
    if FLAGS.only and baseline is not None and baseline not in configs:
        raise ValueError(f"--only={','.join(FLAGS.only)} leaves out the baseline {baseline!r} "
                         "the report compares with: expected it among --only, or --baseline= "
                         f"one of {list(configs)}")
    baseline = check_baseline(baseline, list(configs))
    cli_overrides = keys.dotted(config_flags.get_override_values(FLAGS["config"]))
    if seeds > 1 and "seed" in cli_overrides:
        raise ValueError(f"--config.seed={cli_overrides['seed']} and --seeds={seeds} sets seeds "
                         f"0..{seeds - 1}: expected one of the two")
    check_overrides(cli_overrides, selected)
    runs = variant_configs(FLAGS.config, seed_variants(selected, seeds))
    workdir = FLAGS.workdir or os.path.join("runs", FLAGS.config.experiment)
    if FLAGS.report_only and not os.path.isdir(workdir):
        raise ValueError(f"--report_only: {workdir} is not a directory; expected the sweep's "
                         "--workdir, whose runs it reports")
    check_layout(workdir, list(configs), seeds)
    # A report of runs trained otherwise would compare them as equals; a rerun is checked
    # here too, so that a refused one announces nothing first.
    if FLAGS.report_only or not FLAGS.print_launch:
        check_runs(runs, workdir)
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
        outcome = run(runs, workdir, explicit, batched=FLAGS.batched_seeds)
        if outcome not in (None, FAILED):
            sys.exit(outcome)  # stopped by a signal: the interrupted run saved a checkpoint
        finish(runs, configs, selected, workdir, f"Sweep: {FLAGS.config.experiment}", seeds,
               baseline, outcome)
    elif jax.process_index() == 0:
        _print_report(write_report(configs, selected, workdir,
                                   f"Sweep: {FLAGS.config.experiment}", seeds, baseline))


def finish(runs: dict[str, ml_collections.ConfigDict], configs, variants: Sequence[Variant],
           workdir: str, title: str, seeds: int, baseline: str | None,
           outcome: int | None) -> None:
    """After `run` (`outcome`: what it returned, None or FAILED): the report of the variants
    `configs`, written by process 0 and printed, then a RuntimeError naming the runs that
    failed if any did. Refused first (`check_runs`), as --report_only would, if another sweep
    on the workdir has since trained a run with other settings or past its steps: the report
    would show that run under settings it was not trained with."""
    import jax

    check_runs(runs, workdir)
    if jax.process_index() == 0:
        _print_report(write_report(configs, variants, workdir, title, seeds, baseline))
    if outcome == FAILED:
        failed = [name for name, config in runs.items()
                  if report.status(os.path.join(workdir, name), config) == "failed"]
        raise RuntimeError(f"{len(failed) or 'some'} of {len(runs)} runs failed"
                           + (f" ({', '.join(failed)})" if failed else "") + f" in {workdir}: "
                           "see the report and each one's error.txt")


def _print_report(path: str) -> None:
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
    flags.DEFINE_list("only", None, "Run (and report) only these variants (a name with "
                      "commas, from sweep.product or sweep.zipped, is given whole).")
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
