"""Pretraining: the loop around the pure jitted train step (setup, loop) and the CLI.

    python -m transformer.train --config=experiments/<name>.py --workdir=DIR [--config.KEY=VALUE]

With no flags it trains the default experiment (experiments/gpt_tiny.py) into runs/gpt_tiny.
Rerunning the same command on an existing workdir resumes from its latest complete checkpoint.
Beside it: step (the train step), startup (checks), progress (log lines), optim, state,
run_eval (validation, lm-eval tasks, test) over evaluation, metrics, placement (mesh, compiler
options), checkpoint, workdir (the lock), nonfinite, goodput, profiling, wandb_logging, and the
model families' table in transformer.models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import time
from typing import Any

import jax
import ml_collections

from transformer import config_keys
from transformer.configs import validate_config
from transformer.data import inputs, pipeline
from transformer.data.mixture import Mixture
from transformer.models import build_model, family_of
from transformer.nn import kernels
from transformer.parallel import sharding
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import (
    checkpoint_manager,
    evaluation,
    finetune,
    goodput,
    nonfinite,
    optim,
    profiling,
    progress,
    run_eval,
    startup,
    wandb_logging,
)
from transformer.training import metrics as metrics_lib
from transformer.training import placement as placement_lib
from transformer.training import workdir as workdir_lib
from transformer.training.state import TrainState, active_params, initial_state, num_params
from transformer.training.step import make_train_step
from transformer.utils import fileio, hostmem

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "experiments", "gpt_tiny.py")


@dataclasses.dataclass
class Run:
    """What a training run holds from setup through the loop to its finish."""

    config: ml_collections.ConfigDict
    workdir: str
    tokenizer: Any
    task: Any  # the labeled task (transformer.data.tasks), or None
    model: Any
    placement: placement_lib.Placement
    manager: checkpoint_manager.Manager
    train_data: Any  # the Grain iterator, checkpointed with the state
    state: TrainState  # in train order (placement.train_order; checkpoints: layer order)
    start_step: int
    num_params: int
    active_params: int  # per token: less the experts a token is not routed to (MoE)
    flops_per_token: float  # the model's, a trained token's: metrics.model_flops_per_token
    train_step: Any
    eval_step: Any
    logger: metrics_lib.MetricsLogger
    validation_bytes_per_token: Any
    mixture: Mixture | None = None  # data.sources' schedule (tokens per source)
    step: int = 0
    tokenizer_saved: bool = False  # saved into the workdir with the first checkpoint
    last_metrics: dict = dataclasses.field(default_factory=dict)
    signal: int | None = None  # SIGTERM / SIGINT received: save and stop
    peak: tuple = (None, "")  # (peak FLOP/s per device or None, its source): metrics.peak_flops
    first_step_seconds: float | None = None  # this process's first step, compilation included
    lock: workdir_lib.Lock | None = None  # WORKDIR/train.lock, held to the end of the run
    error: Exception | None = None  # why a run of a batched group stopped alone (NaN)
    goodput: goodput.Clock | None = None  # where the wall time goes (summary.json)
    tracer: profiling.Tracer | None = None  # config.profile's trace
    watch: nonfinite.Watch = dataclasses.field(default_factory=nonfinite.Watch)  # "last good"
    evaluated: bool = False  # run_eval.after_training ran (summary.json: a rerun runs it if not)

    def stop_requested(self) -> bool:
        return placement_lib.agreed(self.signal is not None)


def setup(config: ml_collections.ConfigDict, workdir: str, explicit=(),
          started: float | None = None) -> Run:
    """Validates the config and checks the workdir and the data, then builds or restores
    everything the loop needs. Nothing in an existing workdir changes before every check has
    passed; raises `Finished` if the run is already complete. `explicit`: the config keys the
    user set (an init_from source fills the model's other keys); `started`: when
    the run started (perf_counter; default now), its start-up's beginning (goodput)."""
    started = time.perf_counter() if started is None else started
    # This process's own checks, agreed: one failing stops every process (startup.agreed)
    config = startup.agreed(_checked_config, config, workdir, explicit)
    with contextlib.ExitStack() as opened:  # if a check fails, what was opened is closed
        lock = workdir_lib.hold(workdir)  # before anything in the workdir changes
        opened.callback(lock.release, failed=True)  # a workdir this start made is removed
        run = _build(config, workdir, opened)
        run.lock, run.goodput = lock, goodput.Clock(workdir, run.start_step, started,
                                                     enabled=jax.process_index() == 0)
        opened.pop_all()  # the run owns them now
    return run


def _checked_config(config: ml_collections.ConfigDict, workdir: str, explicit) -> Any:
    """`config` resolved (init_from's model) and validated; the workdir no regular file."""
    config = finetune.resolve_init_config(ml_collections.ConfigDict(config.to_dict()), explicit,
                                          workdir)
    validate_config(config)
    if fileio.path(workdir).exists() and not fileio.path(workdir).is_dir():
        raise NotADirectoryError(f"workdir={workdir}: is a regular file, expected a directory")
    return config


def _build(config: ml_collections.ConfigDict, workdir: str, opened: contextlib.ExitStack) -> Run:
    """setup's checks and building, registering what needs closing with `opened`."""
    is_main = jax.process_index() == 0
    stream = startup.agreed(inputs.data_stream, config)
    startup.check_processes_agree(config, workdir, stream)
    fresh = config.get("fresh_start")
    manager = None if fresh else checkpoint_manager.Manager(workdir, config, stream)
    if manager is not None:
        opened.callback(manager.close)
    resuming = manager is not None and manager.latest_step() is not None
    tokenizer, task = startup.resolve(config, workdir if resuming else None)
    if manager is not None:
        startup.check_workdir(config, workdir, manager)
    model = build_model(config.model)
    optimizer = optim.make_optimizer(config)
    placement = placement_lib.Placement.from_config(config)
    # Before any data thread runs: a CPU peak measured for the first time must not compete.
    peak = metrics_lib.peak_flops(config)
    train_data = iter(inputs.get_dataset(config, tokenizer, "train", rows=placement.rows))
    opened.callback(train_data.close)
    startup.check_splits(config, tokenizer, placement)
    start_position = train_data.get_state()  # peek at one batch for shapes, then rewind
    first_batch = next(train_data)
    train_data.set_state(start_position)
    abstract, state_sharding, init = initial_state(config, model, placement.mesh, first_batch,
                                                   optimizer)
    state, source = startup.fresh_state(config, init, state_sharding, is_main) if fresh \
        else (None, None)
    if fresh:  # every check passed, the model builds, init_from loads: now set the old run aside
        if is_main and (moved := checkpoint_lib.set_aside(workdir)):
            print(f"fresh_start: moved the previous run's checkpoints, metrics, summary and "
                  f"TensorBoard events to {moved}")
        placement_lib.sync("fresh_start")
        manager = checkpoint_manager.Manager(workdir, config, stream)
        opened.callback(manager.close)
    else:
        state = finetune.resumed(config, manager.restore_latest(abstract, state_sharding,
                                                                train_data),
                                 abstract, state_sharding, manager)
    start_step = 0 if state is None else int(placement_lib.fetch(state.step))
    startup.check_finished(config, workdir, start_step)
    if state is None:
        state, source = startup.fresh_state(config, init, state_sharding, is_main)
    manager.base_source = source  # a LoRA run's base, at the step it read
    state = placement.train_order(state)  # (checkpoints and init_from are in layer order)
    run = Run(config, workdir, tokenizer, task, model, placement, manager, train_data, state,
              start_step, num_params(abstract), active_params(abstract, config),
              metrics_lib.model_flops_per_token(config, abstract, first_batch),
              placement.jit_train_step(make_train_step(model, config, optimizer),
                                       state_sharding),
              placement.jit_eval_step(evaluation.make_eval_step(model, config, tokenizer),
                                      state_sharding.params, train_order=True),
              metrics_lib.MetricsLogger(workdir, is_main, start_step),
              functools.cache(lambda source=None: inputs.bytes_per_token(
                  config if source is None else inputs.source_configs(config)[source],
                  tokenizer, "validation")),
              Mixture(inputs.mixture_weights(config), config.seed)
              if config.data.get("sources") else None,
              step=start_step, tokenizer_saved=resuming, peak=peak,
              tracer=profiling.Tracer(config, workdir), watch=nonfinite.Watch(start_step))
    run.last_metrics = progress.resumed_metrics(run.logger)  # summary.json's, if no step runs
    run.logger.sink = wandb_logging.sink(config, workdir, run.logger)
    startup.announce(run, sharding.summary(placement.mesh, abstract, state_sharding,
                                           config.batch_size), config_keys.idle_settings(config))
    return run


def loop(run: Run, peak_flops: float | None) -> bool:
    """Trains from run.step to config.steps, logging (MFU against `peak_flops` per device),
    evaluating and checkpointing on the way; returns whether it stopped early on a signal
    (after saving)."""
    config = run.config
    flops = (run.flops_per_token,) * 2  # model, hardware
    # Speed is timed over windows of training steps alone (from `since`, a (time, step), to
    # the next log): the first step of the process, which compiles, every evaluation and save,
    # and the profiler's trace start and stop happen outside them, timed apart (`pauses`: the
    # ETA counts evaluations and saves).
    start, since, pauses = time.perf_counter(), None, run.goodput.pauses
    # Host page faults per step, once the first steps have mapped in what malloc keeps
    faults = hostmem.FaultWindow(run.step)
    stopping = False
    while run.step < config.steps and not stopping:
        batch = run.placement.global_batch(run.goodput.next_batch(run.train_data))
        # The first call traces the step: record the attention kernels it compiles.
        with run.tracer.step(run), \
                kernels.recording() if since is None else contextlib.nullcontext() as chosen:
            run.state, metrics = run.train_step(run.state, batch)
        if since is None:  # the hardware FLOPs: its matmuls, counted in the step just traced
            flops = (flops[0], metrics_lib.hardware_flops_per_token(
                config, flops[0], run.train_step, run.state, batch))
        run.step += 1
        run.watch.stepped(run.step, metrics["loss"])
        run.manager.check_for_errors(run.step)  # a failed background save stops the run at once
        last = run.step == config.steps
        if since is None:
            jax.block_until_ready(metrics)
            since = (progress.log_first_step(run, start, chosen), run.step)
        elif run.tracer.paused:  # the trace started or stopped around this step
            since = (time.perf_counter(), run.step)
        logged = run.step % config.log_every == 0 or last
        if logged:
            since = (progress.log_train(run, metrics, since, flops, peak_flops, pauses), run.step)
            per_step = faults.end(run.step)
            if per_step is not None and (line := hostmem.advice(jax.default_backend(), per_step)):
                run.logger.print(line)
        evaluate = run_eval.during_training(run, last)
        stopping = run.stop_requested()
        save = run.step % config.checkpoint_every == 0 or last or stopping
        if save:
            with run.goodput.pause("save"):
                save_checkpoint(run)
        if evaluate or save:  # the next window starts after them
            since = (time.perf_counter(), run.step)
        if logged or evaluate or save:
            faults.begin(run.step, pause=evaluate or save)
    if stopping or run.stop_requested():  # also after the last save check
        with run.goodput.pause("save"):
            save_checkpoint(run)
        run.logger.print(f"received signal {run.signal or 'on another process'}: "
                         f"saved step {run.step}, exiting")
        return True
    return False


def save_checkpoint(run: Run) -> None:
    """Checkpoints the current step (a fresh run's tokenizer goes into the workdir with its
    first checkpoint, so a run that fails before it leaves none behind)."""
    run.goodput.saved(run.step)  # first: the check below is part of the save's time
    nonfinite.check(run.state, run.config, run.step, run.manager, saving=True, watch=run.watch)
    if not run.tokenizer_saved:
        inputs.save_tokenizer(run.tokenizer, run.workdir)
        run.tokenizer_saved = True
    run.manager.save(run.step, run.placement.layer_order(run.state), run.train_data)
    run.watch.saved(run.step)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, explicit=(),
                       started: float | None = None) -> dict[str, Any]:
    """Trains `config` in `workdir` (resuming if it holds checkpoints); returns final metrics.
    A run already finished is left as it is: its summary is returned, with no state."""
    try:
        run = setup(config, workdir, explicit, started)
    except startup.Finished as done:
        return startup.finished_result(config, workdir, done)
    failed = True
    try:
        result, failed = train_to_end([run], loop)[0], False
        return result
    finally:  # after summary.json: the workdir is the run's until it is written
        run.lock.release(failed=failed)  # a new workdir left without a checkpoint is removed


