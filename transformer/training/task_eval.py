"""lm-evaluation-harness tasks during training (`config.eval_tasks`).

Every `eval_tasks_every` steps (0: only after the last one) and after the last step, the
current params (schedule-free's evaluation point: `optim.eval_params`) are scored on the tasks
in-process through the harness adapter (`transformer.hf.harness.TransformerLM`), and the results
are logged as validation is: a "tasks" record in metrics.jsonl and TensorBoard, a line in the
log, and `tasks/<task>/<metric>` keys in summary.json.

    config.eval_tasks = ("hellaswag", "path/to/my_task.yaml")
    config.eval_tasks_every = 1000
    config.eval_tasks_limit = 200  # documents per task (0: all)

An entry ending in .yaml / .yml is a local task file: its directory joins the harness's include
path and its `task:` name is what runs. Causal decoder LMs (model.family "gpt") on one process.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import time

import ml_collections


def _is_yaml(entry: str) -> bool:
    return entry.endswith((".yaml", ".yml"))


def tasks(config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """(the task names to run, the include-path directories of the local YAML files)."""
    names, include = [], []
    for entry in config.get("eval_tasks") or ():
        if not _is_yaml(entry):
            names.append(entry)
            continue
        path = os.path.expanduser(entry)
        import yaml

        with open(path) as f:
            name = (yaml.safe_load(f) or {}).get("task")
        if not isinstance(name, str):
            raise ValueError(f"eval_tasks: {entry!r} has no `task:` name: expected an lm-eval "
                             "task YAML")
        names.append(name)
        include.append(os.path.dirname(os.path.abspath(path)))
    return names, sorted(set(include))


def check(config: ml_collections.ConfigDict, family_decoding: str | None,
          num_processes: int) -> None:
    """One-line errors before anything runs: a model the adapter cannot score, several
    processes, a missing YAML file, a task name lm-eval does not know, a local task's split
    its data_files lack or that has no documents (`check_splits`), or a generation as long as
    the context."""
    entries = config.get("eval_tasks") or ()
    if not entries:
        return
    if isinstance(entries, str):
        raise ValueError(f"eval_tasks={entries!r}: expected a tuple of task names or YAML paths")
    if family_decoding != "causal":
        raise ValueError(f"eval_tasks with model.family={config.model.family!r}: expected a "
                         "causal decoder LM ('gpt'), what the harness adapter scores")
    if num_processes > 1:
        raise ValueError(f"eval_tasks on {num_processes} processes: expected one (score a "
                         "multi-host run's checkpoints with python -m transformer.harness)")
    for entry in entries:
        if _is_yaml(entry) and not os.path.isfile(os.path.expanduser(entry)):
            raise ValueError(f"eval_tasks: {entry!r}: no such task file")
    names, include = tasks(config)
    known = set(manager(tuple(include)).all_tasks)
    if unknown := [name for name in names if name not in known]:
        raise ValueError(f"eval_tasks: unknown lm-eval task(s) {unknown}: expected names "
                         "lm_eval --tasks list shows, or local YAML files")
    configs = task_configs(names, manager(tuple(include)))
    check_splits(configs, lead="eval_tasks: ")
    for name, tokens in generation_lengths(configs).items():
        if tokens >= config.seq_len:  # (the adapter's max_length in training)
            raise ValueError(f"eval_tasks: {name!r} generates max_gen_toks={tokens} tokens: "
                             f"expected fewer than seq_len={config.seq_len}, so that its "
                             "prompts keep some of their context")


# The task config keys that name a split lm-eval reads as it builds the task.
SPLIT_KEYS = ("test_split", "validation_split", "training_split", "fewshot_split")


def check_splits(configs: dict[str, dict], lead: str = "") -> None:
    """One line for a task whose documents are local files (dataset_kwargs.data_files) where
    lm-eval's own error would be a bare KeyError (a split its data_files do not name) or
    StopIteration (an empty file): the task, the split and what was expected. `configs`: the
    tasks' configs (`task_configs`); datasets from elsewhere are left to lm-eval. `lead` starts
    the line."""
    for config in configs.values():
        if problem := _split_problem(config):
            raise ValueError(lead + problem)


def task_configs(tasks: list, task_manager) -> dict[str, dict]:
    """{task: config} of the tasks among `tasks` (names in `task_manager`'s index, or task
    configs) and in their groups and tags, each with its `include:`s merged and a group's
    overrides for it applied, as far as the index's YAML files say (a task built otherwise is
    left out): read before lm-eval builds any task or downloads its data.

    E.g. a group `g` whose YAML lists `task: [a, {task: b, num_fewshot: 5}]` gives
    {"a": a.yaml's config, "b": b.yaml's config with num_fewshot 5}."""
    index = getattr(task_manager, "task_index", None) or {}
    found: dict[str, dict] = {}
    seen: set[str] = set()

    def visit(task, depth: int = 0) -> None:
        overrides = {}
        if isinstance(task, dict):
            if depth == 0 and isinstance(task.get("task"), str):  # a task's own config
                found[task["task"]] = task
                return
            overrides = {key: value for key, value in task.items() if key != "task"}
            task = task.get("task")  # a group's member, given with overrides
        if not isinstance(task, str) or task in seen:  # (seen: no cycle is followed twice)
            return
        seen.add(task)
        entry = index.get(task)
        kind = getattr(getattr(entry, "kind", None), "name", "")
        if kind == "TAG":  # (its tasks name it among their tags)
            for name, other in index.items():
                if task in (getattr(other, "tags", None) or ()):
                    visit(name, depth + 1)
        elif getattr(entry, "yaml_path", None):
            config = _task_config(entry)
            if kind == "GROUP":
                members = config.get("task") or []
                for member in [members] if isinstance(members, str | dict) else members:
                    visit(member, depth + 1)
            elif isinstance(config.get("task"), str):
                found[task] = {**config, **overrides}

    for task in tasks:
        visit(task)
    return found


def _task_config(entry) -> dict:
    """An index entry's task config with its `include:`s merged, as lm-eval builds it."""
    try:
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # (another lm-eval: the entry's own keys)
        return dict(getattr(entry, "cfg", None) or {})
    return load_yaml(entry.yaml_path, resolve_func=False)


