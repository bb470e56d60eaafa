"""Chunked (flash-style) attention: online softmax over key tiles, O(T) memory, any backend.

`chunked_attention` computes what `dense_attention.dot_product_attention` computes (same shapes,
mask and bias conventions, GQA, float32 softmax for low-precision inputs, zero output for a query
row with no allowed key) without ever holding a [T, S] logits matrix:

  forward   an outer `lax.scan` over query tiles; for each query tile two inner loops over the
            key tiles it needs, keeping a running max m, running sum l and an unnormalised
            accumulator (all float32). Saves only the output and the per-query logsumexp.
  backward  a `jax.custom_vjp` (FlashAttention-2 style): an outer `lax.scan` over key tiles, inner
            loops over the query tiles that see it; each tile's probabilities are recomputed
            from the logsumexp, dK and dV accumulate per key tile and dQ accumulates into one
            float32 [T, N, H] buffer. Memory is O(T + tile) in both passes.

Tile skipping. The mask spec's static `block_map` classifies every (query tile, key tile) pair
as EMPTY, PARTIAL or FULL; `tile_plan.plan_tiles` turns it into per-row/per-column index lists.
  * EMPTY tiles are never visited: the inner loops run over index lists whose lengths are the
    number of needed tiles (a `fori_loop` with a traced trip count), so a causal mask costs about
    half of a full one (exact for static masks: Full, Causal, SlidingWindow, ChunkedCausal).
  * FULL tiles skip mask evaluation altogether.
  * PARTIAL tiles evaluate the mask spec on the tile (`Mask.tile`, traced tile starts). For masks
    with per-example arrays (PrefixLM, Padding, Segment, dense boolean arrays), whose block map
    is only conservative, the tile's work also sits behind a `lax.cond` on "any key allowed in
    this tile", so e.g. tiles that only hold padding or another packed document are skipped at
    run time (under `vmap` the cond becomes a select and both sides run).

Ragged lengths. Sequences are zero-padded to whole tiles; padded keys are masked with an explicit
`kv_idx < kv_len` predicate on the last key tile and padded query rows are dropped from the output
(their output cotangent is zero). Tile indices come from the plan and are always in range, so no
`dynamic_slice` ever clamps.

Bias. `bias` may be
  * a float array broadcastable to [B, N, T, S] (sliced per tile; gradient returned), or
  * a callable `bias(q_idx, kv_idx)` of int32 index vectors [Q] and [K] (query / key indices in
    the full sequences, so q_len < kv_len alignment is the caller's business, as in
    `positions.alibi_bias(q_positions, kv_positions, N)`) returning a float array broadcastable to
    [B, N, Q, K]. It is evaluated per tile, so ALiBi or T5 biases never materialise at [T, S].
    Floating-point arrays it closes over (e.g. a learned T5 bucket table) receive gradients (via
    `jax.closure_convert`). Indices of padding positions (>= the length) may be passed; the values
    there are ignored, but must not raise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer.nn.masks import FULL, PARTIAL, Mask, as_dense
from transformer.nn.tile_plan import TilePlan, plan_tiles

Array = jax.Array


# -----------------------------------------------------------------------------
# Static configuration and per-tile pieces


def _to_4d(shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    if len(shape) > 4:
        raise ValueError(f"{what} of shape {shape}: expected at most 4 dims ([B, N, T, S])")
    return (1,) * (4 - len(shape)) + tuple(shape)


def _unbroadcast(x: Array, shape: tuple[int, ...]) -> Array:
    """Sums `x` over the axes where `shape` (same rank) is 1 and x is not."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 != n)
    return x.sum(axes, keepdims=True) if axes else x


class _Unknown(Mask):
    """Plans every tile PARTIAL: a mask whose tiles are only known at run time."""

    is_static: ClassVar[bool] = False


