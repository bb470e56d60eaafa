"""A training's progress lines: the train metrics of a step with its speed, MFU and ETA, timed
over training steps alone (transformer.train.loop decides when), and its summary.json."""

from __future__ import annotations

import json
import time

import jax

from transformer.data import inputs
from transformer.nn import kernels as kernels_lib
from transformer.training import goodput, nonfinite, optim
from transformer.training import metrics as metrics_lib
from transformer.training import placement as placement_lib
from transformer.utils import fileio


def remaining(step: int, steps: int, every: int) -> int:
    """How many of steps step+1..steps are multiples of `every` or the last (the steps that
    evaluate, or save, after `step`)."""
    return steps // every - step // every + (steps % every != 0 and step < steps)


def _eta(config, step: int, seconds: float, pauses: dict[str, list[float]]) -> tuple[float, bool]:
    """(seconds left after `step` at `seconds` a step, whether that is a lower bound): the
    evaluations and saves still to come count at the time the latest one of this process took;
    one still to come of a kind this process has not timed yet (a start before its first, a
    resume) is left out, so the ETA is a lower bound, unless the evaluations to come count at
    this process's first one, which compiled (then the ETA runs high, and is no bound)."""
    eta, untimed, high = (config.steps - step) * seconds, False, False
    # the lm-eval tasks: every eval_tasks_every steps (0: only the last) and at the last
    tasks = (config.get("eval_tasks_every", 0) or config.steps) if config.get("eval_tasks") else 0
    for kind, every in (("eval", config.eval_every), ("tasks", tasks),
                        ("save", config.checkpoint_every)):
        # this step's own evaluation and save (if due) are still to come: they run after its log
        due = remaining(step - 1, config.steps, every) if every else 0
        if due and pauses[kind]:
            eta += due * pauses[kind][-1]
        untimed |= bool(due) and not pauses[kind]
        high |= kind != "save" and bool(due) and len(pauses[kind]) == 1
    return eta, untimed and not high


def log_first_step(run, start: float, chosen) -> float:
    """Records and logs the run's first step (since `start`, its compilation included, and
    the attention kernels and MoE dispatch paths `chosen` while it traced); returns when it
    ended."""
    now = time.perf_counter()
    run.first_step_seconds = now - start
    run.goodput.compiled(now)
    kernels, moe = kernels_lib.split_moe(chosen)
    attention = f", attention {'/'.join(kernels)}" if kernels else ""
    attention += "".join(f", {path}" for path in moe)  # e.g. "moe dispatch: ragged"
    run.logger.print(f"step {run.step}: the first step (compilation included{attention}) took "
                     f"{run.first_step_seconds:.1f} s")
    return now


