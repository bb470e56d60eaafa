"""What a sweep is: its variants (config overrides by dotted key), how an experiment file
declares them (`get_sweep`, `get_seeds`, `get_baseline`), their seeds and names, and the
`transformer.train` command line of each (`launch_commands`)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import os
import shlex
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections

from transformer.utils import cli

# Each variant directory's record of the settings it was first trained with.
CONFIG_FILE = "sweep_config.json"


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


def experiment_module(config_file: str):
    """The experiment file as a module. `config_file` may carry get_config's argument
    ("file.py:bert"), which the sweep's functions ignore."""
    path = config_file.split(".py:", 1)[0] + ".py" if ".py:" in config_file else config_file
    spec = importlib.util.spec_from_file_location("sweep_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sweep(config_file: str) -> list[Variant]:
    """The variants of an experiment file's `get_sweep()`, checked for unique, usable names;
    variants with the same overrides under different names get a warning (they train alike)."""
    module = experiment_module(config_file)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"{config_file}: expected a get_sweep() function declaring the variants")
    variants = _sweep_list(config_file, module.get_sweep())
    if not variants:
        raise ValueError(f"{config_file}: get_sweep() returned no variants")
    _check_names(config_file, variants)
    _warn_identical(config_file, variants)
    return variants


_BUILDERS = "sweep.axis / named / product / zipped"


def _sweep_list(config_file: str, result) -> list[Variant]:
    """`get_sweep()`'s `result` as a list, refused in one line unless it lists Variants."""
    # A dict iterates as its keys and a str as characters: neither is a sweep.
    if result is None or isinstance(result, (str, bytes, dict, Variant)) \
            or not isinstance(result, Iterable):
        raise ValueError(f"{config_file}: get_sweep() returned {cli.short_repr(result)}: "
                         f"expected a list of variants ({_BUILDERS})")
    variants = list(result)
    for i, item in enumerate(variants):
        if not isinstance(item, Variant):
            hint = " (join sweeps with +, or combine them with sweep.product / zipped)" \
                if isinstance(item, (list, tuple)) else ""
            raise ValueError(f"{config_file}: get_sweep()'s item {i} is "
                             f"{cli.short_repr(item)}: expected a variant ({_BUILDERS} return "
                             f"lists of them){hint}")
    return variants


def _check_names(config_file: str, variants: Sequence[Variant]) -> None:
    """Refuses a name that is not one plain directory under the workdir, or that repeats."""
    where = f"{config_file}: variant name"
    seps = sorted({"/", os.sep, os.altsep} - {None})
    for variant in variants:
        name = variant.name
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where} {name!r}: expected a non-empty string (the variant's "
                             "directory under --workdir)")
        if name.startswith("."):
            raise ValueError(f"{where} {name!r} starts with '.': expected a directory name that "
                             "does not (not hidden, not '.' or '..')")
        if sep := next((s for s in seps if s in name), None):
            raise ValueError(f"{where} {name!r} contains the path separator {sep!r}: expected "
                             "one directory name under --workdir (give sweep.axis names=[...], "
                             "or name the variants with sweep.named)")
    first: dict[str, Variant] = {}
    for variant in variants:
        other = first.setdefault(variant.name, variant)
        if other is variant:
            continue
        values = [{k: repr(v) for k, v in x.overrides.items()} for x in (other, variant)]
        differ = [f"{k}={values[0].get(k, 'unset')} and {values[1].get(k, 'unset')}"
                  for k in {**values[0], **values[1]} if values[0].get(k) != values[1].get(k)]
        if differ:  # e.g. two axis values that format alike ("{:g}")
            raise ValueError(f"{where} {variant.name!r} repeats for {'; '.join(differ)}: "
                             "expected unique names (give sweep.axis names=[...], or name the "
                             "variants with sweep.named)")
        raise ValueError(f"{where} {variant.name!r} repeats: expected unique names")


def _warn_identical(config_file: str, variants: Sequence[Variant]) -> None:
    """A warning per group of variants whose overrides are equal: they train the same config
    (the same seed too), which is a mistake more often than a deliberate repeat."""
    groups: list[list[Variant]] = []
    for variant in variants:  # pairwise ==, as overrides may hold unhashable values
        group = next((g for g in groups if g[0].overrides == variant.overrides), None)
        if group is None:
            groups.append([variant])
        else:
            group.append(variant)
    for group in (g for g in groups if len(g) > 1):
        cli.warn_once(f"{config_file}: variants {[v.name for v in group]} have the same "
                      f"overrides {cli.short_repr(group[0].overrides)} and train the same "
                      "config (to repeat a run with other seeds, use --seeds=N)")


def load_options(config_file: str, seeds: int | None = None, baseline: str | None = None
                 ) -> tuple[int, str | None]:
    """(number of seeds, baseline variant): the command line's when given, else the experiment
    file's `get_seeds()` / `get_baseline()` if it has them, else 1 and None (the first)."""
    module = experiment_module(config_file)
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


