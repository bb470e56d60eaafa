"""What a long context costs per token mixer: train-step time and peak memory against length.

    python benchmarks/long_context.py [--lengths=1024,2048,4096,8192,16384]
        [--variants=full,hybrid,linear,mla,mamba2] [--repeats=2]

One small decoder LM (4 layers, d_model 128, 4 heads of 32, d_ff 512, vocab 512, float32, batch
1) with each variant's `model.layer_types` / `attention_kind`:

- full: every layer full attention (`attention_impl=auto`: chunked past 2k on CPU, O(T) memory
  but O(T^2) time);
- hybrid: three Gated DeltaNet layers to one full (`linear_attention*3,full_attention`);
- linear: every layer Gated DeltaNet;
- mla: every layer multi-head latent attention (ranks 64, rope dim 16);
- mamba2: every layer Mamba 2.

For each length it jits one forward + backward of the next-token loss (`jax.value_and_grad`),
reads XLA's compiled memory analysis (peak = temp + arguments + outputs), and times the best of
`--repeats` runs after one warm-up. The last column is the growth: time at this length over time
at the first. Linear layers grow as T; attention's scores as T^2, which shows once they dominate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

VARIANTS = {
    "full": dict(),
    "hybrid": dict(layer_types="linear_attention*3,full_attention"),
    "linear": dict(layer_types="linear_attention"),
    "mla": dict(attention_kind="mla"),
    "mamba2": dict(layer_types="mamba2"),
}


def model_config(variant: str):
    from transformer.configs import base_config
    model = base_config().model
    model.update(family="gpt", vocab_size=512, num_layers=4, d_model=128, num_heads=4, d_ff=512,
                 position="rope", norm="rmsnorm", use_bias=False, activation="swiglu")
    for name, value in VARIANTS[variant].items():
        model[name] = value
    if variant == "mla":
        model.mla.update(kv_lora_rank=64, q_lora_rank=0, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32)
    if variant in ("hybrid", "linear"):
        model.linear_attention.update(key_head_dim=32, value_head_dim=32)
    if variant == "mamba2":
        model.mamba2.update(state_size=32, head_dim=32, expand=2)
    return model


def measure(variant: str, length: int, repeats: int):
    """(peak bytes, best seconds) of one forward + backward at `length`."""
    import jax
    import jax.numpy as jnp
    import optax

    from transformer.models import build_model
    model = build_model(model_config(variant))
    tokens = jnp.zeros((1, length + 1), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens[:, :8])["params"]

    def loss(p, t):
        logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    step = jax.jit(jax.value_and_grad(loss))
    compiled = step.lower(params, tokens).compile()
    m = compiled.memory_analysis()
    peak = None if m is None else (m.temp_size_in_bytes + m.argument_size_in_bytes
                                   + m.output_size_in_bytes)
    jax.block_until_ready(compiled(params, tokens))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, tokens))
        best = min(best, time.perf_counter() - start)
    return peak, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, batch 1, 4 layers x 128")
    print("| variant | length | step (s) | peak memory (MiB) | time / time at first length |")
    print("|---|---:|---:|---:|---:|")
    for variant in args.variants.split(","):
        first = None
        for length in lengths:
            peak, seconds = measure(variant, length, args.repeats)
            first = first or seconds
            mib = "n/a" if peak is None else f"{peak / 2**20:.0f}"
            print(f"| {variant} | {length} | {seconds:.3f} | {mib} | {seconds / first:.1f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
