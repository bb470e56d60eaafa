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
    processes, a missing YAML file, a task name lm-eval does not know or a generation as long
    as the context."""
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
    for name, tokens in generation_lengths(names, include).items():
        if tokens >= config.seq_len:  # (the adapter's max_length in training)
            raise ValueError(f"eval_tasks: {name!r} generates max_gen_toks={tokens} tokens: "
                             f"expected fewer than seq_len={config.seq_len}, so that its "
                             "prompts keep some of their context")


def generation_lengths(names: list[str], include: list[str]) -> dict[str, int]:
    """{task: max_gen_toks} of the generate_until tasks among `names` that lm-eval's task index
    describes (a group's tasks, or an lm-eval whose index this does not read, are checked by
    the adapter when they run)."""
    from transformer.hf.harness import MAX_GEN_TOKS

    index = getattr(manager(tuple(include)), "task_index", None) or {}
    lengths = {}
    for name in names:
        task = getattr(index.get(name), "cfg", None) or {}
        if task.get("output_type") == "generate_until":
            kwargs = task.get("generation_kwargs") or {}
            lengths[name] = int(kwargs.get("max_gen_toks", MAX_GEN_TOKS))
    return lengths


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