def train_to_end(runs: list[Run], loop_fn) -> list[dict[str, Any] | Exception]:
    """train_and_evaluate's loop (`loop_fn(runs[0], peak)`, or transformer.batched's over
    several runs), finish and summaries; SIGTERM / SIGINT save and stop. A run that stopped
    alone (`run.error`) gets its error instead of a summary."""

    def request_stop(signum, frame):
        if runs[0].signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (no half-written checkpoint
        for run in runs:  # is ever picked up: Orbax commits a step only when complete)
            run.signal = signum
        # os.write, not print: the handler may interrupt a print to the same stream
        os.write(2, f"received {signal.Signals(signum).name}: saving a checkpoint after this "
                    "step, then exiting (Ctrl-C again: exit at once)\n".encode())

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    peak, source = runs[0].peak
    for run in runs:
        run.logger.print(f"MFU against {peak:.3g} FLOP/s per device ({source})" if peak else
                         f"no MFU: {source}")
        run.goodput.begin_loop()
    run_start, results = time.perf_counter(), []
    try:
        with runs[0].placement.context():  # activation sharding constraints trace under the mesh
            try:
                stopped = loop_fn(runs[0] if len(runs) == 1 else runs, peak)
                for run in runs:
                    if not stopped and run.step == run.config.steps and run.error is None:
                        with run.goodput.after_loop("evaluation"):
                            run_eval.after_training(run)
                        # (a signal during them stops the run: the rerun does what is left)
                        run.evaluated = run.signal is None
            finally:
                # (an error on its way, a full disk's failed save, stays the one reported:
                # closing after it fails too, the logger's flush on that disk)
                quiet = contextlib.suppress(Exception) if sys.exc_info()[0] else \
                    contextlib.nullcontext()
                for run in runs:
                    run.goodput.end_loop()  # (a trace still open stops after it)
                    run.tracer.close(run)
                    with run.goodput.after_loop("checkpoint"), quiet:
                        run.manager.close()  # waits for async saves to finish
                    with quiet:
                        run.logger.close()
                    run.train_data.close()  # stops Grain's prefetch thread before shutdown
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        results = [run.error or progress.summarize(run, time.perf_counter() - run_start)
                   for run in runs]
        return results
    finally:  # W&B's run ends with the summary, or failed
        for k, run in enumerate(runs):
            result = results[k] if k < len(results) else None
            run.logger.finish(result["summary"] if isinstance(result, dict) else None)


def main(argv) -> None:
    from absl import flags, logging
    from ml_collections import config_flags

    del argv
    logging.set_verbosity(logging.WARNING)  # progress lines, not every library's INFO logs
    FLAGS = flags.FLAGS
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                    FLAGS.process_id, cluster=FLAGS.jax_distributed)
    config = FLAGS.config
    workdir = FLAGS.workdir or os.path.join("runs", config.experiment)
    result = train_and_evaluate(  # start-up is timed from the process's start (goodput)
        config, workdir, explicit=config_flags.get_override_values(FLAGS["config"]),
        started=time.perf_counter() - goodput.process_age())
    config = result["config"]  # resolved: its init_from source's model settings filled in
    # stopped by a signal (its checkpoint saved)
    stopped = progress.unfinished(result["summary"], config.steps)
    language_model = family_of(config).continues_text and \
        pipeline.objective_for(config) in pipeline.OBJECTIVES
    if jax.process_index() == 0:
        if config.samples and language_model and not stopped and jax.process_count() == 1 \
                and result["state"] is not None:
            from transformer.generation import text

            text.print_samples(result["model"], optim.eval_params(result["state"], config),
                               result["tokenizer"], config, inputs.sample_prompt(config),
                               num_samples=config.samples)
        print(json.dumps(result["summary"], indent=2))
    return stopped_status(result) if stopped else None


