"""The one way every command line runs: bad input is one line on stderr, not a traceback.

    if __name__ == "__main__":
        cli.run(main, define_flags)   # instead of absl's app.run(main)

A failure prints `error: <message>` and exits with
    2  bad usage or config: an unknown flag or key, a bad value, a missing file, a workdir
       that is not a directory (ValueError, KeyError, TypeError, the file errors, flag errors);
    1  a runtime failure: NaN loss, a failed write, a failed command (anything else);
    130 interrupted (Ctrl-C that the command does not handle itself, and any failure it causes
        as it unwinds, such as a checkpoint write it cut short);
    143 a training stopped by SIGTERM, its checkpoint saved (128 + the signal: 130 for one
        Ctrl-C, which it also handles): rerun the command to continue.
`main` returning an int exits with it. `--help` (`--helpfull`, `--helpxml`) exits 0.
`--verbose` (on every command) shows the traceback.
"""

from __future__ import annotations

import ast
import difflib
import functools
import glob
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

USAGE_ERRORS = (ValueError, KeyError, TypeError, FileNotFoundError, NotADirectoryError,
                FileExistsError, IsADirectoryError)
INTERRUPTED = 130


def run(main: Callable[[list[str]], Any], define_flags: Callable[[], None] | None = None,
        *, positional: bool = False) -> None:
    """absl's app.run(main) with one-line errors and the exit statuses above; never returns.

    `define_flags` runs first, under the same reporting: a config flag with a default file
    already applies the `--config.KEY=VALUE` overrides when it is defined. Arguments that are
    not flags are refused in one line unless `positional` (main reads them: a launcher's
    command and the training flags it passes on).
    """
    from absl import app, flags

    _cpu_without_accelerators()
    _keep_freed_memory_on_cpu()
    _none_overrides()
    verbose = _verbose_requested(sys.argv)
    try:
        if "verbose" not in flags.FLAGS:
            flags.DEFINE_bool("verbose", False, "On an error, show the traceback.")
        if define_flags is not None:
            define_flags()
    except Exception as error:  # noqa: BLE001 - reported as one line
        if verbose:
            raise
        _exit(message(error), 2)

    def parse(argv: list[str]) -> list[str]:
        try:
            try:
                rest = flags.FLAGS(argv)
            except SystemExit as stop:  # absl's --help, --helpfull, --helpxml exit 1
                if stop.code == 1 and _help_shown(argv):
                    raise SystemExit(0) from None
                raise
            if len(rest) > 1 and not positional:  # `--report_only false`: "false" dropped
                raise ValueError(f"unexpected arguments {rest[1:]}: expected only flags "
                                 "(--name=value)")
            expand_home(flags.FLAGS)
            check_config_files(flags.FLAGS)
            return rest
        except Exception as error:  # noqa: BLE001 - every parse failure is bad usage
            if verbose:
                raise
            _exit(message(error), 2)

    def guarded(argv: list[str]) -> Any:
        try:
            return main(argv)
        except KeyboardInterrupt:
            if flags.FLAGS.verbose:
                raise
            failure = ("interrupted", INTERRUPTED)
        except Exception as error:  # noqa: BLE001 - reported as one line
            if flags.FLAGS.verbose:
                raise
            usage = isinstance(error, (*USAGE_ERRORS, flags.Error, app.UsageError))
            failure = ("interrupted", INTERRUPTED) if _interrupted(error) else \
                (message(error), 2 if usage else 1)
        _exit(*failure)  # outside `except`: main's frames (the traceback's) are freed first

    app.run(guarded, flags_parser=parse)


# absl's help flags (`-?` is --help's short name), which print the help and then exit 1.
_HELP = re.compile(r"-(\?|-(help|helpfull|helpshort|helpxml)(=(true|1))?)")


def _help_shown(argv: list[str]) -> bool:
    """Whether `argv` asks for help (absl then exits 1 once it is printed)."""
    return any(_HELP.fullmatch(arg) for arg in argv[1:])


def short_repr(value, width: int = 60) -> str:
    """repr(value), cut to `width` characters ("..." last) for a one-line message."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


@functools.cache
def warn_once(line: str) -> None:
    """Prints `warning: <line>` on stderr, once per process for the same line."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _interrupted(error: BaseException) -> bool:
    """Whether `error` was raised while a Ctrl-C unwound: a failure it caused (a save cut
    short, then reported by a `finally` that waits for it) is the interrupt, not a fault."""
    seen, todo = set(), [error]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        todo += [error.__cause__, error.__context__]
    return False


