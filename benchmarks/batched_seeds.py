"""Batched seeds against one seed after another: N seeds of `small_char_lm` through the sweep CLI.

    python benchmarks/batched_seeds.py [--seeds=4] [--steps=600] [--repeats=2] [--workdir=DIR]

Each side is a real `python -m transformer.sweep --seeds=N` process on a one-variant experiment
(`transformer.configs.small_char_lm`, the ablations' model), once with `--batched_seeds` and once
without, alternating `repeats` times; the table shows each side's best repeat. Wall time is the
whole process (imports, N setups, compiles, training, evaluations, saves, report). Where it goes,
from the runs' own records: the train steps (the logged step times: a batched step trains all N
seeds, so its time counts once, not N times), the first step (compilation included), and the rest
(process start and setup, evaluations, checkpoints, the report). It also says whether the two
sides' losses are equal bit for bit or within 1e-5 relative, and exits 1 only beyond that (the
CLI compiles as users do: under the float32 CPU default's YNNPACK fusions the vmapped gradients
round an ulp apart, docs/ablations.md).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from absl import app, flags

RTOL = 1e-5  # the relative difference in a loss the two sides may show (an ulp is ~1.2e-7)


def _define_flags() -> None:  # (at run time only: the tests import the pure parts)
    flags.DEFINE_integer("seeds", 4, "Seeds of the one variant.")
    flags.DEFINE_integer("steps", 600, "Train steps per seed (small_char_lm's own: 600).")
    flags.DEFINE_integer("repeats", 2, "Timed sweeps per side (the best is shown).")
    flags.DEFINE_string("workdir", None, "Where the sweeps write (default: a temp dir).")

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = textwrap.dedent("""
    from transformer import sweep
    from transformer.configs import small_char_lm


    def get_config():
        config = small_char_lm()
        config.experiment = "batched_seeds_benchmark"
        return config


    def get_sweep():
        return sweep.named({"small_char_lm": {}})
""")


def sweep(experiment: Path, workdir: Path, batched: bool) -> float:
    """Runs one sweep process; returns its wall time."""
    command = [sys.executable, "-m", "transformer.sweep", f"--config={experiment}",
               f"--workdir={workdir}", f"--seeds={flags.FLAGS.seeds}",
               f"--config.steps={flags.FLAGS.steps}"] + (["--batched_seeds"] if batched else [])
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    began = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-2000:] + result.stderr[-2000:])
    return wall


def breakdown(workdir: Path, batched: bool) -> dict:
    """The train steps', first steps' and other seconds of one sweep, from its runs' records."""
    runs = sorted((workdir / "small_char_lm").glob("seed_*"))
    step_seconds, first, losses = [], [], []
    for run in runs:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["split"] == "train"]
        # A log's step_time is the mean over the steps since the previous log (since step 1,
        # whose compile is timed apart, for the first).
        ends = [1] + [r["step"] for r in train]
        step_seconds.append(sum(r["step_time"] * (r["step"] - start)
                                for r, start in zip(train, ends, strict=False)))
        first.append(json.loads((run / "summary.json").read_text())["first_step_seconds"])
        losses.append([r["loss"] for r in records if "loss" in r])
    # A batched step is one program for all the seeds: its time counts once.
    steps = step_seconds[0] if batched else sum(step_seconds)
    compile_ = first[0] if batched else sum(first)
    median_step = statistics.median(
        r["step_time"] for run in runs for r in map(json.loads, (run / "metrics.jsonl")
                                                     .read_text().splitlines())
        if "step_time" in r)
    return {"steps": steps, "first": compile_, "median_step": median_step, "losses": losses}


def compare_losses(separate: list[list[float]], together: list[list[float]],
                   rtol: float = RTOL) -> tuple[str, bool]:
    """How the two sides' losses (a list per seed) agree, and whether that passes: equal bit
    for bit, or each within `rtol` relative (the vmapped gradients may round an ulp apart)."""
    if separate == together:
        return "equal bit for bit", True
    shapes = [len(a) for a in separate] != [len(b) for b in together]
    worst = 0.0 if not shapes else float("inf")
    for a_run, b_run in zip(separate, together, strict=False):
        for a, b in zip(a_run, b_run, strict=False):
            if a != b:
                gap = abs(a - b) / max(abs(a), abs(b))
                worst = max(worst, gap if gap == gap else float("inf"))  # (nan: no match)
    if worst <= rtol:
        return f"not bitwise equal, within {rtol:g} relative (at most {worst:.2g})", True
    what = "a different count" if shapes else f"up to {worst:.2g} relative"
    return f"differ: {what} (beyond {rtol:g})", False


def main(argv) -> None:
    del argv
    root = Path(flags.FLAGS.workdir or tempfile.mkdtemp(prefix="batched-seeds-"))
    root.mkdir(parents=True, exist_ok=True)
    experiment = root / "experiment.py"
    experiment.write_text(EXPERIMENT)
    best: dict[bool, tuple[float, dict]] = {}
    for repeat in range(flags.FLAGS.repeats):
        for batched in (False, True):
            workdir = root / f"{'batched' if batched else 'sequential'}_{repeat}"
            wall = sweep(experiment, workdir, batched)
            parts = breakdown(workdir, batched)
            print(f"repeat {repeat}: {'batched' if batched else 'one after another'}: "
                  f"{wall:.1f} s", flush=True)
            if batched not in best or wall < best[batched][0]:
                best[batched] = (wall, parts)
    (seq_wall, seq), (bat_wall, bat) = best[False], best[True]
    n = flags.FLAGS.seeds
    agreement, close = compare_losses(seq["losses"], bat["losses"])
    print(f"\n{n} seeds of small_char_lm, {flags.FLAGS.steps} steps each, on "
          f"{os.cpu_count()} CPU threads (best of {flags.FLAGS.repeats}); losses {agreement}\n")
    rows = [("wall time, whole sweep (s)", seq_wall, bat_wall),
            ("wall time per seed (s)", seq_wall / n, bat_wall / n),
            ("train steps (s)", seq["steps"], bat["steps"]),
            ("first steps, compilation included (s)", seq["first"], bat["first"]),
            ("the rest: start, setup, evaluations, saves (s)",
             seq_wall - seq["steps"] - seq["first"], bat_wall - bat["steps"] - bat["first"]),
            ("step time per seed-step, median (ms)", 1e3 * seq["median_step"],
             1e3 * bat["median_step"] / n)]
    print("| | one after another | batched | speed-up |")
    print("|---|---:|---:|---:|")
    for name, a, b in rows:
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    if not close:
        sys.exit(f"the batched seeds' losses differ from the separate runs' by more than "
                 f"{RTOL:g} relative")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
