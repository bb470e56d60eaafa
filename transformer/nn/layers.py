"""Transformer layers: norms, the feed-forward, the token embedding and the output head, and
converting a scanned stack's params to per-layer ones and back.

Shapes: B batch, T length, D model width, F feed-forward width.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn import lora as lora_lib
from transformer.nn.activations import ACTIVATIONS, GATED
from transformer.nn.attention import matmul, projection_init
from transformer.nn.config import TransformerConfig
from transformer.parallel import sharding

Array = jax.Array


def norm_layer(config: TransformerConfig, name: str) -> nn.Module:
    """LayerNorm or RMSNorm over the model width, with logical names on its params."""
    scale_init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    common = dict(epsilon=config.norm_epsilon, dtype=config.dtype,
                  param_dtype=config.param_dtype, scale_init=scale_init, name=name)
    if config.norm == "rmsnorm":
        return nn.RMSNorm(**common)
    bias_init = nn.with_logical_partitioning(nn.initializers.zeros, ("embed",))
    return nn.LayerNorm(use_bias=config.use_bias, bias_init=bias_init, **common)


class MLP(nn.Module):
    """Position-wise feed-forward: act(x W_i + b_i) W_o + b_o.

    Gated variants (SwiGLU, GeGLU): (act(x W_gate) * x W_up) W_o.
    """

    config: TransformerConfig
    deterministic: bool = True  # LoRA's dropout

    @nn.compact
    def __call__(self, x_BTD: Array) -> Array:
        cfg = self.config
        d_model = x_BTD.shape[-1]
        x_BTD = x_BTD.astype(cfg.dtype)

        def dense(name, x, features, names):
            scale = cfg.init_scale(residual=name == "wo")
            kernel = self.param(
                name,
                nn.with_logical_partitioning(projection_init(cfg.init_std, 0, 1, scale), names),
                (x.shape[-1], features),
                cfg.param_dtype,
            )
            y = lora_lib.project(self, name, x, kernel, names, 1, cfg.lora, cfg.dtype,
                                 cfg.param_dtype, self.deterministic, matmul)
            if cfg.use_bias:
                b = self.param(f"{name}_bias",
                               nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
                               (features,), cfg.param_dtype)
                y = y + b.astype(cfg.dtype)
            return y

        act = ACTIVATIONS[cfg.activation]
        if cfg.activation in GATED:
            gate_BTF = dense("wi_gate", x_BTD, cfg.d_ff, ("embed", "mlp"))
            up_BTF = dense("wi_up", x_BTD, cfg.d_ff, ("embed", "mlp"))
            hidden_BTF = act(gate_BTF) * up_BTF
        else:
            hidden_BTF = act(dense("wi", x_BTD, cfg.d_ff, ("embed", "mlp")))
        return dense("wo", hidden_BTF, d_model, ("mlp", "embed"))


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled stack params {layers_0: p0, ...} -> scanned {layers: stacked along axis 0}."""
    params = dict(params)
    layers = [params.pop(f"layers_{i}") for i in range(num_layers)]
    params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return params


def unstack_layers(params: dict, num_layers: int) -> dict:
    """Scanned stack params {layers: stacked} -> unrolled {layers_0: p0, ...}."""
    params = dict(params)
    stacked = params.pop("layers")
    for i in range(num_layers):
        params[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params


class TokenEmbedding(nn.Module):
    """Token id -> vector lookup, and its transpose (`attend`) for a tied output head."""

    vocab_size: int
    features: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        init = nn.with_logical_partitioning(nn.initializers.normal(self.init_std),
                                            ("vocab", "embed"))
        self.embedding = self.param("embedding", init, (self.vocab_size, self.features),
                                    self.param_dtype)

    def __call__(self, tokens_BT: Array) -> Array:
        return jnp.take(self.embedding, tokens_BT, axis=0).astype(self.dtype)

    def attend(self, x_BTD: Array) -> Array:
        """Logits x E^T in the compute dtype: [B, T, D] -> [B, T, V].

        Bfloat16 logits, as MaxText and t5x keep them: the loss upcasts inside its fused
        reduction (`objectives.cross_entropy`), so [B, T, V] never exists whole in float32.
        """
        logits_BTV = matmul(x_BTD, self.embedding.T, dtype=self.dtype)
        return sharding.constrain(logits_BTV, sharding.LOGITS)


class OutputHead(nn.Module):
    """An untied projection to the vocabulary (or to classes), logits in the compute dtype."""

    features: int
    use_bias: bool = False
    init_std: float | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    names: tuple[str, str] = ("embed", "vocab")

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = self.param("kernel", nn.with_logical_partitioning(
            projection_init(self.init_std, 0, 1), self.names), (x.shape[-1], self.features),
            self.param_dtype)
        y = matmul(x, kernel, dtype=self.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.with_logical_partitioning(
                nn.initializers.zeros, self.names[1:]), (self.features,), self.param_dtype)
        return sharding.constrain(y, sharding.LOGITS) if y.ndim == 3 else y
