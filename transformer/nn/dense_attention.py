"""Dense softmax attention, the math every kernel must reproduce: `dot_product_attention` (the
"dense" kernel, [B, N, T, S] logits, a hand-written softmax backward) and `reference_attention`
(the "reference" kernel: straight-line float32 softmax attention differentiated by autodiff, for
prototyping and as the tests' yardstick).

Shapes: B batch, T query length, S key length, N query heads, K key/value heads (N % K == 0),
G = N // K, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from transformer.nn import kernels
from transformer.nn.chunked_attention import check_qkv
from transformer.nn.masks import EMPTY, Mask, as_dense

Array = jax.Array

# On CPU the dense kernel runs blocks of at least 64 queries, at most 8 blocks (compile time
# grows with their number), each over only the keys its mask allows (`dot_product_attention(
# q_block=...)`). Measured on a 2-core AVX-512 EPYC, causal fwd+bwd at B8 N6 H64: T=256
# 38 -> 32 ms (35 -> 21 ms in a quieter hour), T=512 168 -> 101 ms; at T=64 blocks of 32 were
# slower than one.
CPU_QUERY_BLOCK, CPU_MAX_BLOCKS = 64, 8
# On CPU, blocks of at most this many query rows a KV head (G x queries) take their logits as
# K Q^T (`dot_product_attention(key_first_rows=...)`): XLA:CPU otherwise copies K transposed on
# every call, for a decode step the whole cache. Measured on a 2-core AVX-512 EPYC (Zen 5), the
# logits dot over 32k keys: 1.6-2.4 -> 0.2-0.8 ms at 1-6 rows of 64 dims (GQA's decode), 14.5
# -> 1.7 ms at 6 rows of 288 (MLA's); as fast or faster up to 48 rows, slower from 96.
CPU_KEY_FIRST_ROWS = 32


def dot_product_attention(
    query: Array, key: Array, value: Array, mask: Mask | Array | None = None,
    bias: Array | None = None, *, scale: float | None = None, dropout_rate: float = 0.0,
    dropout_rng: Array | None = None, return_weights: bool = False, q_block: int | None = None,
    softcap: float = 0.0, sinks: Array | None = None, key_first_rows: int = 0,
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
      sinks: [N] logits, one per query head, that join each row's softmax denominator with no
        value (gpt-oss): weights exp(s_j) / (exp(sink) + sum_j exp(s_j)). Not scaled, capped or
        biased. A row with no allowed key then puts all its weight on the sink (output 0).
      key_first_rows: blocks of at most this many query rows a KV head (G x queries: a decode
        step's) compute their logits as K Q^T, reading K as stored (`CPU_KEY_FIRST_ROWS`).

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
                                             dense_mask, bias, (scale, softcap, key_first_rows),
                                             scores)
        if not keep_weights:
            out_BKMH = softmax_values(logits_BNTS.reshape(batch, num_kv_heads, group * rows, cols),
                                      value_BKSH[:, :, k0:k1], _row_sinks(sinks, group, rows))
            outs_BNTH.append(out_BKMH.reshape(batch, num_heads, rows, head_dim))
            continue
        out_BNTH, weights_BNTS = _weighted_values(logits_BNTS, allowed, value_BKSH, dropout_rate,
                                                  dropout_rng, acc, sinks)
        outs_BNTH.append(out_BNTH)
    out_BNTH = outs_BNTH[0] if len(outs_BNTH) == 1 else jnp.concatenate(outs_BNTH, axis=2)
    out_BTNH = out_BNTH.transpose(0, 2, 1, 3).astype(query.dtype)
    if keep_weights:  # the zeroed weights already zero rows with no allowed key
        return (out_BTNH, weights_BNTS) if return_weights else out_BTNH
    # rows with no allowed key return zeros (None: the mask provably allows a key in every row)
    return kernels.zero_empty_rows(out_BTNH, kernels.rows_with_keys(
        mask if isinstance(mask, Mask) else dense_mask, q_len, kv_len))


def _weighted_values(logits_BNTS, allowed, value_BKSH, dropout_rate: float, dropout_rng, acc,
                     sinks=None):
    """(softmax(logits) V [B, N, T, H], the weights [B, N, T, S] in `acc`) of one whole block,
    with dropout on the weights that multiply V (the weights returned are before dropout)."""
    batch, num_heads, q_len, kv_len = logits_BNTS.shape
    num_kv_heads, head_dim = value_BKSH.shape[1], value_BKSH.shape[-1]
    weights_BNTS = _softmax_with_sinks(logits_BNTS.astype(acc), sinks)
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
    `scaling`: (scale, softcap, key_first_rows)."""
    batch, num_kv_heads, group, q_len, head_dim = query_BKGTH.shape
    kv_len = key_BKHS.shape[-1]
    scale, softcap, key_first_rows = scaling
    q0, q1, k0, k1 = block
    rows, cols = q1 - q0, k1 - k0
    query_BKMH = query_BKGTH[:, :, :, q0:q1].reshape(batch, num_kv_heads, group * rows, head_dim)
    if group * rows <= key_first_rows:  # [S, H] x [H, M], then the small [S, M] transposed
        logits_BKMS = jnp.matmul(key_BKHS[..., k0:k1].swapaxes(-1, -2),
                                 query_BKMH.swapaxes(-1, -2),
                                 preferred_element_type=scores).swapaxes(-1, -2)
    else:
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

    >>> from transformer.nn import masks
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


