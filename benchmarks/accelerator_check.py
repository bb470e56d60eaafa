"""The GPU check (issue 26): cuDNN attention against the dense reference, the 6/6/384
shakespeare_char recipe in bf16 next to nanoGPT's own GPU recipe, and the decode benchmark.

    python benchmarks/accelerator_check.py --text=PATH/tinyshakespeare.txt \
        --nanogpt_dir=PATH/TO/nanoGPT [--max_iters=5000] [--output=accelerator_check.md] \
        [--skip=attention,train,decode] [--workdir=DIR] [--ours_flags=KEY=VALUE,...]

On a machine without a GPU it stops with one line, unless `--allow_cpu`: then the same logic
runs on the CPU at tiny sizes (every size flag not given takes its `CPU_SIZES` value), with the
chunked kernel standing in for cuDNN. Prints the device (`device_kind`) and versions, then three
markdown tables, also written to `--output` after each section (a run cut short keeps what it
finished). Exits 1 if an attention row is out of tolerance or a section failed.

1. Attention (`attention_check`): for each mask the models use (causal; causal GQA; causal +
   packed documents of uneven lengths; right padding of uneven lengths; causal sliding window;
   full; prefix LM; cross-attention between packed segments of another length), the kernel's
   output and its gradients w.r.t. q, k and v, against `dense_attention.dot_product_attention` on
   the same inputs in float32 at the highest matmul precision. Errors are max |kernel - reference|
   / max |reference| (per tensor; the gradients' is the worst of q, k, v). Tolerance: a floor
   per dtype, or 4x the dense path's own error in the same dtype if larger. A mask the kernel
   cannot take (`kernels.select` refuses it) runs dense and says so. The "cuDNN gets" column is
   `cudnn_attention.cudnn_arguments`: what the mask becomes in `jax.nn.dot_product_attention`. All
   masks compile as one program per side (reference, kernel), case by case if that fails.
2. Training (`train_check`): `python -m transformer.train --config=experiments/
   gpt_shakespeare_char.py` as it is on a GPU (bf16; "auto" attention, whose kernel the table
   takes from the run's log; float32 on CPU) and nanoGPT's unmodified
   `train.py config/train_shakespeare_char.py` (its defaults on a GPU: torch.compile, bf16
   autocast, flash attention through scaled_dot_product_attention) from `--nanogpt_dir`, in a
   directory holding the shakespeare_char data written from `--text` as its prepare.py would,
   the same iterations, batch and context (`--max_iters` also sets lr_decay_iters), one after
   the other. Each side's output lines are timestamped as they arrive: tokens/s is the median
   over log windows (between consecutive synced train log lines, eval windows and the first
   window left out) of iterations x batch x context / seconds. MFU is computed the same way for
   both, tokens/s x FLOPs per token / the chip's published peak (`metrics.peak_flops`; on CPU
   the measured one), FLOPs per token by the one formula, 6 N + 12 L D T (N: each side's params
   that multiply activations). nanoGPT's own mfu column is against an A100's 312 TFLOP/s with
   its own per-iteration timing, so it is shown apart. Validation loss: each side's last
   evaluation, and its best (the number nanoGPT's README quotes: it checkpoints only when
   validation improves, and the recipe overfits after about 1,500 iterations); nanoGPT
   averages eval_iters random batches, ours eval_steps batches of a fixed sample.
3. Decode (`decode_check`): `benchmarks/decode.py`'s benchmark (its flags --batch_sizes,
   --new_tokens, --prompt_len, --layers, --d_model, --heads, --vocab, --context and --repeats
   apply), with the HF model on the GPU when there is one.

What differs between the two training recipes: the differences `benchmarks/nanogpt_protocol.py`
lists (c_proj init, warmup by one step, data order, vocabulary, seeds). Both drop attention
weights (dropout 0.2), which runs our dense kernel; `--ours_flags=model.attention_dropout_rate=0`
runs ours with cuDNN instead.
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the repository, where it is not installed (a device's copy)
    sys.path.insert(0, ROOT)

import decode as decode_benchmark  # noqa: E402 - benchmarks/decode.py (sizes the decode check)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from nanogpt_common import (  # noqa: E402 - benchmarks/nanogpt_common.py
    checked_sections_and_gpu,
    chip_peak,
    device_line,
    gpt_flops_per_token,
    link_configurator,
    nanogpt_params,
    prepare_nanogpt_data,
)

SECTIONS = ("attention", "train", "decode")

_TEXT = flags.DEFINE_string("text", None, "tinyshakespeare.txt: the text both sides train on.")
_NANOGPT = flags.DEFINE_string("nanogpt_dir", None, "A checkout of karpathy/nanoGPT (without "
                               "it only ours trains).")
_OUTPUT = flags.DEFINE_string("output", "", "Also write the markdown report here.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where the training runs go (default: a temp "
                               "dir).")
_SKIP = flags.DEFINE_list("skip", [], f"Sections to leave out, of {','.join(SECTIONS)}.")
_OURS_FLAGS = flags.DEFINE_list("ours_flags", [], "Extra config overrides for our run, each "
                                 "KEY=VALUE passed as --config.KEY=VALUE (e.g. "
                                 "model.attention_dropout_rate=0: cuDNN instead of dense).")
_ALLOW_CPU = flags.DEFINE_bool("allow_cpu", False, "Run without a GPU, at CPU_SIZES (chunked "
                               "attention stands in for cuDNN).")
_MAX_ITERS = flags.DEFINE_integer("max_iters", 5000, "Training iterations of each side "
                                  "(the recipe's full run).")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Training batch (the recipe's 64).")
_CONTEXT = flags.DEFINE_integer("block_size", 256, "Training context (the recipe's 256).")
_LAYERS = flags.DEFINE_integer("n_layer", 6, "Layers (the recipe's 6).")
_HEADS = flags.DEFINE_integer("n_head", 6, "Heads (the recipe's 6).")
_WIDTH = flags.DEFINE_integer("n_embd", 384, "Width (the recipe's 384).")
_LOG_INTERVAL = flags.DEFINE_integer("log_interval", 10, "Iterations between train log lines "
                                     "(both sides; the recipe's 10).")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 0, "Batches per evaluation on both sides "
                                     "(0: each recipe's own, nanoGPT 200, ours 50).")
_ATT_BATCH = flags.DEFINE_integer("attention_batch", 2, "Attention check batch.")
_ATT_LEN = flags.DEFINE_integer("attention_len", 1024, "Attention check sequence length.")
_ATT_HEADS = flags.DEFINE_integer("attention_heads", 8, "Attention check query heads.")
_ATT_KV_HEADS = flags.DEFINE_integer("attention_kv_heads", 2, "KV heads of the GQA row.")
_ATT_HEAD_DIM = flags.DEFINE_integer("attention_head_dim", 64, "Attention check head dim.")
_ATT_DTYPE = flags.DEFINE_string("attention_dtype", "", "Input dtype (default: bfloat16 on a "
                                 "GPU, float32 on CPU).")

# Sizes that run in about a minute on a 2-core CPU: what a flag not given takes under
# --allow_cpu without a GPU (decode's are benchmarks/decode.py's flags).
CPU_SIZES = dict(max_iters=20, batch_size=8, block_size=32, n_layer=2, n_head=2, n_embd=64,
                 log_interval=2, eval_batches=2, attention_len=64, attention_heads=4,
                 attention_head_dim=16, batch_sizes=["1"], new_tokens=8, prompt_len=4, layers=1,
                 d_model=32, heads=2, vocab=256, context=32, repeats=1)

# Relative error below which a kernel passes whatever the dense path's own error is.
TOLERANCE_FLOOR = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
TOLERANCE_FACTOR = 4.0  # x the dense path's error in the same dtype
_PREALLOCATE_SET_HERE = False  # main turned JAX's GPU memory preallocation off in this process


# -----------------------------------------------------------------------------
# 1. Attention


def split_lengths(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    """`parts` uneven positive lengths summing to `total` (parts <= total)."""
    cuts = np.sort(rng.choice(np.arange(1, total), parts - 1, replace=False)) if parts > 1 else []
    return np.diff([0, *cuts, total]).tolist()


def packed_segment_ids(batch: int, length: int, docs: list[int], seed: int,
                       padding: list[int] | None = None) -> np.ndarray:
    """int32 [batch, length]: row b packs docs[b] documents of uneven lengths (ids 1, 2, ...),
    then padding[b] positions of id 0."""
    rng = np.random.default_rng(seed)
    padding = padding or [0] * batch
    rows = []
    for b in range(batch):
        lengths = split_lengths(length - padding[b], docs[b], rng)
        rows.append(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] +
                                   [np.zeros(padding[b])]))
    return np.stack(rows).astype(np.int32)


def attention_cases(batch: int, length: int, heads: int, kv_heads: int, seed: int = 0) -> list:
    """(name, mask, kv heads, kv_len) for each mask the models use (see the module docstring)."""
    import jax.numpy as jnp

    from transformer.nn import masks

    rng = np.random.default_rng(seed)
    docs = [3 + b % 3 for b in range(batch)]
    pad = [0 if b % 2 == 0 else length // 8 for b in range(batch)]
    valid = [length if b == 0 else int(rng.integers(length // 4, length)) for b in range(batch)]
    prefix = [int(rng.integers(1, length // 2)) for _ in range(batch)]
    window = max(1, length // 4)
    kv_len = max(2 * max(docs), length // 2)
    cross_q = packed_segment_ids(batch, length, docs, seed + 1)
    cross_kv = packed_segment_ids(batch, kv_len, docs, seed + 2)
    return [
        ("causal", masks.Causal(), heads, length),
        (f"causal, GQA {heads}:{kv_heads}", masks.Causal(), kv_heads, length),
        ("causal + packed segments", masks.Causal() & masks.Segment(
            jnp.asarray(packed_segment_ids(batch, length, docs, seed, pad))), heads, length),
        ("padding", masks.Padding(q_lengths=jnp.asarray(valid), kv_lengths=jnp.asarray(valid)),
         heads, length),
        (f"sliding window {window} (causal)", masks.Causal() & masks.SlidingWindow(
            left=window - 1), heads, length),
        ("full", masks.Full(), heads, length),
        ("prefix LM", masks.PrefixLM(prefix_lengths=jnp.asarray(prefix)), heads, length),
        (f"cross, segments (kv_len {kv_len})", masks.Segment(jnp.asarray(cross_q),
                                                             jnp.asarray(cross_kv)),
         heads, kv_len),
    ]


def cudnn_lowering(mask, q_len: int, kv_len: int) -> str:
    """What `cudnn_attention.cudnn_arguments` turns `mask` into, in words (evaluated abstractly: no
    mask is computed)."""
    from transformer.nn import cudnn_attention

    seen = {}

    def lower(mask):
        seen.update(cudnn_attention.cudnn_arguments(mask, q_len, kv_len))
        return 0

    jax.eval_shape(lower, mask)
    parts = []
    if seen["is_causal"]:
        parts.append("is_causal")
    if seen["local_window_size"] is not None:
        parts.append(f"window {tuple(seen['local_window_size'])}")
    if seen["query_seq_lengths"] is not None:
        parts.append("q lengths")
    if seen["key_value_seq_lengths"] is not None:
        parts.append("kv lengths")
    if seen["mask"] is not None:
        parts.append("dense mask (as a bias)")
    return ", ".join(parts) or "nothing"


def relative_error(value, reference) -> float:
    """max |value - reference| / max |reference|, in float64."""
    value, reference = (np.asarray(x, np.float64) for x in (value, reference))
    return float(np.abs(value - reference).max() / max(np.abs(reference).max(), 1e-30))


def _fwd_bwd(fns: tuple, inputs: list, masks: list) -> list:
    """[(out, (dq, dk, dv))] of fns[i](q, k, v, masks[i]) with cotangent ct, for each (q, k, v,
    ct) of `inputs`: every case in one program."""
    results = []
    for fn, (q, k, v, ct), mask in zip(fns, inputs, masks, strict=True):
        out, vjp = jax.vjp(lambda q, k, v, fn=fn, mask=mask: fn(q, k, v, mask), q, k, v)
        results.append((out, vjp(ct.astype(out.dtype))))
    return results


# The functions are static, so a reference asked for twice compiles once. On CPU, where the
# check is a stand-in for numbers, not speed, XLA's optimization level 0 halves compile time.
_JITTED = {platform: jax.jit(_fwd_bwd, static_argnums=0, compiler_options=options)
           for platform, options in (("cpu", {"xla_backend_optimization_level": 0}),
                                     ("other", None))}


def _run_cases(fns: list, inputs: list, masks: list, platform: str) -> list:
    """`_fwd_bwd` of every case in one compiled program (one compile instead of one per mask);
    if that fails, case by case, so that each failure (an exception in its place) is its own."""
    jitted = _JITTED["cpu" if platform == "cpu" else "other"]
    try:
        return jax.block_until_ready(jitted(tuple(fns), inputs, masks))
    except Exception:  # noqa: BLE001 - retried one case at a time below
        results = []
        for fn, x, mask in zip(fns, inputs, masks, strict=True):
            try:
                results.append(jax.block_until_ready(jitted((fn,), [x], [mask]))[0])
            except Exception as error:  # noqa: BLE001 - reported in its row
                results.append(error)
        return results


@functools.cache
def _attend(impl: str) -> Callable:
    """fn(q, k, v, mask) running `attention.attend` with kernel `impl` (one object per impl)."""
    from transformer.nn import attention

    return lambda q, k, v, mask: attention.attend(q, k, v, mask=mask, impl=impl)


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def attention_check(platform: str, dtype: str, *, impl: str = "cudnn",
                    kernel_fn: Callable | None = None, batch: int = 2, length: int = 1024,
                    heads: int = 8, kv_heads: int = 2, head_dim: int = 64,
                    seed: int = 0) -> list[dict]:
    """Rows {mask, impl, cudnn, dtype, d_out, d_grad, tolerance, ok, error} comparing kernel
    `impl` (run through `attention.attend`, or `kernel_fn(q, k, v, mask)` when given) with the
    dense float32 reference, fwd and bwd, for each of `attention_cases`."""
    import jax.numpy as jnp

    from transformer.nn import dense_attention, kernels

    low = jnp.dtype(dtype)
    floor = TOLERANCE_FLOOR[low.name]
    cases = attention_cases(batch, length, heads, kv_heads, seed)
    rows, fns, inputs, masks = [], [], [], []
    rng = np.random.default_rng(seed)  # NumPy: no per-shape compiles of JAX's RNG on CPU
    for name, mask, kv, kv_len in cases:
        shapes = [(batch, length, heads, head_dim)] + [(batch, kv_len, kv, head_dim)] * 2
        q, k, v = (rng.standard_normal(shape, np.float32).astype(low) for shape in shapes)
        inputs.append((q, k, v, rng.standard_normal(shapes[0], np.float32)))
        masks.append(mask)
        row = dict(mask=name, dtype=low.name, cudnn=cudnn_lowering(mask, length, kv_len),
                   impl=impl, tolerance=floor, error="")
        try:
            kernels.select(impl, platform=platform, mask=mask, bias=None, dropout=0.0,
                           q_len=length, kv_len=kv_len, head_dim=head_dim, dtype=low)
            fns.append(kernel_fn or _attend(impl))
        except ValueError as error:  # the kernel cannot take these inputs: attend runs dense
            row["impl"] = f"dense (fallback: {error})"
            fns.append(_attend("dense"))
        rows.append(row)

    with jax.default_matmul_precision("highest"):  # no TF32 in the reference
        reference = _run_cases([dense_attention.dot_product_attention] * len(cases),
                               [tuple(x.astype(np.float32) for x in xs) for xs in inputs],
                               masks, platform)
    tested = _run_cases(fns, inputs, masks, platform)
    dense_fns = [dense_attention.dot_product_attention] * len(cases)
    dense = (_run_cases(dense_fns, inputs, masks, platform)
             if low != jnp.float32 else [None] * len(cases))  # the dense path in this dtype
    for row, ref, got, own in zip(rows, reference, tested, dense, strict=True):
        error = next((x for x in (ref, got, own) if isinstance(x, Exception)), None)
        if error is not None:
            row.update(d_out=float("nan"), d_grad=float("nan"), ok=False,
                       error=_error_text(error))
            continue
        (ref_out, ref_grads), (out, grads) = ref, got
        row["d_out"] = relative_error(out, ref_out)
        row["d_grad"] = max(map(relative_error, grads, ref_grads))
        if own is not None:
            row["tolerance"] = max(floor, TOLERANCE_FACTOR * max(
                relative_error(own[0], ref_out), *map(relative_error, own[1], ref_grads)))
        row["ok"] = bool(row["d_out"] <= row["tolerance"] and row["d_grad"] <= row["tolerance"])
    return rows


def attention_table(rows: list[dict]) -> str:
    lines = ["| mask | impl | cuDNN gets | dtype | max rel. Δout | max rel. Δgrad (q,k,v) | "
             "tolerance | ok |", "| :--- | :--- | :--- | :--- | ---: | ---: | ---: | :--- |"]
    for r in rows:
        ok = "yes" if r["ok"] else ("**ERROR** " + r["error"] if r["error"] else "**NO**")
        lines.append(f"| {r['mask']} | {r['impl']} | {r['cudnn']} | {r['dtype']} | "
                     f"{r['d_out']:.2e} | {r['d_grad']:.2e} | {r['tolerance']:.1e} | {ok} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# 2. Training

_STAMP = r"^(?:\s*(?P<t>[\d.]+) \| )?"
_NANOGPT_ITER = re.compile(_STAMP + r"iter (?P<iter>\d+): loss (?P<loss>[-\w.]+), "
                           r"time (?P<ms>[\d.]+)ms, mfu (?P<mfu>-?[\d.]+)%", re.M)
_NANOGPT_EVAL = re.compile(_STAMP + r"step (?P<step>\d+): train loss (?P<train>[-\w.]+), "
                           r"val loss (?P<val>[-\w.]+)", re.M)
_OURS_TRAIN = re.compile(_STAMP + r"step (?P<iter>\d+)/\d+ loss (?P<loss>[-\w.]+) ", re.M)
_OURS_EVAL = re.compile(_STAMP + r"step (?P<step>\d+): validation loss (?P<val>[-\w.]+)", re.M)
_OURS_KERNEL = re.compile(r"the first step \(compilation included, attention (?P<kernel>[\w/]+)\)")


def _number(text: str | None) -> float | None:
    return None if text is None else float(text)


def parse_nanogpt_log(text: str) -> dict:
    """nanoGPT's train.py output ("iter N: loss X, time Y ms, mfu Z%", "step N: train loss X,
    val loss Y"), each line optionally prefixed "SECONDS | " by `run_logged`, ->
    {"iters": [{iter, loss, ms, mfu, t}], "evals": [{step, train, val, t}]}."""
    iters = [dict(iter=int(m["iter"]), loss=float(m["loss"]), ms=float(m["ms"]),
                  mfu=float(m["mfu"]), t=_number(m["t"])) for m in _NANOGPT_ITER.finditer(text)]
    evals = [dict(step=int(m["step"]), train=float(m["train"]), val=float(m["val"]),
                  t=_number(m["t"])) for m in _NANOGPT_EVAL.finditer(text)]
    return {"iters": iters, "evals": evals}


def parse_ours_log(text: str) -> dict:
    """`transformer.train`'s progress lines ("step N/M loss X ...", "step N: validation loss
    X ..."), optionally prefixed "SECONDS | ", in the same form as `parse_nanogpt_log`, plus
    "attention": the kernel its first-step line names (None if none)."""
    iters = [dict(iter=int(m["iter"]), loss=float(m["loss"]), t=_number(m["t"]))
             for m in _OURS_TRAIN.finditer(text)]
    evals = [dict(step=int(m["step"]), val=float(m["val"]), t=_number(m["t"]))
             for m in _OURS_EVAL.finditer(text)]
    kernel = _OURS_KERNEL.search(text)
    return {"iters": iters, "evals": evals, "attention": kernel and kernel["kernel"]}


def window_tokens_per_s(iters: list[dict], evals: list[dict], tokens_per_iter: int,
                        skip: int = 1) -> float | None:
    """Median tokens/s over the windows between consecutive timestamped train log lines, leaving
    out the first `skip` windows (compilation, warm-up) and any window an evaluation finished
    in (its line's timestamp falls inside). None if no window is left."""
    eval_times = [e["t"] for e in evals if e["t"] is not None]
    points = [(i["iter"], i["t"]) for i in iters if i["t"] is not None]
    rates = []
    for (a, ta), (b, tb) in list(zip(points, points[1:], strict=False))[skip:]:
        if b > a and tb > ta and not any(ta < t <= tb for t in eval_times):
            rates.append((b - a) * tokens_per_iter / (tb - ta))
    return statistics.median(rates) if rates else None


def side_summary(name: str, parsed: dict, *, tokens_per_iter: int, flops_per_token: float,
                 wall_s: float, attention: str, dtype: str, own_mfu: float | None,
                 start_t: float = 0.0) -> dict:
    """One side's row of the training table from its parsed log (see `train_table`)."""
    last_eval = parsed["evals"][-1] if parsed["evals"] else None
    best_eval = min(parsed["evals"], key=lambda e: e["val"]) if parsed["evals"] else None
    iters = parsed["iters"][-1]["iter"] if parsed["iters"] else 0
    return dict(side=name, attention=attention, dtype=dtype, iters=iters,
                tokens_per_s=window_tokens_per_s(parsed["iters"], parsed["evals"],
                                                 tokens_per_iter),
                flops_per_token=flops_per_token, own_mfu=own_mfu,
                val_loss=last_eval["val"] if last_eval else None,
                val_step=last_eval["step"] if last_eval else None,
                best_val_loss=best_eval["val"] if best_eval else None,
                best_val_step=best_eval["step"] if best_eval else None,
                wall_to_val_s=(last_eval["t"] - start_t) if last_eval and last_eval["t"]
                is not None else None, wall_s=wall_s)


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def train_table(sides: list[dict], peak: float | None) -> str:
    """Markdown: one row per side (`side_summary` dicts, or {side, error}); MFU is tokens/s x
    FLOPs per token / `peak` for every side alike."""
    lines = ["| side | attention | dtype | iters | tokens/s | MFU (chip peak) | own log's MFU | "
             "final val loss (at iter) | best val loss (at iter) | wall to final val (s) | "
             "command wall (s) |",
             "| :--- | :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in sides:
        if "error" in s:
            lines.append(f"| {s['side']} | **failed:** {s['error']} |" + " |" * 9)
            continue
        mfu = (s["tokens_per_s"] * s["flops_per_token"] / peak
               if peak and s["tokens_per_s"] else None)
        val, best = (f"{s[k + 'loss']:.4f} ({s[k + 'step']})" if s[k + "loss"] is not None
                     else "-" for k in ("val_", "best_val_"))
        lines.append(f"| {s['side']} | {s['attention']} | {s['dtype']} | {s['iters']} | "
                     f"{_fmt(s['tokens_per_s'], ',.0f')} | {_fmt(mfu, '.1%')} | "
                     f"{_fmt(s['own_mfu'], '.1%')} | {val} | {best} | "
                     f"{_fmt(s['wall_to_val_s'], '.0f')} | {s['wall_s']:.0f} |")
    return "\n".join(lines)


def run_logged(command: list[str], cwd: str, log_path: str, env=None) -> float:
    """Runs `command`, writing each output line to `log_path` as "SECONDS | line" (seconds since
    the start, taken as the line arrives); returns the wall time. Raises on a failed exit."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace") as process:
        for line in process.stdout:
            # microseconds: a GPU's log window is ~100 ms, so ms stamps would round its rate
            log.write(f"{time.perf_counter() - start:14.6f} | {line}")
            log.flush()
        status = process.wait()
    seconds = time.perf_counter() - start
    if status:
        with open(log_path) as f:
            tail = [line.split(" | ", 1)[-1].strip() for line in f.readlines()[-3:]]
        raise RuntimeError(f"exited {status} after {seconds:.0f} s ({log_path}): "
                           + " / ".join(tail))
    return seconds


def eval_interval(iters: int) -> int:
    """The recipes' 250 when it divides the iterations, else the last iteration only (so both
    sides evaluate at the end)."""
    return 250 if iters % 250 == 0 else iters


def nanogpt_command(nanogpt_dir: str, *, gpu: bool, iters: int, sizes: dict,
                    log_interval: int, eval_batches: int) -> list[str]:
    """nanoGPT's train.py with config/train_shakespeare_char.py and the shared settings."""
    command = [sys.executable, os.path.join(nanogpt_dir, "train.py"),
               os.path.join(nanogpt_dir, "config", "train_shakespeare_char.py"),
               f"--max_iters={iters}", f"--lr_decay_iters={iters}",
               f"--eval_interval={eval_interval(iters)}", f"--log_interval={log_interval}",
               *(f"--{k}={v}" for k, v in sizes.items()), "--out_dir=out"]
    if iters < 1000:
        command.append(f"--warmup_iters={iters // 10}")
    if eval_batches:
        command.append(f"--eval_iters={eval_batches}")
    if not gpu:
        command += ["--device=cpu", "--compile=False", "--dtype=float32"]
    return command


def ours_command(text: str, workdir: str, *, gpu: bool, iters: int, sizes: dict,
                 log_interval: int, eval_batches: int, extra: list[str] = ()) -> list[str]:
    """`transformer.train` on experiments/gpt_shakespeare_char.py with the shared settings, then
    `extra` overrides ("KEY=VALUE": --config.KEY=VALUE)."""
    width = sizes["n_embd"]
    command = [sys.executable, "-m", "transformer.train",
               "--config=experiments/gpt_shakespeare_char.py", f"--config.data.path={text}",
               f"--workdir={workdir}", f"--config.steps={iters}",
               f"--config.eval_every={eval_interval(iters)}",
               f"--config.log_every={log_interval}", f"--config.batch_size={sizes['batch_size']}",
               f"--config.seq_len={sizes['block_size']}",
               f"--config.model.max_len={sizes['block_size']}",
               f"--config.model.num_layers={sizes['n_layer']}",
               f"--config.model.num_heads={sizes['n_head']}", f"--config.model.d_model={width}",
               f"--config.model.d_ff={4 * width}"]
    if iters < 1000:
        command.append(f"--config.optimizer.warmup_steps={iters // 10}")
    if eval_batches:
        command.append(f"--config.eval_steps={eval_batches}")
    if not gpu:  # the CPU stand-in computes in float32, as nanoGPT's CPU run does
        command.append("--config.model.dtype=float32")
    command += [f"--config.{override}" for override in extra]
    return command


def _ours_flops(text_vocab: int, sizes: dict, num_params: int) -> float:
    """`metrics.flops_per_token` for our run's config and params (what its own log uses)."""
    from transformer.configs import experiment
    from transformer.training import metrics

    config = experiment("gpt_shakespeare_char")
    config.seq_len = sizes["block_size"]
    config.model.update(max_len=sizes["block_size"], num_layers=sizes["n_layer"],
                        num_heads=sizes["n_head"], d_model=sizes["n_embd"],
                        vocab_size=text_vocab)
    return metrics.flops_per_token(config, num_params)


def train_check(text_path: str, nanogpt_dir: str | None, workdir: str, *, gpu: bool,
                iters: int, sizes: dict, log_interval: int, eval_batches: int,
                ours_flags: list[str] = ()) -> dict:
    """Trains ours, then nanoGPT (if `nanogpt_dir`), in `workdir`; {"table", "notes", "sides"}."""
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    recipe_dtype = "bfloat16" if gpu else "float32"  # both recipes' compute dtype
    dtype = next((f.split("=", 1)[1] for f in ours_flags if f.startswith("model.dtype=")),
                 recipe_dtype)  # ours', for the table
    tokens_per_iter = sizes["batch_size"] * sizes["block_size"]
    shared = dict(gpu=gpu, iters=iters, sizes=sizes, log_interval=log_interval,
                  eval_batches=eval_batches)
    layers, width, context = sizes["n_layer"], sizes["n_embd"], sizes["block_size"]
    sides, notes = [], []

    ours_dir = os.path.join(workdir, "ours")
    os.makedirs(ours_dir, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    if _PREALLOCATE_SET_HERE:
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # the training run's own default
    command = ours_command(os.path.abspath(text_path), ours_dir, **shared, extra=ours_flags)
    notes.append("ours: `" + " ".join(command[1:]) + "`")
    log = os.path.join(ours_dir, "train.log")
    try:
        wall = run_logged(command, ROOT, log, env)
        with open(log) as f:
            parsed = parse_ours_log(f.read())
        with open(os.path.join(ours_dir, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(ours_dir, "metrics.jsonl")) as f:
            mfus = [r["mfu"] for r in map(json.loads, f) if r.get("split") == "train"
                    and "mfu" in r][1:]
        vocab = _vocab_of_run(ours_dir)
        flops = _ours_flops(vocab, sizes, summary["num_params"])
        sides.append(side_summary(
            "ours (JAX)", parsed, tokens_per_iter=tokens_per_iter, flops_per_token=flops,
            wall_s=wall, attention=parsed["attention"] or "not logged", dtype=dtype,
            own_mfu=statistics.median(mfus) if mfus else None))
        notes.append(f"ours: {summary['num_params']:,} params, vocab {vocab}, "
                     f"{flops / 1e6:.1f} MFLOP/token")
    except Exception as error:  # noqa: BLE001 - reported in the table
        sides.append({"side": "ours (JAX)", "error": str(error)})

    if nanogpt_dir:
        directory = os.path.join(workdir, "nanogpt")
        try:
            prepare_nanogpt_data(text, os.path.join(directory, "data", "shakespeare_char"))
            link_configurator(nanogpt_dir, directory)
            command = nanogpt_command(os.path.abspath(nanogpt_dir), **shared)
            notes.append("nanoGPT: `" + " ".join(command[1:]) + "`")
            log = os.path.join(directory, "train.log")
            wall = run_logged(command, directory, log)
            with open(log) as f:
                parsed = parse_nanogpt_log(f.read())
            vocab = len(set(text))
            n = nanogpt_params(vocab, layers, width)
            flops = gpt_flops_per_token(n, layers, width, context)
            own = [i["mfu"] for i in parsed["iters"] if i["mfu"] >= 0]
            sides.append(side_summary(
                "nanoGPT (PyTorch)", parsed, tokens_per_iter=tokens_per_iter,
                flops_per_token=flops, wall_s=wall, own_mfu=own[-1] / 100 if own else None,
                attention="SDPA (flash)" if gpu else "SDPA", dtype=(
                    "bfloat16 autocast, torch.compile" if gpu else "float32")))
            notes.append(f"nanoGPT: {n:,} params (its count), vocab {vocab}, "
                         f"{flops / 1e6:.1f} MFLOP/token")
        except Exception as error:  # noqa: BLE001
            sides.append({"side": "nanoGPT (PyTorch)", "error": str(error)})
    else:
        notes.append("nanoGPT: not run (no --nanogpt_dir)")

    peak, source = chip_peak(recipe_dtype)
    notes.append(f"MFU (chip peak) = tokens/s x FLOPs per token (6 N + 12 L D T, both sides) / "
                 f"{_fmt(peak, '.3g')} FLOP/s ({source}). own log's MFU: ours' median "
                 "(against the same peak); nanoGPT's last running value, against an A100's "
                 "312 TFLOP/s and its own per-iteration times.")
    notes.append("evaluations (in the wall times): nanoGPT averages eval_iters random batches of "
                 "each split every eval_interval; ours eval_steps batches of a fixed sample of "
                 "the validation split every eval_every, then writes 3 samples after the last.")
    notes.append("tokens/s: median over the log windows between synced train log lines "
                 "(the first window and those an evaluation ran in left out). Wall to final "
                 "val: from the command's start to its last evaluation's line (start-up, "
                 "compilation, evaluations and checkpoints included).")
    return {"table": train_table(sides, peak), "notes": notes, "sides": sides}


def _vocab_of_run(workdir: str) -> int:
    """The vocabulary size of the tokenizer a training run saved in `workdir`."""
    from transformer.data import inputs
    from transformer.data import tokenizers as tokenizers_lib

    return tokenizers_lib.load_tokenizer(os.path.join(workdir, inputs.TOKENIZER_DIR)).vocab_size


# -----------------------------------------------------------------------------
# 3. Decode


def decode_check(*, gpu: bool, **sizes) -> str:
    """benchmarks/decode.py's benchmark (HF on the GPU when there is one), as markdown."""
    import torch

    hf_device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
    result = decode_benchmark.benchmark(hf_device=hf_device, **sizes)
    if hf_device == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to the training runs
    return result["header"] + "\n\n" + decode_benchmark.table(result)


# -----------------------------------------------------------------------------


def _apply_cpu_sizes() -> None:
    for name, value in CPU_SIZES.items():
        if not flags.FLAGS[name].present:
            flags.FLAGS[name].value = value


def main(argv) -> int:
    del argv
    global _PREALLOCATE_SET_HERE
    if not os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"):
        # Before JAX starts its backend: this process's arrays are small, so it leaves the
        # GPU's memory to the training runs (which take JAX's default) and to torch.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        _PREALLOCATE_SET_HERE = True

    gpu = checked_sections_and_gpu(_SKIP.value, SECTIONS, _ALLOW_CPU.value)
    if not gpu:
        _apply_cpu_sizes()
    bad = [f for f in _OURS_FLAGS.value if "=" not in f or f.startswith(("-", "config."))]
    if bad:
        raise ValueError(f"--ours_flags: {bad[0]!r}: expected KEY=VALUE of our config, e.g. "
                         "model.attention_dropout_rate=0")
    if "train" not in _SKIP.value and not _TEXT.value:
        raise ValueError("--text=PATH/tinyshakespeare.txt is required (or --skip=train)")

    report = ["# Accelerator check", "", device_line(),
              "command: `" + " ".join(["python", *sys.argv]) + "`"]
    if not gpu:
        report.append("**No GPU: the CPU stand-in at tiny sizes (chunked for cuDNN); not the "
                      "GPU result.**")
    failed, times = [], {}
    print("\n".join(report), flush=True)

    def emit(*lines: str) -> None:
        report.extend(["", *lines])
        print("\n" + "\n".join(lines), flush=True)
        if _OUTPUT.value:  # after each section: a run cut short keeps what it finished
            with open(_OUTPUT.value, "w") as f:
                f.write("\n".join(report) + "\n")

    # The training runs go last: the longest, and what a time limit would cut.
    for section in ("attention", "decode", "train"):
        if section in _SKIP.value:
            continue
        start = time.perf_counter()
        try:
            body, ok = _run_section(section, gpu)
        except Exception as error:  # noqa: BLE001 - one section's failure ends no other
            body, ok = f"**failed:** {type(error).__name__}: {error}", False
        if not ok:
            failed.append(section)
        times[section] = time.perf_counter() - start
        emit(_TITLES[section], body)
    emit("section times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
         + (f"; failed: {', '.join(failed)}" if failed else "; nothing failed"))
    return 1 if failed else 0


_TITLES = {
    "attention": "## Attention: the kernel vs the dense float32 reference, fwd + bwd",
    "train": "## Training: the shakespeare_char GPU recipe, ours vs nanoGPT's",
    "decode": "## Decode: benchmarks/decode.py",
}


def _run_section(section: str, gpu: bool) -> tuple[str, bool]:
    """(markdown body, whether it passed) of one section, sized by the flags."""
    F = flags.FLAGS
    if section == "attention":
        dtype = _ATT_DTYPE.value or ("bfloat16" if gpu else "float32")
        impl = "cudnn" if gpu else "chunked"
        rows = attention_check("gpu" if gpu else "cpu", dtype, impl=impl,
                               batch=_ATT_BATCH.value, length=_ATT_LEN.value,
                               heads=_ATT_HEADS.value, kv_heads=_ATT_KV_HEADS.value,
                               head_dim=_ATT_HEAD_DIM.value)
        shape = (f"B={_ATT_BATCH.value}, T={_ATT_LEN.value}, {_ATT_HEADS.value} heads x "
                 f"{_ATT_HEAD_DIM.value}")
        tolerance = (f"{TOLERANCE_FLOOR[dtype]:g}" if dtype == "float32" else
                     f"max({TOLERANCE_FLOOR[dtype]:g}, {TOLERANCE_FACTOR:g} x the error of the "
                     f"dense path in {dtype})")
        return (f"{shape}; errors relative to max |reference|; tolerance {tolerance}."
                + ("" if gpu else " On CPU the chunked kernel stands in for cuDNN; the cuDNN "
                   "column still shows how each mask would be passed to it.")
                + "\n\n" + attention_table(rows), all(r["ok"] for r in rows))
    if section == "decode":
        return decode_check(gpu=gpu, batch_sizes=F.batch_sizes, new_tokens=F.new_tokens,
                            prompt_len=F.prompt_len, layers=F.layers, d_model=F.d_model,
                            heads=F.heads, vocab=F.vocab, context=F.context,
                            repeats=F.repeats), True
    sizes = dict(batch_size=_BATCH.value, block_size=_CONTEXT.value, n_layer=_LAYERS.value,
                 n_head=_HEADS.value, n_embd=_WIDTH.value)
    workdir = os.path.abspath(_WORKDIR.value or tempfile.mkdtemp(prefix="accelerator_check_"))
    for side in ("ours", "nanogpt"):
        if os.path.exists(os.path.join(workdir, side)):
            raise FileExistsError(f"--workdir={workdir} already holds a run ({side}/): "
                                  "expected a new directory")
    nanogpt_dir = _NANOGPT.value and os.path.abspath(_NANOGPT.value)
    if nanogpt_dir and not os.path.isfile(os.path.join(nanogpt_dir, "train.py")):
        raise FileNotFoundError(f"--nanogpt_dir={nanogpt_dir}: no train.py (expected a "
                                "checkout of karpathy/nanoGPT)")
    result = train_check(_TEXT.value, nanogpt_dir, workdir, gpu=gpu, iters=_MAX_ITERS.value,
                         sizes=sizes, log_interval=_LOG_INTERVAL.value,
                         eval_batches=_EVAL_BATCHES.value, ours_flags=_OURS_FLAGS.value)
    recipe = sizes == dict(batch_size=64, block_size=256, n_layer=6, n_head=6, n_embd=384)
    shape = (f"layers/heads/width {sizes['n_layer']}/{sizes['n_head']}/{sizes['n_embd']}, "
             f"context {sizes['block_size']}, batch {sizes['batch_size']} "
             f"({'the recipe' if recipe else 'smaller than the recipe'}), {_MAX_ITERS.value} "
             f"iterations; the runs are in {workdir}")
    return shape + "\n\n" + result["table"] + "\n\n" + "\n".join(
        f"- {note}" for note in result["notes"]), not any("error" in s for s in result["sides"])


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(main)
