"""Batched seeds: the seed runs of one sweep variant trained as one jitted program.

    python -m transformer.sweep --config=... --workdir=DIR --seeds=4 --batched_seeds

Each seed stays a run of its own, in its own workdir (DIR/NAME/seed_K): `transformer.train`'s
setup builds it (its lock, config checks, tokenizer, Grain iterator, checkpoint manager with the
data-stream check, restore), and it writes the checkpoints, metrics.jsonl, val_windows.npz and
summary.json a separate run would. Only the train step is shared: `jax.vmap` of the step over a
leading seed axis on the state (params, optimizer state, step counters) and on the batch, where
row block K is seed K's batch from seed K's own iterator and the step's key is seed K's
(`step.make_seeded_train_step`); the optimizer's update, cheap elementwise math, then runs seed
by seed in a `lax.map` (vmapped, XLA fuses it differently and rounds an ulp apart). So seed K
trains as it would alone, with the same init, data order and dropout: on one CPU device its
losses and params equal a separate run's bit for bit (tests/test_batched.py; with the
explosion check, `max_grad_norm > 0`, the params to 1e-6: docs/ablations.md); on a mesh the
vmapped gradients' cross-device reductions round differently (equal to 1e-6 on 4 CPU devices),
and so may an accelerator's batched matmuls. That takes JAX's default PRNG, threefry, whose
bits under vmap are each key's own; other PRNGs (`jax_default_prng_impl=rbg`) are refused.

Checkpoints, evaluation, logs and the non-finite checks take one seed's slice of the stacked
state, at the steps a separate run would. A kill -9 can leave the seeds at different steps (one
seed's save committed, the next one's not): on resume the seeds behind catch up first, in the
same program with the seeds ahead masked (their state kept, their data untouched), then all
train together. A seed whose loss turns NaN stops as it would alone (its error, its checkpoints
set aside); the others go on, its slot masked. Variants with one unfinished seed train the usual
way. Log lines give each seed's own tokens/s; MFU counts the work of all the seeds trained.
The seeds are set up one after another; then every seed's clock (`elapsed`) restarts at once, and
its goodput start-up is its own setup.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from transformer import train
from transformer.models import family_of
from transformer.models.family import token_loss
from transformer.nn import kernels
from transformer.training import metrics as metrics_lib
from transformer.training import optim, progress, run_eval, startup, task_eval
from transformer.training.step import make_seeded_train_step


def check_group(configs: Sequence[ml_collections.ConfigDict]) -> None:
    """Refuses seed runs that differ in anything but `seed` (and their name, `experiment`):
    one program trains them."""
    impl = jax.config.jax_default_prng_impl
    if impl != "threefry2x32":  # rbg's bits under vmap are not the unbatched key's bits
        raise ValueError(f"batched seeds: jax_default_prng_impl={impl!r} draws other random "
                         "bits for a seed under jax.vmap than in a separate run: expected "
                         "'threefry2x32' (JAX's default)")
    first = configs[0].to_dict()
    for config in configs[1:]:
        other = config.to_dict()
        for key in sorted(set(first) | set(other)):
            if key not in ("seed", "experiment") and first.get(key) != other.get(key):
                raise ValueError(f"batched seeds: config key {key!r} is {first.get(key)!r} in "
                                 f"one seed run and {other.get(key)!r} in another: expected "
                                 "runs that differ only in seed")


def train_seeds(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str],
                explicit=()) -> list[dict | Exception]:
    """Trains the seed runs (`configs[k]` in `workdirs[k]`) together; per run, what
    `train.train_and_evaluate` returns, or the exception it would have raised."""
    check_group(configs)
    results: list[dict | Exception | None] = [None] * len(configs)
    runs: list[tuple[int, train.Run]] = []
    setups: list[float] = []  # each run's own setup, in seconds
    with contextlib.ExitStack() as locks, contextlib.ExitStack() as opened:
        for k, (config, workdir) in enumerate(zip(configs, workdirs, strict=True)):
            began = time.perf_counter()
            try:
                run = train.setup(config, workdir, explicit, started=began)
            except startup.Finished as done:
                results[k] = startup.finished_result(config, workdir, done)
                continue
            except Exception as error:  # noqa: BLE001 - this seed fails, the others train
                results[k] = error
                continue
            runs.append((k, run))
            setups.append(time.perf_counter() - began)
            # after summary.json, as train_and_evaluate; a seed that failed in a workdir it
            # made leaves no workdir unless it saved a checkpoint
            locks.callback(lambda run=run, k=k: run.lock.release(
                failed=not isinstance(results[k], dict)))
            opened.callback(_close, run)  # should a later seed's setup not return
        if runs:
            group = [run for _, run in runs]
            _start_together(group, setups)
            for run in group[1:]:  # one compiled evaluation (it does not depend on the seed)
                run.eval_step = group[0].eval_step
            opened.pop_all()  # train_to_end closes them
            done = train.train_to_end(group, train.loop if len(group) == 1 else loop)
            for (k, _), result in zip(runs, done, strict=True):
                results[k] = result
    return results


def _start_together(runs: Sequence[train.Run], setups: Sequence[float]) -> None:
    """Restarts every run's clocks at one moment, now that the last one is set up: each run's
    clock started in its own setup, so an earlier seed's `elapsed` (metrics.jsonl, the sweep
    report's wall time) held the later seeds' setups, and its goodput start-up too. Now each
    `elapsed` counts from here (plus a resumed run's `elapsed_before`), and each start-up is
    the run's own setup (`setups`, seconds)."""
    now = time.perf_counter()
    for run, seconds in zip(runs, setups, strict=True):
        run.logger.start = now
        run.goodput.started = now - seconds


def _close(run: train.Run) -> None:
    run.manager.close()
    run.train_data.close()


class Group:
    """The stacked state of a group's runs and the programs that train and unstack it."""

    def __init__(self, runs: Sequence[train.Run]):
        first = runs[0]
        self.shardings = jax.tree.map(lambda x: x.sharding, first.state)
        stacked = jax.tree.map(lambda s: _with_seed_axis(s, first.placement.mesh),
                               self.shardings)
        self.state = jax.jit(lambda *states: jax.tree.map(lambda *x: jnp.stack(x), *states),
                             out_shardings=stacked)(*[run.state for run in runs])
        for run in runs:
            run.state = None  # the stacked copy holds it now
        self.keys = jnp.stack([jax.random.key(run.config.seed) for run in runs])
        seeded = make_seeded_train_step(first.model, first.config,
                                        optim.make_optimizer(first.config))
        placement = first.placement
        exp_loss = _perplexity_is_exp_loss(first.config)

        def train_step(state, batches, keys, active):
            batch = jax.tree.map(lambda *x: jnp.stack(x), *batches)  # [seeds, rows, ...]
            grads, metrics = jax.vmap(seeded.gradients)(state, batch, keys)
            # The optimizer's update seed by seed (a loop in the program): vmapped, XLA fuses
            # its elementwise math differently and rounds the moments apart by an ulp, which
            # training then amplifies; so each seed's update is a separate run's, bit for bit.
            new, metrics = jax.lax.map(lambda a: seeded.update(*a), (state, grads, metrics))
            if exp_loss:  # the vmapped exp of [seeds] rounds an ulp apart from a scalar one
                metrics = {**metrics, "perplexity": jax.lax.map(jnp.exp, metrics["loss"])}
            if active is not None:  # the seeds ahead keep their state
                new = jax.tree.map(
                    lambda n, o: jnp.where(active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
                    new, state)
            return new, metrics

        train_step = placement.reading_train_order(train_step)  # (as train.py's own step)

        def jitted(masked: bool):
            return placement.paced(jax.jit(
                lambda s, b, k, a: train_step(s, b, k, a if masked else None),
                donate_argnums=0, compiler_options=placement.compiler_options,
                in_shardings=(stacked, [placement.batch_sharding] * len(runs),
                              placement.replicated, placement.replicated),
                out_shardings=(stacked, placement.replicated)))

        self.step_all, self.step_masked = jitted(False), jitted(True)
        self._ran = set()
        self._take = jax.jit(lambda state, k: jax.tree.map(lambda x: x[k], state),
                             out_shardings=self.shardings)

    def seed_state(self):
        """One seed's state, abstract (shapes, dtypes and shardings): what a run's step takes."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s),
                            self.state, self.shardings)

    def train(self, batches, active: np.ndarray):
        """One step of the seeds `active` marks; (metrics [seeds, ...], whether this program
        ran for the first time: it compiled)."""
        program = self.step_all if active.all() else self.step_masked
        first = program not in self._ran
        self._ran.add(program)
        self.state, metrics = program(self.state, batches, self.keys, active)
        return metrics, first

    def take(self, k: int):
        """Seed run k's state (a copy laid out as a separate run's)."""
        return self._take(self.state, k)


def _perplexity_is_exp_loss(config) -> bool:
    """Whether the train step's perplexity is exp(its loss metric), bit for bit: a token
    cross-entropy without label smoothing (ce = nll), in one micro-batch. XLA's CPU exp of a
    [seeds] vector rounds an ulp apart from its scalar exp for 3, 5, 6, 7 seeds (its vector
    tails), so the group takes each seed's exp(loss) by itself, as a separate run's step does."""
    return (family_of(config).loss is token_loss and not config.get("label_smoothing", 0.0)
            and config.optimizer.grad_accumulation_steps == 1)


def _with_seed_axis(sharding, mesh) -> NamedSharding:
    """A state leaf's sharding with a leading, unsharded seed axis."""
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, PartitionSpec(None, *spec))