class _Tiles:
    """Static sizes and the per-tile mask / bias / logits of one `chunked_attention` call."""

    def __init__(self, q_shape, kv_shape, q_dtype, mask, bias, scale, q_chunk, kv_chunk,
                 totals=None, softcap=0.0):
        self.batch, self.q_len, self.num_heads, self.head_dim = q_shape
        _, self.kv_len, self.num_kv_heads, _ = kv_shape
        # `totals` (q_total, kv_total): these queries and keys are blocks of longer sequences
        # (sequence parallelism). The mask and bias then see indices shifted by `offsets`, set
        # per block with `at`, in sequences of the total lengths, and every tile the mask may
        # touch is planned PARTIAL (the offsets are traced), skipped at run time when empty.
        self.blocked = totals is not None
        self.q_total, self.kv_total = totals if self.blocked else (self.q_len, self.kv_len)
        self.offsets = (0, 0)
        self.out_dtype = None  # outputs and gradients in the inputs' dtypes; see `at`
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.softcap = softcap  # > 0: scaled logits -> softcap * tanh(logits / softcap)
        self.acc = jnp.promote_types(q_dtype, jnp.float32)
        if q_chunk < 1 or kv_chunk < 1:
            raise ValueError(f"q_chunk={q_chunk}, kv_chunk={kv_chunk}: expected >= 1")
        self.qb = min(q_chunk, self.q_len)
        self.kb = min(kv_chunk, self.kv_len)
        if self.blocked and not (mask is None or isinstance(mask, Mask)):
            raise ValueError("attention over sequence blocks takes a Mask spec or None, not a "
                             "dense mask array")
        if self.blocked and not (bias is None or callable(bias)):
            raise ValueError("attention over sequence blocks takes a bias function "
                             "bias(q_idx, kv_idx) or None, not a dense bias array")
        planned = mask if not self.blocked or mask is None else _Unknown()
        self.plan = plan_tiles(planned, self.q_len, self.kv_len, self.qb, self.kb)
        self.nq, self.nk = self.plan.num_q_tiles, self.plan.num_kv_tiles
        self.q_pad, self.kv_pad = self.nq * self.qb, self.nk * self.kb
        self.ragged_kv = self.kv_len % self.kb != 0

        # Mask: a spec (its array leaves travel as arguments), a dense array, or nothing.
        if mask is None:
            self.mask_kind, self.dynamic = "none", False
        elif isinstance(mask, Mask):
            self.mask_kind, self.dynamic = "spec", not mask.is_static or self.blocked
            _, self.mask_tree = jax.tree.flatten(mask)
        else:
            self.mask_kind, self.dynamic = "array", True
            self.mask_shape = _to_4d(jnp.shape(mask), "mask")

        # Bias: a dense array, a callable of index vectors, or nothing.
        self.bias_fn = None
        if bias is None:
            self.bias_kind = "none"
        elif callable(bias):
            self.bias_kind = "fn"
            example = (jax.ShapeDtypeStruct((self.qb,), jnp.int32),
                       jax.ShapeDtypeStruct((self.kb,), jnp.int32))
            out = jax.eval_shape(bias, *example)
            self.bias_tile_shape = _to_4d(out.shape, "bias(q_idx, kv_idx)")
            self.bias_dtype = out.dtype
        else:
            self.bias_kind = "array"
            self.bias_shape = _to_4d(jnp.shape(bias), "bias")

    def at(self, q_offset, kv_offset, out_dtype=None) -> _Tiles:
        """These tiles for the query / key blocks starting at `q_offset` / `kv_offset` (traced
        ints) of the total sequences (needs `totals`); `out_dtype`: the dtype of the forward's
        output and the backward's gradients (default: the inputs'), e.g. float32 for partial
        results that are summed over blocks."""
        shifted = copy.copy(self)
        shifted.offsets, shifted.out_dtype = (q_offset, kv_offset), out_dtype
        return shifted

    # -- layout ---------------------------------------------------------------------------------

    # Tiles are stored head-major ([.., K, G, tile, H] / [.., K, tile, H]) so every per-tile
    # product is a plain batched matmul over (B, K) with no transposes inside the loops.

    def q_tiles(self, x: Array) -> Array:
        """[B, T, N, H] -> zero-padded tiles [nq, B, K, G, qb, H]."""
        x = jnp.pad(x, ((0, 0), (0, self.q_pad - self.q_len), (0, 0), (0, 0)))
        x = x.reshape(self.batch, self.nq, self.qb, self.num_kv_heads, self.group, self.head_dim)
        return x.transpose(1, 0, 3, 4, 2, 5)

    def q_untile(self, x: Array) -> Array:
        """[nq, B, K, G, qb, H] -> [B, T, N, H]."""
        x = x.transpose(1, 0, 4, 2, 3, 5)
        x = x.reshape(self.batch, self.q_pad, self.num_heads, self.head_dim)
        return x[:, : self.q_len]

    def kv_tiles(self, x: Array) -> Array:
        """[B, S, K, H] -> zero-padded tiles [nk, B, K, kb, H]."""
        x = jnp.pad(x, ((0, 0), (0, self.kv_pad - self.kv_len), (0, 0), (0, 0)))
        x = x.reshape(self.batch, self.nk, self.kb, self.num_kv_heads, self.head_dim)
        return x.transpose(1, 0, 3, 2, 4)

    def kv_untile(self, x: Array) -> Array:
        """[nk, B, K, kb, H] -> [B, S, K, H]."""
        x = x.transpose(1, 0, 3, 2, 4)
        x = x.reshape(self.batch, self.kv_pad, self.num_kv_heads, self.head_dim)
        return x[:, : self.kv_len]

    def _heads(self, x: Array) -> Array:
        """[b, N or 1, q, k] -> [b, K or 1, G or 1, q, k], broadcastable against logits."""
        b, n, q, k = x.shape
        if n == 1:
            return x.reshape(b, 1, 1, q, k)
        return x.reshape(b, self.num_kv_heads, self.group, q, k)

    # -- dense [.., T, S] operands (dense masks, dense biases) ------------------------------------

    def pad_dense(self, x: Array, shape4: tuple[int, ...], fill) -> Array:
        """Reshape to 4D, pad the T and S dims (where not broadcast) to whole tiles."""
        x = x.reshape(shape4)
        t_pad = self.q_pad - shape4[2] if shape4[2] != 1 else 0
        s_pad = self.kv_pad - shape4[3] if shape4[3] != 1 else 0
        return jnp.pad(x, ((0, 0), (0, 0), (0, t_pad), (0, s_pad)), constant_values=fill)

    def dense_window(self, shape4, i, j):
        starts = (0, 0, i * self.qb if shape4[2] != 1 else 0, j * self.kb if shape4[3] != 1 else 0)
        # one int type: under jax_enable_x64 the Python zeros are int64, the loop's i and j int32
        starts = tuple(jnp.asarray(s, jnp.int32) for s in starts)
        sizes = (shape4[0], shape4[1], self.qb if shape4[2] != 1 else 1,
                 self.kb if shape4[3] != 1 else 1)
        return starts, sizes

    # -- per tile ---------------------------------------------------------------------------------

    def indices(self, i, j):
        """Tile (i, j)'s query and key indices in the total sequences."""
        q_idx = self.offsets[0] + i * self.qb + jnp.arange(self.qb, dtype=jnp.int32)
        kv_idx = self.offsets[1] + j * self.kb + jnp.arange(self.kb, dtype=jnp.int32)
        return q_idx, kv_idx

    def allowed(self, mask_args, i, j) -> Array:
        """bool [b, K or 1, G or 1, qb, kb] for tile (i, j), including the key-padding bound."""
        if self.mask_kind == "spec":
            mask = jax.tree.unflatten(self.mask_tree, mask_args)
            ok = mask.tile(self.offsets[0] + i * self.qb, self.offsets[1] + j * self.kb,
                           self.qb, self.kb, self.q_total, self.kv_total)
        elif self.mask_kind == "array":
            starts, sizes = self.dense_window(self.mask_shape, i, j)
            ok = lax.dynamic_slice(mask_args[0], starts, sizes)
        else:
            ok = jnp.ones((1, 1, 1, 1), bool)
        ok = self._heads(ok)
        if self.ragged_kv:
            ok = ok & (j * self.kb + jnp.arange(self.kb) < self.kv_len)
        return ok

    def bias_tile(self, bias_args, i, j) -> Array | None:
        """The bias of tile (i, j) as [b, N or 1, qb or 1, kb or 1] (its own dtype), or None."""
        if self.bias_kind == "array":
            starts, sizes = self.dense_window(self.bias_shape, i, j)
            return lax.dynamic_slice(bias_args[0], starts, sizes)
        if self.bias_kind == "fn":
            return self.bias_fn(*self.indices(i, j), *bias_args).reshape(self.bias_tile_shape)
        return None

    def logits(self, q_t, k_t, bias_args, i, j, slope: bool = False):
        """Scaled (soft-capped, biased) logits [B, K, G, qb, kb] in the accumulation dtype;
        with `slope`, (logits, d capped / d scaled logits: 1 - tanh^2, or None without a cap)."""
        s = jnp.einsum("bkgqh,bksh->bkgqs", q_t, k_t, preferred_element_type=self.acc)
        s = s * self.scale
        derivative = None
        if self.softcap:
            tanh = jnp.tanh(s / self.softcap)
            s, derivative = self.softcap * tanh, 1.0 - tanh * tanh
        bias = self.bias_tile(bias_args, i, j)
        if bias is not None:
            s = s + self._heads(bias.astype(self.acc))
        return (s, derivative) if slope else s

    def bias_grad_tile(self, bias_args, ds, i, j):
        """Cotangents for `bias_args` from tile (i, j)'s logits cotangent ds [B, K, G, qb, kb]."""
        ds_bnqk = ds.reshape(self.batch, self.num_heads, self.qb, self.kb)
        if self.bias_kind == "array":
            _, sizes = self.dense_window(self.bias_shape, i, j)
            return (_unbroadcast(ds_bnqk, sizes),)
        if self.bias_kind == "fn":
            q_idx, kv_idx = self.indices(i, j)
            shape = self.bias_tile_shape
            ct = _unbroadcast(jnp.broadcast_to(ds_bnqk, jnp.broadcast_shapes(
                ds_bnqk.shape, shape)), shape)
            _, vjp = jax.vjp(lambda *c: self.bias_fn(q_idx, kv_idx, *c).reshape(shape),
                             *bias_args)
            return tuple(vjp(ct.astype(self.bias_dtype)))
        return ()

    def bias_grad_add(self, acc_args, pieces, i, j):
        if self.bias_kind == "array":
            (buf,), (piece,) = acc_args, pieces
            starts, _ = self.dense_window(self.bias_shape, i, j)
            cur = lax.dynamic_slice(buf, starts, piece.shape)
            return (lax.dynamic_update_slice(buf, cur + piece.astype(buf.dtype), starts),)
        return tuple(a + p.astype(a.dtype) for a, p in zip(acc_args, pieces, strict=True))


