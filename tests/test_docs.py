"""The documentation cannot drift from the code: the config reference (docs/config.md) has a
line for every key of base_config() and is what docs/gen_config_reference.py writes; every
`python -m transformer...` (and `launch...`) command in README.md and docs/*.md names only
flags its module defines and `--config.` keys its config has; README's links into docs/
resolve; docs/api.md renders every module."""

from __future__ import annotations

import ast
import functools
import glob
import importlib.util
import os
import re
import shlex

import forkserver
import ml_collections
import pytest

from transformer import configs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = [os.path.join(REPO, "README.md"),
             *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]

# Modules whose command lines are not absl flags: transformer.harness is lm_eval's own command
# line (argparse: --model, --model_args, --tasks, ...) with the project's model registered.
NOT_ABSL = ("transformer.harness",)
# Flags every command has: absl's own (app, logging) and cli.run's --verbose.
COMMON_FLAGS = frozenset({
    "help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "only_check_args",
    "verbosity", "v", "logtostderr", "alsologtostderr", "log_dir", "stderrthreshold",
    "showprefixforinfo", "pdb", "pdb_post_mortem", "run_with_pdb", "run_with_profiling",
    "profile_file", "use_cprofile_for_profiling", "verbose", "noverbose"})
COMMAND = re.compile(r"python -m ((?:transformer|launch)(?:\.\w+)+)")


def _load_generator():
    path = os.path.join(REPO, "docs", "gen_config_reference.py")
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the config reference ------------------------------------------------------------------------


def test_config_reference_has_a_line_for_every_key():
    """Each key of base_config() has its line: its default, its allowed values (its check's
    words) and its meaning (with what it acts only with), all from its one declaration."""
    generator = _load_generator()
    declared = generator.declared()
    with open(generator.PAGE) as f:
        page = f.read()
    for key, default in generator.flat_keys(configs.base_config()):
        line = (f"\n| `{key}` | {generator._default(default)} | "
                f"{generator._cell(declared[key].check[1])} | "
                f"{generator._cell(generator.meaning(declared[key]))} |\n")
        assert line in page, f"{key}: no such line in docs/config.md, rerun the generator"
    assert "Acts only with optimizer.name='muon'. |" in page  # (`Key.needs`)


def test_config_reference_is_current():
    generator = _load_generator()
    with open(generator.PAGE) as f:
        committed = f.read()
    assert committed == generator.render(), \
        "docs/config.md is stale: run PYTHONPATH=. python docs/gen_config_reference.py"


def test_config_reference_names_a_key_without_a_declaration(monkeypatch):
    """A model-group key (transformer.models) that nothing declares stops the page."""
    from transformer import config_keys

    monkeypatch.delitem(config_keys.KEYS, "model.channels")
    with pytest.raises(KeyError, match="model.channels"):
        _load_generator().render()


# --- commands in the docs ------------------------------------------------------------------------


def _module_path(module: str) -> str:
    return os.path.join(REPO, *module.split(".")) + ".py"