def log_train(run, metrics, since: tuple[float, int], flops: tuple[float, float],
              peak: float | None, pauses: dict[str, list[float]],
              now: float | None = None) -> float:
    """Logs the train metrics of the current step, timed against `since` (time, step): the
    training steps since then, nothing else ran in between. Returns the time it finished at.
    A window of no steps (the log falls on the first step, whose compile is not training
    speed) logs no speed. The ETA adds the evaluations and saves still to come, each at the
    time the latest one took (`pauses`: their seconds; the first evaluation also compiles);
    before one of a kind is timed it reads ">H:MM:SS", a lower bound (`_eta`).
    `now`: when the timed steps ended (default: after fetching the metrics)."""
    config, step = run.config, run.step
    metrics = placement_lib.fetch(metrics)
    run.watch.logged(step, float(metrics["loss"]))
    nonfinite.check(run.state, config, step, run.manager, watch=run.watch)
    now = time.perf_counter() if now is None else now
    # Under nonfinite="skip" a skipped step leaves the schedule's count where it was: the
    # rate is the one the count of updates applied before this step gives (this step's own
    # skip, if it was one, not among them), and the skips are counted.
    skipped = getattr(run.state.opt_state, "total_notfinite", None)
    skipped = 0 if skipped is None else int(placement_lib.fetch(skipped))
    last_finite = getattr(run.state.opt_state, "last_finite", None)
    this_one = last_finite is not None and not bool(placement_lib.fetch(last_finite))
    lr = float(optim.learning_rate_schedule(config.optimizer, config.steps)(
        step - 1 - skipped + this_one))
    record = {k: float(v) for k, v in metrics.items()}
    record["learning_rate"] = lr
    if config.get("nonfinite", "stop") == "skip":
        record["skipped_steps"] = skipped
    speed = ""
    if step > since[1]:
        seconds = (now - since[0]) / (step - since[1])
        tokens_per_s = config.batch_size * config.seq_len / seconds
        record.update(step_time=seconds, tokens_per_s=tokens_per_s)
        if peak:  # model and hardware FLOPs utilisation against the run's named peak
            record["mfu"] = tokens_per_s * flops[0] / (peak * len(jax.devices()))
            if flops[1] is not None and flops[1] != flops[0]:
                record["hfu"] = tokens_per_s * flops[1] / (peak * len(jax.devices()))
        eta, untimed = _eta(config, step, seconds, pauses)
        mfu = f"MFU {record['mfu']:.0%} " if "mfu" in record else ""
        mfu += f"HFU {record['hfu']:.0%} " if "hfu" in record else ""  # (remat: differs)
        speed = (f"{seconds * 1e3:,.0f} ms/step {tokens_per_s:,.0f} tok/s {mfu}"
                 f"ETA {'>' if untimed else ''}{metrics_lib.format_eta(eta)}")
    if run.mixture is not None:  # rows read from each source so far, in closed form
        batches = run.train_data.get_state().get("next_index", step)  # the stream's position
        counts = run.mixture.counts(batches * config.batch_size)
        for name, rows in zip(inputs.source_configs(config), counts, strict=True):
            record[f"tokens/{name}"] = int(rows) * config.seq_len
    run.logger.write(step, "train", record)
    run.goodput.heartbeat(step)
    run.logger.print(f"step {step}/{config.steps} loss {record['loss']:.4f} "
                     f"acc {record['accuracy']:.3f} lr {lr:.2e} "
                     f"gnorm {record['grad_norm']:.2f} "
                     + (f"moe balance {record['moe_load_balance']:.2f} dropped "
                        f"{record['moe_dropped']:.1%} " if "moe_dropped" in record else "")
                     + (f"max/mean load {record['moe_imbalance']:.2f} "
                        if "moe_imbalance" in record else "")
                     + speed, transient=True)
    run.last_metrics = record
    return time.perf_counter()  # the next window starts after this log's own host work


def resumed_metrics(logger) -> dict:
    """run.last_metrics of a start resuming at `logger.start_step`, from the records an
    earlier start logged there, as log_train, run_eval and task_eval add them: train metrics,
    validation ("val_") and lm-eval tasks ("tasks/"). (The test split and other lengths:
    run_eval.after_training reads its own.)"""
    metrics = {}
    for split, prefix in (("train", ""), ("validation", "val_"), ("tasks", "tasks/")):
        kept = logger.earlier(logger.start_step, split) or {}
        metrics.update({prefix + k: v for k, v in kept.items()})
    return metrics


def unfinished(summary: dict, steps: int) -> bool:
    """Whether a run's summary is a signal's: before the last step, or at it before the
    after-training evaluations ran (a summary from before that key: finished)."""
    return summary.get("step", 0) < steps or not summary.get("after_training", True)


def summarize(run, wall_seconds: float) -> dict:
    """Writes the run's summary.json (its last metrics, size and times); returns
    train.train_and_evaluate's result."""
    summary = {"step": run.step, "wall_seconds": wall_seconds,
               "elapsed": run.logger.elapsed(), "num_params": run.num_params,
               "active_params": run.active_params,
               "first_step_seconds": run.first_step_seconds, **run.last_metrics,
               # False: a signal stopped the last step before them (startup.check_finished)
               "after_training": run.evaluated, "goodput": run.goodput.close(run.step)}
    run.logger.print(goodput.line(summary["goodput"]))
    if jax.process_index() == 0:
        fileio.write_atomic(fileio.join(run.workdir, "summary.json"),
                            json.dumps(summary, indent=2))
    return {"summary": summary, "state": run.placement.layer_order(run.state),
            "model": run.model, "tokenizer": run.tokenizer, "config": run.config,
            "signal": run.signal}
