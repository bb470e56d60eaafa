"""Profiler traces of chosen training steps (config.profile).

`profile.num_steps` > 0 traces steps `start_step` .. `start_step + num_steps - 1` (step 1 is the
one that compiles; a window past the last step ends at it) with `jax.profiler` into
WORKDIR/profile/ (plugins/profile/<time>/<host>.xplane.pb), which XProf or TensorBoard's profile
plugin opens; each step is marked with a `StepTraceAnnotation`, so their step view splits it by
step. On a multi-host run, process 0 traces, or every host with `profile.all_hosts` (each host
writes its own file). A run resumed past the window traces nothing; one resumed inside it traces
the steps still to come.
"""

from __future__ import annotations

import contextlib

import jax

from transformer.utils import fileio


class Tracer:
    """Starts the trace before the window's first step and stops it after its last (or when
    the training ends first: `close`). In the loop, starting and stopping it (writing the
    trace) are pauses, as evaluations and saves are: timed into goodput's `pauses["profile"]`,
    and `paused` tells the loop to restart its speed window after the step."""

    def __init__(self, config, workdir: str):
        profile = config.get("profile") or {}
        self.first = profile.get("start_step", 1)
        # a window running past the last step stops after it, in the loop (not timed with the
        # profiler on, and the evaluations after training left out of the trace)
        self.last = min(self.first + profile.get("num_steps", 0) - 1, config.steps)
        self.enabled = self.last >= self.first and (jax.process_index() == 0 or
                                                    profile.get("all_hosts", False))
        self.directory = fileio.join(workdir, "profile")
        self.tracing = self.paused = False

    @contextlib.contextmanager
    def step(self, run):
        """Around the train step that makes run.step + 1: traced when it is in the window;
        `paused` after it says whether the trace started or stopped."""
        step, self.paused = run.step + 1, False
        if not self.enabled or not self.first <= step <= self.last:
            yield
            return
        if not self.tracing:
            with self._pause(run, True):
                jax.profiler.start_trace(self.directory)
            self.tracing, self.began = True, step
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield
        if step == self.last:
            self.close(run, step)

    @contextlib.contextmanager
    def _pause(self, run, in_loop: bool):
        """Times the profiler's own work as a goodput pause when `in_loop` (after the loop,
        goodput already counts it outside the training steps)."""
        self.paused = in_loop
        with run.goodput.pause("profile") if in_loop else contextlib.nullcontext():
            yield

    def close(self, run, step: int | None = None) -> None:
        """Stops the trace, once the traced steps have run, and says where it is (`step`:
        the window's last, in the loop; None: after the loop)."""
        if not self.tracing:
            return
        self.tracing = False
        try:
            jax.block_until_ready(run.state)  # the traced steps' own time: training
        finally:
            with self._pause(run, step is not None):
                jax.profiler.stop_trace()
        last = run.step if step is None else step
        run.logger.print(f"profile: steps {self.began}..{last} traced into {self.directory} "
                         "(open it with XProf or TensorBoard's profile plugin)")