@functools.cache
def module_flags(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(flag names, config-file flag names) a command module defines: every
    `*.DEFINE_*("name", ...)` call in its source into the global flags (absl's and
    ml_collections' config_flags), `noNAME` for booleans."""
    with open(_module_path(module)) as f:
        tree = ast.parse(f.read())
    names, config_names = set(), set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and
                node.func.attr.startswith("DEFINE_") and node.args and
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            continue
        if any(keyword.arg == "flag_values" for keyword in node.keywords):
            continue  # into a FlagValues of its own, not the command's
        name = node.args[0].value
        names.add(name)
        if node.func.attr.startswith("DEFINE_config"):
            config_names.add(name)
        if node.func.attr in ("DEFINE_bool", "DEFINE_boolean"):
            names.add(f"no{name}")
    return frozenset(names | COMMON_FLAGS), frozenset(config_names)


def _experiment_config(path: str, arg: str | None) -> ml_collections.ConfigDict:
    """ml_collections' config_flags: `FILE` -> get_config(), `FILE:ARG` -> get_config(ARG)."""
    spec = importlib.util.spec_from_file_location(f"_docs_experiment_{len(path)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg is not None else module.get_config()


@functools.cache
def config_for(value: str | None) -> ml_collections.ConfigDict:
    """The config a `--config=VALUE` names; base_config() for none or a placeholder (`...`,
    `experiments/ablations/<name>.py`)."""
    if value is None or value == "..." or "<" in value:
        return configs.base_config()
    path, _, arg = value.partition(":")
    full = os.path.join(REPO, path)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"--config={value}: no file {path}")
    return _experiment_config(full, arg or None)


def _has_key(config: ml_collections.ConfigDict, key: str) -> bool:
    node = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node.keys():
            return False
        node = node[part]
    return True


def _logical_lines(text: str) -> list[str]:
    """Code-block lines with backslash continuations joined, and inline code spans (which may
    wrap across lines), of one Markdown file."""
    out, in_code, pending = [], False, ""
    prose = []
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            prose.append(line)
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    out += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", "\n".join(prose))]
    return out


def commands(text: str) -> list[str]:
    """Every `python -m transformer...` / `python -m launch...` command in a Markdown text,
    from `python` to the end of its line, a `&&`, `;` or `|`, or a ` # ` comment."""
    found = []
    for line in _logical_lines(text):
        for match in COMMAND.finditer(line):
            command = re.split(r"\s(?:&&|\||;|#)\s", line[match.start():] + " ")[0]
            found.append(command.strip())
    return found


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an unbalanced quote in a shortened example
        return command.split()


def check_command(command: str) -> list[str]:
    """What is wrong with one command: flags its module does not define, `--config.` keys its
    config lacks, a `--config` file that does not exist. Arguments after a lone `--` (launch.tpu,
    launch.gke) are transformer.train's."""
    module = COMMAND.match(command).group(1)
    if module in NOT_ABSL:
        return []
    if not os.path.isfile(_module_path(module)):
        return [f"{command}: no module {module}"]
    problems, config_value, keys = [], None, []
    for token in _tokens(command)[3:]:
        token = token.strip("[]")
        if token == "--":
            problems += _check_flags(module, config_value, keys)
            module, config_value, keys = "transformer.train", None, []
            continue
        if not token.startswith("--"):
            continue
        name, _, value = token[2:].partition("=")
        flag_names, config_names = module_flags(module)
        head, dot, key = name.partition(".")
        if dot and head in config_names:
            keys.append(key)
        elif name in config_names:
            config_value = value
        elif name not in flag_names:
            problems.append(f"--{name}: not a flag of {module}")
    return [f"{command}: {problem}" for problem in
            problems + _check_flags(module, config_value, keys)]


def _check_flags(module: str, config_value: str | None, keys: list[str]) -> list[str]:
    if not keys and config_value is None:
        return []
    try:
        config = config_for(config_value)
    except FileNotFoundError as error:
        return [str(error)]
    where = f"--config={config_value}" if config_value else "base_config()"
    return [f"--config.{key}: no such key in {where}" for key in keys
            if not _has_key(config, key)]


def _doc_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOC_FILES:
        with open(path) as f:
            found += [(os.path.relpath(path, REPO), command) for command in commands(f.read())]
    return found


def test_commands_in_the_docs_name_real_flags_and_config_keys():
    found = _doc_commands()
    modules = {COMMAND.match(command).group(1) for _, command in found}
    assert {"transformer.train", "transformer.sweep", "transformer.evaluate",
            "launch.tpu"} <= modules, modules  # the extraction still finds them
    problems = [f"{path}: {problem}" for path, command in found
                for problem in check_command(command)]
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_a_wrong_flag_or_key():
    doc = """Text with `python -m transformer.evaluate --workdir=DIR --stepz=3` inline.

```
python -m transformer.train --config=experiments/gpt_tiny.py \\
    --config.optimizer.learning_rat=0.1 --config.model.qk_norm=True
python -m transformer.train --config=experiments/nonexistent.py
python -m transformer.sweep --config=experiments/ablations/schedules.py --batched_seedz
python -m launch.tpu run --name=x --dry_run -- --config.data.pathz=/data
python -m transformer.train --config=experiments/gpt_shakespeare_char.py:cpu --config.seed=1
```
"""
    found = commands(doc)
    assert len(found) == 6, found
    problems = [problem for command in found for problem in check_command(command)]
    assert len(problems) == 5, problems
    for expected in ("--stepz: not a flag of transformer.evaluate",
                     "--config.optimizer.learning_rat: no such key",
                     "no file experiments/nonexistent.py", "--batched_seedz: not a flag",
                     "--config.data.pathz: no such key in base_config()"):
        assert any(expected in problem for problem in problems), (expected, problems)


@pytest.mark.slow
def test_the_flags_read_from_the_source_are_the_commands_own():
    """module_flags reads the DEFINE calls in a module's source; each of those flags is one its
    command accepts (`--helpfull` lists it), so a doc naming it names a real flag."""
    import sys

    modules = sorted({COMMAND.match(command).group(1) for _, command in _doc_commands()} -
                     set(NOT_ABSL))
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    for module in modules:
        listed = forkserver.run([sys.executable, "-m", module, "--helpfull"], cwd=REPO, env=env,
                                capture_output=True, text=True).stdout
        real = set(re.findall(r"^\s+--(?:\[no\])?([\w.]+)", listed, re.M))
        real |= {f"no{name}" for name in re.findall(r"^\s+--\[no\]([\w.]+)", listed, re.M)}
        names, _ = module_flags(module)
        assert not sorted(names - real - COMMON_FLAGS), module


# --- links ----------------------------------------------------------------------------------------


def _slugs(heading: str) -> set[str]:
    """A heading's anchor as GitHub makes it and as MkDocs (toc's default slugify) does: one
    anchor when they agree, none when they differ (`a & b`: GitHub `a--b`, MkDocs `a-b`)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    github = text.replace(" ", "-")
    mkdocs = re.sub(r"[-\s]+", "-", text).strip("-")
    return {github} if github == mkdocs else set()


def test_readme_links_into_docs_resolve():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) > 10, links
    for path, anchor in links:
        assert os.path.isfile(os.path.join(REPO, path)), path
        if anchor:
            with open(os.path.join(REPO, path)) as f:
                headings = re.findall(r"^#{1,6} (.+)$", f.read(), re.M)
            assert anchor in set().union(*map(_slugs, headings)), (path, anchor)


# --- the API reference ---------------------------------------------------------------------------


def test_the_api_reference_renders_every_module():
    """docs/api.md has a `::: module` entry for each module of the package (a new file's
    docstrings otherwise never reach the site); packages' __init__ files are optional."""
    root = os.path.join(REPO, "transformer")
    modules = {os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
               for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
               if not path.endswith("__init__.py")}
    with open(os.path.join(REPO, "docs", "api.md"), encoding="utf-8") as f:
        rendered = set(re.findall(r"^::: (\S+)$", f.read(), re.M))
    assert not modules - rendered, sorted(modules - rendered)