def run_names(name: str, seeds: int) -> list[str]:
    """Variant `name`'s runs, as directories under the sweep's: NAME with one seed, else
    NAME/seed_K for K = 0..seeds-1 (`seed_variants`)."""
    return [v.name for v in seed_variants([Variant(name, {})], seeds)]


def held_seeds(directory: str) -> list[int]:
    """The K of the seed runs seed_K that a variant's `directory` holds, in order."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(d[5:]) for d in os.listdir(directory)
                  if d.startswith("seed_") and d[5:].isdigit())


# What a run of one seed has in DIR/NAME itself (the sweep's settings file; a run's logs).
ONE_SEED_FILES = (CONFIG_FILE, "metrics.jsonl", "summary.json")


def check_layout(workdir: str, names: Sequence[str], seeds: int) -> None:
    """Refuses a sweep directory whose runs were made with one seed when `seeds` > 1, or with
    several when it is 1 (the report would find no runs, and the layouts would mix)."""
    for name in names:
        directory = os.path.join(workdir, name)
        if seeds == 1 and os.path.isdir(os.path.join(directory, "seed_0")):
            raise ValueError(f"{directory} holds runs of several seeds (seed_0, ...): expected "
                             "--seeds=N (or get_seeds()) with their number")
        if seeds > 1 and any(os.path.exists(os.path.join(directory, file))
                             for file in ONE_SEED_FILES):
            raise ValueError(f"{directory} holds a run of one seed: expected --seeds=1, or "
                             f"another --workdir for --seeds={seeds}")
        if seeds > 1 and os.path.isdir(os.path.join(directory, f"seed_{seeds}")):
            held = held_seeds(directory)
            raise ValueError(f"{directory} holds runs of seeds {held[0]}..{held[-1]}: expected "
                             f"--seeds={held[-1] + 1} (--seeds={seeds} would rewrite the report "
                             "without the others), or another --workdir")


def layout_seeds(workdir: str, names: Sequence[str]) -> int:
    """The seeds that the runs of variants `names` in `workdir` were made with, read from their
    layout: 1 + the largest K of a NAME/seed_K, 1 without any. A directory that mixes the
    layouts is refused (`check_layout`)."""
    seeds = max((k + 1 for name in names for k in held_seeds(os.path.join(workdir, name))),
                default=1)
    check_layout(workdir, names, seeds)
    return seeds


def check_baseline(baseline: str | None, names: Sequence[str]) -> str:
    """The baseline variant's name: `baseline` if it is one of `names`, the first if None."""
    if baseline is None:
        return names[0]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} (--baseline or get_baseline()): expected one of "
                         f"the variants {list(names)}")
    return baseline



def check_overrides(cli_overrides: dict[str, Any], variants: Sequence[Variant]) -> None:
    """Refuses a command-line override (`--config.KEY`) that a variant sets too: the variant's
    value wins, so the command line's would be dropped without a word.

    >>> check_overrides({"steps": 3}, named({"a": {"steps": 100}, "b": {}}))
    Traceback (most recent call last):
    ...
    ValueError: --config.steps=3: the sweep's variant(s) ['a'] set steps themselves (their value
    wins): expected it left to them, or the variants changed in the experiment file
    """
    for key, value in cli_overrides.items():
        if setting := [v.name for v in variants if key in v.overrides]:
            raise ValueError(f"--config.{key}={flag_value(value)}: the sweep's variant(s) "
                             f"{setting[:3] + ['...'] if len(setting) > 3 else setting} set "
                             f"{key} themselves (their value wins): expected it left to them, "
                             "or the variants changed in the experiment file")


def launch_commands(config_file: str, cli_overrides: dict[str, Any], variants: Sequence[Variant],
                    workdir: str) -> list[str]:
    """One `python -m transformer.train` command per variant: the command line's overrides,
    then the variant's (which win)."""
    commands = []
    for variant in variants:
        overrides = {**cli_overrides, **variant.overrides}
        args = [f"--config={config_file}", f"--workdir={os.path.join(workdir, variant.name)}"]
        args += [f"--config.{key}={flag_value(value)}" for key, value in overrides.items()]
        commands.append(shlex.join(["python", "-m", "transformer.train", *args]))
    return commands


def flag_value(value) -> str:
    """`value` as a --config.KEY= flag's text that ml_collections parses back to it: a string
    as it is, a tuple as a Python literal (its strings quoted: a comma inside one, as in a
    data.sources entry, must not split it).

    >>> flag_value("wsd"), flag_value(("path=a.txt,weight=0.7", "b.txt")), flag_value(["x"])
    ('wsd', "('path=a.txt,weight=0.7', 'b.txt')", "('x',)")
    """
    if isinstance(value, (tuple, list)):
        return repr(tuple(value))
    return str(value)