def loop(runs: Sequence[train.Run], peak_flops: float | None) -> bool:
    """`train.loop` for a group of seed runs (same config but the seed): trains them in one
    program until each reaches config.steps, each logging, evaluating and saving at the steps a
    separate run would; returns whether a signal stopped them (after saving)."""
    config = runs[0].config
    flops, counted = (runs[0].flops_per_token,) * 2, False
    for run in runs:
        run.logger.prefix = f"seed {run.config.seed}: "
        run.logger.print(f"batched seeds: seeds {[r.config.seed for r in runs]} train in one "
                         "program; tok/s is this seed's, MFU counts all the seeds' work")
    group = Group(runs)
    start = time.perf_counter()
    # One timer for all: every seed's step takes the whole program's time, and evaluations and
    # saves of any seed pause them all (outside the timed windows; the ETA counts them all).
    since = {id(run): None for run in runs}
    pauses = runs[0].goodput.pauses  # goodput reads them too: each seed's time is the group's
    for run in runs[1:]:
        run.goodput.pauses = pauses
    stopping = False
    while not stopping:
        live = [run for run in runs if run.error is None and run.step < config.steps]
        if not live:
            break
        ahead = max(run.step for run in live)
        behind = [run for run in live if run.step < ahead]  # after a kill -9: catch up first
        training = {id(run) for run in behind or live}
        active = np.array([id(run) in training for run in runs])
        batches = {id(run): run.placement.global_batch(run.goodput.next_batch(run.train_data))
                   for run, on in zip(runs, active, strict=True) if on}
        filler = next(iter(batches.values()))  # the masked seeds' rows: computed, not kept
        if not counted:  # a seed's hardware FLOPs, counted in a single run's program
            flops, counted = (flops[0], metrics_lib.hardware_flops_per_token(
                config, flops[0], runs[0].train_step, group.seed_state(), filler)), True
        first = any(since[id(run)] is None for run in runs if id(run) in batches)
        with runs[0].tracer.step(runs[0]), \
                kernels.recording() if first else contextlib.nullcontext() as chosen:
            metrics, compiled = group.train([batches.get(id(run), filler) for run in runs],
                                            active)
        # A program's first call compiles (the masked one on a resume that catches up, the
        # other one when the seeds are level): that step is timed in no window.
        # The trace's start or stop around the step is a pause (goodput's "profile") as well.
        paused = _after_step(runs, group, active, metrics, since, start, chosen, flops,
                             peak_flops and peak_flops / active.sum(), pauses,
                             compiled or runs[0].tracer.paused)
        stopping = runs[0].stop_requested()
        saving = [k for k, run in enumerate(runs) if active[k] and run.error is None and (
            run.step % config.checkpoint_every == 0 or run.step == config.steps or stopping)]
        if saving:
            began = time.perf_counter()
            for k in saving:
                _guarded(runs[k], lambda r, k=k: _with_state(r, group, k, train.save_checkpoint))
            pauses["save"].append(time.perf_counter() - began)
            paused = True
        now = time.perf_counter()
        for k, run in enumerate(runs):  # the next windows start after the pauses
            if since[id(run)] is not None and (paused or not active[k]):
                since[id(run)] = (now, run.step)
    for k, run in enumerate(runs):
        run.state = group.take(k)  # finish and the result read each seed's final state
    if stopping:
        for run in runs:
            if run.error is None:
                _guarded(run, train.save_checkpoint)
                run.logger.print(f"received signal {run.signal or 'on another process'}: "
                                 f"saved step {run.step}, exiting")
        return True
    return False


