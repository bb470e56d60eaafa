"""Goodput: where a training's wall time goes, summed over every start of it (its restarts).

Each process that trains the workdir (process 0 of a multi-host run) times its parts:

- start-up: from the process's start (a CLI run's; in-process, `train.setup`'s call) to the
  training loop (checks, data, restore);
- compilation: the process's first train step (tracing and compiling it, and running it once),
  less its wait for data;
- productive: the training steps after it, with their host work (logging); `goodput` is this
  part of the total;
- waiting for data: the loop blocked on the input iterator (`next`);
- evaluation: validation in the loop (its compilation included), and the test split and other
  lengths after it;
- checkpoint saves: the blocking part of each save, and the wait for the last async save;
- restarts: in every start after the first, its start-up and compilation; and the productive
  time of steps trained again after a preemption (those after the checkpoint the next start
  resumed from);
- other: the profiler's trace start and stop in the loop (config.profile), and the rest after
  the loop (closing the logs and the data).

Evaluations, saves and the trace's start and stop are the loop's own `pauses`
(progress.log_train's ETA reads the first two), so nothing is timed twice. The ledger,
WORKDIR/goodput.json, holds each start's parts and, at each checkpoint, its productive time so
far; it is rewritten at every log and save, so a process killed without warning loses at most
its time since the last one. The totals are in
summary.json ("goodput") and in the line printed at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

from transformer.utils import fileio

LEDGER = "goodput.json"
# The parts, in the order of the line at the end: (key, what the line calls it).
PARTS = (("productive", "training steps"), ("startup", "start-up"),
         ("compilation", "compilation"), ("data", "waiting for data"),
         ("evaluation", "evaluation"), ("checkpoint", "checkpoint saves"),
         ("restarts", "restarts"), ("other", "other"))
MARKS = 64  # the checkpoints a start remembers (a resume picks one of the newest)
REMOTE_WRITE_EVERY = 60.0  # seconds between ledger writes to an object store (gs://)


def process_age() -> float:
    """Seconds since this process started (from /proc on Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after comm
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - started / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


class Clock:
    """This process's time by part, and its record in the workdir's ledger (written when
    `enabled`: process 0)."""

    def __init__(self, workdir: str, start_step: int, started: float | None = None,
                 enabled: bool = True):
        self.path = fileio.join(workdir, LEDGER)
        self.enabled = enabled
        self.started = time.perf_counter() if started is None else started
        self.loop_start = self.loop_end = self.compilation = None
        self.data = 0.0
        self.after = {"evaluation": 0.0, "checkpoint": 0.0}  # after the loop
        # the loop's evaluations, saves and profiler trace starts and stops, in seconds
        self.pauses = {"eval": [], "tasks": [], "save": [], "profile": []}
        self.record = {"start_step": start_step, "step": start_step,
                       "marks": [[start_step, 0.0]]}
        self.previous = self._read() if enabled else []
        self.written = -math.inf

    def _read(self) -> list[dict]:
        path = fileio.path(self.path)
        try:
            return json.loads(path.read_text())["starts"] if path.exists() else []
        except (ValueError, KeyError, TypeError):
            return []  # unreadable (an older format): the totals start again here

    def seconds(self) -> dict[str, float]:
        """This process's parts so far (not `restarts`: that is read across starts)."""
        now = time.perf_counter()
        start = now if self.loop_start is None else self.loop_start
        end = now if self.loop_end is None else self.loop_end
        evaluation = sum(self.pauses["eval"]) + sum(self.pauses["tasks"])
        saves = sum(self.pauses["save"])
        profile = sum(self.pauses["profile"])
        in_loop = max(end - start, 0.0) - self.data - evaluation - saves - profile
        compilation = in_loop if self.compilation is None else self.compilation
        return {"startup": start - self.started, "compilation": compilation,
                "productive": in_loop - compilation, "data": self.data,
                "evaluation": evaluation + self.after["evaluation"],
                "checkpoint": saves + self.after["checkpoint"],
                "other": profile + max(now - end - sum(self.after.values()), 0.0)}

    def begin_loop(self) -> None:
        self.loop_start = time.perf_counter()
        self.heartbeat(self.record["step"], force=True)

    def next_batch(self, iterator):
        """next(iterator), its wait counted as waiting for data."""
        began = time.perf_counter()
        try:
            return next(iterator)
        finally:
            self.data += time.perf_counter() - began

    def compiled(self, now: float) -> None:
        """The first step ended at `now` (perf_counter); a pause in it (the trace's start) is
        not compilation."""
        if self.compilation is None and self.loop_start is not None:
            self.compilation = now - self.loop_start - self.data - sum(
                map(sum, self.pauses.values()))

    @contextlib.contextmanager
    def pause(self, kind: str):
        """Times a validation ("eval"), the lm-eval tasks ("tasks"), a save ("save") or the
        profiler's trace start or stop ("profile") in the loop, into `pauses`."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.pauses[kind].append(time.perf_counter() - began)

    def end_loop(self) -> None:
        """The loop has ended (at the first call): what follows is timed after it."""
        if self.loop_end is None:
            self.loop_end = time.perf_counter()

    @contextlib.contextmanager
    def after_loop(self, part: str):
        """Times `part` ("evaluation" or "checkpoint") after the loop has ended."""
        self.end_loop()
        began = time.perf_counter()
        try:
            yield
        finally:
            self.after[part] += time.perf_counter() - began

    def saved(self, step: int) -> None:
        """Checkpoint `step` is being saved: a start resuming from it loses only what follows."""
        marks = self.record["marks"]
        marks.append([step, self.seconds()["productive"]])
        del marks[1:-MARKS]
        self.heartbeat(step, force=True)

    def heartbeat(self, step: int, force: bool = False) -> None:
        """Records the step reached and rewrites the ledger (to an object store at most every
        REMOTE_WRITE_EVERY seconds unless `force`)."""
        self.record["step"] = step
        now = time.perf_counter()
        if not self.enabled or (not force and fileio.is_remote(self.path) and
                                now - self.written < REMOTE_WRITE_EVERY):
            return
        self.written = now
        fileio.write_atomic(self.path, json.dumps({"starts": self.starts()}))

    def starts(self) -> list[dict]:
        """The ledger: the earlier starts' records and this one's, with its parts so far."""
        return self.previous + [{**self.record, "seconds": self.seconds()}]

    def close(self, step: int) -> dict:
        """Writes the ledger a last time; returns the totals over every start (`totals`)."""
        self.record["step"] = step
        starts = self.starts()
        if self.enabled:
            fileio.write_atomic(self.path, json.dumps({"starts": starts}))
        return totals(starts)


def totals(starts: list[dict]) -> dict:
    """The parts summed over the starts, with what restarts lost moved to `restarts`: a later
    start's start-up and compilation, and the productive time of the steps an earlier start
    trained after the checkpoint a later one resumed from."""
    parts = dict.fromkeys((key for key, _ in PARTS), 0.0)
    recomputed = 0
    for j, start in enumerate(starts):
        own = {**start["seconds"], "restarts": 0.0}
        later = [s["start_step"] for s in starts[j + 1:]]
        if later and start["step"] > min(later):
            kept = min(later)
            base = max((m for m in start["marks"] if m[0] <= kept), default=(kept, 0.0))
            lost = max(own["productive"] - base[1], 0.0)
            own["productive"] -= lost
            own["restarts"] += lost
            recomputed += start["step"] - max(kept, start["start_step"])
        if j > 0:
            own["restarts"] += own.pop("startup") + own.pop("compilation")
        for key, value in own.items():
            parts[key] += value
    total = sum(parts.values())
    return {"goodput": parts["productive"] / total if total > 0 else None,
            "total_seconds": total, **{f"{key}_seconds": v for key, v in parts.items()},
            "starts": len(starts), "steps_recomputed": recomputed}


def line(result: dict) -> str:
    """The line at the end of a run: goodput, then each part."""
    head = (f"goodput {result['goodput']:.1%}" if result["goodput"] is not None else "goodput -")
    starts = result["starts"]
    parts = []
    for key, name in PARTS:
        text = f"{name} {result[f'{key}_seconds']:.1f} s"
        if key == "restarts":
            text += f" ({result['steps_recomputed']} steps recomputed)"
        parts.append(text)
    return (f"{head} of {result['total_seconds']:.1f} s over {starts} "
            f"start{'s' if starts != 1 else ''}: " + ", ".join(parts))