def stopped_status(result: dict) -> int:
    """The exit status of a run a signal stopped (its checkpoint saved): 128 + the signal's
    number (143 for SIGTERM, as a shell reports it), so a launcher or a Kubernetes JobSet reads
    it as unfinished and reruns it, where 0 would read as done. (A signal to another process:
    SIGTERM's.)"""
    return 128 + (result.get("signal") or signal.SIGTERM)


def _define_flags(flag_values=None, sys_argv: list[str] | None = None) -> None:
    """The command's flags, in absl's FLAGS (or `flag_values`, with the config's overrides
    read from `sys_argv`: launch.tpu parses training's arguments as this command would)."""
    from absl import flags
    from ml_collections import config_flags

    into = {"flag_values": flags.FLAGS if flag_values is None else flag_values}
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Experiment file (get_config).",
                                    lock_config=True, sys_argv=sys_argv, **into)
    flags.DEFINE_string("workdir", None, "Run directory (default runs/<experiment>).", **into)
    flags.DEFINE_string("coordinator_address", None,
                        "host:port of process 0, to run as one of several processes "
                        "(auto-detected on multi-host Cloud TPU).", **into)
    flags.DEFINE_integer("num_processes", None, "With --coordinator_address: process count.",
                         **into)
    flags.DEFINE_integer("process_id", None, "With --coordinator_address: this process's id.",
                         **into)
    flags.DEFINE_bool("jax_distributed", False, "Start jax.distributed from the cluster "
                      "environment (multi-host Cloud TPU; launch.tpu passes it).", **into)


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(main, _define_flags)
