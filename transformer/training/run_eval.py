"""The evaluations a training run makes: validation every `eval_every` steps, lm-eval tasks
when due (`task_eval`), and after the last step the test split and validation at
other lengths. Each logs its metrics (metrics.jsonl, TensorBoard, the log) and adds them to the
run's summary (`run.last_metrics`); `run` is a `train.Run`.
"""

from __future__ import annotations

from transformer.data import inputs
from transformer.training import evaluation, optim, task_eval
from transformer.training import placement as placement_lib


def during_training(run, last: bool) -> bool:
    """Validation every eval_every steps and at the last (with its per-window losses), the
    lm-eval tasks when due, each timed as an evaluation pause; whether either ran."""
    config = run.config
    validation = run.step % config.eval_every == 0 or last
    if validation:
        with run.goodput.pause("eval"):
            result = evaluate_split(run, "validation", config.eval_steps, windows=last)
            run.last_metrics = {**run.last_metrics,
                                **{f"val_{k}": v for k, v in result.items()}}
    tasks = task_eval.due(config, run.step, last)
    if tasks:  # (timed apart: the ETA counts each kind at its own latest time)
        with run.goodput.pause("tasks"):
            task_eval.evaluate(run, optim.eval_params(run.placement.layer_order(run.state),
                                                      config))
    return validation or tasks


def evaluate_split(run, split: str, steps: int | None, seq_len: int | None = None,
                   windows: bool = False) -> dict:
    """Evaluates the current params (optim.eval_params: schedule-free's x) on `split` (at
    `seq_len`), logs and returns the metrics; with `windows`, saves the per-window losses too
    (evaluation.save_windows). An evaluation an earlier start logged at this step (a start
    resumed at the last step, after a kill during the after-training evaluations) is not run
    again: its kept metrics are returned."""
    name = split if seq_len is None else f"{split}@{seq_len}"
    earlier = run.logger.earlier(run.step, name)  # (process 0 reads metrics.jsonl: agreed)
    if placement_lib.agreed(earlier is not None):
        return earlier or {}
    config, params = run.config, optim.eval_params(run.state, run.config)
    if seq_len is None:
        bytes_per_token = run.validation_bytes_per_token if split == "validation" else None
        result = evaluation.evaluate(params, run.eval_step, config, run.tokenizer, steps,
                                     run.placement, bytes_per_token, split=split, windows=windows)
    else:
        result = evaluation.evaluate_at_length(params, run.eval_step, config, run.tokenizer,
                                               seq_len, run.placement, steps)
    if (per_window := result.pop("windows", None)) is not None:  # the final validation pass
        evaluation.save_windows(run.workdir, run.step, per_window)
    at = "" if seq_len is None else f" at length {seq_len}"
    # A mixture's sources, each its own record ("validation/web"), then their total.
    for source, metrics in result.pop("by_source", {}).items():
        run.logger.write(run.step, f"{name}/{source}", metrics)
        run.logger.print(f"step {run.step}: {split}/{source}{at} " + " ".join(
            f"{k} {v:.4f}" for k, v in metrics.items() if k != "num_tokens"))
    run.logger.write(run.step, name, result)
    run.logger.print(f"step {run.step}: {split}{at} " + " ".join(
        f"{k} {v:.4f}" for k, v in result.items() if k != "num_tokens"))
    return result


def after_training(run) -> None:
    """After the last step: the test split (a labeled task's, or data.test_path: all of it),
    then validation at other lengths, until a signal (`run.signal`) stops them."""
    config = run.config
    if inputs.has_test_split(config):
        result = evaluate_split(run, "test", None)
        run.last_metrics.update({f"test_{k}": v for k, v in result.items()})
    for seq_len in config.get("eval_seq_lens") or ():
        if run.signal is not None:  # SIGTERM / Ctrl-C: stop; the rerun runs the ones left
            return
        try:
            evaluation.check_eval_seq_len(config, seq_len, run.tokenizer)
        except ValueError as error:
            run.logger.print(f"validation at length {seq_len}: skipped: {error}")
            run.last_metrics[f"val_loss@{seq_len}"] = None
            continue
        result = evaluate_split(run, "validation", config.eval_steps, seq_len)
        run.last_metrics.update({f"val_{k}@{seq_len}": v for k, v in result.items()
                                 if k in ("loss", "accuracy", "bits_per_byte")})
