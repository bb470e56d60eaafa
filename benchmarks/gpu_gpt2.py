"""GPT-2 124M on one GPU, ours against nanoGPT's model and training loop on the same tokens, then
the token mixers' decode table (issue 58). One command, one markdown report.

The device run, on one H100 or H200 (estimated 6 minutes, under 10). The repository need not be
installed there; `benchmarks/gpu_bundle.sh NANOGPT_CHECKOUT`, run beforehand where pip reaches
PyPI, copies the nanoGPT checkout (karpathy/nanoGPT; written against commit 3adf61e) to
build/nanoGPT and puts the wheels a GPU image without a package index lacks (grain,
array_record, ml_collections, tensorboardX) in build/wheels, so with build/ carried to the
machine the run is one command:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
        build/wheels/*.whl && PYTHONPATH=/tmp/site python3 benchmarks/gpu_gpt2.py \\
        --nanogpt_dir=build/nanoGPT --output=$OUT/gpu_gpt2.md

Other flags: [--steps=500] [--batch_size=16] [--skip=train,decode] [--nanogpt_compile=False]
[--mixers=gqa,mha,mla,gated_deltanet,mamba2] [--contexts=1024,8192,32768] [--kv_heads=4]
[--batch_sizes=1] [--new_tokens=128] [--repeats=3].

Without a GPU it stops with one line, unless `--allow_cpu`: then the same logic runs on the CPU
at tiny sizes (each flag not given takes its `CPU_SIZES` value), float32, nanoGPT uncompiled.

1. Training. Both sides train GPT-2 124M as nanoGPT's train.py defines it (12 layers, 12
   heads, 768 wide, context 1024, vocab 50304, pre-LN LayerNorm and Linear without biases,
   exact GELU, learned positions, tied embeddings, dropout 0, N(0, 0.02) init with the residual
   projections at 0.02 / sqrt(2 x 12)) for `--steps` steps of `--batch_size` rows, on the same
   batches in the same order: windows drawn with `--seed` from the first 90% of the embedded
   corpus (Python's docs and standard library, one token per UTF-8 byte: ids 0-255 of the
   vocabulary; `nanogpt_common.corpus_bytes`), no download. Both follow one learning-rate
   schedule (ours, `optim.learning_rate_schedule`: linear warmup over `--warmup_steps` to
   `--learning_rate`, cosine to a tenth at the last step; nanoGPT's param groups are set to it
   each step) with train.py's AdamW (b1 0.9, b2 0.95, weight decay 0.1 on >= 2-D params) and
   clipping at 1.0.
   - ours: the train step `python -m transformer.train` runs (`compile_time.build_train_step`),
     bf16 compute with float32 params, attention "auto" (cuDNN on a GPU);
   - nanoGPT: model.py's GPT and configure_optimizers (fused AdamW on CUDA) imported from
     `--nanogpt_dir`, `torch.compile(model)`, bf16 autocast and TF32 as train.py sets them,
     and train.py's loop body each step (forward, backward, clip_grad_norm_, step,
     zero_grad(set_to_none=True)). train.py itself is not run: it draws its own batches.
   tokens/s: the steps after `--timed_from` (compilation left out), synced at both ends, the
   losses kept on the device until the end. MFU = tokens/s x (6 N + 12 L D T) / the chip's
   published bf16 dense peak (`metrics.PEAK_FLOPS`: 989 TFLOP/s for H100 SXM and H200, NVIDIA's
   datasheets), N nanoGPT's count for both. Loss at equal steps: each side's training loss,
   the mean over the `steps // 20` steps up to a quarter, half, three quarters and all of the
   steps; and both final models on the same `--eval_batches` batches of the held-out 10%.
2. Decode: `benchmarks/decode.py --table=mixers` at this model's shape (12 x 768, 12 heads,
   vocab 50304, bf16): tokens/s and cache bytes per sequence per token mixer at each context.
   decode.py's flags --mixers, --contexts, --kv_heads, --batch_sizes, --new_tokens and
   --repeats apply (here --batch_sizes defaults to 1 and --mixers adds multi-head attention).

The report (device, versions, the command, a table per section, notes) goes to stdout and, after
each section and each mixer, to `--output` (a run cut short keeps what it finished). Exits 1 if
a section, a side or a mixer failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the repository, where it is not installed (a device's copy)
    sys.path.insert(0, ROOT)

import decode as decode_benchmark  # noqa: E402 - benchmarks/decode.py (its flags size decode)
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from nanogpt_common import (  # noqa: E402 - benchmarks/nanogpt_common.py
    checked_sections_and_gpu,
    chip_peak,
    corpus_bytes,
    device_line,
    gpt_flops_per_token,
    nanogpt_params,
    random_windows,
)

SECTIONS = ("train", "decode")

_NANOGPT = flags.DEFINE_string("nanogpt_dir", None, "A checkout of karpathy/nanoGPT (without "
                               "it only ours trains).")
_OUTPUT = flags.DEFINE_string("output", "", "Also write the markdown report here.")
_ALLOW_CPU = flags.DEFINE_bool("allow_cpu", False, "Run without a GPU, at CPU_SIZES.")
_SKIP = flags.DEFINE_list("skip", [], f"Sections to leave out, of {','.join(SECTIONS)}.")
_STEPS = flags.DEFINE_integer("steps", 500, "Training steps of each side.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Rows per step (nanoGPT's micro-batch is 12).")
_CONTEXT = flags.DEFINE_integer("block_size", 1024, "Context (GPT-2's 1024).")
_LAYERS = flags.DEFINE_integer("n_layer", 12, "Layers (GPT-2 124M's 12).")
_HEADS = flags.DEFINE_integer("n_head", 12, "Heads (12).")
_WIDTH = flags.DEFINE_integer("n_embd", 768, "Width (768).")
_VOCAB = flags.DEFINE_integer("vocab_size", 50304, "Vocabulary (GPT-2's 50257 padded, as "
                              "nanoGPT does).")
_LR = flags.DEFINE_float("learning_rate", 6e-4, "Peak learning rate (train.py's 6e-4).")
_WARMUP = flags.DEFINE_integer("warmup_steps", 50, "Linear warmup steps.")
_TIMED_FROM = flags.DEFINE_integer("timed_from", 10, "Steps before the timed window (their "
                                   "compilation and warm-up left out).")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 8, "Held-out batches scoring both models.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the batches and of our init.")
_NANOGPT_COMPILE = flags.DEFINE_bool("nanogpt_compile", True, "torch.compile nanoGPT's model on "
                                     "a GPU (train.py's default).")

# What a flag not given takes: on a GPU (decode.py's flags), and under --allow_cpu without one.
GPU_DEFAULTS = dict(batch_sizes=["1"], kv_heads=4,
                    mixers=["gqa", "mha", "mla", "gated_deltanet", "mamba2"])
CPU_SIZES = dict(steps=8, batch_size=2, block_size=32, n_layer=2, n_head=2, n_embd=32,
                 warmup_steps=2, timed_from=2, eval_batches=2, batch_sizes=["1"],
                 contexts=["32", "64"], new_tokens=4, kv_heads=1, repeats=3,
                 mixers=["gqa", "mla", "gated_deltanet", "mamba2"])
HELD_OUT = 0.1  # the corpus' last tenth scores both models


# -----------------------------------------------------------------------------
# 1. Training


def sizes() -> dict:
    return dict(layers=_LAYERS.value, heads=_HEADS.value, width=_WIDTH.value,
                context=_CONTEXT.value, batch=_BATCH.value, vocab=_VOCAB.value)


def features(windows_BT1: np.ndarray) -> dict:
    """Our pipeline's features of [B, T + 1] windows: inputs, next-token targets, all weighted."""
    inputs, targets = windows_BT1[:, :-1], windows_BT1[:, 1:]
    return {"inputs": np.ascontiguousarray(inputs), "targets": np.ascontiguousarray(targets),
            "weights": np.ones(inputs.shape, np.float32),
            "segment_ids": np.ones(inputs.shape, np.int32),
            "positions": np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32),
                                         inputs.shape)}


