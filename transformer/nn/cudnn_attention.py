"""cuDNN flash attention on GPU, through `jax.nn.dot_product_attention`: the "cudnn" kernel of
`kernels.KERNELS`, and the mapping of a mask spec onto its arguments."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from transformer.nn.chunked_attention import check_qkv
from transformer.nn.kernels import (
    Call,
    _parts,
    refusal,
    rows_with_keys,
    target_platform,
    zero_empty_rows,
)
from transformer.nn.masks import And, Causal, Full, Mask, Padding, SlidingWindow, as_dense

Array = jax.Array


def cudnn_arguments(mask: Mask | Array | None, q_len: int, kv_len: int) -> dict[str, Any]:
    """Mask spec -> keyword arguments of `jax.nn.dot_product_attention` (pure, no kernel call).

    Returns `is_causal`, `local_window_size`, `query_seq_lengths`, `key_value_seq_lengths` and
    `mask` (a dense bool [B, 1, T, S] of whatever is left, or None). Parts of an And map as

      Causal                  -> is_causal=True                      (q_len == kv_len only)
      SlidingWindow(left, 0)  -> is_causal=True, window (left, 0)   (q_len == kv_len only)
      Padding                 -> query_seq_lengths / key_value_seq_lengths (int32 [B])
      Full                    -> nothing
      anything else           -> the dense `mask` (cuDNN adds it as a bias)

    jax aligns causal masks and windows top-left, ours bottom-right, so they only agree when
    q_len == kv_len; cuDNN takes a local window only with a causal mask (right == 0).
    """
    args = dict(is_causal=False, local_window_size=None, query_seq_lengths=None,
                key_value_seq_lengths=None, mask=None)
    if mask is not None and not isinstance(mask, Mask):
        args["mask"] = as_dense(mask, q_len, kv_len)
        return args
    rest, left = [], None
    square = q_len == kv_len
    for part in _parts(mask):
        if isinstance(part, Full):
            continue
        if isinstance(part, Causal) and square:
            args["is_causal"] = True
        elif isinstance(part, SlidingWindow) and part.right == 0 and square:
            args["is_causal"] = True
            if part.left is not None:
                left = part.left if left is None else min(left, part.left)
        elif isinstance(part, Padding):
            for name, lengths in (("query_seq_lengths", part.q_lengths),
                                  ("key_value_seq_lengths", part.kv_lengths)):
                if lengths is not None:
                    lengths = jnp.asarray(lengths, jnp.int32)
                    prev = args[name]
                    args[name] = lengths if prev is None else jnp.minimum(prev, lengths)
        else:
            rest.append(part)
    if left is not None:
        args["local_window_size"] = (left, 0)
    if rest:
        args["mask"] = (rest[0] if len(rest) == 1 else And(tuple(rest))).dense(q_len, kv_len)
    return args


def cudnn_attention(query: Array, key: Array, value: Array, mask: Mask | Array | None = None, *,
                    scale: float | None = None, implementation: str = "cudnn") -> Array:
    """Attention with cuDNN flash attention via `jax.nn.dot_product_attention`; same conventions
    and result as `dot_product_attention(query, key, value, mask, scale=scale)`.

    The mask is mapped by `cudnn_arguments`; query rows with no allowed key are zeroed
    explicitly. cuDNN needs float16 / bfloat16 inputs and head_dim <= 128 (a multiple of 8).
    `implementation="xla"` runs the same call through XLA (any backend, any dtype), which is how
    the mapping is tested without a GPU.
    """
    check_qkv(query, key, value)
    batch, q_len, _, head_dim = query.shape
    kv_len = key.shape[1]
    if implementation == "cudnn":
        reason = refusal("cudnn", Call(target_platform(), mask, q_len=q_len, kv_len=kv_len,
                                       head_dim=head_dim, dtype=query.dtype))
        if reason is not None:
            raise ValueError(f"cudnn_attention {reason}")
    args = cudnn_arguments(mask, q_len, kv_len)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):  # jax wants exactly [B]
        if args[name] is not None:
            args[name] = jnp.broadcast_to(args[name], (batch,))
    out = jax.nn.dot_product_attention(query, key, value, scale=scale,
                                       implementation=implementation, **args)
    return zero_empty_rows(out, rows_with_keys(mask, q_len, kv_len))


__all__ = ["cudnn_arguments", "cudnn_attention"]
