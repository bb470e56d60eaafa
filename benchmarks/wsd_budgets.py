"""Warmup-stable-decay's promise: one stable run serves several training budgets.

    python benchmarks/wsd_budgets.py [--budgets=300,450,600] [--workdir=DIR]

With `experiments/ablations/schedules.py`'s settings (the small char-level GPT, AdamW at 2e-3,
50 warmup steps; WSD decays linearly over the last 20% of `steps` to 10%), through the real CLI:

1. one WSD run to the largest budget, keeping a checkpoint at the start of every smaller
   budget's decay (0.8 x budget);
2. for each smaller budget, a branch: that checkpoint copied into a new workdir and resumed with
   `--config.steps=BUDGET`, so it decays over its own last 20% (the decay follows `steps`);
3. for comparison, a separate WSD run and a separate cosine run at each budget.

The table gives each budget's final validation loss three ways. A branch trains exactly what a
separate WSD run at its budget trains (the same warmup, the same peak until the decay, the same
data order), so their losses must be equal, bit for bit on one CPU: the script checks it. The
cost column counts the optimizer steps each way needs for all the budgets together.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from absl import app, flags

_BUDGETS = flags.DEFINE_list("budgets", ["300", "450", "600"], "Training budgets (steps).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs go (default: a temp dir).")

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = "experiments/ablations/schedules.py"


def train(workdir: Path, steps: int, decay: str, *more: str) -> None:
    command = [sys.executable, "-m", "transformer.train", f"--config={EXPERIMENT}",
               f"--workdir={workdir}", f"--config.steps={steps}",
               f"--config.optimizer.decay={decay}", "--config.optimizer.decay_fraction=0.2",
               f"--config.eval_every={steps}", *more]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(" ".join(command) + "\n" + result.stderr[-3000:])


def final_loss(workdir: Path) -> float:
    return json.loads((workdir / "summary.json").read_text())["val_loss"]


def branch(stable: Path, at: int, workdir: Path) -> None:
    """A new workdir holding the stable run's checkpoint `at` (and its tokenizer), as if that
    run had stopped there."""
    workdir.mkdir(parents=True)
    shutil.copytree(stable / "checkpoints" / str(at), workdir / "checkpoints" / str(at))
    shutil.copytree(stable / "tokenizer", workdir / "tokenizer")


def main(argv) -> None:
    del argv
    budgets = sorted(int(b) for b in _BUDGETS.value)
    root = Path(_WORKDIR.value or tempfile.mkdtemp(prefix="wsd-budgets-"))
    starts = [round(0.8 * b) for b in budgets[:-1]]
    every = math.gcd(*starts, budgets[-1])  # a checkpoint at every decay start
    stable = root / "stable"
    train(stable, budgets[-1], "wsd", f"--config.checkpoint_every={every}",
          "--config.keep_checkpoints=100")
    rows = []
    for budget, start in zip(budgets, starts + [None], strict=True):
        if start is None:
            one_run = final_loss(stable)
        else:
            branch(stable, start, root / f"branch_{budget}")
            train(root / f"branch_{budget}", budget, "wsd")
            one_run = final_loss(root / f"branch_{budget}")
        train(root / f"wsd_{budget}", budget, "wsd")
        train(root / f"cosine_{budget}", budget, "cosine")
        rows.append((budget, one_run, final_loss(root / f"wsd_{budget}"),
                     final_loss(root / f"cosine_{budget}")))
    shared = budgets[-1] + sum(b - s for b, s in zip(budgets, starts, strict=False))
    print(f"final validation loss by budget ({root}); one WSD run: {shared} steps for all "
          f"budgets, separate runs: {sum(budgets)}\n")
    print("| budget (steps) | WSD, branched from one run | WSD, own run | cosine, own run |")
    print("|---:|---:|---:|---:|")
    for budget, one_run, own, cosine in rows:
        print(f"| {budget} | {one_run:.4f} | {own:.4f} | {cosine:.4f} |")
    equal = all(one_run == own for _, one_run, own, _ in rows)
    print(f"\nbranches equal their own WSD runs bit for bit: {equal}")
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
