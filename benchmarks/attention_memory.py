"""Peak memory of one attention layer's forward + backward: dense reference vs chunked.

    python benchmarks/attention_memory.py [--lengths=1024,2048,4096,8192,16384,32768]
        [--dense-max=32768] [--chunk=512] [--time-lengths=1024,4096]

For batch 1, 8 heads, head dim 64, float32, causal mask, jits `(q, k, v, d_out) -> (out, dq, dk,
dv)` for `dense_attention.dot_product_attention` and `chunked_attention.chunked_attention` and reads
XLA's compiled memory analysis (nothing is allocated or run for the table): peak = temp +
argument + output bytes. The dense logits alone are T * T * 8 heads * 4 bytes (32 GiB at 32k), so
dense lengths above --dense-max are not compiled ("n/a"); a dense compile that fails is reported
as "n/a" with its error. Then times one forward + backward at --time-lengths for both (dense
"n/a" above --dense-max there too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BATCH, HEADS, HEAD_DIM = 1, 8, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--dense-max", type=int, default=32768,
                        help="longest length at which the dense reference is compiled")
    parser.add_argument("--chunk", type=int, default=512, help="q_chunk = kv_chunk")
    parser.add_argument("--time-lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import jax
    import jax.numpy as jnp
    import numpy as np

    from transformer.nn import masks
    from transformer.nn.chunked_attention import chunked_attention
    from transformer.nn.dense_attention import dot_product_attention
    from transformer.nn.tile_plan import plan_tiles

    mask = masks.Causal()
    impls = {
        "dense": lambda q, k, v: dot_product_attention(q, k, v, mask),
        "chunked": lambda q, k, v: chunked_attention(q, k, v, mask, q_chunk=args.chunk,
                                                     kv_chunk=args.chunk),
    }

    def fwd_bwd(attend):
        def step(q, k, v, d_out):
            out, vjp = jax.vjp(attend, q, k, v)
            return (out, *vjp(d_out))
        return jax.jit(step)

    def shapes(length):
        s = jax.ShapeDtypeStruct((BATCH, length, HEADS, HEAD_DIM), jnp.float32)
        return s, s, s, s

    def compiled_peak(name, length):
        """(peak bytes, temp bytes, compile seconds) or (None, reason, None)."""
        if name == "dense" and length > args.dense_max:
            return None, f"not compiled above --dense-max={args.dense_max}", None
        start = time.perf_counter()
        try:
            compiled = fwd_bwd(impls[name]).lower(*shapes(length)).compile()
        except Exception as e:  # noqa: BLE001 - report any compile failure in the table
            return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}", None
        seconds = time.perf_counter() - start
        m = compiled.memory_analysis()
        if m is None:
            return None, "no memory analysis on this backend", None
        peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
        return peak, m.temp_size_in_bytes, seconds

    def fmt(n):
        if n is None:
            return "n/a"
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if n >= size:
                return f"{n / size:.2f} {unit}"
        return f"{n} B"

    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"attention fwd+bwd, batch {BATCH}, {HEADS} heads, head dim {HEAD_DIM}, float32, "
          f"causal; chunked tiles {args.chunk}x{args.chunk}; {jax.devices()[0].platform}")
    print("peak = temp + argument + output bytes of jax.jit(fwd+bwd).lower(...).compile()"
          ".memory_analysis()\n")
    header = (f"{'length':>7} {'dense peak':>12} {'chunked peak':>13} {'chunked temp':>13} "
              f"{'x prev. length':>15} {'tiles computed':>15}")
    print(header)
    print("-" * len(header))
    notes, previous = [], None
    for length in lengths:
        dense, dense_info, _ = compiled_peak("dense", length)
        chunked, chunked_temp, _ = compiled_peak("chunked", length)
        if dense is None:
            notes.append(f"dense at {length}: n/a ({dense_info})")
        if chunked is None:
            notes.append(f"chunked at {length}: n/a ({chunked_temp})")
            chunked_temp = None
        ratio = f"{chunked / previous:.2f}" if chunked and previous else "-"
        previous = chunked
        chunk = min(args.chunk, length)
        plan = plan_tiles(mask, length, length, chunk, chunk)
        tiles = f"{plan.count()}/{plan.num_q_tiles * plan.num_kv_tiles}"
        print(f"{length:>7} {fmt(dense):>12} {fmt(chunked):>13} {fmt(chunked_temp):>13} "
              f"{ratio:>15} {tiles:>15}", flush=True)
    for note in notes:
        print("  " + note)
    dense_logits = lengths[-1] ** 2 * HEADS * 4 * BATCH
    print(f"\n(one dense [B, N, T, T] float32 logits array at {lengths[-1]}: {fmt(dense_logits)})")

    time_lengths = [int(x) for x in args.time_lengths.split(",") if x]
    if time_lengths:
        print(f"\nwall time per fwd+bwd (median of {args.repeats} after one warm-up run)\n")
        print(f"{'length':>7} {'dense':>10} {'chunked':>10}")
        rng = np.random.default_rng(0)
        for length in time_lengths:
            arrays = [jnp.asarray(rng.normal(size=(BATCH, length, HEADS, HEAD_DIM)), jnp.float32)
                      for _ in range(4)]
            row = []
            for name in ("dense", "chunked"):
                if name == "dense" and length > args.dense_max:
                    row.append("n/a")  # (as in the table: not run above --dense-max)
                    continue
                step = fwd_bwd(impls[name])
                jax.block_until_ready(step(*arrays))
                runs = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(step(*arrays))
                    runs.append(time.perf_counter() - start)
                row.append(f"{np.median(runs) * 1e3:.0f} ms")
            print(f"{length:>7} {row[0]:>10} {row[1]:>10}", flush=True)


if __name__ == "__main__":
    main()
