"""muP's coordinate check: how big each layer's activations get after a few Adam steps, by width.

    python benchmarks/mup_coord_check.py [--widths=64,128,256,512,1024] [--steps=4]

For each width w (d_model; 4 heads of w / 4, d_ff 4w, 2 layers, init_std 0.02, learning rate
0.01, byte tokens of the embedded corpus), under the standard parametrization and under muP with
base width 64, it trains `steps` Adam steps through `optim.make_optimizer` (muP's
learning-rate groups included) and prints the mean |activation| of each layer kind on a fixed
batch: the token embedding, the attention and MLP outputs (both layers averaged) and the logits.
Under muP the columns stay flat as the width grows; under the standard parametrization the
updates of the hidden matrices grow with the width and so do the activations (Tensor Programs V,
Figure 5). The last rows give each column's log2 slope against log2 width: ~0 flat, 1 linear.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from transformer.configs import base_config
from transformer.data import sources
from transformer.models import build_model
from transformer.nn import objectives
from transformer.training import optim

KINDS = ("embed", "attention", "mlp", "logits")
BASE_WIDTH = 64


def config_for(width: int, parametrization: str, learning_rate: float = 1e-2,
               steps: int = 4):
    config = base_config()
    config.steps = steps
    config.model.update(family="gpt", num_layers=2, d_model=width, num_heads=4, d_ff=4 * width,
                        vocab_size=256, position="rope", norm="layernorm", use_bias=False,
                        init_std=0.02, parametrization=parametrization,
                        mup_base_width=BASE_WIDTH)
    config.optimizer.update(learning_rate=learning_rate, warmup_steps=0, decay="constant",
                            weight_decay=0.0, grad_clip_norm=0.0)
    return config


def batch(rows: int = 8, length: int = 64, seed: int = 0) -> np.ndarray:
    """Byte windows [rows, length + 1] of the embedded corpus."""
    text = "".join(doc.text for doc in sources.embedded_corpus()[:40]).encode()
    starts = np.random.default_rng(seed).integers(0, len(text) - length - 1, rows)
    return np.stack([np.frombuffer(text[s:s + length + 1], np.uint8) for s in starts]).astype(
        np.int32)


def activations(model, params, tokens) -> dict[str, float]:
    """Mean |output| of the token embedding, the attention and MLP layers, and the logits."""
    logits, state = model.apply({"params": params}, tokens, capture_intermediates=True)
    found = {kind: [] for kind in KINDS}
    paths = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
    for path, value in paths:
        keys = [getattr(k, "key", "") for k in path]
        if "__call__" not in keys:
            continue
        owner = keys[keys.index("__call__") - 1]
        kind = {"embed": "embed", "self_attention": "attention", "mlp": "mlp"}.get(owner)
        if kind and (kind != "embed" or len(keys) == 3):  # the embedding's lookup, not attend
            found[kind].append(float(jnp.mean(jnp.abs(value))))
    found["logits"].append(float(jnp.mean(jnp.abs(logits))))
    return {kind: float(np.mean(values)) for kind, values in found.items()}


def coordinates(width: int, parametrization: str, steps: int = 4, seed: int = 0,
                learning_rate: float = 1e-2) -> dict[str, float]:
    """`activations` after `steps` Adam steps on fixed batches at this width."""
    config = config_for(width, parametrization, learning_rate, steps)
    model = build_model(config.model)
    data = [batch(seed=seed + 1 + step) for step in range(steps)]
    # threefry whatever jax_default_prng_impl says: the same draws in the test suite (rbg) too
    key = jax.random.key(seed, impl="threefry2x32")
    params = nn.unbox(model.init(key, data[0][:, :-1])["params"])
    tx = optim.make_optimizer(config)
    state = tx.init(params)

    @jax.jit
    def step(params, state, rows):
        def loss(p):
            logits = model.apply({"params": p}, rows[:, :-1])
            return objectives.cross_entropy(logits, rows[:, 1:], jnp.ones(rows[:, 1:].shape))[0]
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for rows in data:
        params, state = step(params, state, rows)
    return activations(model, params, batch(seed=seed)[:, :-1])


def slopes(table: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each kind's least-squares slope of log2 |activation| against log2 width."""
    widths = np.log2(sorted(table))
    return {kind: float(np.polyfit(widths, np.log2([table[w][kind] for w in sorted(table)]), 1)[0])
            for kind in KINDS}


def main(argv):
    del argv
    widths, steps = [int(w) for w in flags.FLAGS.widths], flags.FLAGS.steps
    print(f"mean |activation| after {steps} Adam steps (lr 0.01, init_std 0.02); "
          f"muP base width {BASE_WIDTH}\n")
    for parametrization in ("standard", "mup"):
        table = {w: coordinates(w, parametrization, steps) for w in widths}
        print(f"{parametrization}\n| width | " + " | ".join(KINDS) + " |")
        print("|---:|" + "---:|" * len(KINDS))
        for w in widths:
            print(f"| {w} | " + " | ".join(f"{table[w][k]:.3g}" for k in KINDS) + " |")
        print("| log2 slope | " + " | ".join(f"{s:+.2f}" for s in slopes(table).values())
              + " |\n")


if __name__ == "__main__":  # flags only as a command: tests import this module beside others
    flags.DEFINE_list("widths", ["64", "128", "256", "512", "1024"], "d_model values.")
    flags.DEFINE_integer("steps", 4, "Adam steps before measuring.")
    app.run(main)
