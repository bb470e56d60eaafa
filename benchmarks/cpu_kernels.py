"""The kernels of a GPT 6/6/384 train step (batch 8 x 256), XLA:CPU against PyTorch, one by one.

    python benchmarks/cpu_kernels.py [--repeats=5] [--torch_threads=2]

`benchmarks/train_throughput.py` compares whole train steps with nanoGPT's; this splits the
difference by kind of work, each op alone on the same float32 inputs: the block's GEMMs (the
MLP's two and a weight gradient), the attention core's batched matmuls at the shapes the CPU
query blocks run (64 queries over 64 to 256 keys, 48 = batch x heads of them), and the
elementwise work (exact GELU, LayerNorm, an add). XLA compiles each with the options training
uses (`placement.compiler_options`: XLA's default YNNPACK fusions, the scheduler, the heap cap
under glibc) and again with the same options plus the flag that turns YNNPACK off (Eigen's
dots), so the two columns differ only in the dot library; PyTorch under its defaults (MKL /
oneDNN GEMMs). A row's
ratio is PyTorch's ms over XLA's with the training default: below 1.0x, XLA is slower. Every
cell is the best of `repeats` runs, the sides taking turns. The CPU is named in the header.
"""

from __future__ import annotations

import time

from absl import app, flags
from nanogpt_common import cpu_model  # benchmarks/nanogpt_common.py

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per cell (the best is shown).")
_THREADS = flags.DEFINE_integer("torch_threads", 2, "torch.set_num_threads.")

TOKENS, WIDTH, BLOCKS = 8 * 256, 384, 48  # GPT 6/6/384, batch 8 x 256; batch x heads


def cases(np, torch, jax):
    """(name, GFLOP, jax function, its numpy inputs, the same op in PyTorch as a thunk)."""
    from transformer.nn import activations

    rng = np.random.default_rng(0)
    new = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    out = []
    for m, k, n in ((TOKENS, WIDTH, 4 * WIDTH), (TOKENS, 4 * WIDTH, WIDTH)):
        a, b = new(m, k), new(k, n)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        out.append((f"GEMM [{m}, {k}] x [{k}, {n}]", 2 * m * k * n / 1e9, lambda a, b: a @ b,
                    (a, b), lambda ta=ta, tb=tb: ta @ tb))
    x, g = new(TOKENS, WIDTH), new(TOKENS, 4 * WIDTH)
    tx, tg = torch.from_numpy(x), torch.from_numpy(g)
    out.append((f"weight gradient [{WIDTH}, {TOKENS}] x [{TOKENS}, {4 * WIDTH}]",
                2 * TOKENS * WIDTH * 4 * WIDTH / 1e9, lambda x, g: x.T @ g, (x, g),
                lambda: tx.T @ tg))
    for m, k, n in ((64, 64, 256), (64, 256, 64), (256, 64, 256)):
        a, b = new(BLOCKS, m, k), new(BLOCKS, k, n)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        out.append((f"batched {BLOCKS} x [{m}, {k}] x [{k}, {n}]", 2 * BLOCKS * m * k * n / 1e9,
                    lambda a, b: a @ b, (a, b), lambda ta=ta, tb=tb: torch.bmm(ta, tb)))
    t_gelu = torch.nn.GELU()
    out.append((f"exact GELU [{TOKENS}, {4 * WIDTH}]", 0.0, activations.gelu, (g,),
                lambda: t_gelu(tg)))
    out.append((f"LayerNorm [{TOKENS}, {WIDTH}]", 0.0, lambda x: jax.nn.standardize(x, axis=-1),
                (x,), lambda: torch.nn.functional.layer_norm(tx, (WIDTH,))))
    out.append((f"add [{TOKENS}, {4 * WIDTH}]", 0.0, lambda x: x + 1.0, (g,), lambda: tg + 1.0))
    return out


def dot_settings(training: dict) -> dict:
    """{column: XLA options}: `training`, the options the train steps compile with, and the
    same with YNNPACK's fusions off (XLA's dots back on Eigen), nothing else changed."""
    return {"YNNPACK (training default)": dict(training),
            "Eigen dots": {**training, "xla_cpu_experimental_ynn_fusion_type": ""}}


def mean_ms(thunk, calls: int = 20) -> float:
    """ms per call of `thunk` over `calls` calls, after one untimed call (a jax result is
    waited for)."""
    thunk()
    start = time.perf_counter()
    for _ in range(calls):
        result = thunk()
    getattr(result, "block_until_ready", lambda: None)()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv) -> None:
    del argv
    from transformer.utils import hostmem

    hostmem.keep_freed_memory()  # as the command lines run (docs/performance.md, "CPU runs")
    import jax
    import ml_collections
    import numpy as np
    import torch

    from transformer.training import placement

    settings = dot_settings(placement.compiler_options(
        ml_collections.ConfigDict(), jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))))
    torch.set_num_threads(_THREADS.value)
    print(f"{cpu_model()}; jax {jax.__version__}, torch {torch.__version__} "
          f"({_THREADS.value} threads); float32, best of {_REPEATS.value}\n")
    names = list(settings)
    print(f"| op | {' | '.join(f'XLA {n} ms' for n in names)} | PyTorch ms | ratio |")
    print(f"| :--- | {' | '.join('---:' for _ in names)} | ---: | ---: |")
    for name, gflop, f, args, torch_thunk in cases(np, torch, jax):
        # on the device once, as a train step's operands are: NumPy arguments would be copied
        # in at every call and timed with the op
        args = tuple(jax.device_put(a) for a in args)
        compiled = [jax.jit(f).lower(*args).compile(compiler_options=o)
                    for o in settings.values()]
        times = [float("inf")] * len(compiled) + [float("inf")]
        for _ in range(_REPEATS.value):  # the sides take turns
            for i, c in enumerate(compiled):
                times[i] = min(times[i], mean_ms(lambda c=c, a=args: c(*a)))
            times[-1] = min(times[-1], mean_ms(torch_thunk))
        cells = " | ".join(f"{ms:.3f}" + (f" ({gflop / ms * 1e3:.0f} GFLOP/s)" if gflop else "")
                           for ms in times)
        print(f"| {name} | {cells} | {times[-1] / times[0]:.2f}x |")


if __name__ == "__main__":
    app.run(main)
