"""kill -9 stress test: training killed at random moments resumes to the same bits.

    python benchmarks/fault_injection.py [--trials=20] [--steps=40] [--max_kills=3] [--seed=0]
        [--root=/tmp/fault_injection]

Trains a tiny GPT (experiments/gpt_tiny.py shrunk, dropout on, a checkpoint every 2 steps,
written asynchronously) through the real CLI, uninterrupted as the reference (twice; kill times
come from the faster run, since the first pays for cold caches). Then, per trial, starts the
same command in a fresh workdir and SIGKILLs it at a random moment (up to `max_kills` times;
each kill, with equal odds, at a uniform time within the reference's whole
wall time or within its training phase, counted from the first logged step), restarts
it, and finally lets it finish. A kill can land anywhere: during start-up, compilation, a step,
or an async checkpoint write (counted when a temporary Orbax directory was left behind). Each
trial then checks that the final train state is bitwise equal to the reference's and that every
step's logged loss equals the reference's. Prints one row per trial and a summary; exits 1 if
any trial differs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = ["--config.model.num_layers=2", "--config.model.d_model=32",
              "--config.model.num_heads=2", "--config.model.d_ff=64",
              "--config.model.dropout_rate=0.1"]


def command(workdir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "transformer.train", "--config=experiments/gpt_tiny.py",
            f"--workdir={workdir}", f"--config.steps={steps}", "--config.batch_size=2",
            "--config.seq_len=16", "--config.log_every=1", f"--config.eval_every={steps}",
            "--config.eval_steps=1", "--config.checkpoint_every=2", *TINY_MODEL]


def environment() -> dict[str, str]:
    xla = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
            "XLA_FLAGS": xla.strip()}


# How a run starts: tests/test_faults.py sets tests/forkserver.Popen (the same command, forked
# from a process that has already imported the package).
popen = subprocess.Popen


def start(workdir: Path, steps: int, log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return popen(command(workdir, steps), cwd=REPO, env=environment(), stdout=out,
                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def checkpoints(workdir: Path) -> tuple[list[int], int]:
    """(complete checkpoint steps, number of temporary, i.e. unfinished, step directories)."""
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return [], 0
    names = [p.name for p in directory.iterdir()]
    return sorted(int(n) for n in names if n.isdigit()), sum("tmp" in n for n in names)


def final_state(workdir: Path, step: int) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(workdir / "checkpoints" / str(step) / "state")
    leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(state))
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if r["split"] == "train"]
    if len(train) != len({s for s, _ in train}):
        raise AssertionError(f"{workdir}: steps logged twice: {[s for s, _ in train]}")
    return dict(train)


def wait_for_training(process: subprocess.Popen, log: Path, offset: int) -> bool:
    """Waits until the run logs its first step (past byte `offset` of its log); False if it
    exits first."""
    while process.poll() is None:
        with open(log, "rb") as f:
            f.seek(offset)
            if b"\nstep " in f.read():
                return True
        time.sleep(0.02)
    return False


def reference_run(root: Path, steps: int, runs: int = 2) -> tuple[Path, float, float]:
    """The uninterrupted run: (workdir, wall seconds, seconds from the first step to exit).

    Run `runs` times in fresh workdirs, keeping the shortest times: the first run of a session
    pays for cold caches, and kill times drawn from its longer span would often come after a
    trial's run has already finished."""
    walls, trainings = [], []
    for index in range(runs):
        suffix = "" if index == 0 else f"_{index}"
        workdir, log = root / f"reference{suffix}", root / f"reference{suffix}.log"
        began = time.perf_counter()
        process = start(workdir, steps, log)
        wait_for_training(process, log, 0)
        training = time.perf_counter()
        if process.wait() != 0:
            raise RuntimeError(f"the reference run failed: see {log}")
        end = time.perf_counter()
        walls.append(end - began)
        trainings.append(end - training)
    return root / "reference", min(walls), min(trainings)


