"""nanoGPT's shakespeare_char CPU recipe against ours, trained the same number of steps and scored
on the same validation windows (issue 24).

    python benchmarks/nanogpt_protocol.py --nanogpt_dir=PATH/TO/nanoGPT \
        --data=PATH/tinyshakespeare.txt [--steps=2000] [--windows=2400] [--seed=0] \
        [--workdir=DIR] [--output=results.json] [--torch_threads=N] [--skip_nanogpt] [--skip_ours]

1. Writes nanoGPT's `data/shakespeare_char/` (train.bin / val.bin: uint16 char ids, an id being
   the character's index in the sorted set of the text's characters; the first 90% / last 10% of
   the text; meta.pkl with vocab_size, stoi, itos) into WORKDIR/nanogpt, the directory nanoGPT's
   train.py runs in (it reads `data/<dataset>` and `configurator.py` relative to its working
   directory; configurator.py is linked there from the checkout, nothing of nanoGPT is copied).
2. Trains nanoGPT's CPU recipe from its README, unmodified (`train.py
   config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
   --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
   --max_iters=STEPS --lr_decay_iters=STEPS --dropout=0.0`), evaluating only at the start and
   the end (`--eval_interval=STEPS`) and saving the end's checkpoint
   (`--always_save_checkpoint=True`).
3. Trains ours right after it: `python -m transformer.train
   --config=experiments/gpt_shakespeare_char.py:cpu --config.data.path=DATA
   --config.steps=STEPS --config.eval_every=STEPS` (evaluating at the end only).
4. Scores both final models on the same `--windows` windows of 65 characters drawn with
   `--seed` from the last 10% of the text (nanoGPT's estimate_loss protocol: the mean
   cross-entropy of each window's 64 next-character predictions), each model reading the
   characters through its own tokenizer (nanoGPT: meta.pkl's stoi; ours: the run's saved char
   tokenizer); also on as many windows from the first 90% (the training text). The table has
   the paired difference of the validation losses with its standard error over windows.
5. Prints a markdown table (and writes JSON to `--output`): each side's loss on the shared
   windows, its own final train loss (nanoGPT: its estimate_loss over 20 random training
   batches at the end; ours: the last step's batch loss), its wall time (the whole training
   command: start-up, compilation, the evaluations it runs itself and checkpointing included)
   and steps; the CPU and the torch / JAX versions. The two trainings run one right after
   the other, so on a shared machine compare their wall times with care.

The recipes match in: the model (4 layers, 4 heads, 128 wide, MLP 512, pre-LN LayerNorm
without biases, eps 1e-5, learned positions, tied embeddings, no biases, dropout 0, float32,
exact (erf) GELU), init N(0, 0.02) for embeddings and projections, context 64, batch 12,
AdamW (lr 1e-3, b1 0.9, b2 0.99, eps 1e-8, weight decay 0.1 on the parameters of >= 2
dimensions, embeddings included), global-norm clipping at 1.0, 100 warmup steps then cosine
decay to 1e-4 at STEPS. What still differs:

- Residual projections' init: nanoGPT draws attention's and the MLP's output projections
  (c_proj) with std 0.02 / sqrt(2 n_layer) (0.0071 here); ours with 0.02, like every other
  projection. The library now has it (`model.scale_residual_init=True`); this protocol keeps
  it off so that the table docs/performance.md quotes stays the one measured.
- Warmup: nanoGPT's step i (0-based) uses lr (i + 1) / 101 of the peak, ours i / 100 (optax's
  warmup from 0: our first update has learning rate 0). The cosine part is the same.
- Training data order: nanoGPT draws each batch's 12 windows at uniformly random offsets of
  train.bin (with replacement); ours reads the training text in epochs (every window once per
  epoch, at a seeded offset, in a seeded order; 2000 steps are about 1.5 epochs).
- Vocabulary: nanoGPT's 65 characters of the whole text; ours the 7 special ids plus the
  characters of the training 90% (its tokenizer is built from the train split), and the
  stream's one <eos> at its end.
- Seeds: nanoGPT's train.py always seeds torch with 1337; ours uses `--seed`.
- nanoGPT runs one more optimizer step after its last checkpoint (its loop ends after step
  STEPS + 1); the checkpoint scored is the one after STEPS steps, like ours.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import tempfile

import numpy as np
from absl import app, flags, logging
from nanogpt_common import (  # benchmarks/nanogpt_common.py
    cpu_model,
    link_configurator,
    prepare_nanogpt_data,
    split_text,
    timed_run,
    versions,
)

_NANOGPT = flags.DEFINE_string("nanogpt_dir", None, "A checkout of karpathy/nanoGPT.")
_DATA = flags.DEFINE_string("data", None, "tinyshakespeare.txt (the text both sides train on).")
_STEPS = flags.DEFINE_integer("steps", 2000, "Training steps of each side.")
_WINDOWS = flags.DEFINE_integer("windows", 2400, "Shared evaluation windows per split.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the evaluation windows and of our run.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where both runs go (default: a temp dir).")
_OUTPUT = flags.DEFINE_string("output", "", "Also write the results here as JSON.")
_TORCH_THREADS = flags.DEFINE_integer(
    "torch_threads", 0, "OMP_NUM_THREADS for nanoGPT's training (0: torch's default, one per "
    "core). On a machine other jobs load, 1 avoids torch's multi-threaded stalls.")
_SKIP_NANOGPT = flags.DEFINE_bool("skip_nanogpt", False, "Do not train nanoGPT (score the "
                                  "run already in --workdir, if any).")
_SKIP_OURS = flags.DEFINE_bool("skip_ours", False, "Do not train ours (score the run already "
                               "in --workdir, if any).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 64
NANOGPT_ARGS = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
                "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--dropout=0.0", "--always_save_checkpoint=True"]


def train_nanogpt(nanogpt_dir: str, text: str, directory: str, steps: int,
                  threads: int = 0) -> dict:
    os.makedirs(directory, exist_ok=True)
    prepare_nanogpt_data(text, os.path.join(directory, "data", "shakespeare_char"))
    link_configurator(nanogpt_dir, directory)
    command = [sys.executable, os.path.join(nanogpt_dir, "train.py"),
               os.path.join(nanogpt_dir, "config", "train_shakespeare_char.py"), *NANOGPT_ARGS,
               f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps}",
               "--out_dir=out"]
    print("nanoGPT:", " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    seconds = timed_run(command, directory, os.path.join(directory, "train.log"), env)
    run = {"wall_s": seconds, "steps": steps, "torch_threads": threads or "default"}
    with open(os.path.join(directory, "run.json"), "w") as f:
        json.dump(run, f)
    return run


def train_ours(data: str, workdir: str, steps: int, seed: int) -> dict:
    command = [sys.executable, "-m", "transformer.train",
               "--config=experiments/gpt_shakespeare_char.py:cpu", f"--config.data.path={data}",
               f"--config.steps={steps}", f"--config.eval_every={steps}",
               f"--config.seed={seed}", f"--workdir={workdir}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    print("ours:", " ".join(command), flush=True)
    os.makedirs(workdir, exist_ok=True)
    seconds = timed_run(command, ROOT, os.path.join(workdir, "train.log"), env)
    run = {"wall_s": seconds, "steps": steps}
    with open(os.path.join(workdir, "run.json"), "w") as f:
        json.dump(run, f)
    return run


def windows(text: str, count: int, seed: int) -> list[str]:
    """`count` windows of CONTEXT + 1 characters at uniformly random offsets of `text`."""
    starts = np.random.default_rng(seed).integers(0, len(text) - CONTEXT, size=count)
    return [text[s:s + CONTEXT + 1] for s in starts]


def per_window_losses(ids: np.ndarray, logits_fn, batch: int = 240) -> np.ndarray:
    """Mean next-token cross-entropy of each row of `ids` [N, CONTEXT + 1] (float64)."""
    out = []
    for i in range(0, len(ids), batch):
        rows = ids[i:i + batch]
        logits = np.asarray(logits_fn(rows[:, :-1]), np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(log_probs, rows[:, 1:, None], -1)[..., 0]
        out.append(-picked.mean(-1))
    return np.concatenate(out)


def score_nanogpt(nanogpt_dir: str, directory: str, texts: dict[str, list[str]]) -> dict:
    """Loads out/ckpt.pt as nanoGPT's sample.py does and scores it on `texts`."""
    import torch

    sys.path.insert(0, nanogpt_dir)
    from model import GPT, GPTConfig  # nanoGPT's model.py

    checkpoint = torch.load(os.path.join(directory, "out", "ckpt.pt"), map_location="cpu")
    model = GPT(GPTConfig(**checkpoint["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
    model.load_state_dict(state)
    model.eval()
    with open(os.path.join(directory, "data", "shakespeare_char", "meta.pkl"), "rb") as f:
        stoi = pickle.load(f)["stoi"]

    @torch.no_grad()
    def logits_fn(x):
        # GPT.forward returns only the last position's logits without targets; pass dummy
        # targets to get every position's.
        x = torch.from_numpy(x.astype(np.int64))
        return model(x, torch.zeros_like(x))[0].numpy()

    scores = {split: per_window_losses(np.array([[stoi[c] for c in w] for w in ws]),
                                       logits_fn) for split, ws in texts.items()}
    with open(os.path.join(directory, "train.log")) as f:
        log = f.read()
    found = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", log)
    own = {"own_train_loss": float(found[-1][1]), "own_val_loss": float(found[-1][2]),
           "checkpoint_step": int(checkpoint["iter_num"])}
    return {"losses": scores, **own}


def score_ours(workdir: str, texts: dict[str, list[str]]) -> dict:
    import jax

    from transformer.generate import load_workdir

    model, params, tokenizer, config = load_workdir(workdir)
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
    unknown = sorted({c for ws in texts.values() for c in tokenizer.unknown_chars("".join(ws))})
    if unknown:
        print(f"ours: characters outside the run's vocabulary (scored as <unk>): {unknown}")
    scores = {split: per_window_losses(np.stack([np.asarray(tokenizer.encode(w), np.int32)
                                                 for w in ws]),
                                       lambda x: apply(params, x)) for split, ws in texts.items()}
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    return {"losses": scores, "own_train_loss": summary["loss"],
            "own_val_loss": summary.get("val_loss"), "checkpoint_step": summary["step"]}


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax's restore logs
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU recipe; libtpu need not probe
    if not _DATA.value:
        raise app.UsageError("--data=PATH/tinyshakespeare.txt is required")
    if not _NANOGPT.value:
        raise app.UsageError("--nanogpt_dir=PATH (a checkout of karpathy/nanoGPT) is required")
    nanogpt_dir = os.path.abspath(_NANOGPT.value)
    data = os.path.abspath(_DATA.value)
    workdir = os.path.abspath(_WORKDIR.value or tempfile.mkdtemp(prefix="nanogpt_protocol_"))
    steps = _STEPS.value
    with open(data, encoding="utf-8") as f:
        text = f.read()
    nanogpt_run, ours_run = os.path.join(workdir, "nanogpt"), os.path.join(workdir, "ours")
    print(f"workdir: {workdir}", flush=True)

    for skip, directory in ((_SKIP_NANOGPT, nanogpt_run), (_SKIP_OURS, ours_run)):
        if not skip.value and os.path.exists(directory):
            raise app.UsageError(f"{directory} exists: use a new --workdir, or --{skip.name} to "
                                 "score the run already there")
    runs = {}
    if not _SKIP_NANOGPT.value:
        runs["nanoGPT"] = train_nanogpt(nanogpt_dir, text, nanogpt_run, steps,
                                         _TORCH_THREADS.value)
    if not _SKIP_OURS.value:
        runs["ours"] = train_ours(data, ours_run, steps, _SEED.value)
    for side, directory in (("nanoGPT", nanogpt_run), ("ours", ours_run)):
        if side not in runs and os.path.isfile(os.path.join(directory, "run.json")):
            with open(os.path.join(directory, "run.json")) as f:
                runs[side] = json.load(f)  # skipped: the run already in --workdir

    train_text, val_text = split_text(text)
    texts = {"val": windows(val_text, _WINDOWS.value, _SEED.value),
             "train": windows(train_text, _WINDOWS.value, _SEED.value + 1)}
    scores = {}
    if "nanoGPT" in runs:
        scores["nanoGPT"] = score_nanogpt(nanogpt_dir, nanogpt_run, texts)
    if "ours" in runs:
        scores["ours"] = score_ours(ours_run, texts)

    results = {"steps": steps, "windows": _WINDOWS.value, "seed": _SEED.value,
               "cpu": cpu_model(), "versions": versions(), "workdir": workdir, "sides": {}}
    lines = ["| side | val loss (shared windows) | train loss (shared windows) | own final "
             "train loss | wall time (s) | steps |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for side, score in scores.items():
        val, train = score["losses"]["val"], score["losses"]["train"]
        row = {"val_loss": float(val.mean()), "train_loss_shared": float(train.mean()),
               "own_train_loss": score["own_train_loss"], "own_val_loss": score["own_val_loss"],
               "checkpoint_step": score["checkpoint_step"], **runs[side]}
        results["sides"][side] = row
        lines.append(f"| {side} | {row['val_loss']:.4f} | {row['train_loss_shared']:.4f} | "
                     f"{row['own_train_loss']:.4f} | {row['wall_s']:.0f} | "
                     f"{row['checkpoint_step']} |")
    if len(scores) == 2:
        diff = scores["ours"]["losses"]["val"] - scores["nanoGPT"]["losses"]["val"]
        results["val_loss_difference"] = {"mean": float(diff.mean()),
                                          "stderr": float(diff.std(ddof=1) / len(diff) ** 0.5)}
    print()
    print("\n".join(lines))
    if "val_loss_difference" in results:
        d = results["val_loss_difference"]
        print(f"\nours - nanoGPT, val loss on the same {_WINDOWS.value} windows: "
              f"{d['mean']:+.4f} +- {d['stderr']:.4f} (standard error, paired by window)")
    v = results["versions"]
    print(f"CPU: {results['cpu']}; torch {v.get('torch', '-')}, jax {v['jax']}, "
          f"python {v['python']}")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump({**results, "table": "\n".join(lines)}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