def _split_problem(config: dict) -> str | None:
    """What is wrong with a task's splits, where its data_files are on this machine."""
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if not files or config.get("custom_dataset"):
        return None
    if not isinstance(files, dict):  # (datasets names a lone file list "train")
        files = {"train": files}
    files = {split: [paths] if isinstance(paths, str) else list(paths)
             for split, paths in files.items()}
    if any(not isinstance(p, str) or "://" in p for paths in files.values() for p in paths):
        return None  # remote files: lm-eval's (datasets') to read
    task = config["task"]
    for key in SPLIT_KEYS:
        if (split := config.get(key)) is not None and split not in files:
            return (f"task {task!r}: {key}={split!r} is not among its data_files' splits "
                    f"{sorted(files)}: expected one of those")
    key = "test_split" if config.get("test_split") is not None else "validation_split"
    if (split := config.get(key)) is None:
        return None
    # datasets reads relative data_files from a local dataset_path directory, else from here
    base = str(config.get("dataset_path") or "")
    base = os.path.expanduser(base) if os.path.isdir(os.path.expanduser(base)) else ""
    found = [f for p in files[split] for f in glob.glob(os.path.join(base, os.path.expanduser(p)))]
    if found and all(_blank(f) for f in found):
        return (f"task {task!r}: its {key} {split!r} has no documents ({', '.join(found)} "
                f"{'is' if len(found) == 1 else 'are'} empty): expected at least one")
    return None


def _blank(path: str) -> bool:
    """Whether a file holds nothing but whitespace (read up to its first other byte)."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def generation_lengths(configs: dict[str, dict]) -> dict[str, int]:
    """{task: max_gen_toks} of the generate_until tasks among `configs` (`task_configs`)."""
    from transformer.hf.harness import MAX_GEN_TOKS

    return {name: int((config.get("generation_kwargs") or {}).get("max_gen_toks", MAX_GEN_TOKS))
            for name, config in configs.items() if config.get("output_type") == "generate_until"}


@functools.cache
def manager(include: tuple[str, ...]):
    """lm-eval's task index over its own tasks and the `include` directories, built once per
    process (it reads every task YAML lm-eval ships: seconds at each evaluation otherwise)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None)


def due(config: ml_collections.ConfigDict, step: int, last: bool) -> bool:
    every = config.get("eval_tasks_every", 0)
    return bool(config.get("eval_tasks")) and (last or bool(every and step % every == 0))


def flatten(results: dict) -> dict[str, float]:
    """lm-eval's {task: {"acc,none": 0.5, "alias": ...}} -> {"task/acc": 0.5}: numbers only,
    the filter name kept where it is not "none" ("task/exact_match,strict")."""
    flat = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    key == "sample_len":  # (lm-eval's count of the task's documents)
                continue
            metric, _, filter_name = key.partition(",")
            name = metric if filter_name in ("", "none") else key
            flat[f"{task}/{name}"] = float(value) if math.isfinite(value) else None
    return flat


def evaluate(run, params) -> float:
    """Scores `params` on the run's tasks, logs the results and adds them to
    run.last_metrics; returns the seconds it took."""
    import lm_eval

    from transformer.hf.harness import TransformerLM

    began = time.perf_counter()
    config = run.config
    names, include = tasks(config)
    lm = TransformerLM.from_params(run.model, params, run.tokenizer, config,
                                   batch_size=config.batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager(tuple(include)),
                                      limit=config.get("eval_tasks_limit", 0) or None,
                                      bootstrap_iters=0, log_samples=False,
                                      verbosity="ERROR")["results"]
    flat = flatten({name: results[name] for name in names if name in results})
    run.logger.write(run.step, "tasks", flat)
    run.logger.print(f"step {run.step}: tasks " + " ".join(
        f"{k} {v:.4f}" for k, v in flat.items() if v is not None and "_stderr" not in k))
    run.last_metrics.update({f"tasks/{k}": v for k, v in flat.items()})
    return time.perf_counter() - began