def ours_config(s: dict, *, gpu: bool, steps: int, lr: float, warmup: int):
    """The shakespeare_char GPT config (`compile_time.gpt_config`) at GPT-2's shape and
    train.py's optimizer settings; bf16 compute on a GPU."""
    from compile_time import gpt_config  # benchmarks/compile_time.py

    config = gpt_config(layers=s["layers"], d_model=s["width"], heads=s["heads"],
                        d_ff=4 * s["width"], seq_len=s["context"], batch=s["batch"],
                        vocab=s["vocab"])
    config.steps = steps
    config.model.update(dtype="bfloat16" if gpu else "float32", scale_residual_init=True)
    config.optimizer.update(learning_rate=lr, warmup_steps=warmup, min_learning_rate_ratio=0.1,
                            decay="cosine", b1=0.9, b2=0.95, weight_decay=0.1,
                            grad_clip_norm=1.0)
    return config


def train_ours(config, train_SBT1: np.ndarray, held_out: np.ndarray, *, timed_from: int,
               seed: int) -> dict:
    """Our train step over the batches: {losses, seconds (timed window), first_s, eval_loss,
    params, attention}."""
    import jax
    from compile_time import build_train_step

    from transformer.models import family_of
    from transformer.nn import kernels

    built = build_train_step(config, features(train_SBT1[0]), seed=seed)
    family = family_of(config)
    loss_fn = jax.jit(lambda p, b: family.loss_and_metrics(built.model, config, p, b)[0])
    with built.placement.context():
        batches = [built.placement.global_batch(features(w)) for w in train_SBT1]
        evals = [built.placement.global_batch(features(w)) for w in held_out]
        state, losses, start = built.state, [], time.perf_counter()
        with kernels.recording() as chosen:
            for i, batch in enumerate(batches):
                if i == timed_from:
                    jax.block_until_ready(state)
                    first_s, start = time.perf_counter() - start, time.perf_counter()
                state, metrics = built.jitted(state, batch)
                losses.append(metrics["loss"])
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        eval_loss = np.mean([float(loss_fn(state.params, b)) for b in evals])
    return dict(losses=np.array(jax.device_get(losses), np.float64), seconds=seconds,
                first_s=first_s, eval_loss=float(eval_loss),
                params=sum(x.size for x in jax.tree.leaves(state.params)),
                attention=", ".join(kernels.split_moe(chosen)[0]) or "-")


