"""Attention masks as values.

A mask is a small frozen dataclass holding a predicate `allowed(query index, key index)` plus any
per-example arrays (prefix lengths, valid lengths, segment ids). From that one definition come
  * `dense(q_len, kv_len)`: the boolean [B, 1, q_len, kv_len] reference array,
  * `tile(...)`: the same predicate on one (q block, kv block) tile, for blocked kernels,
  * `block_map(...)`: a static EMPTY / PARTIAL / FULL map of tiles, so kernels can skip work.
Masks combine with `&` and `|`. True means "may attend".

Alignment: when q_len != kv_len the queries are the *last* q_len positions of the key sequence
(bottom-right), so query i sits at position i + (kv_len - q_len). That is what KV-cache decoding
needs: a single new query sees every cached key. (`jax.nn.dot_product_attention(is_causal=True)`
aligns top-left instead.)
"""

from __future__ import annotations

import functools
import operator
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Tile classes of `block_map`, ordered so that `&` is elementwise min and `|` is elementwise max.
EMPTY, PARTIAL, FULL = 0, 1, 2


def show(mask: Mask | jax.Array, q_len: int = 5, kv_len: int = 5, batch: int = 0) -> str:
    """Renders one example of a mask as a grid of 1 (attend) and 0 (masked), queries as rows."""
    grid = mask.dense(q_len, kv_len) if isinstance(mask, Mask) else mask
    grid = np.asarray(grid)
    grid = grid[min(batch, grid.shape[0] - 1), 0]
    return "\n".join(" ".join(str(int(v)) for v in row) for row in grid)


def _grid(q_idx, kv_idx):
    """Index arrays [Q] and [K] -> broadcastable [1, 1, Q, 1] and [1, 1, 1, K]."""
    return q_idx[None, None, :, None], kv_idx[None, None, None, :]


def _per_example(values) -> jax.Array:
    """[B] per-example scalars -> [B, 1, 1, 1] so they broadcast against index grids."""
    return jnp.asarray(values)[:, None, None, None]


class Mask:
    """Base class. Subclasses implement `_allowed(q_idx, kv_idx, q_len, kv_len)`.

    `q_idx` [Q] and `kv_idx` [K] are integer indices into the query and key sequences; the result
    is a boolean array broadcastable to [B, 1, Q, K]. A mask is *static* when the predicate depends
    on indices alone (no per-example arrays); static masks can be evaluated in NumPy at trace
    time, which is what `block_map` does.
    """

    is_static: ClassVar[bool] = True

    def _allowed(self, q_idx, kv_idx, q_len: int, kv_len: int):
        raise NotImplementedError

    @property
    def batch_size(self) -> int:
        """Leading batch size of the per-example arrays (1 for static masks)."""
        return 1

    def dense(self, q_len: int, kv_len: int) -> jax.Array:
        """The reference boolean mask, shape [B, 1, q_len, kv_len] (B = 1 for static masks)."""
        return self.tile(0, 0, q_len, kv_len, q_len, kv_len)

    def tile(self, q_start, kv_start, q_block: int, kv_block: int, q_len: int, kv_len: int):
        """The mask of one tile: queries q_start..q_start+q_block, keys kv_start..+kv_block.

        `q_start` and `kv_start` may be traced (e.g. a loop index inside a kernel); block sizes
        and full lengths are static. Returns bool [B, 1, q_block, kv_block].
        """
        allowed = self._tile(q_start, kv_start, q_block, kv_block, q_len, kv_len)
        return jnp.broadcast_to(jnp.asarray(allowed, dtype=bool),
                                (self.batch_size, 1, q_block, kv_block))

    def _tile(self, q_start, kv_start, q_block: int, kv_block: int, q_len: int, kv_len: int):
        """`_allowed` over one tile's index ranges, broadcastable to [B, 1, q_block, kv_block]. A
        mask whose per-example arrays can be sliced there, rather than gathered, overrides it."""
        q_idx = q_start + jnp.arange(q_block, dtype=jnp.int32)
        kv_idx = kv_start + jnp.arange(kv_block, dtype=jnp.int32)
        return self._allowed(q_idx, kv_idx, q_len, kv_len)

    def block_map(self, q_len: int, kv_len: int, q_block: int, kv_block: int) -> np.ndarray:
        """Static tile classes [ceil(q_len/q_block), ceil(kv_len/kv_block)]: EMPTY/PARTIAL/FULL.

        Exact for static masks; per-example masks are conservatively PARTIAL wherever they
        could be either. Out-of-range rows/columns of ragged edge tiles are ignored.
        """
        if not self.is_static:
            return np.full(_num_tiles(q_len, kv_len, q_block, kv_block), PARTIAL, np.int8)
        return _classify_static(self, q_len, kv_len, q_block, kv_block)

    def __and__(self, other: Mask) -> Mask:
        return And(_flatten(And, (self, other)))

    def __or__(self, other: Mask) -> Mask:
        return Or(_flatten(Or, (self, other)))