def message(error: BaseException) -> str:
    """An exception as one line: a missing key as `unknown key 'name'`, an embedded traceback
    reduced to its last line, the other lines joined to the first.

    >>> message(KeyError("stpes"))
    "unknown key 'stpes'"
    >>> message(ValueError("steps=0: bad value\\nexpected a positive int"))
    'steps=0: bad value; expected a positive int'
    """
    args = error.args
    text = args[0] if len(args) == 1 and isinstance(args[0], str) else str(error)
    if isinstance(error, (KeyError, AttributeError)):
        text = _unquote_key(text, bare_is_key=isinstance(error, KeyError))
    if isinstance(error, (KeyError, AttributeError, TypeError)) or \
            isinstance(error, ValueError) and text.startswith("Could not parse '"):
        text = _name_override(text, error, sys.argv)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if "Traceback (most recent call last):" in lines:
        lines = [lines[0], lines[-1]]
    text = lines[0]
    for line in lines[1:]:
        if text[-1] in ".:;,?!":
            text += " " + line
        else:
            text += (". " if line[0].isupper() else "; ") + line
    if type(error).__module__ == "builtins" and not re.match(r"unknown key|--?\w+\.", text) and \
            not isinstance(error, (*USAGE_ERRORS, OSError, RuntimeError, FloatingPointError)):
        text = f"{type(error).__name__}: {text}"  # e.g. an AttributeError: say what it is
    return text


def _unquote_key(text: str, bare_is_key: bool) -> str:
    """A KeyError's message is the key's repr, and ConfigDict re-raises that repr (with a
    "Did you mean" line) as an AttributeError's message: `unknown key 'name'` and the rest."""
    while re.fullmatch(r"'.*'|\".*\"", text, re.S):
        try:
            inner = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            break
        if not isinstance(inner, str):
            break
        text, bare_is_key = inner, True
    first, newline, rest = text.partition("\n")
    if re.fullmatch(r"'[^'\s]*'", first):
        first = f"unknown key {first}"
    elif bare_is_key and re.fullmatch(r"[^'\"\s]+", first) and not newline:
        first = f"unknown key {first!r}"
    return first + newline + rest


def _name_override(text: str, error: BaseException, argv: list[str]) -> str:
    """An error from a `--config.KEY=VALUE` that ml_collections could not apply, as the
    override it is in: ConfigDict names only the missing part (`unknown key 'name'`), a key
    under a tuple or a scalar gets Python's own message, and a part that is a number
    (`eval_seq_lens.0`) a SyntaxError. The key it likely means (`closest`, over every key of
    the config; else ConfigDict's "Did you mean") is given as a whole override; under a field
    that holds an empty dict (compiler_options) the key is no typo, and the field is given
    whole; a tuple is given whole; a scalar has no keys."""
    from ml_collections import ConfigDict

    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    # The outermost ml_collections frame with a `config` is the flag's _parse: the root.
    parse = next((f for f in frames if "config_flags" in f.f_code.co_filename
                  and isinstance(f.f_locals.get("config"), ConfigDict)), None)
    if parse is None:
        return text  # not an override's, e.g. a KeyError in the command's own code
    config = parse.f_locals["config"]
    found = re.match(r"unknown key '([^'\s]+)'", text)
    key, rest = (found[1], text[found.end():].strip()) if found else (None, "")
    unparsed = re.match(r"Could not parse '([\w.]+)'", text)
    if unparsed:  # a part that is no name (`sources.0`): ml_collections' path syntax refused it
        key = _unresolved(config, unparsed[1])
    failed = _failed_override(config, getattr(parse.f_locals.get("self"), "name", None), argv,
                              key)
    if failed is None:
        return text
    override, at, holder = failed
    written, negated, flag, path, value = override.groups()  # written: `--noconfig`
    parts = path.split(".")
    field = ".".join(parts[:at])
    if not isinstance(holder, ConfigDict):
        kind = type(holder).__name__
        if not isinstance(holder, (tuple, list)):
            return f"{written}.{path}: {field} is {'an' if kind[0] in 'aeiou' else 'a'} " \
                   f"{kind}, with no keys"
        whole = repr(holder) if holder and len(repr(holder)) <= 60 else "(...)"
        return f'{written}.{path}: {field} is a {kind}: give it whole (--{flag}.{field}=' \
               f'"{whole}")'
    text = f"unknown key {key!r} in {written}.{path}"
    if at and not len(holder):
        if value is None:
            value = "False" if negated else "True"
        try:
            ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError):
            value = repr(value)  # a string, as its override would give it
        for part in reversed(parts[at:]):
            value = f"{{{part!r}: {value}}}"
        return f'{text}: {field} takes a whole dict (--{flag}.{field}="{value}")'
    groups = at + 1 < len(parts)  # the part named is a group: `modle` in modle.d_model
    close = closest(".".join(parts[:at + 1]), [p for p, group in _paths(config)
                                               if group or not groups])
    if close:
        return f"{text}: did you mean {'.'.join([written, close, *parts[at + 1:]])}?"
    meant = re.fullmatch(r'\.?\s*Did you mean "([^"]+)" instead of "[^"]+"\?', rest)
    if meant:
        return text + ": did you mean " + ".".join([written, *parts[:at], meant[1],
                                                     *parts[at + 1:]]) + "?"
    return text + (rest and f"\n{rest}")


