"""Stopping at NaN/Inf, so that the checkpoints a run leaves are good ones.

The train step records the first step whose loss, gradients or new params were not finite
(`TrainState.first_nonfinite_step`), or, under `nonfinite="skip"`, counts the steps skipped in a
row (optax.apply_if_finite). `check` reads them at every log and before every save.

A checkpoint is good when the step after it trained finitely from its params. Step B's loss is
computed from step B-1's params, so a NaN first seen at step B can come from params that were
saved as checkpoint B-1 while every number of steps <= B-1 was finite (params of 1e6 after a
diverging learning rate, say). So when a run stops, the checkpoints it saved from step B-1 on
(from the step before the skips began, under "skip") move to WORKDIR/checkpoints.nonfinite/, and
the message names the newest checkpoint left: the last good one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer.training import placement as placement_lib


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every float in `tree` is finite (one fused reduction)."""
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def first_suspect(state, config, step: int) -> tuple[int, str] | None:
    """(the first step whose checkpoint led to the failure, what failed) once the run must stop
    at `step`; None while it may go on."""
    if config.get("nonfinite", "stop") == "skip":
        in_a_row = int(placement_lib.fetch(state.opt_state.notfinite_count))
        if in_a_row <= config.max_nonfinite_skips:
            return None
        began = step - in_a_row + 1
        return began - 1, (f"{in_a_row} steps in a row (from step {began}) had NaN/Inf "
                           f"gradients{_or_exploded(config)} (max_nonfinite_skips="
                           f"{config.max_nonfinite_skips})")
    bad = int(placement_lib.fetch(state.first_nonfinite_step))
    if bad < 0:
        return None
    return bad - 1, (f"loss, gradients or parameters became NaN/Inf{_or_exploded(config)} at "
                     f"step {bad} (batch {bad - 1} of the data stream, counting from 0)")


def check(state, config, step: int, manager, saving: bool = False) -> None:
    """Stops the run (before any checkpoint of a bad state is saved) at the first non-finite
    step, setting aside the checkpoints this run saved whose params led to it, and naming the
    last good checkpoint. `saving`: about to save `step`, so the optimizer's moments are checked
    too (they can overflow to Inf while the params stay finite)."""
    found = first_suspect(state, config, step)
    if found is None and saving and not bool(placement_lib.fetch(all_finite(state.opt_state))):
        found = step, f"the optimizer state became NaN/Inf at step {step} (its params are finite)"
    if found is None:
        return
    suspect = max(found[0], 1)
    moved, where = manager.set_aside_from(suspect)
    message = found[1]
    if moved:
        message += f"; moved checkpoint(s) {moved}, whose params led to it, to {where}"
    if earlier := [s for s in manager.all_steps() if s >= suspect]:
        message += f"; checkpoint(s) {earlier}, which this run resumed from, led to it too"
    kept = [s for s in manager.all_steps() if s < suspect]
    message += (f"; the last good checkpoint is step {kept[-1]} ({manager.directory}/{kept[-1]})"
                if kept else "; no good checkpoint is left: none was saved before it")
    if config.get("nonfinite", "stop") == "stop":
        message += " (set nonfinite='skip' to skip such batches, or lower the learning rate)"
    raise FloatingPointError(message)


def _or_exploded(config) -> str:
    limit = config.get("max_grad_norm", 0.0)
    return f", or the gradient norm exceeded max_grad_norm={limit}," if limit else ""
