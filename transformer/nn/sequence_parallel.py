"""Sequence (context) parallelism: attention when the `sequence` mesh axis splits the length.

With `mesh.sequence` = n > 1 the rules table shards every activation's length dimension over
the `sequence` axis: each device holds T / n positions of every row, so activation memory per
device falls with n. Everything but attention is per position and needs nothing more. Attention
runs per device in a `shard_map` over that axis (batch and heads stay sharded as the other axes
say), with one of two strategies (`model.sequence_parallel`):

  all_gather  each device gathers the whole K and V ([B, S, K, H]: memory O(S) per device) and
              attends its query block to them with the chunked kernel. One all-gather forward,
              one reduce-scatter of dK / dV backward. Simple; best while K/V fit.
  ring        K/V blocks travel round the axis (`ppermute`, n steps; each step sends the block
              on before computing with it, so XLA can overlap the transfer with the compute);
              per-block results are merged by their logsumexps (the online softmax). The
              backward pass sends K/V round again with their dK / dV accumulators, which arrive
              home after the last step. Memory O(S / n).

Load balancing. Under a causal mask the device holding the last positions does n times the work
of the first. `zigzag` lays the sequence out so that it does not: the length is cut into 2n
chunks and device i holds chunks i and 2n - 1 - i. The decoder LMs apply that order to their
inputs (`model.sequence_load_balance`) and evaluate the mask at the original positions
(`masks.Permuted`), so packed segments, prefix-LM, sliding windows and bottom-right causal masks
stay exact.

Masks and biases are evaluated at global indices (`chunked_attention`'s `totals` / `offsets`);
bias functions (ALiBi, T5) read positions in the layout order. Dense mask or bias arrays are not
supported under the axis (the models build Mask specs and bias functions when it is on).

Splash (TPU). With `attention_impl` "auto" on TPU (or "splash"; Pallas interpret mode elsewhere)
the all-gather strategy runs splash per device instead of the chunked kernel (`splash_attention`):
each device gathers K and V, puts them back in the original order (`from_zigzag`) and runs its
query block against them. Splash evaluates the mask at the query positions of its `q_sequence`,
so the kernel is built once for the whole (zig-zag) query order with `q_seq_shards` = n and each
device receives its slice of the mask information. Packed documents go in as splash segment ids.
What splash cannot express falls back to the chunked kernel, and the kernel line says why
(`splash_reason`): the ring, biases (ALiBi, T5), per-example masks other than segment ids
(prefix-LM, padding), lengths whose per-device blocks are not multiples of 128.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from transformer.nn import kernels, masks
from transformer.nn.chunked_attention import _backward, _forward, _prepare, chunked_attention
from transformer.parallel import sharding

AXIS = "sequence"
STRATEGIES = ("all_gather", "ring")

Array = jax.Array


def shards() -> int:
    """How many ways activations' length dimension is split where this is traced: the size of
    the `sequence` axis of the mesh in context when the logical rules map "activation_length"
    onto it, else 1."""
    return sharding.traced_split("activation_length", AXIS)


def zigzag(length: int, num_shards: int) -> np.ndarray:
    """The load-balanced layout of a causal sequence over `num_shards` devices: position i of the
    layout holds original position `order[i]`. Device d gets chunks d and 2n - 1 - d of 2n.

    >>> zigzag(8, 2).tolist()  # device 0: chunks 0, 3; device 1: chunks 1, 2
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    return np.asarray(to_zigzag(np.arange(length)[None], num_shards)[0])


def to_zigzag(x, num_shards: int):
    """x [B, T, ...] in the original order -> the `zigzag` layout (reshapes, no gather)."""
    check_length(x.shape[1], num_shards, load_balance=True)
    chunks = x.reshape(x.shape[0], 2 * num_shards, -1, *x.shape[2:])
    first, last = chunks[:, :num_shards], chunks[:, num_shards:][:, ::-1]
    return _stack(first, last).reshape(x.shape)


