"""LFM2's short convolution (Liquid AI, 2025), the `conv` layers of its hybrids: a gated
depthwise causal convolution over 3 tokens, parametrised as Hugging Face's `Lfm2ShortConv`.

    B, C, x = x W_B, x W_C, x W_x        y = (C * conv(B * x)) W_out

A whole token mixer in one file: its params (with logical axes), its forward, its decode state
(the last 2 inputs of the convolution) and its registry record, `MIXER`; the registry
(`transformer.nn.mixers.MIXERS`) lists it as `conv`. docs/extending.md walks through it.

Shapes: B batch, T tokens, D model width, K taps.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn.attention import matmul, projection_init
from transformer.nn.mixers.base import Mixer, no_sequence_axis
from transformer.nn.mixers.conv import causal_conv

Array = jax.Array
TAPS = 3  # LFM2's conv_L_cache


class ShortConv(nn.Module):
    """The layer: the config is a `TransformerConfig` (d_model, use_bias, init, dtypes).

    The conv kernel takes torch's Conv1d init, U[+-1 / sqrt(K)] (std 1/3 at K = 3) whatever
    `init_std`, as Gated DeltaNet's conv does; Hugging Face's `Lfm2ForCausalLM._init_weights`
    draws it normal(0, initializer_range), std 0.02. Kept, so seeded runs with `conv`
    layers reproduce. The projections follow `init_std`."""

    config: object

    @nn.compact
    def __call__(self, x_BTD, *, mask=None, bias=None, q_positions=None, segment_ids=None,
                 deterministic=True, decode=False):
        cfg, width = self.config, x_BTD.shape[-1]
        gate_B, gate_C, x_BTD = (self._project(name, x_BTD, ("embed", "mlp"))
                                 for name in ("B", "C", "x"))
        kernel = self.param("conv", nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=0, out_axis=1),
            ("conv", "mlp")), (TAPS, width), cfg.param_dtype)
        conv_bias = self.param("conv_bias", nn.with_logical_partitioning(
            nn.initializers.zeros, ("mlp",)), (width,), cfg.param_dtype) if cfg.use_bias else None
        state = None
        if decode:  # the last TAPS - 1 inputs of the convolution; zeros until written
            state = self.variable("cache", "conv_state", jnp.zeros,
                                  (x_BTD.shape[0], TAPS - 1, width), jnp.float32)
        y_BTD, new_state = causal_conv(gate_B * x_BTD, kernel, conv_bias,
                                       None if state is None else state.value, segment_ids)
        if state is not None and not self.is_initializing():
            state.value = new_state
        return self._project("out", gate_C * y_BTD, ("mlp", "embed"), residual=True)

    def _project(self, name: str, x: Array, names: tuple[str, str], residual=False) -> Array:
        """x [..., D] W_name [D, D] (+ bias), in the compute dtype."""
        cfg, width = self.config, x.shape[-1]
        kernel = self.param(name, nn.with_logical_partitioning(projection_init(
            cfg.init_std, 0, 1, cfg.init_scale(residual=residual)), names), (width, width),
            cfg.param_dtype)
        y = matmul(x, kernel, dtype=cfg.dtype)
        if cfg.use_bias:
            y = y + self.param(f"{name}_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, names[1:]), (width,), cfg.param_dtype).astype(cfg.dtype)
        return y


MIXER = Mixer(
    layer=lambda config, name: ShortConv(config, name=name),
    param_name="conv",
    # the convolution's 2 K D multiply-adds a token are 6 x its params, already in MFU's 6 N
    flops_per_token=lambda config, seq_len: 0,
    decode_state="recurrent state",
    cache_bytes_per_token=lambda config: 0,
    refuses=no_sequence_axis("conv", "convolution's state"))
