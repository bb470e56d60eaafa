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

Finite is not enough: params of 1e6 can give a finite loss of 3.6e10 and the NaN only a step
later. So a checkpoint is good when, besides, the loss its params gave on the next batch (one
they never trained on: held-out data for them) is finite and at most `BLOWUP` times the median
of the losses the run logged before it (`Watch`). Checkpoints older than the NaN that fail this
are set aside too.
"""

from __future__ import annotations

import math
import statistics

import jax
import jax.numpy as jnp

from transformer.training import placement as placement_lib


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every float in `tree` is finite.

    x * 0 is 0 for every finite x and NaN for NaN and +-Inf, so the sum of those products is
    NaN exactly when some element is not finite (and cannot overflow). XLA keeps the multiply:
    it does not assume floats are real (the test on CPU, and TPU's compiled HLO, show it).
    XLA:CPU compiles these sums faster than per-leaf `isfinite(x).all()`: for gpt_tiny's
    optimizer state 0.69 against 1.00 s (0.92 against 1.32 at the test suite's -O0)."""
    # abs: a complex NaN stays NaN in float32; float32: 8-bit floats do not promote implicitly
    total = sum((jnp.abs(jnp.sum(x * 0)).astype(jnp.float32) for x in jax.tree.leaves(tree)
                 if jnp.issubdtype(x.dtype, jnp.inexact)), jnp.float32(0))
    return jnp.isfinite(total)


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


# A checkpoint whose params give a loss over BLOWUP x the run's recent median on the next batch
# is blown up. Between healthy steps the loss moves by far less (a spike of 2x is already rare
# and recovers); 3x the median of a trained model is near or past a uniform guess over the
# vocabulary; and diverged params give losses orders of magnitude above (3.6e10 from params of
# 1e6 at learning_rate=1e6). The median of the last RECENT losses ignores a spike among them.
BLOWUP = 3.0
RECENT = 10


class Watch:
    """The losses that say whether a checkpoint is good: each logged train loss, and the loss
    of the step after each checkpoint (computed from its params; kept on device, fetched only
    if the run stops). Every process holds the same values, so they agree on what to set
    aside."""

    def __init__(self, resumed_from: int = 0):
        self.losses: dict[int, object] = {}  # step -> its train loss (float or device scalar)
        self.next_loss: dict[int, object] = {}  # checkpoint step -> the loss of the step after
        self.before: dict[int, list] = {}  # checkpoint step -> the RECENT losses before it
        self.waiting = {resumed_from} if resumed_from else set()  # saved, next step not run

    def saved(self, step: int) -> None:
        self.waiting.add(step)
        self.before[step] = [v for s, v in sorted(self.losses.items()) if s <= step][-RECENT:]

    def stepped(self, step: int, loss) -> None:
        """`loss`: `step`'s train loss, or a function giving it (called only when needed)."""
        if step - 1 in self.waiting:
            self.waiting.discard(step - 1)
            self.next_loss[step - 1] = self.losses[step] = loss() if callable(loss) else loss
            self._trim()

    def logged(self, step: int, loss: float) -> None:
        self.losses[step] = loss
        self._trim()

    def _trim(self) -> None:  # the recent losses, and those of the last checkpoints
        for kept, limit in ((self.losses, RECENT), (self.next_loss, 2 * RECENT),
                            (self.before, 2 * RECENT)):
            for step in sorted(kept)[:-limit]:
                del kept[step]

    def blown_up(self, step: int) -> str | None:
        """Why checkpoint `step` is not good though its params are finite, or None (also when
        the loss after it is unknown: it was never the last checkpoint before a step ran)."""
        if step not in self.next_loss:
            return None
        loss = _value(self.next_loss[step])
        if not math.isfinite(loss):
            return f"checkpoint {step}'s params gave a NaN/Inf loss on the next batch"
        before = [v for v in map(_value, self.before.get(step, [])) if math.isfinite(v)]
        if before and loss > BLOWUP * (median := statistics.median(before)):
            return (f"checkpoint {step}'s params gave loss {loss:.4g} on the next batch, over "
                    f"{BLOWUP:g}x the median {median:.4g} of the losses before it (blown up)")
        return None


def _value(loss) -> float:
    return loss if isinstance(loss, float) else float(placement_lib.fetch(loss))


def check(state, config, step: int, manager, saving: bool = False,
          watch: Watch | None = None) -> None:
    """Stops the run (before any checkpoint of a bad state is saved) at the first non-finite
    step, setting aside the checkpoints this run saved whose params led to it or are blown up
    (`watch`), and naming the last good checkpoint. `saving`: about to save `step`, so the
    optimizer's moments are checked too (they can overflow to Inf while the params stay
    finite)."""
    found = first_suspect(state, config, step)
    if found is None and saving and not bool(placement_lib.fetch(all_finite(state.opt_state))):
        found = step, f"the optimizer state became NaN/Inf at step {step} (its params are finite)"
    if found is None:
        return
    suspect, message = max(found[0], 1), found[1]
    for older in reversed([s for s in manager.all_steps() if s < suspect]):
        if watch is None or (why := watch.blown_up(older)) is None:
            break
        suspect, message = older, f"{message}; {why}"
    moved, where = manager.set_aside_from(suspect)
    if moved:
        message += f"; moved checkpoint(s) {moved}, whose params led to it, to {where}"
    if earlier := [s for s in manager.all_steps() if s >= suspect]:
        message += f"; checkpoint(s) {earlier}, which this run resumed from, led to it too"
    kept = [s for s in manager.all_steps() if s < suspect]
    if kept:
        message += f"; the last good checkpoint is step {kept[-1]} ({manager.directory}/{kept[-1]})"
    elif pruned := [s for s in manager.pruned if s < suspect]:
        message += (f"; no good checkpoint is left: this run deleted the older ones {pruned} "
                    f"(keep_checkpoints={config.get('keep_checkpoints', 3)})")
    else:
        message += "; no good checkpoint is left: none was saved before it"
    if config.get("nonfinite", "stop") == "stop":
        message += " (set nonfinite='skip' to skip such batches, or lower the learning rate)"
    raise FloatingPointError(message)


def _or_exploded(config) -> str:
    limit = config.get("max_grad_norm", 0.0)
    return f", or the gradient norm exceeded max_grad_norm={limit}," if limit else ""