def nanogpt_model(nanogpt_dir: str, s: dict, device: str):
    """nanoGPT's GPT from `nanogpt_dir`'s model.py at these sizes, seeded as train.py seeds."""
    import torch

    if nanogpt_dir not in sys.path:
        sys.path.insert(0, nanogpt_dir)
    from model import GPT, GPTConfig  # nanoGPT's model.py

    torch.manual_seed(1337)
    return GPT(GPTConfig(block_size=s["context"], vocab_size=s["vocab"], n_layer=s["layers"],
                         n_head=s["heads"], n_embd=s["width"], dropout=0.0, bias=False)
               ).to(device)


def train_nanogpt(nanogpt_dir: str, s: dict, train_SBT1: np.ndarray, held_out: np.ndarray, *,
                  gpu: bool, lrs: list[float], timed_from: int, compile: bool) -> dict:
    """train.py's loop body over the batches; the same dict as `train_ours`."""
    import torch

    device = "cuda" if gpu else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py sets them
    torch.backends.cudnn.allow_tf32 = True
    with contextlib.redirect_stdout(sys.stderr):  # its prints stay out of the report
        model = nanogpt_model(nanogpt_dir, s, device)
        optimizer = model.configure_optimizers(0.1, lrs[0], (0.9, 0.95), device)
    step_model = torch.compile(model) if compile else model
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if gpu else \
        contextlib.nullcontext()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    x, y = (torch.from_numpy(np.ascontiguousarray(a)).long().to(device)
            for a in (train_SBT1[..., :-1], train_SBT1[..., 1:]))
    losses, start = [], time.perf_counter()
    for i, lr in enumerate(lrs):
        if i == timed_from:
            sync()
            first_s, start = time.perf_counter() - start, time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr
        with ctx:
            _, loss = step_model(x[i], y[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync()
    seconds = time.perf_counter() - start
    return dict(losses=torch.stack(losses).float().cpu().numpy().astype(np.float64),
                seconds=seconds, first_s=first_s, attention="SDPA (flash)" if gpu else "SDPA",
                eval_loss=nanogpt_eval(model, held_out, ctx, device),
                params=sum(p.numel() for p in model.parameters()))


def nanogpt_eval(model, held_out: np.ndarray, ctx, device: str) -> float:
    """Mean loss of the uncompiled module over the held-out batches (eval mode, no grad)."""
    import torch

    model.eval()
    with torch.no_grad(), ctx:
        losses = [float(model(torch.from_numpy(w[:, :-1]).long().to(device),
                              torch.from_numpy(w[:, 1:]).long().to(device))[1])
                  for w in held_out]
    return float(np.mean(losses))


def loss_points(losses: np.ndarray) -> list[tuple[int, float]]:
    """(step, mean loss over the `len // 20` steps up to it) at a quarter, half, three quarters
    and all of the steps (1-based)."""
    n = len(losses)
    window = max(1, n // 20)
    return [(k, float(losses[k - window:k].mean()))
            for k in sorted({max(window, round(n * f)) for f in (0.25, 0.5, 0.75, 1.0)})]


def train_table(sides: list[dict], *, tokens_per_step: int, flops_per_token: float,
                peak: float | None) -> str:
    """Markdown: a row per side ({side, ...`train_ours`'s dict, steps, timed_steps, dtype} or
    {side, error})."""
    points = next((loss_points(s["losses"]) for s in sides if "losses" in s), [])
    lines = ["| side | attention | dtype | steps | tokens/s | MFU | first steps (s) | train "
             "loss at step " + " / ".join(str(k) for k, _ in points) + " | held-out loss |",
             "| :--- | :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in sides:
        if "error" in s:
            lines.append(f"| {s['side']} | **failed:** {s['error']} |" + " |" * 7)
            continue
        rate = s["timed_steps"] * tokens_per_step / s["seconds"]
        mfu = f"{rate * flops_per_token / peak:.1%}" if peak else "-"
        curve = " / ".join(f"{v:.4f}" for _, v in loss_points(s["losses"]))
        lines.append(f"| {s['side']} | {s['attention']} | {s['dtype']} | {len(s['losses'])} | "
                     f"{rate:,.0f} | {mfu} | {s['first_s']:.1f} | {curve} | "
                     f"{s['eval_loss']:.4f} |")
    return "\n".join(lines)


def train_section(gpu: bool) -> tuple[str, bool]:
    """(markdown, passed) of section 1."""
    from transformer.training import optim

    s, steps, timed_from = sizes(), _STEPS.value, _TIMED_FROM.value
    if not 0 < timed_from < steps:
        raise ValueError(f"--timed_from={timed_from}: expected 0 < it < --steps={steps}")
    tokens = corpus_bytes()
    cut = int(len(tokens) * (1 - HELD_OUT))
    train = random_windows(tokens[:cut], (steps, s["batch"]), s["context"] + 1, _SEED.value)
    held_out = random_windows(tokens[cut:], (_EVAL_BATCHES.value, s["batch"]),
                              s["context"] + 1, _SEED.value + 1)
    config = ours_config(s, gpu=gpu, steps=steps, lr=_LR.value, warmup=_WARMUP.value)
    schedule = optim.learning_rate_schedule(config.optimizer, steps)
    dtype = "bfloat16" if gpu else "float32"
    runs = [("ours (JAX)", dtype, lambda: train_ours(
        config, train, held_out, timed_from=timed_from, seed=_SEED.value))]
    if _NANOGPT.value:
        compile = gpu and _NANOGPT_COMPILE.value
        runs.append(("nanoGPT (PyTorch)", "bfloat16 autocast" + (", torch.compile" if compile
                                                                 else "") if gpu else dtype,
                     lambda: train_nanogpt(
                         os.path.abspath(_NANOGPT.value), s, train, held_out, gpu=gpu,
                         lrs=[float(schedule(i)) for i in range(steps)],
                         timed_from=timed_from, compile=compile)))
    sides = [run_side(name, label, fn, steps - timed_from) for name, label, fn in runs]
    return train_report(sides, s, dtype, steps), not any("error" in x for x in sides)


def run_side(name: str, dtype: str, fn, timed_steps: int) -> dict:
    """`fn()`'s dict as a table row, or the error it raised."""
    try:
        result = fn()
    except Exception as error:  # noqa: BLE001 - reported in its row
        return {"side": name, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        _free_torch_memory()
    return {"side": name, "dtype": dtype, "timed_steps": timed_steps, **result}


def _free_torch_memory() -> None:
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


def train_report(sides: list[dict], s: dict, dtype: str, steps: int) -> str:
    """The section's markdown: the shape, `train_table`, and notes (FLOPs, peak, params)."""
    n = nanogpt_params(s["vocab"], s["layers"], s["width"])
    flops = gpt_flops_per_token(n, s["layers"], s["width"], s["context"])
    peak, source = chip_peak(dtype)
    shape = (f"{s['layers']} layers, {s['heads']} heads, {s['width']} wide, context "
             f"{s['context']}, vocab {s['vocab']}, batch {s['batch']}; {steps} steps, timed "
             f"after step {_TIMED_FROM.value}; the same byte-level batches on both sides")
    if "NVIDIA" in source:
        source += " (NVIDIA's datasheet, bf16 Tensor Core without sparsity; metrics.PEAK_FLOPS)"
    notes = [f"FLOPs per token 6 N + 12 L D T = {flops / 1e6:.1f} M (N = {n:,}, nanoGPT's "
             f"count); MFU against {peak:.4g} FLOP/s: {source}." if peak else f"MFU: {source}",
             "params: " + ", ".join(f"{x['side']} {x['params']:,}" for x in sides
                                   if "params" in x) + " (ours counts the position table, "
             "nanoGPT's model.parameters() too)",
             "first steps (s): the steps before the timed window, compilation included.",
             f"train loss: the mean over the {max(1, steps // 20)} steps up to each step; "
             f"held-out loss: {_EVAL_BATCHES.value} batches of the corpus' last 10%, the same "
             "for both."]
    rates = [x["timed_steps"] / x["seconds"] for x in sides if "seconds" in x]
    if len(rates) == 2:
        notes.append(f"ours / nanoGPT tokens/s: {rates[0] / rates[1]:.2f}x")
    table = train_table(sides, tokens_per_step=s["batch"] * s["context"],
                        flops_per_token=flops, peak=peak)
    return shape + "\n\n" + table + "\n\n" + "\n".join(f"- {note}" for note in notes)


# -----------------------------------------------------------------------------
# 2. Decode


def decode_section(gpu: bool, partial=lambda body: None) -> tuple[str, bool]:
    """(markdown, passed) of section 2: decode.py's mixers table at the model's shape, one mixer
    at a time, `partial(markdown so far)` after each."""
    F, result, failed, body = flags.FLAGS, None, [], "no mixers (--mixers is empty)"
    for mixer in F.mixers:
        try:
            one = decode_benchmark.mixer_benchmark(
                mixers=[mixer], contexts=F.contexts, batch_sizes=F.batch_sizes,
                new_tokens=F.new_tokens, layers=_LAYERS.value, d_model=_WIDTH.value,
                heads=_HEADS.value, kv_heads=F.kv_heads, vocab=_VOCAB.value,
                repeats=F.repeats, dtype="bfloat16" if gpu else "float32")
            result = one if result is None else {**result, "rows": result["rows"] + one["rows"]}
        except Exception as error:  # noqa: BLE001 - one mixer's failure ends no other
            failed.append(f"- {mixer}: **failed:** {type(error).__name__}: {str(error)[:300]}")
        body = "\n\n".join(([result["header"], decode_benchmark.mixer_table(result)]
                             if result else []) + ["\n".join(failed)] * bool(failed))
        partial(body)
    return body, not failed


# -----------------------------------------------------------------------------


TITLES = {"train": "## Training: GPT-2 124M, ours vs nanoGPT, the same batches",
          "decode": "## Decode: each token mixer's tokens/s and cache per sequence"}


def _defaults(gpu: bool) -> None:
    """GPU_DEFAULTS, and CPU_SIZES without a GPU, for each flag not given."""
    for name, value in (GPU_DEFAULTS if gpu else {**GPU_DEFAULTS, **CPU_SIZES}).items():
        if not flags.FLAGS[name].present:
            flags.FLAGS[name].value = value


def main(argv) -> int:
    del argv
    # Before JAX starts its backend: JAX's share of the GPU grows as it needs, so torch gets
    # the rest (JAX would otherwise take 75% of it up front).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    gpu = checked_sections_and_gpu(_SKIP.value, SECTIONS, _ALLOW_CPU.value)
    _defaults(gpu)
    nanogpt = _NANOGPT.value
    if nanogpt and not os.path.isfile(os.path.join(nanogpt, "model.py")):
        raise ValueError(f"--nanogpt_dir={nanogpt}: no model.py (expected a checkout of "
                         "karpathy/nanoGPT)")
    report = ["# GPT-2 124M on one GPU: ours vs nanoGPT, and the token mixers' decode", "",
              device_line(), "command: `" + " ".join(["python", *sys.argv]) + "`"]
    if not gpu:
        report.append("**No GPU: the CPU rehearsal at tiny sizes; not the GPU result.**")
    print("\n".join(report), flush=True)
    failed, times = [], {}
    for section in SECTIONS:
        if section in _SKIP.value:
            continue
        start = time.perf_counter()
        partial = lambda body, section=section: _write(report + ["", TITLES[section], body])
        try:
            body, ok = train_section(gpu) if section == "train" else decode_section(gpu, partial)
        except Exception as error:  # noqa: BLE001 - one section's failure ends no other
            body, ok = f"**failed:** {type(error).__name__}: {error}", False
        failed += [] if ok else [section]
        times[section] = time.perf_counter() - start
        _emit(report, TITLES[section], body)
    _emit(report, "section times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
          + (f"; failed: {', '.join(failed)}" if failed else "; nothing failed"))
    return 1 if failed else 0


def _emit(report: list[str], *lines: str) -> None:
    """Adds `lines` to the report, prints them, and rewrites --output (a run cut short keeps
    what it finished)."""
    report.extend(["", *lines])
    print("\n" + "\n".join(lines), flush=True)
    _write(report)


def _write(lines: list[str]) -> None:
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(main)