def closest(key: str, keys: Iterable[str]) -> str | None:
    """The dotted key of `keys` that the unknown `key` likely means, or None. Its own group
    first: the one key whose words' initials it is (optimizer.lr: optimizer.learning_rate), or
    whose words its words begin (n_head: num_heads), or that ends it (train_steps: steps), else
    the closest spelling (difflib), else the one it begins (model.act: model.activation). Then:
    the keys with its last part (learning_rate: optimizer.learning_rate; several joined by
    " or "; before the spelling for a top-level name), the one with those initials, and the
    closest spelling anywhere if its group is unknown too (modle.d_model: model.d_model)."""
    keys = sorted(keys)
    group, _, leaf = key.rpartition(".")
    siblings = {name.rpartition(".")[2]: name for name in keys
                if name.rpartition(".")[0] == group}

    def initials(name: str) -> bool:
        return len(leaf) > 1 and "".join(w[:1] for w in name.split("_")) == leaf

    def suffix(name: str) -> bool:  # train_steps: steps
        return len(name) > 3 and leaf.endswith("_" + name)

    def prefix(name: str) -> bool:  # act: activation
        return len(leaf) > 2 and name.startswith(leaf)

    def words(name: str) -> bool:  # n_head: num_heads
        mine, its = leaf.split("_"), name.split("_")
        return len(mine) == len(its) > 1 and all(
            b.startswith(a) for a, b in zip(mine, its, strict=True))

    def one(rule) -> str | None:
        found = [name for name in siblings if rule(name)]
        return siblings[found[0]] if len(found) == 1 else None

    if found := one(initials) or one(words) or one(suffix):
        return found
    same = [name for name in keys if name.rpartition(".")[2] == leaf]
    if same and not group:  # a top-level name is a group's key written without its group
        return " or ".join(same)
    if meant := difflib.get_close_matches(leaf, sorted(siblings), n=1):
        return siblings[meant[0]]
    if found := one(prefix):
        return found
    if same:
        return " or ".join(same)
    if len(found := [name for name in keys if initials(name.rpartition(".")[2])]) == 1:
        return found[0]
    if group and not siblings:
        return next(iter(difflib.get_close_matches(key, keys, n=1)), None)
    return None


def _paths(config, prefix: str = ""):
    """(dotted path, whether a group) of every key of ConfigDict `config`, at any depth."""
    from ml_collections import ConfigDict

    for name, value in config.items():
        yield prefix + name, isinstance(value, ConfigDict)
        if isinstance(value, ConfigDict):
            yield from _paths(value, f"{prefix}{name}.")


def _unresolved(config, path: str) -> str | None:
    """The first part of dotted `path` that names no key of ConfigDict `config`."""
    from ml_collections import ConfigDict

    for part in path.split("."):
        if not (isinstance(config, ConfigDict) and part in config):
            return part
        config = config[part]
    return None


def _failed_override(config, flag: str | None, argv: list[str], key: str | None):
    """(override's match, index of the failing part, its holder) for the `--FLAG.PATH` in
    `argv` that ml_collections failed on: the first whose path does not resolve in `config`,
    in its order (the parents of every override first, then each leaf; a path given twice
    counts where last given), failing at `key` if the error names one, else under a value
    that is no ConfigDict. None if no override fits."""
    from ml_collections import ConfigDict

    name = re.escape(flag) if flag else r"\w+"
    overrides = {}
    for arg in argv[1:]:
        override = re.fullmatch(rf"(--?(no)?({name}))\.([\w.]+)(?:=(.*))?", arg, re.S)
        if override:
            overrides.pop(override[4], None)
            overrides[override[4]] = override
    failed = []
    for path, override in overrides.items():
        node, parts = config, path.split(".")
        for at, part in enumerate(parts):
            if not (isinstance(node, ConfigDict) and part in node):
                if part == key if key else not isinstance(node, ConfigDict):
                    failed.append((override, at, node))
                break
            node = node[part]
    failed.sort(key=lambda f: f[1] == f[0][4].count("."))  # stable: parents' failures first
    return failed[0] if failed else None