def from_zigzag(x, num_shards: int):
    """The inverse of `to_zigzag`.

    >>> from_zigzag(to_zigzag(np.arange(12)[None], 3), 3).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    """
    pairs = x.reshape(x.shape[0], num_shards, 2, -1, *x.shape[2:])
    first, last = pairs[:, :, 0], pairs[:, :, 1][:, ::-1]
    return _concat(first, last).reshape(x.shape)


def _stack(a, b):
    return (np if isinstance(a, np.ndarray) else jnp).stack([a, b], axis=2)


def _concat(a, b):
    return (np if isinstance(a, np.ndarray) else jnp).concatenate([a, b], axis=1)


def check_length(length: int, num_shards: int, *, load_balance: bool, what: str = "length"):
    """One-line error unless `length` splits over `num_shards` (in 2n chunks if balanced)."""
    parts = 2 * num_shards if load_balance else num_shards
    if length % parts:
        detail = f"2 x mesh.sequence={num_shards} (load-balanced chunks)" if load_balance else (
            f"mesh.sequence={num_shards}")
        raise ValueError(f"{what}={length}: expected a multiple of {detail}")


def attention(query: Array, key: Array, value: Array, mask=None, bias=None, *,
              strategy: str = "all_gather", scale: float | None = None, q_chunk: int = 512,
              kv_chunk: int = 512, softcap: float = 0.0, sinks: Array | None = None) -> Array:
    """Attention of query [B, T, N, H] over key / value [B, S, K, H] whose T and S are split over
    the mesh's `sequence` axis; what `chunked_attention` computes on the whole sequences.

    `mask`: a `masks.Mask` or None; `bias`: a function bias(q_idx, kv_idx) or None; both see
    indices in the whole sequences; `softcap` and `sinks` as chunked_attention's (the ring
    merges the sink into each row once, as one more block with output 0 and logsumexp the
    sink). Needs a mesh in context (`jax.set_mesh`) with the axis.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"sequence_parallel={strategy!r}: expected one of {STRATEGIES}")
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh.shape[AXIS]
    q_len, kv_len = query.shape[1], key.shape[1]
    if q_len % n or kv_len % n:
        raise ValueError(f"query length {q_len}, key length {kv_len}: expected multiples of "
                         f"mesh.{AXIS}={n}")
    local = _ring if strategy == "ring" else _all_gather
    local = functools.partial(local, scale=scale, q_chunk=q_chunk, kv_chunk=kv_chunk,
                              softcap=softcap)
    split = P(None, AXIS)  # the other mesh axes stay automatic (batch, heads as the rules say)
    kv_split = split
    if strategy == "all_gather":  # K and V whole along the sequence on every device of the axis
        key, value, kv_split = _gather_rows(key), _gather_rows(value), P()
    return jax.shard_map(local, in_specs=(split, kv_split, kv_split, P(), P(), P()),
                         out_specs=split, axis_names={AXIS}, check_vma=False)(
                             query, key, value, mask, bias, sinks)


def _all_gather(q, k_all, v_all, mask, bias, sinks, *, scale, q_chunk, kv_chunk, softcap):
    """This device's queries over the whole (`_gather_rows`) keys and values."""
    n, i = lax.axis_size(AXIS), lax.axis_index(AXIS)
    q_len = q.shape[1]
    return chunked_attention(q, k_all, v_all, mask, bias, scale=scale, q_chunk=q_chunk,
                             kv_chunk=kv_chunk, totals=(q_len * n, k_all.shape[1]),
                             offsets=(i * q_len, 0), softcap=softcap, sinks=sinks)


