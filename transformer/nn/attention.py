"""Scaled dot-product attention as pure functions, `dot_product_attention` (the dense math) and
`attend` (picks a kernel and runs it), and the Linen multi-head attention layer.

Shapes: B batch, T query length, S key length, N query heads, K key/value heads (N % K == 0:
K == N is multi-head, 1 < K < N grouped-query, K == 1 multi-query), G = N // K, H head dim,
D model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.nn import kernels, quantization
from transformer.nn import lora as lora_lib
from transformer.nn import positions as positions_lib
from transformer.nn import sequence_parallel as sequence_parallel_lib
from transformer.nn.chunked_attention import check_qkv, chunked_attention
from transformer.nn.masks import EMPTY, Mask, as_dense

Array = jax.Array

# On CPU the dense kernel runs blocks of at least 64 queries, at most 8 blocks (compile time
# grows with their number), each over only the keys its mask allows (`dot_product_attention(
# q_block=...)`). Measured on a 2-core AVX-512 EPYC, causal fwd+bwd at B8 N6 H64: T=256
# 38 -> 32 ms (35 -> 21 ms in a quieter hour), T=512 168 -> 101 ms; at T=64 blocks of 32 were
# slower than one.
CPU_QUERY_BLOCK, CPU_MAX_BLOCKS = 64, 8


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Mask | Array | None = None,
    bias: Array | None = None,
    *,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    q_block: int | None = None,
    softcap: float = 0.0,
):
    """softmax(Q K^T * scale + bias) V over the keys the mask allows.

    Args:
      query: [B, T, N, H]; key, value: [B, S, K, H] with N divisible by K.
      mask: a `masks.Mask`, a boolean array broadcastable to [B, N, T, S], or None (all allowed).
      bias: float array broadcastable to [B, N, T, S] added to the logits (ALiBi, T5 buckets).
      scale: logit scale, default 1 / sqrt(H).
      dropout_rate, dropout_rng: dropout on the attention weights (training only).
      return_weights: also return the weights [B, N, T, S] (float32, or float64).
      q_block: compute q_block queries at a time, each block over only the keys its `Mask` can
        allow (`Mask.block_map`): causal attention then computes about half the logits. Used
        where the mask leaves keys out of some block, without dropout or weights; else one block.
      softcap: > 0: scaled logits -> softcap * tanh(logits / softcap) before bias and mask.

    Float32 (or float64) inputs keep logits and weights in their dtype. Bfloat16 / float16 inputs
    keep the [B, N, T, S] logits and weights in that dtype, half the memory, as MaxText does: the
    matmuls accumulate in float32 and the softmax's max and sum run in float32; the backward pass
    keeps only the weights (`softmax_values`). Masked keys get exactly zero weight, and a query
    row with no allowed key returns zeros (its gradient is finite). Dropout and `return_weights`
    compute the weights in float32.
    """
    check_qkv(query, key, value)
    batch, q_len, num_heads, head_dim = query.shape
    _, kv_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    acc = jnp.promote_types(query.dtype, jnp.float32)  # float32, or float64 for float64 inputs
    low_precision = jnp.dtype(query.dtype).itemsize < 4  # bfloat16 / float16
    scores = query.dtype if low_precision else acc  # the dtype of the [B, N, T, S] tensors
    keep_weights = dropout_rate > 0.0 or return_weights
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng")

    # Batched matmuls in their canonical form, [batch..., M, K] x [batch..., K, N], with the
    # query group folded into M: XLA CPU runs the 5-index einsums 3x slower.
    query_BKGTH = query.reshape(batch, q_len, num_kv_heads, group, head_dim).transpose(
        0, 2, 3, 1, 4)
    key_BKHS = key.transpose(0, 2, 3, 1)
    value_BKSH = value.transpose(0, 2, 1, 3)
    whole = (0, q_len, 0, kv_len)
    if q_block and isinstance(mask, Mask) and not keep_weights:
        blocks = _query_blocks(mask, q_len, kv_len, q_block)
    else:
        blocks = [whole]
    dense_mask = None if isinstance(mask, Mask) else as_dense(mask, q_len, kv_len)

    outs_BNTH = []
    for q0, q1, k0, k1 in blocks:
        rows, cols = q1 - q0, k1 - k0
        logits_BNTS, allowed = _block_logits(query_BKGTH, key_BKHS, (q0, q1, k0, k1), mask,
                                             dense_mask, bias, (scale, softcap), scores)
        if not keep_weights:
            out_BKMH = softmax_values(logits_BNTS.reshape(batch, num_kv_heads, group * rows, cols),
                                      value_BKSH[:, :, k0:k1])
            outs_BNTH.append(out_BKMH.reshape(batch, num_heads, rows, head_dim))
            continue
        out_BNTH, weights_BNTS = _weighted_values(logits_BNTS, allowed, value_BKSH, dropout_rate,
                                                  dropout_rng, acc)
        outs_BNTH.append(out_BNTH)
    out_BNTH = outs_BNTH[0] if len(outs_BNTH) == 1 else jnp.concatenate(outs_BNTH, axis=2)
    out_BTNH = out_BNTH.transpose(0, 2, 1, 3).astype(query.dtype)
    if keep_weights:  # the zeroed weights already zero rows with no allowed key
        return (out_BTNH, weights_BNTS) if return_weights else out_BTNH
    # rows with no allowed key return zeros (None: the mask provably allows a key in every row)
    return kernels.zero_empty_rows(out_BTNH, kernels.rows_with_keys(
        mask if isinstance(mask, Mask) else dense_mask, q_len, kv_len))


def _weighted_values(logits_BNTS, allowed, value_BKSH, dropout_rate: float, dropout_rng, acc):
    """(softmax(logits) V [B, N, T, H], the weights [B, N, T, S] in `acc`) of one whole block,
    with dropout on the weights that multiply V (the weights returned are before dropout)."""
    batch, num_heads, q_len, kv_len = logits_BNTS.shape
    num_kv_heads, head_dim = value_BKSH.shape[1], value_BKSH.shape[-1]
    weights_BNTS = jax.nn.softmax(logits_BNTS.astype(acc), axis=-1)
    if allowed is not None:  # zero rows where nothing is allowed
        weights_BNTS = jnp.where(allowed, weights_BNTS, 0.0)
    probs_BNTS = weights_BNTS
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BNTS.shape)
        probs_BNTS = jnp.where(keep, probs_BNTS / (1.0 - dropout_rate), 0.0)
    probs_BKMS = probs_BNTS.reshape(batch, num_kv_heads, num_heads // num_kv_heads * q_len,
                                    kv_len)
    out_BKMH = jnp.matmul(probs_BKMS.astype(value_BKSH.dtype), value_BKSH,
                          preferred_element_type=acc)
    return out_BKMH.reshape(batch, num_heads, q_len, head_dim), weights_BNTS


def _block_logits(query_BKGTH, key_BKHS, block, mask, dense_mask, bias, scaling, scores):
    """dot_product_attention's scaled (soft-capped), biased and masked logits [B, N, rows, cols]
    of one (q0, q1, k0, k1) block, in dtype `scores`, and the block's allowed keys (None: all).
    `scaling`: (scale, softcap)."""
    batch, num_kv_heads, group, q_len, head_dim = query_BKGTH.shape
    kv_len = key_BKHS.shape[-1]
    scale, softcap = scaling
    q0, q1, k0, k1 = block
    rows, cols = q1 - q0, k1 - k0
    query_BKMH = query_BKGTH[:, :, :, q0:q1].reshape(batch, num_kv_heads, group * rows, head_dim)
    logits_BKMS = jnp.matmul(query_BKMH, key_BKHS[..., k0:k1], preferred_element_type=scores)
    logits_BNTS = logits_BKMS.reshape(batch, num_kv_heads * group, rows, cols) * scale
    if softcap:  # in float32 at least: tanh near +-cap loses the logits' differences in bf16
        capped = jnp.tanh(logits_BNTS.astype(jnp.promote_types(scores, jnp.float32)) / softcap)
        logits_BNTS = (softcap * capped).astype(scores)
    if bias is not None:
        logits_BNTS = logits_BNTS + _window(bias, q0, q1, k0, k1).astype(scores)
    if isinstance(mask, Mask):
        allowed = mask.tile(q0, k0, rows, cols, q_len, kv_len)
    else:
        allowed = None if dense_mask is None else _window(dense_mask, q0, q1, k0, k1)
    if allowed is not None:
        # the dtype's most negative finite value, so fully masked rows stay NaN-free
        logits_BNTS = jnp.where(allowed, logits_BNTS, float(jnp.finfo(scores).min))
    return logits_BNTS, allowed


def _query_blocks(mask: Mask, q_len: int, kv_len: int, q_block: int) -> list[tuple[int, ...]]:
    """[(q0, q1, k0, k1)]: blocks of `q_block` queries, each with the key range [k0, k1) that
    holds every key `mask` may allow them; the whole [0, T) x [0, S) if no block skips a key.

    >>> from transformer import masks
    >>> _query_blocks(masks.Causal(), 6, 6, 2)  # queries 0-1 see keys 0-1, 2-3 see 0-3, ...
    [(0, 2, 0, 2), (2, 4, 0, 4), (4, 6, 0, 6)]
    >>> _query_blocks(masks.SlidingWindow(left=1, right=0), 6, 6, 3)
    [(0, 3, 0, 3), (3, 6, 2, 6)]
    >>> _query_blocks(masks.Full(), 6, 6, 2)
    [(0, 6, 0, 6)]
    """
    if q_len <= q_block:
        return [(0, q_len, 0, kv_len)]
    classes = mask.block_map(q_len, kv_len, q_block, 1)  # [query blocks, keys]
    blocks = []
    for i, row in enumerate(classes):
        live = np.flatnonzero(row != EMPTY)
        # a block with no allowed key: any one key; its rows are zeroed on the output
        k0, k1 = (int(live[0]), int(live[-1]) + 1) if live.size else (0, 1)
        blocks.append((i * q_block, min(q_len, (i + 1) * q_block), k0, k1))
    if all((k0, k1) == (0, kv_len) for _, _, k0, k1 in blocks):
        return [(0, q_len, 0, kv_len)]
    return blocks


def _window(x: Array, q0: int, q1: int, k0: int, k1: int) -> Array:
    """Queries [q0, q1) and keys [k0, k1) of an array broadcastable to [B, N, T, S]; its axes
    of size 1 (broadcast) stay whole."""
    x = jnp.asarray(x)
    index = [slice(None)] * x.ndim
    for axis, (start, stop) in zip((-2, -1), ((q0, q1), (k0, k1)), strict=True):
        if x.ndim >= -axis and x.shape[axis] != 1 and (start, stop) != (0, x.shape[axis]):
            index[axis] = slice(start, stop)
    return x[tuple(index)]


@jax.custom_vjp
def softmax_values(logits: Array, values: Array) -> Array:
    """softmax(logits) @ values over the last axis of logits [..., M, S] and values [..., S, H],
    in the accumulation dtype (float32 for bfloat16 / float16 / float32 inputs).

    The softmax's max and sum run in float32 and the weights are kept in the logits' dtype. The
    backward pass keeps only those weights P (not a float32 copy, not the logits) and uses the
    flash-attention identity sum_j P_ij dP_ij = dO_i . O_i: d logits = P (dO V^T - rowsum(dO O)),
    one pass over the [M, S] tensors that XLA can fuse into the dO V^T matmul. P is computed as
    exp(x - max - log(sum)), not exp(x - max) / sum: XLA would fuse the cheap division into the
    backward pass and keep exp(x - max) alive beside P until then (one more [M, S] tensor per
    layer: 7.5 MB at GPT 6/6/384, batch 8 x 256, in CPU query blocks).

    >>> x = jnp.log(jnp.array([[1.0, 3.0]], jnp.bfloat16))  # weights 1/4, 3/4
    >>> out = softmax_values(x, jnp.array([[1.0], [5.0]], jnp.bfloat16))  # 1/4 + 15/4
    >>> out.dtype, round(float(out[0, 0]), 2)
    (dtype('float32'), 4.0)
    """
    return _softmax_values_fwd(logits, values)[0]


def _softmax_values_fwd(logits, values):
    acc = jnp.promote_types(values.dtype, jnp.float32)
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    shifted = x - jnp.max(x, axis=-1, keepdims=True)
    log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    probs = jnp.exp(shifted - log_sum).astype(logits.dtype)
    out = jnp.matmul(probs.astype(values.dtype), values, preferred_element_type=acc)
    return out, (probs, values, out)


def _softmax_values_bwd(residuals, grad_out):
    probs, values, out = residuals
    acc = out.dtype
    grad_values = jnp.matmul(jnp.swapaxes(probs, -1, -2).astype(values.dtype),
                             grad_out.astype(values.dtype), preferred_element_type=acc)
    grad_probs = jnp.matmul(grad_out.astype(values.dtype), jnp.swapaxes(values, -1, -2),
                            preferred_element_type=acc)
    row = jnp.sum(grad_out * out, axis=-1, keepdims=True)  # = sum_j P_ij dP_ij
    grad_logits = probs.astype(acc) * (grad_probs - row)
    return grad_logits.astype(probs.dtype), grad_values.astype(values.dtype)


softmax_values.defvjp(_softmax_values_fwd, _softmax_values_bwd)


def attend(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Mask | Array | None = None,
    bias: Array | Callable | None = None,
    impl: str = "dense",
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    sequence_parallel: str = "all_gather",
    softcap: float = 0.0,
):
    """Attention through the kernel `impl` names: what `dot_product_attention` computes.

    Args:
      query: [B, T, N, H]; key, value: [B, S, K, H] with N divisible by K.
      mask: a `masks.Mask`, a boolean array broadcastable to [B, N, T, S], or None.
      bias: a float array broadcastable to [B, N, T, S], or a function `bias(q_idx, kv_idx)` of
        query and key indices (see `chunked_attention`): the chunked kernel evaluates it per
        tile, the others materialise it.
      impl: one of `kernels.IMPLS`, resolved by `kernels.select`: "dense"
        (`dot_product_attention`, [B, N, T, S] logits; on CPU in query blocks), "chunked"
        (`chunked_attention`, O(T + S) memory), "splash" (the Pallas TPU kernel; Pallas
        interpret mode elsewhere), "cudnn" (cuDNN flash attention on GPU) or "auto" (by
        platform and length; see `kernels`).
      scale: logit scale, default 1 / sqrt(H).
      dropout_rate, dropout_rng: dropout on the attention weights (training only).
      return_weights: also return the weights [B, N, T, S].
      sequence_parallel: "all_gather" or "ring": the strategy when the mesh in context splits
        the length over its `sequence` axis (see `sequence_parallel`); each device then runs
        splash where `impl` is "splash" (or "auto" on TPU) and splash can, else chunked.
      softcap: > 0 soft-caps the scaled logits (see `dot_product_attention`). Every kernel but
        cuDNN takes it; "auto" then skips cuDNN.

    Dropout and `return_weights` always run the dense path (also under a `sequence` axis, where
    XLA then partitions it). Returns out [B, T, N, H], or (out, weights) with `return_weights`.

    >>> from transformer import masks
    >>> q, kv = jnp.ones((2, 4, 8, 16)), jnp.ones((2, 6, 2, 16))
    >>> attend(q, kv, kv, mask=masks.Causal(), impl="chunked").shape
    (2, 4, 8, 16)
    >>> attend(q, kv, kv, impl="chunked", return_weights=True)[1].shape  # ran dense
    (2, 8, 4, 6)
    """
    platform = kernels.target_platform()
    split = sequence_parallel_lib.shards()
    if (split > 1 and not (dropout_rate or return_weights)
            and (mask is None or isinstance(mask, Mask)) and (bias is None or callable(bias))
            and query.shape[1] % split == 0 and key.shape[1] % split == 0):
        return _attend_split(query, key, value, mask, bias, impl=impl, scale=scale,
                             strategy=sequence_parallel, softcap=softcap, split=split,
                             platform=platform)
    if dropout_rate or return_weights:
        impl = "dense"
        kernels.record(impl)
    else:
        mesh_set = not jax.sharding.get_abstract_mesh().empty
        impl = kernels.select(impl, platform=platform, mask=mask, bias=bias, dropout=0.0,
                              q_len=query.shape[1], kv_len=key.shape[1],
                              head_dim=query.shape[-1], dtype=query.dtype,
                              interpret=impl == "splash" and platform != "tpu",
                              devices=1 if mesh_set else jax.device_count(), softcap=softcap)
    if callable(bias) and impl != "chunked":
        bias = bias(jnp.arange(query.shape[1]), jnp.arange(key.shape[1]))
    if impl == "chunked":
        return chunked_attention(query, key, value, mask, bias, scale=scale, softcap=softcap)
    if impl == "splash":
        return kernels.splash_attention(query, key, value, mask, scale=scale,
                                        interpret=platform != "tpu", softcap=softcap)
    if impl == "cudnn":
        return kernels.cudnn_attention(query, key, value, mask, scale=scale)
    return dot_product_attention(query, key, value, mask, bias, scale=scale,
                                 dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                                 return_weights=return_weights,
                                 q_block=_cpu_query_block(query.shape[1], platform),
                                 softcap=softcap)


def _attend_split(query, key, value, mask, bias, *, impl, scale, strategy, softcap, split,
                  platform):
    """Attention under a `sequence` axis of `split` devices: splash per device where `impl` asks
    for it ("splash", or "auto" on TPU) and it can run, else the chunked kernel; the kernel line
    says which, and why splash could not."""
    note = ""
    if impl == "splash" or (impl == "auto" and platform == "tpu"):
        interpret = platform != "tpu"
        reason = sequence_parallel_lib.splash_reason(
            mask, bias, strategy=strategy, q_len=query.shape[1], kv_len=key.shape[1],
            num_shards=split, platform=platform, interpret=interpret)
        if reason is None:
            kernels.record(f"splash per device, {strategy} over sequence={split}")
            return sequence_parallel_lib.splash_attention(query, key, value, mask, scale=scale,
                                                          softcap=softcap, interpret=interpret)
        note = f" (splash {reason})"
    kernels.record(f"chunked per device, {strategy} over sequence={split}{note}")
    return sequence_parallel_lib.attention(query, key, value, mask, bias, strategy=strategy,
                                           scale=scale, softcap=softcap)


def _cpu_query_block(q_len: int, platform: str) -> int | None:
    if platform != "cpu":
        return None
    return max(CPU_QUERY_BLOCK, -(-q_len // CPU_MAX_BLOCKS))


def matmul(x: Array, kernel: Array, contract: int = 1, dtype=None,
           preferred_element_type=None) -> Array:
    """x [..., *kernel.shape[:contract]] times kernel -> [..., *kernel.shape[contract:]].

    Computed as one 2-D [tokens, in] x [in, out] matmul (in `dtype`, if given). With 3-D
    operands XLA CPU lays the backward pass's activation gradients out transposed, which made
    fwd+bwd of a GPT-2-sized MLP 2x slower; flat matmuls are plain GEMMs on every backend.

    >>> matmul(jnp.ones((2, 3, 4)), jnp.ones((4, 5, 6))).shape
    (2, 3, 5, 6)
    """
    in_shape, out_shape = kernel.shape[:contract], kernel.shape[contract:]
    lead = x.shape[:x.ndim - contract]
    if x.shape[x.ndim - contract:] != in_shape:
        raise ValueError(f"matmul: x shape {x.shape} does not end in the kernel's input dims "
                         f"{in_shape}")
    size = math.prod(in_shape)
    if dtype is not None:
        x, kernel = x.astype(dtype), kernel.astype(dtype)
    y = quantization.projection_dot(x.reshape(-1, size), kernel.reshape(size, -1),
                                    preferred_element_type)  # Qwix quantizes it, if asked
    return y.reshape(*lead, *out_shape)


def projection_init(std: float | None, in_axis, out_axis,
                    multiplier: float = 1.0) -> nn.initializers.Initializer:
    """Normal(std) if std is given, else fan-in variance scaling over the given kernel axes;
    either with its standard deviation times `multiplier` (GPT-2's 1 / sqrt(2 L) on the
    projections into the residual stream, `TransformerConfig.scale_residual_init`)."""
    if std is not None:
        return nn.initializers.normal(stddev=std * multiplier)
    return nn.initializers.variance_scaling(
        multiplier**2, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )


class MultiHeadAttention(nn.Module):
    """Multi-head attention: per-head W_q, W_k, W_v, attention per head, concat, W_o.

    Self-attention when `inputs_kv` is None, cross-attention otherwise. Grouped-query and
    multi-query attention via `num_kv_heads`. `qk_norm` normalises q and k, then RoPE (if
    `rope_theta` is set) rotates them at `q_positions` / `kv_positions`; the cache holds the
    normalised, rotated keys. Params carry logical axis names: query [embed, heads, kv],
    key/value [embed, kv_heads, kv], out [heads, kv, embed].

    The attention weights are sown into the 'intermediates' collection as `attention_weights`
    when that collection is mutable (for attention-map pictures), and returned as a second
    output when `return_weights=True`.

    `decode=True` uses the 'cache' collection (apply with `mutable=["cache"]`). Self-attention
    writes the new (rotated) keys and values into slots `q_positions` of its [B, L, K, H]
    buffers and attends over the whole buffer, so the caller's mask must hide the slots not
    written yet (slot j > the query's position). A `cross=True` layer caches the keys and values
    of `inputs_kv` when given them and reuses them when `inputs_kv` is None. The decode call
    inside `init` only creates the buffers, shaped like its inputs (L = the input length).

    The attention itself is `attend` with `impl`: `mask` and `bias` (an array or a function of
    query and key indices) are passed to it as given.
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    use_bias: bool = False
    qkv_bias: bool | None = None  # biases on the q/k/v projections; None: = use_bias
    scale: float | None = None  # logit scale; None: 1/sqrt(head_dim)
    rope_theta: float | None = None
    rope_layout: str = "half"
    rope_scale: float = 1.0
    rope_scaling: str = "linear"  # how rope_scale stretches positions: linear | llama3
    rope_low_freq_factor: float = 1.0  # llama3 only (positions.rope_frequencies)
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    dropout_rate: float = 0.0
    init_std: float | None = None
    init_scale: float = 1.0  # W_q, W_k, W_v's init std multiplier (projection_init)
    out_init_scale: float = 1.0  # W_o's
    # RMSNorm with a learned scale on q and k after the projections, before RoPE: "head" over
    # each head's H values (Qwen3, Gemma 3), "projection" over all N x H (OLMo 2); "": none
    qk_norm: str = ""
    norm_epsilon: float = 1e-6  # the q/k norms'
    softcap: float = 0.0  # > 0: logit soft-cap, softcap * tanh(logits / softcap) (Gemma 2)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    cross: bool = False  # cross-attention: under decode, K/V are cached once and reused
    # kernels.IMPLS: "auto", "dense", "chunked" (O(T) memory), "splash" or "cudnn"; dropout on
    # the weights and requests for the weights use dense
    impl: str = "auto"
    sequence_parallel: str = "all_gather"  # under a `sequence` mesh axis: all_gather | ring
    lora: Any = None  # transformer.nn.lora.LoraConfig: adapters on the projections it targets

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        *,
        mask: Mask | Array | None = None,
        bias: Array | Callable | None = None,
        q_positions: Array | None = None,
        kv_positions: Array | None = None,
        deterministic: bool = True,
        return_weights: bool = False,
        decode: bool = False,
    ):
        num_kv_heads = self._num_kv_heads()
        reuse_kv = decode and self.cross and inputs_kv is None  # a cross-attention decode step
        self_attention = inputs_kv is None and not self.cross
        inputs_kv = inputs_q if self_attention else inputs_kv
        query_BTNH = self._normed("query", self._project("query", inputs_q, self.num_heads,
                                                         "heads", deterministic), "heads")
        if reuse_kv:
            key_BSKH, value_BSKH = self._cached("cross_key"), self._cached("cross_value")
        else:
            key_BSKH = self._normed("key", self._project("key", inputs_kv, num_kv_heads,
                                                         "kv_heads", deterministic), "kv_heads")
            value_BSKH = self._project("value", inputs_kv, num_kv_heads, "kv_heads",
                                       deterministic)
        if self.rope_theta is not None:
            q_positions = _default_positions(q_positions, inputs_q.shape[1])
            query_BTNH = self._rotate(query_BTNH, q_positions)
            if not reuse_kv:  # cached keys were rotated before they were written
                kv_positions = q_positions if self_attention and kv_positions is None else (
                    _default_positions(kv_positions, inputs_kv.shape[1]))
                key_BSKH = self._rotate(key_BSKH, kv_positions)
        if decode and not reuse_kv:
            key_BSKH, value_BSKH = self._update_cache(key_BSKH, value_BSKH, q_positions)
        out_BTNH, weights_BNTS = self._attend(query_BTNH, key_BSKH, value_BSKH, mask, bias,
                                              deterministic, return_weights)
        out_BTD = self._output(out_BTNH, inputs_q.shape[-1], deterministic)
        return (out_BTD, weights_BNTS) if return_weights else out_BTD

    def _num_kv_heads(self) -> int:
        num_kv_heads = self.num_kv_heads or self.num_heads
        if self.num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads}: expected a multiple of num_kv_heads={num_kv_heads}"
            )
        return num_kv_heads

    def _project(self, name: str, x_BTD: Array, heads: int, heads_axis: str,
                 deterministic: bool = True) -> Array:
        """x [B, T, D] -> [B, T, heads, H] through param `name` (and `name`_bias)."""
        names = ("embed", heads_axis, "kv")
        kernel = self.param(
            name,
            nn.with_logical_partitioning(projection_init(self.init_std, 0, (1, 2),
                                                         self.init_scale), names),
            (x_BTD.shape[-1], heads, self.head_dim),
            self.param_dtype,
        )
        y_BTNH = self._matmul(name, x_BTD, kernel, names, 1, deterministic)
        if self.use_bias if self.qkv_bias is None else self.qkv_bias:
            b = self.param(
                f"{name}_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
                (heads, self.head_dim),
                self.param_dtype,
            )
            y_BTNH = y_BTNH + b.astype(self.dtype)
        return y_BTNH

    def _normed(self, name: str, x_BTNH: Array, heads_axis: str) -> Array:
        """`qk_norm`: RMSNorm of the projection `name` over each head's H values, or over all
        its heads' (param `name`_norm/scale [H] or [heads, H]); `x` itself without it."""
        if self.qk_norm not in ("", "head", "projection"):
            raise ValueError(f"qk_norm={self.qk_norm!r}: expected '', 'head' or 'projection'")
        if not self.qk_norm:
            return x_BTNH
        axes = (-2, -1) if self.qk_norm == "projection" else -1
        names = (heads_axis, "kv") if self.qk_norm == "projection" else ("kv",)
        return nn.RMSNorm(epsilon=self.norm_epsilon, dtype=self.dtype,
                          param_dtype=self.param_dtype, reduction_axes=axes, feature_axes=axes,
                          scale_init=nn.with_logical_partitioning(nn.initializers.ones, names),
                          name=f"{name}_norm")(x_BTNH)

    def _rotate(self, x_BTNH: Array, positions: Array) -> Array:
        """RoPE at `positions` [B or 1, T]."""
        return positions_lib.apply_rope(x_BTNH, positions, theta=self.rope_theta,
                                        layout=self.rope_layout, scale=self.rope_scale,
                                        scaling=self.rope_scaling,
                                        low_freq_factor=self.rope_low_freq_factor,
                                        high_freq_factor=self.rope_high_freq_factor,
                                        original_max_len=self.rope_original_max_len)

    def _update_cache(self, key_BSKH: Array, value_BSKH: Array,
                      q_positions: Array | None) -> tuple[Array, Array]:
        """Decode: writes the new keys and values into the cache (cross-attention: replaces
        them; self-attention: at slots `q_positions`) and returns what to attend over."""
        if self.cross:
            return (self._cache("cross_key", key_BSKH, None),
                    self._cache("cross_value", value_BSKH, None))
        if q_positions is None:
            raise ValueError("decode=True needs q_positions: the cache slots to write")
        return (self._cache("key", key_BSKH, q_positions),
                self._cache("value", value_BSKH, q_positions))

    def _attend(self, query_BTNH, key_BSKH, value_BSKH, mask, bias, deterministic,
                return_weights) -> tuple[Array, Array | None]:
        """`attend` with this layer's kernel, scale and dropout; sows the weights into
        'intermediates' when mutable. Returns (out [B, T, N, H], weights or None)."""
        dropout = self.dropout_rate if not deterministic else 0.0
        sow = self.is_mutable_collection("intermediates")
        want_weights = return_weights or sow  # forces the dense path
        result = attend(query_BTNH, key_BSKH, value_BSKH, mask=mask, bias=bias, impl=self.impl,
                        scale=self.scale, dropout_rate=dropout,
                        dropout_rng=self.make_rng("dropout") if dropout > 0.0 else None,
                        return_weights=want_weights, sequence_parallel=self.sequence_parallel,
                        softcap=self.softcap)
        out_BTNH, weights_BNTS = result if want_weights else (result, None)
        if sow:
            self.sow("intermediates", "attention_weights", weights_BNTS)
        return out_BTNH, weights_BNTS

    def _matmul(self, name, x, kernel, names, contract, deterministic) -> Array:
        if self.lora is None:
            return matmul(x, kernel, contract, dtype=self.dtype)
        return lora_lib.project(self, name, x, kernel, names, contract, self.lora, self.dtype,
                                self.param_dtype, deterministic, matmul)

    def _output(self, out_BTNH: Array, d_model: int, deterministic: bool = True) -> Array:
        """W_o: [B, T, N, H] -> [B, T, D] (plus the output bias)."""
        out_init = projection_init(self.init_std, (0, 1), 2, self.out_init_scale)
        w_out = self.param(
            "out",
            nn.with_logical_partitioning(out_init, ("heads", "kv", "embed")),
            (self.num_heads, self.head_dim, d_model),
            self.param_dtype,
        )
        out_BTD = self._matmul("out", out_BTNH, w_out, ("heads", "kv", "embed"), 2,
                               deterministic)
        if self.use_bias:
            b_out = self.param(
                "out_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                (d_model,),
                self.param_dtype,
            )
            out_BTD = out_BTD + b_out.astype(self.dtype)
        return out_BTD

    def _cache(self, name: str, new_BTKH: Array, slots_BT: Array | None) -> Array:
        """Cache buffer `name` with `new` [B, T, K, H] written at slots `slots_BT` [B, T] (or
        replacing it, when None), returned as [B, L, K, H]. Inside `init` the buffer is only
        created, shaped like `new`. Buffers are stored [B, K, L, H], the layout the attention
        dots read without a transpose per step."""
        initialized = self.has_variable("cache", name)
        new_BKTH = new_BTKH.transpose(0, 2, 1, 3)
        buffer = self.variable("cache", name, jnp.zeros, new_BKTH.shape, new_BKTH.dtype)
        if not initialized:
            return new_BTKH
        new_BKTH = new_BKTH.astype(buffer.value.dtype)
        if slots_BT is None:
            buffer.value = new_BKTH
        else:
            batch, heads = new_BKTH.shape[:2]
            rows = jnp.arange(batch)[:, None, None]
            kv_heads = jnp.arange(heads)[None, :, None]
            buffer.value = buffer.value.at[rows, kv_heads, slots_BT[:, None, :]].set(new_BKTH)
        return buffer.value.transpose(0, 2, 1, 3)

    def _cached(self, name: str) -> Array:
        """A cache buffer as [B, L, K, H], for decode steps that only read it."""
        return self.variable("cache", name).value.transpose(0, 2, 1, 3)


def _default_positions(positions: Array | None, length: int) -> Array:
    return jnp.arange(length, dtype=jnp.int32)[None] if positions is None else positions
