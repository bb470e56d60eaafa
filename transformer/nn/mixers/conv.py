"""The depthwise causal convolution the recurrent mixers put before their state (Mamba 2,
Gated DeltaNet, LFM2's short convolution), with a decode state and document boundaries.

Shapes: B batch, T tokens, C channels, K taps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _float(*arrays):
    dtype = jnp.promote_types(jnp.result_type(*arrays), jnp.float32)
    return [a.astype(dtype) for a in arrays]


def _runs(segment_ids: Array) -> Array:
    """[B, T] -> the index of each token's run of equal segment ids (0 for the first run)."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]  # [B, T - 1]: [B, 0] for one token
    return jnp.pad(change, ((0, 0), (1, 0))).astype(jnp.int32).cumsum(1)


def causal_conv(x_BTC: Array, kernel_KC: Array, bias_C: Array | None = None,
                state: Array | None = None, segment_ids: Array | None = None,
                activation=None) -> tuple[Array, Array]:
    """Depthwise causal convolution: y_t = act(bias + sum_k kernel[k] x_{t-K+1+k}) per channel
    (Hugging Face's conv1d weight [C, 1, K] is kernel.T; `activation` None: none), in float32,
    returned in x's dtype.

    `state` [B, K-1, C]: the inputs before x (zeros if None), part of the first token's
    document. A tap reaching into another run of `segment_ids` reads 0. Returns (y [B, T, C],
    the new state [B, K-1, C]: the last K-1 inputs of state + x before the padding, which must be
    at the end, segment 0: a right-padded prefill's state ends at each row's last token)."""
    taps = kernel_KC.shape[0]
    (xf, kernel), batch, length = _float(x_BTC, kernel_KC), x_BTC.shape[0], x_BTC.shape[1]
    if state is None:
        state = jnp.zeros((batch, taps - 1, x_BTC.shape[2]), xf.dtype)
    xp = jnp.concatenate([state.astype(xf.dtype), xf], 1)  # [B, K-1+T, C]
    y = jnp.zeros_like(xf) if bias_C is None else jnp.broadcast_to(bias_C.astype(xf.dtype),
                                                                   xf.shape)
    if segment_ids is not None:
        runs = _runs(segment_ids)
        runs_p = jnp.concatenate([jnp.repeat(runs[:, :1], taps - 1, 1), runs], 1)
    for k in range(taps):  # tap k reads x_{t-K+1+k} = xp[t + k]
        tap = xp[:, k:k + length]
        if segment_ids is not None:
            tap = jnp.where((runs_p[:, k:k + length] == runs)[..., None], tap, 0)
        y = y + kernel[k] * tap
    valid = length if segment_ids is None else (segment_ids != 0).sum(1, keepdims=True)
    index = valid + jnp.arange(taps - 1)[None]  # xp[n : n + K-1], n the valid tokens
    new_state = jnp.take_along_axis(xp, jnp.broadcast_to(index, (batch, taps - 1))[..., None], 1)
    if activation is not None:
        y = activation(y)
    return y.astype(x_BTC.dtype), new_state.astype(state.dtype)
