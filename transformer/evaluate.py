"""Evaluate a run's checkpoint on its validation split.

    python -m transformer.evaluate --workdir=DIR [--step=N] [--eval_steps=N]

Uses the config and tokenizer saved in the workdir; prints the metrics and writes them to
DIR/eval_<step>.json.
"""

from __future__ import annotations

import json
import os

import jax

from transformer import checkpoint as checkpoint_lib
from transformer import sharding
from transformer import train as train_lib
from transformer.data import inputs
from transformer.models import build_model


def evaluate_workdir(workdir: str, step: int | None = None,
                     eval_steps: int | None = None) -> dict[str, float]:
    """Restores `step` (default: the latest) of the run in `workdir` and evaluates it."""
    step, config = checkpoint_lib.saved_run(workdir, step)
    tokenizer = inputs.get_tokenizer(config, workdir)
    model = build_model(config.model)
    optimizer = train_lib.make_optimizer(config)
    placement = train_lib.Placement(sharding.make_mesh(config.mesh), config.batch_size)
    example = next(iter(inputs.get_dataset(config, tokenizer, "validation", num_epochs=1,
                                           shuffle=False, rows=placement.rows)))
    abstract, shardings, _ = sharding.sharded_init(
        train_lib.init_fn(model, config, optimizer, example), placement.mesh,
        jax.random.key(config.seed))
    manager = checkpoint_lib.Manager(workdir, config)
    state = manager.restore(step, abstract, shardings)
    manager.close()
    eval_step = placement.jit_eval_step(train_lib.make_eval_step(model, config),
                                        shardings.params)
    with placement.context():
        metrics = train_lib.evaluate(state.params, eval_step, config, tokenizer, eval_steps,
                                     placement)
    metrics["step"] = step
    if jax.process_index() == 0:
        with open(os.path.join(workdir, f"eval_{step}.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics


def main(argv) -> None:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)
    metrics = evaluate_workdir(flags.FLAGS.workdir, flags.FLAGS.step, flags.FLAGS.eval_steps)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("workdir", None, "Training workdir to evaluate.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer("eval_steps", None, "Validation batches (default: the whole split).")
    app.run(main)