def _after_step(runs, group, active, metrics, since, start, chosen, flops, peak,
                pauses, restart: bool) -> bool:
    """Each trained seed's step count, first-step line, log, then evaluation, as `train.loop`
    does them; returns whether an evaluation ran (a pause in the timed windows). `restart`:
    the step compiled its program, or the trace started or stopped around it, so the timed
    windows restart after it."""
    config = runs[0].config
    trained = [(k, run) for k, run in enumerate(runs) if active[k] and run.error is None]
    for k, run in trained:
        run.step += 1
        run.watch.stepped(run.step, lambda k=k: metrics["loss"][k])
        run.manager.check_for_errors(run.step)
        if since[id(run)] is None:
            jax.block_until_ready(metrics)
            since[id(run)] = (progress.log_first_step(run, start, chosen), run.step)
        elif restart:
            jax.block_until_ready(metrics)
            since[id(run)] = (time.perf_counter(), run.step)
    # Every log before any evaluation, all timed to the end of the same steps; the next
    # windows start after all of them.
    logging = [(k, run) for k, run in trained
               if run.step % config.log_every == 0 or run.step == config.steps]
    if logging:
        now = time.perf_counter() if jax.block_until_ready(metrics) else None
        for k, run in logging:
            mine = jax.tree.map(lambda m, k=k: m[k], metrics)
            _guarded(run, lambda r, k=k, mine=mine: _with_state(
                r, group, k, lambda r: progress.log_train(r, mine, since[id(r)], flops, peak,
                                                          pauses, now)))
        for _, run in logging:
            since[id(run)] = (time.perf_counter(), run.step)
    began = time.perf_counter()
    evaluating = [(k, run) for k, run in trained if run.error is None and (
        run.step % config.eval_every == 0 or run.step == config.steps)]
    for k, run in evaluating:
        result = _with_state(run, group, k, lambda r: run_eval.evaluate_split(
            r, "validation", config.eval_steps, windows=r.step == config.steps))
        run.last_metrics = {**run.last_metrics,
                            **{f"val_{key}": v for key, v in result.items()}}
    scoring = [(k, run) for k, run in trained if run.error is None
               and task_eval.due(config, run.step, run.step == config.steps)]
    for k, run in scoring:  # lm-eval tasks, as a separate run scores them
        _with_state(run, group, k, lambda r: task_eval.evaluate(
            r, optim.eval_params(r.placement.layer_order(r.state), r.config)))
    if evaluating or scoring:
        pauses["eval"].append(time.perf_counter() - began)
    return bool(evaluating or scoring)


def _guarded(run: train.Run, use):
    """`use(run)`; a non-finite stop (transformer.training.nonfinite) stops this seed alone, as it
    would stop a separate run, with its message."""
    try:
        return use(run)
    except FloatingPointError as error:
        run.logger.print(f"step {run.step}: stopped: {error}")
        run.error = error
        return None


def _with_state(run: train.Run, group: Group, k: int, use):
    """`use(run)` with run.state set to seed k's slice of the group's state."""
    run.state = group.take(k)
    try:
        return use(run)
    finally:
        run.state = None