def _gather_rows(x):
    """x [B, S, ...] split over the axis -> whole along S on each of its devices, each device
    gathering its own batch rows only: one shard_map manual over the axis and the axes that
    split the batch. Manual over `sequence` alone, XLA's partitioner makes the batch whole for
    the gather and for its transpose (dK / dV, reduce-scattered), all rows on every device; a
    shard_map over the batch's axes nested inside that one fails jax 0.12's check that manual
    axes come in mesh order (data before sequence)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules() or sharding.LOGICAL_AXIS_RULES
    rows = sharding.mesh_spec(P("activation_batch"), x.shape[:1], mesh, rules)[0]
    row_axes = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    gather = functools.partial(lax.all_gather, axis_name=AXIS, axis=1, tiled=True)
    return jax.shard_map(gather, in_specs=P(rows, AXIS), out_specs=P(rows),
                         axis_names={*row_axes, AXIS}, check_vma=False)(x)


def _ring(q, k, v, mask, bias, sinks, *, scale, q_chunk, kv_chunk, softcap):
    n = lax.axis_size(AXIS)
    q_len, kv_len = q.shape[1], k.shape[1]
    t, mask_args, bias_args = _prepare(q, k, v, mask, bias, scale, q_chunk, kv_chunk,
                                       totals=(q_len * n, kv_len * n), softcap=softcap)
    to_next = [(d, (d + 1) % n) for d in range(n)]
    shift = lambda tree: jax.tree.map(lambda x: lax.ppermute(x, AXIS, to_next), tree)

    def block(s):
        """The tiles of step s, when this device holds the K/V block of device i - s (mod n).
        (The axis index is read where it is used: the backward pass is traced on its own.)"""
        i = lax.axis_index(AXIS)
        return t.at(i * q_len, (i - s) % n * kv_len, out_dtype=t.acc)

    def forward(q, k, v, mask_args, bias_args, sinks):
        def step(s, carry):
            out, lse, kv = carry
            following = shift(kv)  # independent of this step's compute: the transfer overlaps
            out_s, lse_s, _ = _forward(block(s), q, *kv, mask_args, bias_args)
            out, lse = _merge(out, lse, out_s, _lse_rows(t, lse_s))
            return out, lse, following

        batch, _, heads, head_dim = q.shape
        init = (jnp.zeros((batch, q_len, heads, head_dim), t.acc),
                jnp.full((batch, q_len, heads), -jnp.inf, t.acc), (k, v))
        out, lse, kv = lax.fori_loop(0, n - 1, step, init)
        out_s, lse_s, _ = _forward(block(n - 1), q, *kv, mask_args, bias_args)
        out, lse = _merge(out, lse, out_s, _lse_rows(t, lse_s))
        if sinks is None:
            return out, lse
        # the sink: one more block, with output 0 and logsumexp the sink, merged once per row
        return _merge(out, lse, jnp.zeros_like(out), jnp.broadcast_to(
            sinks.astype(t.acc), lse.shape))

    @jax.custom_vjp
    def ring(q, k, v, mask_args, bias_args, sinks):
        return forward(q, k, v, mask_args, bias_args, sinks)[0].astype(q.dtype)

    def ring_fwd(q, k, v, mask_args, bias_args, sinks):
        out, lse = forward(q, k, v, mask_args, bias_args, sinks)
        out = out.astype(q.dtype)
        return out, (q, k, v, mask_args, bias_args, sinks, out, lse)

    def ring_bwd(res, d_out):
        q, k, v, mask_args, bias_args, sinks, out, lse = res
        lse_t = _lse_tiles(t, lse)

        def grads(s, kv):
            dq, dk, dv, dbias, _ = _backward(block(s), q, *kv, mask_args, bias_args, out, lse_t,
                                             d_out)
            return dq, dk, dv, dbias

        def step(s, carry):
            dq, dbias, kv, dkv = carry
            following = shift(kv)
            dq_s, dk_s, dv_s, db_s = grads(s, kv)
            dkv = shift((dkv[0] + dk_s, dkv[1] + dv_s))  # travels with its block
            dbias = tuple(a + b for a, b in zip(dbias, db_s, strict=True))
            return dq + dq_s, dbias, following, dkv

        zeros = lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32))
        init = (zeros(q), tuple(zeros(b) for b in bias_args), (k, v), (zeros(k), zeros(v)))
        dq, dbias, kv, dkv = lax.fori_loop(0, n - 1, step, init)
        dq_s, dk_s, dv_s, db_s = grads(n - 1, kv)
        dk, dv = shift((dkv[0] + dk_s, dkv[1] + dv_s))  # the n-th hop brings them home
        dbias = tuple((a + b).astype(c.dtype)
                      for a, b, c in zip(dbias, db_s, bias_args, strict=True))
        d_sinks = None
        if sinks is not None:  # this device's rows: -exp(sink - lse) (dO . O)
            delta = jnp.sum(d_out.astype(t.acc) * out.astype(t.acc), -1)  # [B, T, N]
            d_sinks = -jnp.sum(jnp.exp(sinks.astype(t.acc) - lse) * delta, (0, 1))
            d_sinks = d_sinks.astype(sinks.dtype)
        return ((dq + dq_s).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
                tuple(None for _ in mask_args), dbias, d_sinks)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring(q, k, v, mask_args, bias_args, sinks)


def splash_reason(mask, bias, *, strategy: str, q_len: int, kv_len: int, num_shards: int,
                  platform: str, interpret: bool) -> str | None:
    """Why splash cannot run each device's block under the axis (None: it can); then
    `attention` (the chunked kernel) runs it."""
    if platform != "tpu" and not interpret:
        return f"needs platform tpu (got {platform})"
    if strategy != "all_gather":
        return f"runs the all_gather strategy only (got {strategy})"
    if bias is not None:
        return "takes no bias (ALiBi / T5)"
    if q_len != kv_len or (q_len // num_shards) % kernels._LANES:
        return (f"needs q_len == kv_len and per-device blocks that are multiples of "
                f"{kernels._LANES} (got {q_len} / {num_shards}, {kv_len})")
    layout = _splash_layout(mask, q_len, num_shards)
    return layout if isinstance(layout, str) else None


def _splash_layout(mask, length: int, n: int):
    """mask -> (query order or None, static Mask or None, Segment or None), or a reason string.

    The order is a NumPy array known at trace time: from a zig-zag `masks.Permuted`'s
    `zigzag_shards`, or from its `q_order` where that is concrete."""
    order = None
    if isinstance(mask, masks.Permuted):
        if mask.kv_order is not None:
            return "takes one order for queries and keys"
        if mask.zigzag_shards == n:
            order = zigzag(length, n)
        else:
            try:
                order = np.asarray(mask.q_order)
            except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
                return "needs a permuted mask's order at trace time (masks.Permuted.zigzag_shards)"
        mask = mask.mask
    parts = () if mask is None else mask.parts if isinstance(mask, masks.And) else (mask,)
    static = [p for p in parts if p.is_static]
    dynamic = [p for p in parts if not p.is_static]
    if len(dynamic) > 1 or any(not isinstance(p, masks.Segment) or p.kv_segment_ids is not None
                               for p in dynamic):
        return "takes no per-example mask but segment ids (prefix-LM, padding)"
    static = None if not static else static[0] if len(static) == 1 else masks.And(tuple(static))
    if static is not None and not kernels._allows_diagonal(static):
        return "needs a static mask that allows every query's own position"
    return order, static, dynamic[0] if dynamic else None


def splash_attention(query: Array, key: Array, value: Array, mask=None, *,
                     scale: float | None = None, softcap: float = 0.0, interpret: bool = False,
                     block_size: int = 512) -> Array:
    """What `attention(strategy="all_gather")` computes, with the splash kernel per device
    (`splash_reason` must be None). Batch and heads split over the other mesh axes as the rules
    table splits them (`kernels.splash_attention`'s partition); the kernel runs per device."""
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh.shape[AXIS]
    batch, length, num_heads, head_dim = query.shape
    order, static, segment = _splash_layout(mask, length, n)
    b, h, kv_h = kernels._splash_partition(mesh, batch, num_heads, key.shape[2])
    local_heads = num_heads // (1 if h is None else int(np.prod([mesh.shape[a] for a in (
        h if isinstance(h, tuple) else (h,))])))
    q_order = np.arange(length) if order is None else order
    kernel = kernels.splash_kernel(
        kernels._splash_mask(static, length, length, q_order), num_heads=local_heads,
        mqa=key.shape[2] == 1, q_len=length // n, kv_len=length, block_size=block_size,
        interpret=interpret, softcap=softcap, q_seq_shards=n)
    ids = ()
    if segment is not None:  # queries' ids in the layout order, keys' in the original order
        kv_ids = jnp.broadcast_to(jnp.asarray(segment.q_segment_ids, jnp.int32), (batch, length))
        ids = (jnp.take(kv_ids, jnp.asarray(q_order), axis=1), kv_ids)
    scale = head_dim**-0.5 if scale is None else scale

    def local(kernel, q, k, v, *ids):
        k, v = (lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
        if order is not None:  # back to the original order, which the keys' mask assumes
            k, v = _unpermute(k, order, n), _unpermute(v, order, n)
        out = kernels.splash_run(kernel, q, k, v, ids, scale=scale)
        if ids:  # a padding query (id 0) has no key: zeros, as the other kernels give
            out = jnp.where((ids[0] != 0)[:, :, None, None], out, 0).astype(out.dtype)
        return out

    q_spec, kv_spec = P(b, AXIS, h, None), P(b, AXIS, kv_h, None)
    ids_specs = (P(b, AXIS), P(b, None)) if ids else ()
    return jax.shard_map(local, in_specs=(_kernel_specs(kernel), q_spec, kv_spec, kv_spec,
                                          *ids_specs),
                         out_specs=q_spec, check_vma=False)(kernel, query, key, value, *ids)


def _unpermute(x, order: np.ndarray, n: int):
    """x [B, S, ...] in the layout `order` -> the original order."""
    if np.array_equal(order, zigzag(len(order), n)):
        return from_zigzag(x, n)  # reshapes, no gather
    return jnp.take(x, jnp.asarray(np.argsort(order)), axis=1)


def _kernel_specs(kernel):
    """shard_map specs of a splash kernel built with q_seq_shards = n: its mask information
    split along the query blocks over the axis (as splash's `manual_sharding_spec` does)."""
    def info(mask_info):
        if mask_info is None:
            return None
        split = {name: P(AXIS) if name == "q_sequence" else P(None, AXIS)
                 for name in ("data_next", "mask_next", "block_mask", "q_sequence")
                 if getattr(mask_info, name) is not None}
        whole = P() if mask_info.partial_mask_blocks is not None else None
        return mask_info._replace(partial_mask_blocks=whole, **split)
    return type(kernel)(info(kernel.fwd_mask_info), info(kernel.dq_mask_info),
                        info(kernel.dkv_mask_info), **kernel.kwargs)


def _merge(out, lse, out_s, lse_s):
    """Two normalised partial attentions (out [B, T, N, H], logsumexp [B, T, N], -inf: no key
    yet) -> the attention over the union of their keys."""
    total = jnp.logaddexp(lse, lse_s)
    safe = jnp.where(jnp.isfinite(total), total, 0.0)
    w, w_s = jnp.exp(lse - safe), jnp.exp(lse_s - safe)
    return w[..., None] * out + w_s[..., None] * out_s, total


def _lse_rows(t, lse_tiles):
    """The chunked kernel's logsumexp tiles [nq, B, K, G, qb] (+inf: no key) -> [B, T, N]
    (-inf: no key)."""
    rows = lse_tiles.transpose(1, 0, 4, 2, 3).reshape(t.batch, t.q_pad, t.num_heads)
    rows = rows[:, :t.q_len]
    return jnp.where(rows == jnp.inf, -jnp.inf, rows)


def _lse_tiles(t, rows):
    """The inverse of `_lse_rows`."""
    rows = jnp.where(rows == -jnp.inf, jnp.inf, rows)
    rows = jnp.pad(rows, ((0, 0), (0, t.q_pad - t.q_len), (0, 0)))
    tiles = rows.reshape(t.batch, t.nq, t.qb, t.num_kv_heads, t.group)
    return tiles.transpose(1, 0, 3, 4, 2)


__all__ = ["AXIS", "STRATEGIES", "attention", "check_length", "shards", "splash_attention",
           "splash_reason", "zigzag"]