def _exit(text: str, status: int) -> None:
    print(f"error: {text}", file=sys.stderr, flush=True)
    if status == INTERRUPTED:
        # At once, like the kill it stands for: interpreter shutdown would wait for the
        # background threads of an interrupted save (Orbax, Grain), which then fail noisily.
        # What is on disk is safe either way (tests/test_faults.py kills runs with -9).
        sys.stdout.flush()
        os._exit(status)
    sys.exit(status)


def _none_overrides() -> None:
    """`--config.KEY=None` sets KEY to None: ml_collections parses an override by the type of
    the key's value or placeholder (`model.init_std=0.02` a float, `model.num_kv_heads` an int
    placeholder), and had no way to say None. Whether None is allowed is the key's own check
    (`validate_config`: `model.init_std` "None or a number > 0" takes it; `steps=None` is
    refused in one line)."""
    from absl import flags
    from ml_collections import config_flags

    class NoneOr(flags.ArgumentParser):
        def __init__(self, parser: flags.ArgumentParser, expected: str):
            self.parser, self.expected = parser, expected

        def parse(self, argument):
            try:
                return None if argument == "None" else self.parser.parse(argument)
            except ValueError:  # absl: `flag --config.steps=1.5: <this>`
                raise ValueError(f"expected {self.expected}") from None

        def flag_type(self) -> str:
            return self.parser.flag_type()

    for field_type, parser, expected in (
            (int, flags.IntegerParser(), "an int"), (float, flags.FloatParser(), "a number"),
            (bool, flags.BooleanParser(), "true or false"), (str, flags.ArgumentParser(), "")):
        config_flags.register_flag_parser_for_type(field_type, NoneOr(parser, expected))


def _verbose_requested(argv: list[str]) -> bool:
    """--verbose before any `--`, read by hand: errors can come before the flags are parsed."""
    args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    return any(a in ("--verbose", "--verbose=true", "--verbose=True", "--verbose=1")
               for a in args)


# The commands' path flags: a leading `~` in them is the home directory.
PATH_FLAGS = ("workdir", "output_dir", "output", "input", "tokenizer_path")


def expand_home(flag_values) -> None:
    """Expands a leading `~` (or `~user`) in the path flags: a shell leaves `--workdir=~/x`
    as it is (it expands `~` only at a word's start), which would make a directory named `~`.
    """
    for name in PATH_FLAGS:
        if name in flag_values:
            value = flag_values[name].value
            if isinstance(value, str) and value.startswith("~"):
                flag_values[name].value = os.path.expanduser(value)


def check_config_files(flag_values) -> None:
    """ml_collections defers a config file's load error to its first use, i.e. deep inside
    main: raise it now, naming the flag."""
    from ml_collections import config_flags

    for name in flag_values:
        flag = flag_values[name]
        if not hasattr(flag, "config_filename") or flag.value is None:
            continue  # not a DEFINE_config_file flag, or not given
        try:
            getattr(flag.value, "to_dict", None)  # a failed load raises on any attribute
        except OSError as error:
            cause = str(error.__cause__ or error).strip().splitlines()[-1].strip()
            cause = re.sub(r"^\[Errno \d+\] ", "", cause)
            raise FileNotFoundError(f"--{name}={config_flags.get_config_filename(flag)}: "
                                    f"{cause}") from None


def _keep_freed_memory_on_cpu() -> None:
    """A run on the CPU has glibc keep XLA's freed scratch memory for the next step instead of
    unmapping it and page-faulting it in again (hostmem.keep_freed_memory)."""
    from transformer.utils import hostmem

    jax = sys.modules.get("jax")
    platforms = os.environ.get("JAX_PLATFORMS") if jax is None else jax.config.jax_platforms
    if platforms == "cpu":
        hostmem.keep_freed_memory()


def _cpu_without_accelerators() -> None:
    """Use the CPU directly on a machine without TPU or GPU devices.

    With libtpu installed (the tpu extra), JAX tries the TPU backend first; libtpu then looks
    for a TPU, finds no accelerator type or worker hostnames and prints five lines of warnings
    (`Failed to find host bounds`, `INVALID_ARGUMENT`) before JAX falls back to the CPU. Where
    no TPU (/dev/accel*, /dev/vfio) or GPU device exists, the CPU is the only choice anyway, so
    ask for it and libtpu is never probed. JAX_PLATFORMS, if set, wins.
    """
    devices = ("/dev/accel*", "/dev/vfio", "/dev/nvidia*", "/dev/kfd")
    if os.environ.get("JAX_PLATFORMS") or any(glob.glob(d) for d in devices):
        return
    jax = sys.modules.get("jax")
    if jax is None:
        os.environ["JAX_PLATFORMS"] = "cpu"  # read when jax is imported
    elif jax.config.jax_platforms is None:
        jax.config.update("jax_platforms", "cpu")  # read when the backends start
