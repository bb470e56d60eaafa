"""Global batches across processes: which rows of the global batch this process's devices
hold (`process_rows`, the `rows` its pipeline produces), and the global arrays assembled from
every process's rows (`make_global_batch`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np


def process_rows(sharding: jax.sharding.Sharding, batch_size: int) -> np.ndarray:
    """The sorted global rows of a [batch_size, ...] array laid out by `sharding` (batch on the
    leading axis) that this process's devices hold: the `rows` its pipeline should produce.

    A row replicated over several of this process's devices appears once.
    """
    ndim = max(1, len(getattr(sharding, "spec", ())))
    shape = (batch_size,) + (len(sharding.device_set),) * (ndim - 1)
    held = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        held.update(range(*index[0].indices(batch_size)))
    return np.array(sorted(held), dtype=np.int64)


def make_global_batch(local_batch: dict[str, np.ndarray], sharding, rows: Sequence[int], *,
                      batch_size: int) -> dict[str, jax.Array]:
    """Assembles each process's rows into global [batch_size, ...] arrays laid out by `sharding`.

    local_batch[k][i] is global row rows[i] (the `rows` the pipeline was built with, e.g.
    `process_rows(sharding, batch_size)`); each device gets the global rows its shard covers,
    which must all be among this process's rows.
    """
    rows = np.asarray(rows, dtype=np.int64)
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]

    def positions(index) -> np.ndarray:
        wanted = np.arange(*index[0].indices(batch_size))
        found = np.searchsorted(sorted_rows, wanted)
        present = found < len(sorted_rows)
        present[present] = sorted_rows[found[present]] == wanted[present]
        if not present.all():
            raise ValueError(f"the sharding puts global rows {wanted[~present].tolist()} on this "
                             f"process's devices, but it holds rows {rows.tolist()}")
        return order[found]

    def global_array(value: np.ndarray) -> jax.Array:
        value = np.asarray(value)
        if len(value) != len(rows):
            raise ValueError(f"a local batch of {len(value)} rows for {len(rows)} rows: expected "
                             f"one row per global row index")
        return jax.make_array_from_callback(
            (batch_size,) + value.shape[1:], sharding,
            lambda index: value[positions(index)][(slice(None),) + tuple(index[1:])])

    return {k: global_array(v) for k, v in local_batch.items()}
