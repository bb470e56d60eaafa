"""The static tile plan of `chunked_attention`: which (query tile, key tile) pairs it visits,
from the mask spec's `block_map`, and which of them need the mask evaluated."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from transformer.nn.masks import EMPTY, FULL, PARTIAL, Mask

Array = jax.Array



@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Which (query tile, key tile) pairs a kernel visits, and which of them need the mask.

    `classes` [num_q_tiles, num_kv_tiles] holds EMPTY / PARTIAL / FULL after the ragged last key
    tile (if any) has been demoted from FULL to PARTIAL (its padding keys must be masked).
    """

    q_block: int
    kv_block: int
    classes: np.ndarray

    @property
    def num_q_tiles(self) -> int:
        return self.classes.shape[0]

    @property
    def num_kv_tiles(self) -> int:
        return self.classes.shape[1]

    def count(self, kind: int | None = None) -> int:
        """Number of tiles of class `kind` (default: every tile a kernel computes)."""
        if kind is None:
            return int((self.classes != EMPTY).sum())
        return int((self.classes == kind).sum())

    def rows(self, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """Per query tile, the key tiles of class `kind`: ids [nq, max(1, widest)], counts [nq]."""
        return _index_lists(self.classes == kind)

    def cols(self, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """Per key tile, the query tiles of class `kind`: ids [nk, max(1, widest)], counts [nk]."""
        return _index_lists((self.classes == kind).T)


def _index_lists(selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    counts = selected.sum(1).astype(np.int32)
    ids = np.zeros((selected.shape[0], max(1, int(counts.max(initial=0)))), np.int32)
    for r, row in enumerate(selected):
        hits = np.flatnonzero(row)
        ids[r, : len(hits)] = hits
    return ids, counts


def plan_tiles(mask: Mask | Array | None, q_len: int, kv_len: int, q_block: int,
               kv_block: int) -> TilePlan:
    """The static tile plan of `chunked_attention` for a mask (spec, boolean array, or None)."""
    shape = (-(-q_len // q_block), -(-kv_len // kv_block))
    if mask is None:
        classes = np.full(shape, FULL, np.int8)
    elif isinstance(mask, Mask):
        classes = np.asarray(mask.block_map(q_len, kv_len, q_block, kv_block), np.int8)
        if classes.shape != shape:
            raise ValueError(f"block_map shape {classes.shape}, expected {shape}")
    else:  # a dense boolean array: values unknown at trace time
        classes = np.full(shape, PARTIAL, np.int8)
    classes = classes.copy()
    if kv_len % kv_block:
        classes[:, -1] = np.minimum(classes[:, -1], PARTIAL)
    return TilePlan(q_block, kv_block, classes)
