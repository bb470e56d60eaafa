"""LSTM language model: the recurrent baseline, with the same tokens -> logits interface as the
decoder-only transformer so an ablation can swap one for the other."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.models.family import Family, transformer_config
from transformer.nn.attention import projection_init
from transformer.nn.layers import OutputHead, TokenEmbedding

Array = jax.Array


def _orthogonal_in_float32(key, shape, dtype):
    """An orthogonal matrix made in float32 and cast to `dtype`: the QR it takes has no 16-bit
    kernel on CPU (a bfloat16 param_dtype raised NotImplementedError)."""
    return nn.initializers.orthogonal(column_axis=-1)(key, shape, jnp.float32).astype(dtype)


class LSTMLayer(nn.Module):
    """One LSTM layer over time (a `lax.scan`); the state resets where a new document starts.

    Gates (input, forget, cell, output) = x_t W_x + h_{t-1} W_h + b; c_t = f * c_{t-1} + i * g;
    h_t = o * tanh(c_t). The forget-gate bias starts at 1.
    """

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BTD: Array, resets_BT: Array) -> Array:
        d_in, hidden = x_BTD.shape[-1], self.features
        w_x = self.param("input_kernel", nn.with_logical_partitioning(
            projection_init(None, 0, (1, 2)), ("embed", "gates", "mlp")),
            (d_in, 4, hidden), self.param_dtype)
        w_h = self.param("recurrent_kernel", nn.with_logical_partitioning(
            _orthogonal_in_float32, ("mlp_in", "gates", "mlp")), (hidden, 4, hidden),
            self.param_dtype)
        bias_init = lambda key, shape, dtype: jnp.zeros(shape, dtype).at[1].set(1.0)
        bias = self.param("bias", nn.with_logical_partitioning(bias_init, ("gates", "mlp")),
                          (4, hidden), self.param_dtype)
        # The input projection of every step at once (one big matmul), then the recurrence.
        gates_x_BTGH = jnp.einsum("btd,dgh->btgh", x_BTD.astype(self.dtype),
                                  w_x.astype(self.dtype)) + bias.astype(self.dtype)
        w_h = w_h.astype(self.dtype)

        def step(carry, inputs):
            h_BH, c_BH = carry
            gates_x_BGH, reset_B = inputs
            keep = (~reset_B)[:, None].astype(self.dtype)
            h_BH, c_BH = h_BH * keep, c_BH * keep
            gates = gates_x_BGH + jnp.einsum("bh,hgk->bgk", h_BH, w_h)
            i, f, g, o = (gates[:, k] for k in range(4))
            c_BH = nn.sigmoid(f) * c_BH + nn.sigmoid(i) * jnp.tanh(g)
            h_BH = nn.sigmoid(o) * jnp.tanh(c_BH)
            return (h_BH, c_BH), h_BH

        batch = x_BTD.shape[0]
        zeros = jnp.zeros((batch, hidden), self.dtype)
        _, h_TBH = jax.lax.scan(step, (zeros, zeros),
                                (jnp.swapaxes(gates_x_BTGH, 0, 1), jnp.swapaxes(resets_BT, 0, 1)))
        return jnp.swapaxes(h_TBH, 0, 1)


class LSTMLM(nn.Module):
    """Embedding -> N LSTM layers (dropout between) -> logits [B, T, V]."""

    vocab_size: int
    d_model: int
    num_layers: int = 2
    dropout_rate: float = 0.0
    tie_embeddings: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens_BT: Array, *, segment_ids: Array | None = None,
                 positions: Array | None = None, deterministic: bool = True) -> Array:
        """`segment_ids` (packed rows) reset the state at each document start; `positions` is
        accepted for interface parity and unused (recurrence carries order)."""
        del positions
        embed = TokenEmbedding(self.vocab_size, self.d_model, dtype=self.dtype,
                               param_dtype=self.param_dtype, name="embed")
        if segment_ids is None:
            resets_BT = jnp.zeros(tokens_BT.shape, bool).at[:, 0].set(True)
        else:
            resets_BT = segment_ids != jnp.pad(segment_ids, ((0, 0), (1, 0)),
                                               constant_values=-1)[:, :-1]
        x_BTD = nn.Dropout(self.dropout_rate)(embed(tokens_BT), deterministic=deterministic)
        for i in range(self.num_layers):
            x_BTD = LSTMLayer(self.d_model, self.dtype, self.param_dtype, name=f"lstm_{i}")(
                x_BTD, resets_BT)
            x_BTD = nn.Dropout(self.dropout_rate)(x_BTD, deterministic=deterministic)
        if self.tie_embeddings:
            return embed.attend(x_BTD)
        return OutputHead(self.vocab_size, dtype=self.dtype, param_dtype=self.param_dtype,
                          name="lm_head")(x_BTD)


def _build(model_config) -> LSTMLM:
    cfg = transformer_config(model_config)  # validates dims and dtypes
    return LSTMLM(model_config.vocab_size, cfg.d_model, cfg.num_layers, cfg.dropout_rate,
                  model_config.tie_embeddings, cfg.dtype, cfg.param_dtype)


LSTM = Family("lstm", _build, inputs=("inputs",), features=("segment_ids",),
              objectives=("next_token",), decoding="recompute", attention=False,
              reads=("d_model", "num_layers", "dropout_rate", "tie_embeddings", "dtype",
                     "param_dtype"))
