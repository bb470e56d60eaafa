"""What a token mixer is: the `Mixer` record the registry (`transformer.nn.mixers.MIXERS`) holds
for each layer type, and the call every mixer's Linen layer answers.

A block calls its mixer's layer as

    y_BTD = layer(x_BTD, mask=..., bias=..., q_positions=..., segment_ids=...,
                  deterministic=..., decode=...)

- `x_BTD` [B, T, D]: the normed residual stream; `y_BTD` [B, T, D] is added back to it.
- `mask`, `bias`: the layer's attention mask (a `masks.Mask`, or under decode the [B, 1, T, L]
  array over the cache slots; sliding layers get the window's) and the position bias. Mixers
  that are not attention ignore them.
- `q_positions` [B or 1, T]: the tokens' positions (under decode, the cache slots they write).
- `segment_ids` [B, T] or None: in training, packed documents (1, 2, ... per document, 0 for
  padding): a recurrent mixer starts a fresh state at each document and never carries one across.
  Under decode, a prefill passes 1 for its prompt tokens and 0 for the right padding after them:
  a padded token must leave a recurrent state as it is (the steps that follow overwrite those
  positions). Attention ignores it (its mask already says so).
- `decode=True`: the 'cache' collection holds the decode state (KV cache, latent cache, or
  recurrent and convolution state). `init` with decode creates it; a call with T > 1 tokens
  continues from it as a call with one token does (a prefill starts from the zero state).

The layer's params carry logical axis names (`parallel.sharding.LOGICAL_AXIS_RULES`); its
forward runs under `nn.scan` and `nn.remat` as blocks do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn

# (TransformerConfig, mesh axis sizes {"tensor": 2, ...}) -> why the mixer cannot run so, or None
Refusal = Callable[[Any, dict], "str | None"]


def refuses_nothing(config, mesh) -> str | None:
    return None


def no_sequence_axis(layer_type: str, state: str = "recurrent state") -> Refusal:
    """The refusal of a mixer whose state runs through the tokens in order: a `sequence` mesh
    axis would split it, and the state is not passed between devices.

    >>> no_sequence_axis("mamba2")(None, {"sequence": 2})
    'mamba2 layers: mesh.sequence=2: expected 1 (the recurrent state is not passed between devices)'
    """
    def refuses(config, mesh) -> str | None:
        if (split := mesh.get("sequence", 1)) > 1:
            return (f"{layer_type} layers: mesh.sequence={split}: expected 1 (the {state} is "
                    "not passed between devices)")
        return None
    return refuses


@dataclasses.dataclass(frozen=True)
class Mixer:
    """One layer type's token mixer, as the registry lists it.

    Attributes:
      layer: (TransformerConfig, name) -> the Linen layer (see the module docstring's call).
      param_name: the sublayer's name in a block: its params are `<param_name>/...`, its norm's
        `<param_name>_norm` ("self_attention" for attention, as checkpoints have always had it).
      flops_per_token: (TransformerConfig, seq_len) -> the forward + backward FLOPs per token a
        layer spends beyond 6 x its matmul params (attention's scores and values, a linear
        layer's state updates): what MFU adds to 6 N for each layer of this type.
      decode_state: what decoding keeps: "kv cache", "latent cache" or "recurrent state".
      cache_bytes_per_token: (TransformerConfig) -> the bytes the decode state grows by per
        token and layer (0 for a state of constant size).
      refuses: (TransformerConfig, mesh axis sizes) -> one line saying why this mixer cannot run
        under those settings (a kernel, a mesh axis), or None; checked before anything compiles.
      local: the layer attends through the sliding window (`config.sliding_window`).
      config: the dataclass of the mixer's own keys (a `model.<group>` config group), if any.
    """

    layer: Callable[[Any, str], nn.Module]
    param_name: str
    flops_per_token: Callable[[Any, int], float]
    decode_state: str
    cache_bytes_per_token: Callable[[Any], int]
    refuses: Refusal = refuses_nothing
    local: bool = False
    config: type | None = None