# -----------------------------------------------------------------------------
# Forward and backward kernels


def _forward(t: _Tiles, q, k, v, mask_args, bias_args, sinks=None):
    """Returns out [B, T, N, H], logsumexp [nq, B, K, G, qb] and the number of tiles computed.

    The logsumexp of a query row with no allowed key is +inf (every recomputed probability is 0).
    `sinks` [N]: the running max starts at the row's sink logit and the running sum at 1 (its
    exp(sink - max)), so the sink joins the denominator once and the logsumexp includes it.
    """
    q_t, k_t, v_t = t.q_tiles(q), t.kv_tiles(k), t.kv_tiles(v)
    full_ids, full_n = t.plan.rows(FULL)
    part_ids, part_n = t.plan.rows(PARTIAL)
    B, K, G, qb, H = t.batch, t.num_kv_heads, t.group, t.qb, t.head_dim
    has_full, has_part = t.plan.count(FULL) > 0, t.plan.count(PARTIAL) > 0

    def q_step(count, xs):
        i, q_i, f_ids, f_n, p_ids, p_n = xs

        def update(state, j, ok):
            m, total, acc = state
            s = t.logits(q_i, k_t[j], bias_args, i, j)
            if ok is not None:
                s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing allowed yet
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            total = alpha * total + p.sum(-1)
            pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v_t[j],
                            preferred_element_type=t.acc)
            return m_new, total, alpha[..., None] * acc + pv

        def full_body(n, carry):
            state, count = carry
            return update(state, f_ids[n], None), count + 1

        def part_body(n, carry):
            state, count = carry
            j = p_ids[n]
            ok = t.allowed(mask_args, i, j)
            if not t.dynamic:  # static masks: the plan is exact, a PARTIAL tile is never empty
                return update(state, j, ok), count + 1
            return lax.cond(ok.any(), lambda s: (update(s, j, ok), count + 1),
                            lambda s: (s, count), state)

        state = (jnp.full((B, K, G, qb), -jnp.inf, t.acc), jnp.zeros((B, K, G, qb), t.acc),
                 jnp.zeros((B, K, G, qb, H), t.acc))
        if sinks is not None:
            state = (jnp.broadcast_to(_tile_sinks(t, sinks), (B, K, G, qb)),
                     jnp.ones((B, K, G, qb), t.acc), state[2])
        carry = (state, count)
        if has_full:
            carry = lax.fori_loop(0, f_n, full_body, carry)
        if has_part:
            carry = lax.fori_loop(0, p_n, part_body, carry)
        (m, total, acc), count = carry
        nonzero = total > 0
        l_safe = jnp.where(nonzero, total, 1.0)
        out = jnp.where(nonzero[..., None], acc / l_safe[..., None], 0.0)
        lse = jnp.where(nonzero, m + jnp.log(l_safe), jnp.inf)
        out = out.astype(t.out_dtype or q.dtype)  # [B, K, G, qb, H]
        return count, (out, lse)

    xs = (jnp.arange(t.nq, dtype=jnp.int32), q_t, full_ids, full_n, part_ids, part_n)
    count, (out_t, lse) = lax.scan(q_step, jnp.int32(0), xs)
    return t.q_untile(out_t), lse, count


