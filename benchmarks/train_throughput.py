"""Train-step throughput against karpathy/nanoGPT (PyTorch) on this machine, same model.

    python benchmarks/train_throughput.py --nanogpt_dir=PATH/TO/nanoGPT [--shapes=small,medium]
        [--steps=10] [--repeats=3] [--torch_threads=2] [--breakdown=medium]

Both sides train the same GPT: GPT-2 style (pre-LN, GELU (erf) MLP 4x wide, learned positions,
tied embeddings, no biases), character vocabulary of 65, dropout 0, AdamW (weight decay on
matrices) with global-norm clipping at 1.0, on the same random tokens. Ours is the real jitted
`train.make_train_step` from `experiments/gpt_shakespeare_char.py`; nanoGPT's is its `model.py`
and `configure_optimizers` imported from a local checkout (`--nanogpt_dir`; nothing of it is
copied here): forward, backward, clip, step, zero_grad, exactly its train.py loop body.

Shapes: `small` = 4 layers / 4 heads / 128 wide, context 64, batch 12 (nanoGPT's CPU recipe);
`medium` = 6/6/384, context 256, batch 8. After a warm-up the two alternate `repeats` times, `steps`
steps each, and each shows its best run. Also prints model FLOPs per step
(`metrics.flops_per_token`, the PaLM formula: 6 N per token, N the params that multiply, so not the
learned position table, which nanoGPT's `estimate_mfu` leaves out too, plus attention scores), the
achieved FLOP/s, and the float32 matmul peak each framework reaches on this machine (2048^2), so MFU
is against a measured peak: XLA's, the larger of this run's and the best this host has shown
(`metrics.cpu_peak`'s cache, as training's MFU uses), since one measurement on a loaded machine
reads low; an MFU above 100% is flagged as measured under load. Ours is jitted with the compiler
options training uses (`placement.compiler_options`). Both sides run under the process's malloc,
which the header names, set up as `python -m transformer.train` sets it
(`hostmem.keep_freed_memory`: glibc keeps XLA's scratch memory between steps; docs/performance.md,
"CPU runs"); `--nokeep_freed_memory` leaves glibc as it starts.

Then, for the `--breakdown` shapes, where our step's time goes: forward, forward + backward and
the optimizer update alone, and the two kinds of matmul work inside, each timed alone: the
attention core (softmax(QK^T)V, causal) and the projection + MLP GEMMs with nothing between them,
each also in PyTorch on the same inputs, and a block's elementwise work alone (LayerNorms,
residual adds, GELU) on both sides. Last, the attention core as each whole train step runs
it: the step's time less the same step with q + k + v in the core's place (the projections stay),
both sides alternating; a difference at or below zero reads "within noise". A part can cost
more inside the step than alone (caches, the other work the step runs beside it).
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

_NANOGPT = flags.DEFINE_string("nanogpt_dir", None, "A checkout of karpathy/nanoGPT.")
_SHAPES = flags.DEFINE_list("shapes", ["small", "medium"], "small, medium.")
_STEPS = flags.DEFINE_integer("steps", 10, "Train steps per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per side (the best is shown).")
_KEEP = flags.DEFINE_bool("keep_freed_memory", True, "Under glibc malloc, keep freed memory "
                          "as python -m transformer.train does (hostmem.keep_freed_memory).")
_THREADS = flags.DEFINE_integer("torch_threads", 2, "torch.set_num_threads.")
_OURS_ONLY = flags.DEFINE_bool("ours_only", False, "Skip nanoGPT (for profiling ours).")
_BREAKDOWN = flags.DEFINE_list("breakdown", ["medium"], "Shapes whose step time to split into "
                               "parts (forward, backward, optimizer, attention, GEMMs).")

SHAPES = {  # layers, heads, width, context, batch
    "small": (4, 4, 128, 64, 12),
    "medium": (6, 6, 384, 256, 8),
}
VOCAB = 65


def ours(shape, features):
    """A `step()` that runs one jitted train step of this project, and its model FLOPs per
    token (`metrics.flops_per_token`: the learned position table, only looked up, not counted)."""
    import jax
    from compile_time import build_train_step, gpt_config  # benchmarks/compile_time.py

    from transformer.training import metrics as metrics_lib

    layers, heads, width, context, batch = shape
    config = gpt_config(layers=layers, d_model=width, heads=heads, d_ff=4 * width,
                        seq_len=context, batch=batch, vocab=VOCAB)
    config.model.activation = "gelu"  # nanoGPT's nn.GELU() is the exact (erf) GELU
    built = build_train_step(config, features)
    num_params = sum(p.size for p in jax.tree.leaves(built.state.params))

    def step(n):
        with built.placement.context():
            s = built.state
            for _ in range(n):
                s, metrics = built.jitted(s, built.batch)
            metrics["loss"].block_until_ready()
            built.state = s
        return float(metrics["loss"])

    return step, metrics_lib.flops_per_token(config, num_params)


def nanogpt(shape, tokens, directory):
    """The same `step()` for nanoGPT's model and optimizer, imported from `directory`."""
    import torch

    sys.path.insert(0, directory)
    from model import GPT, GPTConfig  # nanoGPT's model.py

    layers, heads, width, context, batch = shape
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=context, vocab_size=VOCAB, n_layer=layers, n_head=heads,
                          n_embd=width, dropout=0.0, bias=False))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    x, y = (torch.from_numpy(t.astype("int64")) for t in tokens)

    def step(n):
        for _ in range(n):
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def breakdown(shape, features, nanogpt_dir=None):
    """Rows (part, ms, GFLOP) splitting our train step at `shape`, each part jitted alone with
    the train step's compiler options: forward, forward + backward, the optimizer update, the
    attention core (softmax(QK^T)V, causal) fwd+bwd x layers, and the layers' projection and
    MLP matmuls alone (the same GEMMs, fwd+bwd, without anything between them) x layers. For
    comparison, the same attention core in PyTorch as nanoGPT runs it (the fused CPU kernel of
    `scaled_dot_product_attention`, causal) and the same GEMMs in PyTorch, on the same inputs.
    Last, `attention_in_step`'s rows: ours, and nanoGPT's from `nanogpt_dir` when given."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from compile_time import build_train_step, gpt_config

    from transformer.models import family_of
    from transformer.nn import attention, masks
    from transformer.training import metrics

    layers, heads, width, context, batch = shape
    config = gpt_config(layers=layers, d_model=width, heads=heads, d_ff=4 * width,
                        seq_len=context, batch=batch, vocab=VOCAB)
    config.model.activation = "gelu"
    built = build_train_step(config, features)
    options = built.placement.compiler_options
    params, opt_state = built.state.params, built.state.opt_state

    def ms(f, *args, n=5, repeats=3):
        compiled = jax.jit(f, compiler_options=options)
        jax.block_until_ready(compiled(*args))
        return 1e3 * min(timed(lambda k: jax.block_until_ready(
            [compiled(*args) for _ in range(k)][-1]), n)[0] / n for _ in range(repeats))

    def loss(p):
        return family_of(config).loss_and_metrics(built.model, config, p, built.batch)[0]

    def update(grads, state, p):
        updates, state = built.optimizer.update(grads, state, p)
        return jax.tree.map(jnp.add, p, updates), state

    tokens, head_dim = batch * context, width // heads
    key = jax.random.split(jax.random.key(0), 8)
    qkv = [jax.random.normal(k, (batch, context, heads, head_dim)) for k in key[:3]]
    # as the model runs it: `attend` picks the kernel (dense, in query blocks on CPU)
    core = lambda q, k, v: jnp.sum(attention.attend(q, k, v, mask=masks.Causal(), impl="auto"))
    x = jax.random.normal(key[3], (tokens, width))
    weights = [jax.random.normal(k, s) * 0.02 for k, s in zip(
        key[4:], [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)],
        strict=True)]

    def gemms(x, w_qkv, w_out, w_in, w_mlp):  # the block's matmuls, chained linearly
        h = (x @ w_qkv)[:, :width] @ w_out  # (runs on jax and torch arrays alike)
        return ((h @ w_in) @ w_mlp).sum()

    num_params = sum(p.size for p in jax.tree.leaves(params))
    step_gflop = metrics.flops_per_token(config, num_params) * tokens / 1e9  # main table's
    with built.placement.context():
        grads = jax.jit(jax.grad(loss))(params)
        rows = [("forward (loss)", ms(loss, params), step_gflop / 3),
                ("forward + backward", ms(jax.grad(loss), params), step_gflop),
                ("optimizer update (clip, AdamW)", ms(update, grads, opt_state, params), 0.0)]
    core_gflop = 12 * batch * heads * context * context * head_dim * layers / 1e9
    rows.append((f"attention core fwd+bwd x {layers}",
                 layers * ms(jax.grad(core, argnums=(0, 1, 2)), *qkv), core_gflop))
    q_t, k_t, v_t = (torch.from_numpy(np.array(a)).transpose(1, 2).contiguous()
                     .requires_grad_(True) for a in qkv)  # [B, N, T, H], as nanoGPT's

    def torch_core(n):
        for _ in range(n):
            out = torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True)
            out.sum().backward()
        return None

    torch_core(1)
    torch_ms = 1e3 * min(timed(torch_core, 5)[0] / 5 for _ in range(3))
    rows.append((f"nanoGPT's attention core (PyTorch SDPA) fwd+bwd x {layers}",
                 layers * torch_ms, core_gflop))
    gemm_gflop = 6 * 12 * width * width * tokens * layers / 1e9  # 12 w^2 weights a layer
    rows.append((f"projection + MLP GEMMs alone fwd+bwd x {layers}",
                 layers * ms(jax.grad(gemms, argnums=(0, 1, 2, 3, 4)), x, *weights), gemm_gflop))
    x_t, *weights_t = (torch.from_numpy(np.array(a)).requires_grad_(True)
                       for a in (x, *weights))

    def torch_gemms(n):
        for _ in range(n):
            for t in (x_t, *weights_t):
                t.grad = None  # as nanoGPT's zero_grad(set_to_none=True)
            gemms(x_t, *weights_t).backward()
        return None

    torch_gemms(1)
    rows.append((f"the same GEMMs in PyTorch fwd+bwd x {layers}",
                 layers * 1e3 * min(timed(torch_gemms, 5)[0] / 5 for _ in range(3)), gemm_gflop))
    rows += elementwise_rows(ms, layers, tokens, width)
    rows += attention_in_step(shape, features, nanogpt_dir, core_gflop)
    return rows


def elementwise_rows(ms, layers, tokens, width):
    """Rows (part, ms, GFLOP): a block's elementwise work alone, fwd+bwd x `layers`, ours (the
    model's `activations.gelu`, Flax's LayerNorm, timed by `breakdown`'s `ms`: jitted with the
    step's compiler options) and PyTorch's (`nn.GELU`, `layer_norm`, as nanoGPT's block runs
    them) on the same inputs: two LayerNorms and two residual adds over [tokens, width], one
    exact GELU over [tokens, 4 width].
    No matmul: what these cost is memory traffic and transcendentals (erf), and how many cores
    each framework spreads them over."""
    import flax.linen as nn
    import jax
    import numpy as np
    import torch

    from transformer.nn import activations

    norm = nn.LayerNorm(use_bias=False)
    norm_params = norm.init(jax.random.key(0), np.zeros((1, width), np.float32))

    def block(x, h):
        y = x + norm.apply(norm_params, x)
        return (y + norm.apply(norm_params, y)).sum() + activations.gelu(h).sum()

    rng = np.random.default_rng(0)
    x, h = (rng.standard_normal(s).astype(np.float32) for s in ((tokens, width),
                                                               (tokens, 4 * width)))
    ours_ms = ms(jax.grad(block, argnums=(0, 1)), x, h)
    x_t, h_t = (torch.from_numpy(a).requires_grad_(True) for a in (x, h))
    t_norm, t_gelu = torch.nn.LayerNorm(width, bias=False), torch.nn.GELU()

    def torch_block(n):
        for _ in range(n):
            x_t.grad = h_t.grad = None
            y = x_t + t_norm(x_t)
            ((y + t_norm(y)).sum() + t_gelu(h_t).sum()).backward()
        return None

    torch_block(1)
    torch_ms = 1e3 * min(timed(torch_block, 5)[0] / 5 for _ in range(3))
    return [(f"elementwise alone (2 LayerNorm, 2 adds, GELU) fwd+bwd x {layers}",
             layers * ours_ms, 0.0),
            (f"the same in PyTorch fwd+bwd x {layers}", layers * torch_ms, 0.0)]


def attention_in_step(shape, features, nanogpt_dir, core_gflop, steps=5, repeats=3):
    """Rows (part, ms, GFLOP): the attention core's share of each side's whole train step, i.e.
    the step's ms less the ms of the same step with q + k + v in the core's place (ours:
    `dense_attention.dot_product_attention`, the CPU kernel `attend` runs; nanoGPT: torch's
    `scaled_dot_product_attention`). The four steps alternate `repeats` times, best of each."""
    import torch

    from transformer.nn import dense_attention

    def stand_in(q, k, v, *args, **kwargs):
        return q + k + v

    real_core = dense_attention.dot_product_attention
    dense_attention.dot_product_attention = stand_in  # read when the step is traced, in ours()
    try:
        without, _ = ours(shape, features)
        without(1)  # traces and compiles with the stand-in
    finally:
        dense_attention.dot_product_attention = real_core
    sides = {"ours": ours(shape, features)[0], "ours without": without}
    if nanogpt_dir:
        tokens = features["inputs"], features["targets"]
        real_sdpa = torch.nn.functional.scaled_dot_product_attention

        def nanogpt_without(step):
            def run(n):
                torch.nn.functional.scaled_dot_product_attention = stand_in
                try:
                    return step(n)
                finally:
                    torch.nn.functional.scaled_dot_product_attention = real_sdpa
            return run

        sides["nanoGPT"] = nanogpt(shape, tokens, nanogpt_dir)
        sides["nanoGPT without"] = nanogpt_without(nanogpt(shape, tokens, nanogpt_dir))
    for step in sides.values():
        step(1)
    best = alternate(sides, steps, repeats)
    return [(f"{side}: attention core in the step (step - step without it: "
             f"{best[side] * 1e3:.0f} - {best[side + ' without'] * 1e3:.0f} ms)",
             (best[side] - best[side + " without"]) * 1e3, core_gflop)
            for side in ("ours", "nanoGPT") if side in best]


def alternate(sides, steps, repeats):
    """{side: best seconds per step}: each side's `step(steps)` in turn, `repeats` times over,
    so load from elsewhere hits every side alike."""
    best = {side: float("inf") for side in sides}
    for _ in range(repeats):
        for side, step in sides.items():
            best[side] = min(best[side], timed(step, steps)[0] / steps)
    return best


def timed(step, n):
    start = time.perf_counter()
    loss = step(n)
    return time.perf_counter() - start, loss


def xla_mfu_peak(measured: float) -> tuple[float, float]:
    """(the XLA peak MFU is taken against, the host best): the larger of `measured` (this run's
    matmul) and the best this CPU has shown under this jax (`metrics.cpu_peak`, the cached peak
    training's MFU uses): one measurement on a loaded machine reads low."""
    from transformer.training import metrics

    host_best = metrics.cpu_peak()[0]
    return max(measured, host_best), host_best


def mfu_cell(flops_per_s: float, peak: float) -> str:
    """The MFU column: `flops_per_s` / `peak`, flagged above 100% (a peak measured while the
    machine was busy reads low; no step outruns the real one)."""
    mfu = flops_per_s / peak
    return f"{mfu:.0%}" + (" (peak measured under load)" if mfu > 1 else "")


def part_row(part: str, seconds_ms: float, gflop: float) -> str:
    """A breakdown table row. A time at or below zero can only be a difference of two best
    times (`attention_in_step`) that noise outweighed: "within noise", no rate."""
    if seconds_ms <= 0:
        return f"| {part} | within noise | {gflop:.1f} | - |"
    rate = f"{gflop / seconds_ms * 1e3:.0f}" if gflop else "-"
    return f"| {part} | {seconds_ms:.1f} | {gflop:.1f} | {rate} |"


def matmul_peaks(size=2048, repeats=20):
    """Float32 FLOP/s of a size^2 matmul in XLA and in torch on this machine."""
    import jax
    import numpy as np
    import torch

    a = (np.random.default_rng(0).standard_normal((size, size)) / np.sqrt(size)).astype(
        np.float32)
    t = torch.from_numpy(a)
    for _ in range(3):
        t @ t
    torch_seconds = min(timed(lambda n: t @ t, 1)[0] for _ in range(repeats))
    xla = jax.jit(lambda x: x @ x)
    x = jax.device_put(a)
    xla(x).block_until_ready()
    xla_seconds = min(timed(lambda n: xla(x).block_until_ready(), 1)[0] for _ in range(repeats))
    flops = 2 * size**3
    return flops / xla_seconds, flops / torch_seconds


def main(argv) -> None:
    from nanogpt_common import cpu_model  # benchmarks/nanogpt_common.py

    del argv
    import jax
    import torch
    from compile_time import random_batch  # benchmarks/compile_time.py (adds the repo to the path)

    from transformer.utils import hostmem

    if not _OURS_ONLY.value and not (_NANOGPT.value and
                                     os.path.exists(os.path.join(_NANOGPT.value, "model.py"))):
        raise app.UsageError(f"--nanogpt_dir={_NANOGPT.value!r}: expected a checkout of "
                             "karpathy/nanoGPT (a directory with model.py), or --ours_only")
    for flag in (_SHAPES, _BREAKDOWN):
        for name in flag.value:
            if name not in SHAPES:
                raise app.UsageError(f"--{flag.name}: {name!r} is not one of {sorted(SHAPES)}")
    torch.set_num_threads(_THREADS.value)
    kept = _KEEP.value and hostmem.keep_freed_memory()
    xla_now, torch_peak = matmul_peaks()
    xla_peak, host_best = xla_mfu_peak(xla_now)
    print(f"{cpu_model()}; jax {jax.__version__}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); float32 matmul 2048^2 peak: XLA "
          f"{xla_peak / 1e9:.0f} GFLOP/s (this run {xla_now / 1e9:.0f}, host best "
          f"{host_best / 1e9:.0f}: MFU is against the larger), torch "
          f"{torch_peak / 1e9:.0f} GFLOP/s; {_STEPS.value} steps per run, best of "
          f"{_REPEATS.value}; malloc: {hostmem.allocator()}"
          f"{' (keeping freed memory)' if kept else ''}")

    rows = []
    for name in _SHAPES.value:
        shape = SHAPES[name]
        layers, heads, width, context, batch = shape
        features = random_batch(batch, context, VOCAB)  # the same tokens for both sides
        tokens = features["inputs"], features["targets"]
        ours_step, per_token = ours(shape, features)
        sides = {"ours": ours_step}
        if not _OURS_ONLY.value:
            sides["nanoGPT"] = nanogpt(shape, tokens, os.path.abspath(_NANOGPT.value))
        compile_seconds, _ = timed(ours_step, 1)
        for step in sides.values():
            step(2)  # warm-up
        best = alternate(sides, _STEPS.value, _REPEATS.value)
        # The project's formula for both sides: 6 x the params that multiply (the tied table
        # once, as the head; the position table is only looked up) + attention's 12 L D T.
        flops = per_token * batch * context
        rows.append((name, shape, best, flops, compile_seconds))

    print()
    print("| shape | layers/heads/width, context, batch | side | ms/step | tokens/s | ratio | "
          "GFLOP/s | MFU of XLA peak |")
    print("| :--- | :--- | :--- | ---: | ---: | ---: | ---: | ---: |")
    for name, (layers, heads, width, context, batch), best, flops, _ in rows:
        for side, seconds in best.items():
            ratio = best.get("nanoGPT", seconds) / seconds
            print(f"| {name} | {layers}/{heads}/{width}, {context}, {batch} | {side} | "
                  f"{seconds * 1e3:.1f} | {batch * context / seconds:,.0f} | {ratio:.2f}x | "
                  f"{flops / seconds / 1e9:.0f} | {mfu_cell(flops / seconds, xla_peak)} |")
    print("\nratio = nanoGPT's ms/step / this side's; compile time of ours (first step): " +
          ", ".join(f"{name} {c:.1f} s" for name, *_, c in rows))
    for name in _BREAKDOWN.value:
        layers, heads, width, context, batch = SHAPES[name]
        parts = breakdown(SHAPES[name], random_batch(batch, context, VOCAB),
                          None if _OURS_ONLY.value else os.path.abspath(_NANOGPT.value))
        print(f"\nwhere ours spends a {name} step (each part jitted and timed alone; the "
              "last rows inside whole steps):\n")
        print("| part | ms | GFLOP | GFLOP/s |")
        print("| :--- | ---: | ---: | ---: |")
        for part, seconds_ms, gflop in parts:
            print(part_row(part, seconds_ms, gflop))


if __name__ == "__main__":
    app.run(main)