def _num_tiles(q_len, kv_len, q_block, kv_block):
    return (-(-q_len // q_block), -(-kv_len // kv_block))


def _classify_static(mask: Mask, q_len, kv_len, q_block, kv_block) -> np.ndarray:
    nq, nk = _num_tiles(q_len, kv_len, q_block, kv_block)
    kv_idx = np.arange(kv_len)
    tile_of_key = kv_idx // kv_block
    out = np.empty((nq, nk), np.int8)
    for i in range(nq):  # one block row of the dense mask at a time: O(q_block * kv_len) memory
        q_idx = np.arange(i * q_block, min((i + 1) * q_block, q_len))
        rows = np.broadcast_to(mask._allowed(q_idx, kv_idx, q_len, kv_len), (1, 1, len(q_idx),
                                                                           kv_len))[0, 0]
        count = np.bincount(tile_of_key, weights=rows.sum(0), minlength=nk)
        size = len(q_idx) * np.bincount(tile_of_key, minlength=nk)
        out[i] = np.where(count == 0, EMPTY, np.where(count == size, FULL, PARTIAL))
    return out


def _flatten(kind, parts):
    flat = []
    for part in parts:
        if not isinstance(part, Mask):
            raise TypeError(f"can only combine Mask objects, got {type(part).__name__}")
        flat.extend(part.parts if isinstance(part, kind) else (part,))
    return tuple(flat)


@struct.dataclass
class And(Mask):
    """Attend where every part allows (built by `a & b`)."""

    parts: tuple[Mask, ...]

    @property
    def is_static(self) -> bool:
        return all(p.is_static for p in self.parts)

    @property
    def batch_size(self) -> int:
        return max(p.batch_size for p in self.parts)

    def _allowed(self, *indices):
        return functools.reduce(operator.and_, (part._allowed(*indices) for part in self.parts))

    def _tile(self, *tile):
        return functools.reduce(operator.and_, (part._tile(*tile) for part in self.parts))

    def block_map(self, q_len, kv_len, q_block, kv_block):
        return _combine_maps(self, And, np.minimum, FULL, q_len, kv_len, q_block, kv_block)


@struct.dataclass
class Or(Mask):
    """Attend where any part allows (built by `a | b`)."""

    parts: tuple[Mask, ...]

    @property
    def is_static(self) -> bool:
        return all(p.is_static for p in self.parts)

    @property
    def batch_size(self) -> int:
        return max(p.batch_size for p in self.parts)

    def _allowed(self, *indices):
        return functools.reduce(operator.or_, (part._allowed(*indices) for part in self.parts))

    def _tile(self, *tile):
        return functools.reduce(operator.or_, (part._tile(*tile) for part in self.parts))

    def block_map(self, q_len, kv_len, q_block, kv_block):
        return _combine_maps(self, Or, np.maximum, EMPTY, q_len, kv_len, q_block, kv_block)


def _combine_maps(mask, kind, reduce, identity, q_len, kv_len, q_block, kv_block):
    """Static parts are classified exactly as one predicate; dynamic parts are reduced in."""
    static = [p for p in mask.parts if p.is_static]
    dynamic = [p for p in mask.parts if not p.is_static]
    shape = _num_tiles(q_len, kv_len, q_block, kv_block)
    result = np.full(shape, identity, np.int8)
    if static:
        result = _classify_static(kind(tuple(static)), q_len, kv_len, q_block, kv_block)
    for part in dynamic:
        result = reduce(result, part.block_map(q_len, kv_len, q_block, kv_block))
    return result


@struct.dataclass
class Full(Mask):
    """Bidirectional (encoder) attention: every query sees every key.

    >>> print(show(Full()))
    1 1 1 1 1
    1 1 1 1 1
    1 1 1 1 1
    1 1 1 1 1
    1 1 1 1 1
    """

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        q, k = _grid(q_idx, kv_idx)
        return (q >= 0) | (k >= 0)


@struct.dataclass
class Causal(Mask):
    """Decoder attention: the query at position t sees keys 0..t (bottom-right aligned).

    >>> print(show(Causal()))
    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0
    1 1 1 1 0
    1 1 1 1 1

    With fewer queries than keys (decoding with a cache) the last query sees every key:

    >>> print(show(Causal(), q_len=2, kv_len=5))
    1 1 1 1 0
    1 1 1 1 1
    """

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        q, k = _grid(q_idx, kv_idx)
        return k <= q + (kv_len - q_len)


@struct.dataclass
class SlidingWindow(Mask):
    """Local attention: query t sees keys t-left..t+right (`left=None`: unbounded to the left).

    `SlidingWindow(left=2)` is local causal attention over the last three positions:

    >>> print(show(SlidingWindow(left=2)))
    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0
    0 1 1 1 0
    0 0 1 1 1

    `SlidingWindow(left=1, right=1)` is a bidirectional band:

    >>> print(show(SlidingWindow(left=1, right=1)))
    1 1 0 0 0
    1 1 1 0 0
    0 1 1 1 0
    0 0 1 1 1
    0 0 0 1 1
    """

    left: int | None = struct.field(pytree_node=False, default=None)
    right: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self):
        if self.left is not None and (not isinstance(self.left, int) or self.left < 0):
            raise ValueError(f"SlidingWindow left={self.left!r}: expected an int >= 0 or None")
        if not isinstance(self.right, int) or self.right < 0:
            raise ValueError(f"SlidingWindow right={self.right!r}: expected an int >= 0")

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        q, k = _grid(q_idx, kv_idx)
        offset = k - (q + (kv_len - q_len))  # key position relative to the query's position
        allowed = offset <= self.right
        if self.left is not None:
            allowed = allowed & (offset >= -self.left)
        return allowed


@struct.dataclass
class ChunkedCausal(Mask):
    """Causal attention within fixed chunks of `chunk_size` positions (no attention across chunks).

    >>> print(show(ChunkedCausal(chunk_size=2)))
    1 0 0 0 0
    1 1 0 0 0
    0 0 1 0 0
    0 0 1 1 0
    0 0 0 0 1
    """

    chunk_size: int = struct.field(pytree_node=False, default=1)

    def __post_init__(self):
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"ChunkedCausal chunk_size={self.chunk_size!r}: expected an int >= 1")

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        q, k = _grid(q_idx, kv_idx)
        q_pos = q + (kv_len - q_len)
        return (k <= q_pos) & (q_pos // self.chunk_size == k // self.chunk_size)


@struct.dataclass
class PrefixLM(Mask):
    """Prefix LM: bidirectional over each example's first `prefix_lengths[b]` keys, causal after.

    >>> print(show(PrefixLM(prefix_lengths=jnp.array([3]))))
    1 1 1 0 0
    1 1 1 0 0
    1 1 1 0 0
    1 1 1 1 0
    1 1 1 1 1
    """

    prefix_lengths: jax.Array  # [B] int

    is_static: ClassVar[bool] = False

    @property
    def batch_size(self) -> int:
        return self.prefix_lengths.shape[0]

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        q, k = _grid(q_idx, kv_idx)
        causal = k <= q + (kv_len - q_len)
        return causal | (k < _per_example(self.prefix_lengths))

    def block_map(self, q_len, kv_len, q_block, kv_block):
        # Everything causal allows is allowed; anything else may be, depending on the prefix.
        causal = Causal().block_map(q_len, kv_len, q_block, kv_block)
        return np.maximum(causal, PARTIAL).astype(np.int8)


@struct.dataclass
class Padding(Mask):
    """Right padding: queries past `q_lengths[b]` and keys past `kv_lengths[b]` are masked.

    Either length may be None (that side is unpadded). On its own this is the whole
    cross-attention mask (decoder queries over encoder keys). Example with 3 valid keys and 4
    valid queries; a fully masked query row yields a zero output in attention:

    >>> print(show(Padding(q_lengths=jnp.array([4]), kv_lengths=jnp.array([3]))))
    1 1 1 0 0
    1 1 1 0 0
    1 1 1 0 0
    1 1 1 0 0
    0 0 0 0 0
    """

    q_lengths: jax.Array | None = None  # [B] int
    kv_lengths: jax.Array | None = None  # [B] int

    is_static: ClassVar[bool] = False

    def __post_init__(self):
        if self.q_lengths is None and self.kv_lengths is None:
            raise ValueError("Padding(q_lengths=None, kv_lengths=None): give at least one")

    @property
    def batch_size(self) -> int:
        return max(x.shape[0] for x in (self.q_lengths, self.kv_lengths) if x is not None)

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        q, k = _grid(q_idx, kv_idx)
        allowed = (q >= 0) & (k >= 0)
        if self.q_lengths is not None:
            allowed = allowed & (q < _per_example(self.q_lengths))
        if self.kv_lengths is not None:
            allowed = allowed & (k < _per_example(self.kv_lengths))
        return allowed


@struct.dataclass
class Segment(Mask):
    """Packed sequences: attend only within the same segment id; id 0 marks padding.

    `kv_segment_ids` defaults to the query ids (self-attention). Combine with `Causal()` for a
    packed decoder. Two documents [1 1 1 2 2] packed in one row:

    >>> ids = jnp.array([[1, 1, 1, 2, 2]])
    >>> print(show(Segment(ids) & Causal()))
    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0
    0 0 0 1 0
    0 0 0 1 1
    """

    q_segment_ids: jax.Array  # [B, Q] int
    kv_segment_ids: jax.Array | None = None  # [B, K] int

    is_static: ClassVar[bool] = False

    @property
    def batch_size(self) -> int:
        return self.q_segment_ids.shape[0]

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        return _same_segment(jnp.take(self.q_segment_ids, q_idx, axis=1, mode="clip"),
                             jnp.take(self._kv_ids, kv_idx, axis=1, mode="clip"))

    def _tile(self, q_start, kv_start, q_block, kv_block, q_len, kv_len):
        # a tile's ids are a slice: XLA does not turn `_allowed`'s gather of iota indices into
        # one, and on CPU each fusion reading the gathered ids then transposes them per element
        # (the attention core of a GPT 6/6/384 step: 18.3 -> 15.7 ms fwd+bwd a layer)
        return _same_segment(_span(self.q_segment_ids, q_start, q_block),
                             _span(self._kv_ids, kv_start, kv_block))

    @property
    def _kv_ids(self) -> jax.Array:
        return self.q_segment_ids if self.kv_segment_ids is None else self.kv_segment_ids


def _same_segment(q_ids_BQ: jax.Array, kv_ids_BK: jax.Array) -> jax.Array:
    """[B, 1, Q, K]: query and key in the same segment, and the query not padding (id 0)."""
    q_ids, kv_ids = q_ids_BQ[:, None, :, None], kv_ids_BK[:, None, None, :]
    return (q_ids == kv_ids) & (q_ids != 0)


def _span(ids: jax.Array, start, size: int) -> jax.Array:
    """ids[:, start:start + size] for a static or traced `start`; positions past the end read the
    last id, as `jnp.take(..., mode="clip")` does."""
    if isinstance(start, int) and start + size <= ids.shape[1]:
        return ids[:, start:start + size]
    padded = jnp.pad(ids, ((0, 0), (0, size)), mode="edge")
    return jax.lax.dynamic_slice_in_dim(padded, start, size, axis=1)


@struct.dataclass
class Permuted(Mask):
    """`mask` on a reordered sequence: row / column i of this mask is query `q_order[i]` / key
    `kv_order[i]` of `mask` (`kv_order` defaults to `q_order`). Sequence parallelism lays the
    sequence out zig-zag so that every device gets the same share of a causal mask's work; the
    mask is still evaluated at the original positions, so packed segments, prefixes and windows
    stay exact. `mask`'s per-example arrays (segment ids, ...) stay in the original order.

    Causal attention over 4 positions laid out as 0 3 1 2 (row i is the query at `order[i]`):

    >>> print(show(Permuted(Causal(), jnp.array([0, 3, 1, 2])), 4, 4))
    1 0 0 0
    1 1 1 1
    1 0 1 0
    1 0 1 1
    """

    mask: Mask
    q_order: jax.Array  # [Q] int: original query index of each row
    kv_order: jax.Array | None = None  # [K] int: original key index of each column
    # n > 0: q_order is `sequence_parallel.zigzag(length, n)`, known at trace time even where
    # q_order is traced (splash under the sequence axis builds its mask from it)
    zigzag_shards: int = struct.field(pytree_node=False, default=0)

    is_static: ClassVar[bool] = False

    @property
    def batch_size(self) -> int:
        return self.mask.batch_size

    def _allowed(self, q_idx, kv_idx, q_len, kv_len):
        kv_order = self.q_order if self.kv_order is None else self.kv_order
        return self.mask._allowed(jnp.take(self.q_order, q_idx, mode="clip"),
                                  jnp.take(kv_order, kv_idx, mode="clip"), q_len, kv_len)


def as_dense(mask: Mask | jax.Array | None, q_len: int, kv_len: int) -> jax.Array | None:
    """A Mask, a boolean array broadcastable to [B, N, q_len, kv_len], or None -> dense or None."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        return mask.dense(q_len, kv_len)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_ or mask.ndim != 4:
        raise ValueError(
            f"mask of dtype {mask.dtype} and shape {mask.shape}: expected a Mask or a boolean "
            f"array broadcastable to [batch, heads, {q_len}, {kv_len}]"
        )
    return mask


__all__ = [
    "EMPTY", "PARTIAL", "FULL", "Mask", "And", "Or", "Full", "Causal", "SlidingWindow",
    "ChunkedCausal", "PrefixLM", "Padding", "Permuted", "Segment", "as_dense", "show",
]