def _backward(t: _Tiles, q, k, v, mask_args, bias_args, out, lse, d_out):
    """Returns dq, dk, dv, bias cotangents (a tuple matching bias_args) and the tile count."""
    q_t, k_t, v_t = t.q_tiles(q), t.kv_tiles(k), t.kv_tiles(v)
    do_t = t.q_tiles(d_out.astype(q.dtype))
    # delta_i = sum_h dO * O  (= sum_s P * dP), per query: [nq, B, K, G, qb]
    delta = jnp.sum(do_t.astype(t.acc) * t.q_tiles(out).astype(t.acc), -1)
    full_ids, full_n = t.plan.cols(FULL)
    part_ids, part_n = t.plan.cols(PARTIAL)
    has_full, has_part = t.plan.count(FULL) > 0, t.plan.count(PARTIAL) > 0
    B, K, H, kb = t.batch, t.num_kv_heads, t.head_dim, t.kb

    if t.bias_kind == "array":
        dbias0 = (jnp.zeros(bias_args[0].shape, t.acc),)
    else:
        dbias0 = tuple(jnp.zeros(c.shape, jnp.promote_types(c.dtype, jnp.float32))
                       for c in bias_args)

    def kv_step(carry, xs):
        dq_buf, dbias, count = carry
        j, k_j, v_j, f_ids, f_n, p_ids, p_n = xs

        def grads(i, ok):
            """Tile (i, j)'s contributions: dq_i, dk_j, dv_j, bias pieces."""
            q_i, do_i = q_t[i], do_t[i]
            s, capped = t.logits(q_i, k_j, bias_args, i, j, slope=True)
            if ok is not None:
                s = jnp.where(ok, s, -jnp.inf)
            p = jnp.exp(s - lse[i][..., None])  # [B, K, G, qb, kb]; 0 where masked
            dv = jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do_i.dtype), do_i,
                            preferred_element_type=t.acc)
            dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=t.acc)
            ds = p * (dp - delta[i][..., None])  # d loss / d logits (the bias's cotangent)
            ds_qk = ds if capped is None else ds * capped  # through the soft-cap's tanh
            dq = jnp.einsum("bkgqs,bksh->bkgqh", ds_qk.astype(k_j.dtype), k_j,
                            preferred_element_type=t.acc) * t.scale
            dk = jnp.einsum("bkgqs,bkgqh->bksh", ds_qk.astype(q_i.dtype), q_i,
                            preferred_element_type=t.acc) * t.scale
            return dq, dk, dv, t.bias_grad_tile(bias_args, ds, i, j)

        def accumulate(inner, i, pieces, computed=1):
            (dk, dv, dq_buf, dbias, count), (dq_i, dk_i, dv_i, db_i) = inner, pieces
            dq_buf = dq_buf.at[i].add(dq_i)
            dbias = t.bias_grad_add(dbias, db_i, i, j)
            return dk + dk_i, dv + dv_i, dq_buf, dbias, count + computed

        def full_body(n, inner):
            i = f_ids[n]
            return accumulate(inner, i, grads(i, None))

        def part_body(n, inner):
            i = p_ids[n]
            ok = t.allowed(mask_args, i, j)
            if not t.dynamic:
                return accumulate(inner, i, grads(i, ok))
            # The cond returns tile-sized pieces (zeros when skipped), not the big buffers.
            any_ok = ok.any()
            shapes = jax.eval_shape(lambda: grads(i, ok))
            pieces = lax.cond(any_ok, lambda: grads(i, ok),
                              lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
            return accumulate(inner, i, pieces, any_ok.astype(jnp.int32))

        zeros = jnp.zeros((B, K, kb, H), t.acc)
        inner = (zeros, zeros, dq_buf, dbias, count)
        if has_full:
            inner = lax.fori_loop(0, f_n, full_body, inner)
        if has_part:
            inner = lax.fori_loop(0, p_n, part_body, inner)
        dk, dv, dq_buf, dbias, count = inner
        return (dq_buf, dbias, count), (dk.astype(t.out_dtype or k.dtype),
                                         dv.astype(t.out_dtype or v.dtype))

    dq0 = jnp.zeros(q_t.shape, t.acc)
    xs = (jnp.arange(t.nk, dtype=jnp.int32), k_t, v_t, full_ids, full_n, part_ids, part_n)
    (dq_buf, dbias, count), (dk_t, dv_t) = lax.scan(kv_step, (dq0, dbias0, jnp.int32(0)), xs)
    dq = t.q_untile(dq_buf).astype(t.out_dtype or q.dtype)
    dk, dv = t.kv_untile(dk_t), t.kv_untile(dv_t)
    return dq, dk, dv, dbias, count


def _tile_sinks(t: _Tiles, sinks: Array) -> Array:
    """Sink logits [N] -> [K, G, 1] in the accumulation dtype (rows of a [.., K, G, qb] tile)."""
    return sinks.astype(t.acc).reshape(t.num_kv_heads, t.group, 1)


def _sinks_grad(t: _Tiles, sinks, out, lse, d_out) -> Array:
    """d loss / d sinks [N]: the sink's probability exp(sink - lse) times (0 - dO . O), summed
    over every query row of each head (padded rows have dO = 0)."""
    delta = jnp.sum(t.q_tiles(d_out).astype(t.acc) * t.q_tiles(out).astype(t.acc), -1)
    grad = -jnp.exp(_tile_sinks(t, sinks) - lse) * delta  # [nq, B, K, G, qb]
    return grad.sum((0, 1, 4)).reshape(t.num_heads).astype(sinks.dtype)


# -----------------------------------------------------------------------------
# Public entry point


def check_qkv(query, key, value) -> None:
    """One-line errors unless query is [B, T, N, H] and key == value [B, S, K, H], K | N."""
    batch, _, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"query {query.shape}, key {key.shape}, value {value.shape}: expected query "
            "[B, T, N, H] and key == value shape [B, S, K, H]"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads: expected a multiple of {num_kv_heads} kv heads")


def _prepare(query, key, value, mask, bias, scale, q_chunk, kv_chunk, totals=None,
             softcap=0.0):
    check_qkv(query, key, value)
    q_len, kv_len = query.shape[1], key.shape[1]
    if mask is not None and not isinstance(mask, Mask):
        mask = as_dense(mask, q_len, kv_len)  # validates: bool, 4D
    t = _Tiles(query.shape, key.shape, query.dtype, mask, bias, scale, q_chunk, kv_chunk,
               totals, softcap)

    if t.mask_kind == "spec":
        mask_args = tuple(jnp.asarray(x) for x in jax.tree.leaves(mask))
    elif t.mask_kind == "array":
        mask_args = (t.pad_dense(mask, t.mask_shape, False),)
    else:
        mask_args = ()

    if t.bias_kind == "array":
        bias_args = (t.pad_dense(jnp.asarray(bias), t.bias_shape, 0),)
    elif t.bias_kind == "fn":
        leaves, tree = jax.tree.flatten(bias)
        if all(isinstance(x, jax.Array | np.ndarray) for x in leaves):
            # A pytree of arrays (positions.AlibiBiasFn, T5BiasFn): every leaf is an argument.
            # (closure_convert would keep integer tracers inside the function it caches, which
            # escape when the backward pass is traced apart from the forward, as in shard_map.)
            t.bias_fn = lambda q_idx, kv_idx, *args: jax.tree.unflatten(tree, args)(q_idx,
                                                                                   kv_idx)
            bias_args = tuple(leaves)
        else:
            example = (jnp.zeros((t.qb,), jnp.int32), jnp.zeros((t.kb,), jnp.int32))
            t.bias_fn, consts = jax.closure_convert(bias, *example)
            bias_args = tuple(consts)
    else:
        bias_args = ()
    return t, mask_args, bias_args


def chunked_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Mask | Array | None = None,
    bias: Array | Callable[[Array, Array], Array] | None = None,
    *,
    scale: float | None = None,
    q_chunk: int = 512,
    kv_chunk: int = 512,
    totals: tuple[int, int] | None = None,
    offsets: tuple[Array, Array] | None = None,
    softcap: float = 0.0,
    sinks: Array | None = None,
) -> Array:
    """softmax(Q K^T * scale + bias) V, computed tile by tile in O(T + S) memory.

    Args:
      query: [B, T, N, H]; key, value: [B, S, K, H] with N divisible by K (GQA / MQA).
      mask: a `masks.Mask` (evaluated per tile; its static block map skips empty tiles), a
        boolean array broadcastable to [B, N, T, S] (sliced per tile), or None.
      bias: None, a float array broadcastable to [B, N, T, S], or a callable
        `bias(q_idx [Q] int32, kv_idx [K] int32) -> broadcastable to [B, N, Q, K]` evaluated per
        tile (see the module docstring). Both forms are differentiable.
      scale: logit scale, default 1 / sqrt(H).
      q_chunk, kv_chunk: tile sizes (clipped to T and S). Lengths need not be multiples.
      totals, offsets: the queries and keys are the blocks starting at `offsets` (ints, may be
        traced) of sequences of lengths `totals` (sequence parallelism): the mask and the bias
        function see indices in the whole sequences. Dense mask / bias arrays are refused.
      softcap: > 0 caps the scaled logits at softcap * tanh(logits / softcap) before the bias
        and the mask (Gemma 2); 0 leaves them.
      sinks: [N] sink logits, one per query head, in each row's softmax denominator with no
        value (see `dot_product_attention`); differentiable.

    Same result as `dense_attention.dot_product_attention(query, key, value, mask, bias,
    scale=scale)` (no dropout, no weights output): float32 logits / softmax statistics for
    lower-precision inputs, masked keys get zero weight, a query row with no allowed key returns
    zeros and zero (finite) gradients. Gradients flow to query, key, value and the bias.
    """
    t, mask_args, bias_args = _prepare(query, key, value, mask, bias, scale, q_chunk, kv_chunk,
                                       totals, softcap)
    if (totals is None) != (offsets is None):
        raise ValueError(f"totals={totals}, offsets={offsets}: expected both or neither")
    offsets = tuple(jnp.asarray(o, jnp.int32) for o in offsets or (0, 0))
    at = lambda offsets: t.at(*offsets) if t.blocked else t

    @jax.custom_vjp
    def attend(q, k, v, mask_args, bias_args, offsets, sinks):
        return _forward(at(offsets), q, k, v, mask_args, bias_args, sinks)[0]

    def attend_fwd(q, k, v, mask_args, bias_args, offsets, sinks):
        out, lse, _ = _forward(at(offsets), q, k, v, mask_args, bias_args, sinks)
        return out, (q, k, v, mask_args, bias_args, offsets, sinks, out, lse)

    def attend_bwd(res, d_out):
        q, k, v, mask_args, bias_args, offsets, sinks, out, lse = res
        dq, dk, dv, dbias, _ = _backward(at(offsets), q, k, v, mask_args, bias_args, out, lse,
                                         d_out)
        d_mask = tuple(None for _ in mask_args)
        if t.bias_kind == "array":
            dbias = (dbias[0].astype(bias_args[0].dtype),)
        else:
            dbias = tuple(d.astype(c.dtype) for d, c in zip(dbias, bias_args, strict=True))
        d_sinks = None if sinks is None else _sinks_grad(t, sinks, out, lse, d_out)
        return dq, dk, dv, d_mask, dbias, (None, None), d_sinks

    attend.defvjp(attend_fwd, attend_bwd)
    # A dense bias was padded (jnp.pad) outside `attend`, so its cotangent flows back through
    # the pad to the caller's unpadded array.
    return attend(query, key, value, mask_args, bias_args, offsets, sinks)


def chunked_attention_stats(query, key, value, mask=None, bias=None, *, scale=None,
                            q_chunk=512, kv_chunk=512) -> dict[str, Any]:
    """Diagnostics: the tile plan and how many tiles the forward and backward actually computed
    (run-time counts; for per-example masks they include the `lax.cond` skips)."""
    t, mask_args, bias_args = _prepare(query, key, value, mask, bias, scale, q_chunk, kv_chunk)
    out, lse, fwd_count = _forward(t, query, key, value, mask_args, bias_args)
    *_, bwd_count = _backward(t, query, key, value, mask_args, bias_args, out, lse,
                              jnp.ones_like(out))
    return {"plan": t.plan, "total_tiles": t.nq * t.nk, "planned_tiles": t.plan.count(),
            "forward_tiles": fwd_count, "backward_tiles": bwd_count}


__all__ = ["TilePlan", "chunked_attention", "chunked_attention_stats", "plan_tiles"]
