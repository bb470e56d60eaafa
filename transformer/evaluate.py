"""Evaluate a run's checkpoint on its validation (or test) split.

    python -m transformer.evaluate --workdir=DIR [--step=N] [--eval_steps=N] [--split=test]
    python -m transformer.evaluate --workdir=DIR --eval_seq_len=128,256,512

Uses the config and tokenizer saved in the workdir; names the step it read on stderr (`step N
of DIR`), prints the metrics, then writes them to DIR/eval_<step>.json (eval_<step>_test.json
for the test split; a partial evaluation, --eval_steps=N, to eval_<step>_stepsN.json, never
over the whole split's). If they cannot be
written, one line says so (exit status 1) below the printed metrics. A fine-tuned classifier
(a labeled task, transformer.data.tasks) gets accuracy, macro-F1 and its confusion matrix, also
drawn to DIR/confusion_<step>_<split>.png. The data is read as it is now; content changed
since the checkpoint was saved is said in a warning and in the results (`data_changed`), and
where it now gives other classes than the checkpoint records (`tasks.label_change`: new
speakers that outnumber old ones), the evaluation is refused in one line, before the restore.

`--eval_seq_len` evaluates at other sequence lengths than the run trained at (length
extrapolation), reading about the same number of tokens at each length; a model with learned
positions cannot go beyond its table (model.max_len), and on a sequence-parallel mesh a length
must split over mesh.sequence as seq_len did: either is said in one line before the restore.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import jax

from transformer.data import inputs, tasks
from transformer.models import build_model
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import evaluation, finetune
from transformer.training import placement as placement_lib
from transformer.training.checkpoint_manager import stream_differences
from transformer.utils import fileio


class NotWritten(RuntimeError):
    """The metrics were computed but could not be written."""


def results_name(step: int, *, eval_steps: int | None = None, seq_lens: tuple[int, ...] = (),
                 split: str = "validation") -> str:
    """The results file's name, distinct per evaluation: a partial one (`eval_steps`
    batches) never overwrites the whole split's.

    >>> results_name(400), results_name(400, eval_steps=5, seq_lens=(64, 128), split="test")
    ('eval_400.json', 'eval_400_len64_128_steps5_test.json')
    """
    return (f"eval_{step}" + ("_len" + "_".join(map(str, seq_lens)) if seq_lens else "") +
            (f"_steps{eval_steps}" if eval_steps is not None else "") +
            ("_test" if split == "test" else "") + ".json")


def evaluate_workdir(workdir: str, step: int | None = None, eval_steps: int | None = None,
                     seq_lens: tuple[int, ...] = (), split: str = "validation", *,
                     show: Callable[[dict], None] | None = None, say_step: bool = False) -> dict:
    """Restores `step` (default: the latest) of the run in `workdir` and evaluates it on
    `split` ("test" for labeled tasks, which hold one out, and runs with data.test_path).

    Returns the metrics at the training length, or with `seq_lens` {"step": ...,
    "train_seq_len": ..., "split": ..., "by_seq_len": {L: metrics at length L}}, after
    `show(metrics)` (if given) and writing them to WORKDIR/`results_name(...)`; a failed write
    raises `NotWritten`, naming the file and the cause. `say_step`: print `step N of WORKDIR`,
    the step read, on stderr once it is read (a training beside it may have deleted the latest
    meanwhile), as generate and export do.
    """
    if eval_steps is not None and (isinstance(eval_steps, bool) or eval_steps < 1):
        raise ValueError(f"eval_steps={eval_steps!r}: expected an int >= 1 (or none: the whole "
                         "split)")
    newest = step is None
    step, config = checkpoint_lib.saved_run(workdir, step)
    task = inputs.labeled_task(config)
    is_task = task is not None
    has_test = inputs.has_test_split(config)
    if split not in ("validation", "test") or (split == "test" and not has_test):
        raise ValueError(f"split={split!r}: expected 'validation'" + (
            " or 'test'" if has_test else
            " (only labeled tasks and runs with data.test_path have a test split)"))
    if task is not None:
        check_labels(workdir, step, task.labels, or_newer=newest)
    config, devices, note = placement_lib.local_mesh(config, "evaluating")
    for seq_len in seq_lens:  # before anything is restored or compiled, on the mesh used here
        evaluation.check_eval_seq_len(config, seq_len)
    if note:
        print(note, file=sys.stderr)
    tokenizer = inputs.get_tokenizer(config, workdir)
    for seq_len in seq_lens:  # span corruption: the sentinels of the tokenizer read
        evaluation.check_eval_seq_len(config, seq_len, tokenizer)
    model = build_model(config.model)
    placement = placement_lib.Placement.from_config(config, devices)
    # A training beside it may delete the newest step meanwhile: then the next one is read.
    step, _, params = finetune.restore_params(workdir, step, placement.mesh,
                                                    or_newer=newest)
    if say_step:
        print(f"step {step} of {workdir}", file=sys.stderr, flush=True)
    eval_step = placement.jit_eval_step(evaluation.make_eval_step(model, config, tokenizer),
                                        jax.tree.map(lambda x: x.sharding, params))
    with placement.context():
        if seq_lens:
            by_length = {seq_len: evaluation.evaluate_at_length(
                params, eval_step, config, tokenizer, seq_len, placement, eval_steps, split)
                for seq_len in seq_lens}
            metrics = {"step": step, "train_seq_len": config.seq_len, "split": split,
                       "by_seq_len": by_length}
        else:
            metrics = evaluation.evaluate(params, eval_step, config, tokenizer, eval_steps,
                                          placement, split=split, with_confusion=is_task)
    metrics["step"] = step
    if changed := data_changes(workdir, step, config, split, tokenizer):
        metrics["data_changed"] = changed
        print(f"warning: the data changed since checkpoint {step} was saved "
              f"({'; '.join(changed)}): evaluating on it as it is now", file=sys.stderr)
    path = fileio.join(workdir, results_name(step, eval_steps=eval_steps, seq_lens=seq_lens,
                                             split=split))
    if is_task and not seq_lens:  # per-length results carry no confusion matrix
        metrics["labels"] = list(task.labels)
        partial = "" if eval_steps is None else f"_steps{eval_steps}"
        metrics["confusion_png"] = fileio.join(workdir, f"confusion_{step}_{split}{partial}.png")
    if show is not None:
        show(metrics)
    if jax.process_index() == 0:
        if "confusion_png" in metrics:
            _writing(metrics["confusion_png"], save_confusion, metrics["confusion"],
                     metrics["labels"], metrics["confusion_png"],
                     f"{config.experiment} step {step}, {split}: accuracy "
                     f"{metrics['accuracy']:.3f}, macro-F1 {metrics['macro_f1']:.3f}")
        _writing(path, fileio.write_atomic, path, json.dumps(metrics, indent=2))
    return metrics


def check_labels(workdir: str, step: int, labels, or_newer: bool = False) -> None:
    """Raises ValueError, in one line naming both lists, where the class names checkpoint
    `step` records (its stream's) are not the task's `labels` now: each class id would be
    scored as another class. A checkpoint saved before they were recorded passes."""
    saved = checkpoint_lib.saved_stream(workdir, step, or_newer=or_newer) or {}
    if change := tasks.label_change(saved.get(tasks.LABELS), labels):
        raise ValueError(f"checkpoint {step} of {workdir} {change}: expected the data it was "
                         "trained on (the classes are the task's data.num_classes most frequent "
                         "labels)")


def data_changes(workdir: str, step: int, config, split: str = "validation",
                 tokenizer=None) -> list[str]:
    """How the data's content differs from what checkpoint `step` trained on (its saved
    stream's fingerprints, `inputs.data_stream`): files added, removed or edited since, and
    ids put before each document since (`inputs.document_start`, of `tokenizer`: the run's),
    SFT's loss mask since (`inputs.SFT_MASK`);
    for the test split, data.test_path's too (a checkpoint saved before it was recorded:
    unknown)."""
    # (a training beside it may have deleted `step` since: the newest step's stream, then)
    saved = checkpoint_lib.saved_stream(workdir, step, or_newer=True)
    if saved is None:
        return []
    current = inputs.data_stream(config, tokenizer)
    changes = stream_differences(saved, current, [
        key for key in current
        if key.endswith("fingerprint") or key in (inputs.DOCUMENT_START, inputs.SFT_MASK)])
    test = inputs.TEST_FINGERPRINT
    if split == "test" and saved.get(test) not in (None, current.get(test)):
        changes.append(f"{config.data.test_path} content fingerprint: checkpoint "
                       f"{saved[test]!r}, config {current.get(test)!r}")
    return changes


def _writing(path: str, write: Callable, *args) -> None:
    """`write(*args)`, an OSError raised as `NotWritten` naming `path` and the cause."""
    try:
        write(*args)
    except OSError as error:
        raise NotWritten(f"could not write {path} ({error.strerror or error})") from error


def save_confusion(confusion, labels, path: str, title: str) -> None:
    """The confusion matrix [true, predicted] as a PNG heatmap with the counts written in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    counts = np.asarray(confusion)
    size = 1.5 + 0.55 * len(labels)
    figure, axes = plt.subplots(figsize=(size + 1.5, size))
    image = axes.imshow(counts, cmap="Blues")
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    axes.set_yticks(range(len(labels)), labels)
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    axes.set_title(title, fontsize=9)
    for (i, j), count in np.ndenumerate(counts):
        axes.text(j, i, str(count), ha="center", va="center", fontsize=8,
                  color="white" if count > counts.max() / 2 else "black")
    figure.colorbar(image, ax=axes, fraction=0.046)
    figure.tight_layout()
    with fileio.path(path).open("wb") as f:
        figure.savefig(f, format="png", dpi=100)
    plt.close(figure)


def main(argv) -> None:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)
    FLAGS = flags.FLAGS
    seq_lens = tuple(_positive_int(value) for value in FLAGS.eval_seq_len or ())
    try:
        metrics = evaluate_workdir(FLAGS.workdir, FLAGS.step, FLAGS.eval_steps, seq_lens,
                                   FLAGS.split, show=print_metrics, say_step=True)
    except NotWritten as error:
        raise NotWritten(f"{error}; the metrics are above") from None
    names = [results_name(metrics["step"], eval_steps=steps, seq_lens=seq_lens,
                          split=FLAGS.split) for steps in (FLAGS.eval_steps, None)]
    partial = "" if FLAGS.eval_steps is None else (
        f" (a partial evaluation, --eval_steps={FLAGS.eval_steps}; the whole split's "
        f"results go to {names[1]})")
    print(f"wrote {fileio.join(FLAGS.workdir, names[0])}{partial}", file=sys.stderr)


