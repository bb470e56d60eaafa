"""A tiny forward pass through every mask and positional encoding (README's first command).

    python -m transformer.demo
"""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import masks
from transformer.layers import POSITIONS, TransformerConfig, TransformerStack


def main() -> None:
    batch, length, d_model = 2, 8, 32
    x_BTD = jax.random.normal(jax.random.key(0), (batch, length, d_model))
    patterns = {
        "causal": masks.Causal(),
        "full": masks.Full(),
        "prefix_lm": masks.PrefixLM(jnp.array([3, 5])),
        "sliding_window": masks.SlidingWindow(left=2),
        "chunked_causal": masks.ChunkedCausal(chunk_size=4),
        "packed_causal": masks.Segment(jnp.array([[1] * 5 + [2] * 3] * 2)) & masks.Causal(),
    }
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; input {x_BTD.shape}\n")
    print("causal mask (5x5):\n" + masks.show(masks.Causal()) + "\n")
    print(f"{'position':<11} {'mask':<15} {'params':>7} {'out std':>9} {'ms':>7}")
    runs = [(position, "causal") for position in POSITIONS]
    runs += [("rope", name) for name in patterns if name != "causal"]
    for position, name in runs:
        cfg = TransformerConfig(num_layers=2, d_model=d_model, num_heads=4, num_kv_heads=2,
                                d_ff=64, position=position, scan_layers=True)
        stack = TransformerStack(cfg, bidirectional=name == "full")
        variables = jax.jit(stack.init)(jax.random.key(1), x_BTD, patterns[name])
        params = sum(p.size for p in jax.tree.leaves(nn.unbox(variables)))
        start = time.perf_counter()
        out_BTD = jax.jit(stack.apply)(variables, x_BTD, patterns[name]).block_until_ready()
        ms = (time.perf_counter() - start) * 1e3  # includes compilation
        print(f"{position:<11} {name:<15} {params:>7} {float(out_BTD.std()):>9.4f} {ms:>7.1f}")

if __name__ == "__main__":
    main()