def _row_sinks(sinks: Array | None, group: int, rows: int) -> Array | None:
    """Sink logits [N] -> [1, K, G * rows, 1] (float32 at least), one per row of the
    [B, K, G * rows, S] logits `dot_product_attention` folds its query groups into."""
    if sinks is None:
        return None
    sinks = sinks.astype(jnp.promote_types(sinks.dtype, jnp.float32))
    return jnp.repeat(sinks.reshape(-1, group), rows, axis=1)[None, :, :, None]


def _softmax_with_sinks(logits_BNTS: Array, sinks: Array | None) -> Array:
    """softmax over the last axis, with sink logits [N] (or None) in each row's denominator."""
    if sinks is None:
        return jax.nn.softmax(logits_BNTS, axis=-1)
    sink_BNT1 = jnp.broadcast_to(sinks.astype(logits_BNTS.dtype)[None, :, None, None],
                                 (*logits_BNTS.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([logits_BNTS, sink_BNT1], -1), axis=-1)[..., :-1]


@jax.custom_vjp
def softmax_values(logits: Array, values: Array, sink: Array | None = None) -> Array:
    """softmax(logits) @ values over the last axis of logits [..., M, S] and values [..., S, H],
    in the accumulation dtype (float32 for bfloat16 / float16 / float32 inputs). `sink`
    (broadcastable to [..., M, 1], float32): a logit per row in the softmax's denominator that
    has no value; its gradient is -P_sink (dO . O) per row.

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
    return _softmax_values_fwd(logits, values, sink)[0]


def _softmax_values_fwd(logits, values, sink=None):
    acc = jnp.promote_types(values.dtype, jnp.float32)
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if sink is None:
        shifted = x - jnp.max(x, axis=-1, keepdims=True)
        log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
        sink_probs = None
    else:  # the sink joins the max and the sum; its weight is kept for its gradient
        top = jnp.maximum(jnp.max(x, axis=-1, keepdims=True), sink.astype(x.dtype))
        shifted = x - top
        log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)
                          + jnp.exp(sink - top))
        sink_probs = jnp.exp(sink - top - log_sum)  # [..., M, 1]
    probs = jnp.exp(shifted - log_sum).astype(logits.dtype)
    out = jnp.matmul(probs.astype(values.dtype), values, preferred_element_type=acc)
    return out, (probs, values, out, sink_probs, None if sink is None else sink.shape)


def _softmax_values_bwd(residuals, grad_out):
    probs, values, out, sink_probs, sink_shape = residuals
    acc = out.dtype
    grad_values = jnp.matmul(jnp.swapaxes(probs, -1, -2).astype(values.dtype),
                             grad_out.astype(values.dtype), preferred_element_type=acc)
    grad_probs = jnp.matmul(grad_out.astype(values.dtype), jnp.swapaxes(values, -1, -2),
                            preferred_element_type=acc)
    row = jnp.sum(grad_out * out, axis=-1, keepdims=True)  # = sum_j P_ij dP_ij
    grad_logits = probs.astype(acc) * (grad_probs - row)
    grad_sink = None
    if sink_probs is not None:  # d sink = P_sink (0 - row): the sink's value is zero
        grad_sink = _sum_to(-sink_probs * row.astype(sink_probs.dtype), sink_shape)
    return grad_logits.astype(probs.dtype), grad_values.astype(values.dtype), grad_sink


def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """x summed over the axes where `shape` (x's rank) is 1: the cotangent of a broadcast."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 != n)
    return x.sum(axes, keepdims=True) if axes else x


softmax_values.defvjp(_softmax_values_fwd, _softmax_values_bwd)


def cpu_layout(q_len: int, platform: str) -> dict:
    """`dot_product_attention`'s query block and key_first_rows on `platform` (none but on CPU)."""
    if platform != "cpu":
        return {}
    return dict(q_block=cpu_query_block(q_len, platform), key_first_rows=CPU_KEY_FIRST_ROWS)


def cpu_query_block(q_len: int, platform: str) -> int | None:
    """The dense kernel's query block on `platform` (None: one block)."""
    if platform != "cpu":
        return None
    return max(CPU_QUERY_BLOCK, -(-q_len // CPU_MAX_BLOCKS))


def reference_attention(query: Array, key: Array, value: Array, mask: Mask | Array | None = None,
                        bias: Array | None = None, *, scale: float | None = None,
                        softcap: float = 0.0, dropout_rate: float = 0.0,
                        dropout_rng: Array | None = None, return_weights: bool = False,
                        sinks: Array | None = None):
    """The "reference" kernel: softmax(softcap(Q K^T * scale) + bias) V written out plainly, in
    float32 (float64 for float64 inputs), differentiated by autodiff. For prototyping a new
    attention idea (edit it here first) and as the yardstick the other kernels are tested
    against; same arguments and results as `dot_product_attention` (masked keys get zero weight,
    a row with no allowed key returns zeros; `sinks` [N] join each row's denominator).

    >>> q = jnp.ones((1, 3, 2, 4))
    >>> reference_attention(q, q, q, return_weights=True)[1][0, 0, 0].tolist()
    [0.3333333432674408, 0.3333333432674408, 0.3333333432674408]
    """
    check_qkv(query, key, value)
    batch, q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    acc = jnp.promote_types(query.dtype, jnp.float32)
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    q_BNTH = query.astype(acc).transpose(0, 2, 1, 3)
    k_BNSH = jnp.repeat(key.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    v_BNSH = jnp.repeat(value.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    logits = q_BNTH @ jnp.swapaxes(k_BNSH, -1, -2) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        logits = logits + jnp.asarray(bias, acc)
    allowed = jnp.ones((1, 1, q_len, kv_len), bool) if mask is None else as_dense(
        mask, q_len, kv_len)
    logits = jnp.where(allowed, logits, -jnp.inf)
    if sinks is not None:  # a column of sink logits joins each row's softmax, then is dropped
        sink_BNT1 = jnp.broadcast_to(sinks.astype(acc)[None, :, None, None],
                                     (*logits.shape[:-1], 1))
        logits = jnp.concatenate([logits, sink_BNT1], axis=-1)
    weights = jax.nn.softmax(logits, axis=-1)[..., :kv_len]
    weights = jnp.where(allowed, weights, 0.0)  # rows with no allowed key: 0, not NaN
    probs = weights
    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng")
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = (probs @ v_BNSH).transpose(0, 2, 1, 3).astype(query.dtype)
    return (out, weights) if return_weights else out