def print_metrics(metrics: dict) -> None:
    """Prints evaluate_workdir's metrics: a per-length table, a confusion matrix, then the
    metrics as JSON (without the matrix)."""
    if "by_seq_len" in metrics:
        print(f"step {metrics['step']}, trained at seq_len {metrics['train_seq_len']}, "
              f"{metrics['split']} split")
        print(format_length_table(metrics["by_seq_len"]))
    if "confusion" in metrics:
        print(format_confusion(metrics["confusion"], metrics["labels"]))
        metrics = {k: v for k, v in metrics.items() if k not in ("confusion", "labels")}
    print(json.dumps(metrics, indent=2), flush=True)


def format_confusion(confusion, labels) -> str:
    """The confusion matrix as text: one row per true class, one column per prediction.

    >>> print(format_confusion([[2, 0], [1, 1]], ["ab", "c"]))
    true \\ predicted     ab      c
    ab                    2      0
    c                     1      1
    """
    corner = "true \\ predicted"
    first = max(len(corner), *(len(label) for label in labels)) + 1
    width = max(6, *(len(label) + 1 for label in labels))
    lines = [corner.ljust(first) + "".join(label.rjust(width) for label in labels)]
    lines += [label.ljust(first) + "".join(str(count).rjust(width) for count in row)
              for label, row in zip(labels, confusion, strict=True)]
    return "\n".join(lines)


def format_length_table(by_seq_len: dict) -> str:
    """A Markdown table of a split's metrics per sequence length."""
    lines = ["| seq_len | loss | perplexity | accuracy | bits/byte |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for seq_len, m in by_seq_len.items():
        bpb = f"{m['bits_per_byte']:.4f}" if "bits_per_byte" in m else "-"
        lines.append(f"| {seq_len} | {m['loss']:.4f} | {m['perplexity']:.2f} | "
                     f"{m['accuracy']:.3f} | {bpb} |")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--eval_seq_len={text!r}: expected comma-separated ints") from None


if __name__ == "__main__":
    from absl import flags

    from transformer.utils import cli

    flags.DEFINE_string("workdir", None, "Training workdir to evaluate.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer("eval_steps", None, "Validation batches (default: the whole split).")
    flags.DEFINE_enum("split", "validation", ["validation", "test"],
                      "Split to evaluate (test: a labeled task's test split or "
                      "data.test_path).")
    flags.DEFINE_list("eval_seq_len", None, "Evaluate at these sequence lengths, e.g. 256,512 "
                      "(length extrapolation; default: the training length).")
    cli.run(main)