def trial(root: Path, index: int, steps: int, max_kills: int, wall: float, training: float,
          rng: random.Random, reference: dict, reference_losses: dict) -> dict:
    """One trial: kill -9 up to `max_kills` times at random moments, then run to the end. Each
    kill is, with equal odds, uniform over the whole run or over its training phase (from the
    first logged step), where the async checkpoint writes happen."""
    workdir, log = root / f"trial_{index:02d}", root / f"trial_{index:02d}.log"
    kills, mid_write, resumed_from = [], 0, []
    for _ in range(rng.randint(1, max_kills)):
        resumed_from.append(max(checkpoints(workdir)[0], default=0))
        offset = log.stat().st_size if log.exists() else 0
        process = start(workdir, steps, log)
        during_training = rng.random() < 0.5
        delay = rng.uniform(0.0, training if during_training else wall)
        if during_training and not wait_for_training(process, log, offset):
            delay = 0.0  # it exited before training (nothing left to do)
        try:
            process.wait(timeout=delay)  # finished before the kill: nothing to kill
        except subprocess.TimeoutExpired:
            process.kill()  # SIGKILL
            process.wait()
            saved, unfinished = checkpoints(workdir)
            kills.append((("after step 1: " if during_training else "") + f"{delay:.2f} s",
                          max(saved, default=0)))
            mid_write += unfinished > 0
    resumed_from.append(max(checkpoints(workdir)[0], default=0))
    process = start(workdir, steps, log)
    if process.wait() != 0:
        return dict(trial=index, kills=kills, mid_write=mid_write, resumed_from=resumed_from,
                    params_equal=False, losses_equal=False, error=f"final run failed: {log}")
    import numpy as np

    state = final_state(workdir, steps)
    params_equal = state.keys() == reference.keys() and all(
        np.array_equal(state[k], v) for k, v in reference.items())
    return dict(trial=index, kills=kills, mid_write=mid_write, resumed_from=resumed_from,
                params_equal=params_equal, losses_equal=losses(workdir) == reference_losses,
                error="")


def run(root: Path, trials: int, steps: int, max_kills: int, seed: int, report=print) -> list:
    """Runs the reference and `trials` kill/resume trials under `root`; returns the rows."""
    root.mkdir(parents=True, exist_ok=True)
    reference_dir, wall, training = reference_run(root, steps)
    reference = final_state(reference_dir, steps)
    reference_losses = losses(reference_dir)
    report(f"reference: {steps} steps in {wall:.1f} s, {training:.1f} s of it from the first "
           f"step on; each kill at a uniform time in one of the two, with equal odds")
    report("| trial | kill -9 at (s, newest complete checkpoint then) | mid-write kills | "
           "resumed from steps | final state bitwise equal | losses equal |")
    report("| ---: | :--- | ---: | :--- | :--- | :--- |")
    rng, rows = random.Random(seed), []
    for index in range(trials):
        row = trial(root, index, steps, max_kills, wall, training, rng, reference,
                    reference_losses)
        rows.append(row)
        kills = ", ".join(f"{t} (step {s})" for t, s in row["kills"]) or "finished first"
        report(f"| {index} | {kills} | {row['mid_write']} | {row['resumed_from']} | "
               f"{'yes' if row['params_equal'] else 'NO'} | "
               f"{'yes' if row['losses_equal'] else 'NO'} {row['error']} |")
    return rows


_TRIALS = flags.DEFINE_integer("trials", 20, "Kill/resume trials.")
_STEPS = flags.DEFINE_integer("steps", 40, "Train steps per run.")
_MAX_KILLS = flags.DEFINE_integer("max_kills", 3, "Kills per trial: uniform in 1..max_kills.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the kill times.")
_ROOT = flags.DEFINE_string("root", "/tmp/fault_injection", "Where the workdirs go (wiped).")


def main(argv) -> None:
    del argv
    import shutil

    from absl import logging
    logging.set_verbosity(logging.WARNING)  # Orbax logs every read at INFO

    root = Path(_ROOT.value)
    shutil.rmtree(root, ignore_errors=True)
    rows = run(root, _TRIALS.value, _STEPS.value, _MAX_KILLS.value, _SEED.value)
    kills = sum(len(r["kills"]) for r in rows)
    good = sum(r["params_equal"] and r["losses_equal"] for r in rows)
    print(f"\n{good}/{len(rows)} trials bitwise equal to the uninterrupted run; {kills} kills, "
          f"{sum(r['mid_write'] for r in rows)} of them during an async checkpoint write")
    sys.exit(0 if good == len(rows) else 1)


if __name__ == "__main__":
    app.run(main)
