"""Grain input pipelines: documents -> token ids -> packed rows -> objective features -> batches.

Each global batch row has its own stream of documents (row r reads documents r, r + B, ...),
so the global batches do not depend on the number of processes, and each process reads only
the documents of the rows it holds. The iterator state (Grain's `get_state`/`set_state`) is
what a checkpoint saves to resume at exactly the next batch. The objectives that need
randomness (MLM, span corruption, prefix split) run in the pipeline on the host CPU, each row
keyed by its stream and its position in the stream, so a row's noise does not depend on the
process either, and a restored iterator draws the same noise again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import grain
import jax
import ml_collections
import numpy as np
from grain import experimental as grain_experimental

from transformer import objectives
from transformer.data import tokenizers as tokenizers_lib
from transformer.models import FAMILIES

OBJECTIVES = ("next_token", "prefix_lm", "mlm", "span_corruption")
TASK_OBJECTIVES = ("classification", "text2text")  # labeled tasks: transformer.data.tasks
IMAGE_OBJECTIVES = ("image_classification", "contrastive", "captioning")  # data.images


def objective_for(config: ml_collections.ConfigDict) -> str:
    """`data.objective`, or the model family's pretraining objective when it is empty."""
    family = FAMILIES.get(config.model.family)
    objective = config.data.get("objective") or (family and family.objective)
    known = OBJECTIVES + TASK_OBJECTIVES + IMAGE_OBJECTIVES
    if objective not in known:
        raise ValueError(f"data.objective={objective!r}: expected one of {known}")
    return objective


# --- feature converters: packed numpy rows -> the named arrays the models read --------------


def next_token_features(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Packed rows of T + 1 tokens ([..., T + 1]) -> next-token features of length T.

    Position t predicts token t + 1 of the same document; predictions across a document
    boundary and on padding get weight 0. Two documents [a b c <eos>] [d e <eos>] packed into
    T + 1 = 9 slots (0 = padding):

        tokens       a  b  c  E  d  e  E  0  0
        segment_ids  1  1  1  1  2  2  2  0  0
        inputs       a  b  c  E  d  e  E  0        targets  b  c  E  d  e  E  0  0
        weights      1  1  1  0  1  1  0  0        positions 0 1  2  3  0  1  2  0

    >>> row = {"tokens": np.array([5, 6, 7, 2, 8, 9, 2, 0, 0]),
    ...        "tokens_segment_ids": np.array([1, 1, 1, 1, 2, 2, 2, 0, 0]),
    ...        "tokens_positions": np.array([0, 1, 2, 3, 0, 1, 2, 0, 0])}
    >>> features = next_token_features(row)
    >>> features["targets"].tolist(), features["weights"].tolist()
    ([6, 7, 2, 8, 9, 2, 0, 0], [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    """
    tokens, segments = row["tokens"], row["tokens_segment_ids"]  # [..., T + 1]
    same_document = (segments[..., 1:] == segments[..., :-1]) & (segments[..., 1:] != 0)
    return {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "weights": same_document.astype(np.float32),
        "segment_ids": segments[..., :-1],
        "positions": row["tokens_positions"][..., :-1],
    }


def _padded(tokens: np.ndarray, length: int) -> np.ndarray:
    return np.pad(tokens, (0, length - len(tokens)), constant_values=tokenizers_lib.PAD_ID)


# The randomized objectives are jitted once per shape and run on the host CPU device. Each row
# gets its own key (raw threefry key data: building JAX keys on the host costs more than
# corrupting a row): the converters below draw one per row from their NumPy `rng`, the pipeline
# derives one per stream and row (`_Batches`). The rows are corrupted independently under
# `vmap`, so a row's features do not depend on the rows batched with it: converting a batch
# equals converting each row (with a leading axis of 1) with its own key, e.g. each row in
# turn with the same `rng`.
@functools.cache
def _cpu():
    # This process's own CPU device: in a multi-process CPU run jax.devices("cpu") lists every
    # process's devices, and the first is process 0's.
    return jax.local_devices(backend="cpu")[0]


def _row_keys(rng: np.random.Generator, rows: int) -> np.ndarray:
    """One raw threefry key [2] uint32 per row drawn from `rng`: [rows, 2]."""
    return rng.integers(2**32, size=(rows, 2), dtype=np.uint32)


def _per_row_keys(corrupt):
    """corrupt(key, tokens [1, ...], **kw) -> arrays [1, ...], vmapped over keys [B, 2] and
    token rows [B, ...]. The keys are threefry whatever JAX's default PRNG: under vmap "rbg"
    would draw the whole batch's bits from the first key alone."""
    def batched(keys, tokens, **kwargs):
        def one(key, row):
            key = jax.random.wrap_key_data(key, impl="threefry2x32")
            out = corrupt(key, row[None], **kwargs)
            return jax.tree.map(lambda x: x[0], out)
        return jax.vmap(one)(keys, tokens)
    return batched


@functools.partial(jax.jit, static_argnames=("vocab_size", "special_ids", "rate"))
def _mlm(keys, tokens, *, vocab_size, special_ids, rate):
    return _per_row_keys(objectives.mlm_corrupt)(
        keys, tokens, vocab_size=vocab_size, mask_id=tokenizers_lib.MASK_ID,
        special_ids=special_ids, rate=rate)


@functools.partial(jax.jit, static_argnames=("vocab_size", "noise_density", "mean_span_length"))
def _span(keys, tokens, *, vocab_size, noise_density, mean_span_length):
    inputs, targets = _per_row_keys(objectives.span_corrupt)(
        keys, tokens, vocab_size=vocab_size, eos_id=tokenizers_lib.EOS_ID,
        noise_density=noise_density, mean_span_length=mean_span_length)
    bos = jax.numpy.full_like(targets[:, :1], tokenizers_lib.BOS_ID)
    return inputs, jax.numpy.concatenate([bos, targets[:, :-1]], axis=1), targets


@jax.jit
def _prefix_split(keys, tokens):
    return _per_row_keys(objectives.prefix_lm_split)(keys, tokens, pad_id=tokenizers_lib.PAD_ID)


def mlm_features(batch, rng, *, tokenizer, rate):
    """Packed rows of T tokens -> BERT MLM features (`objectives.mlm_corrupt`, 80/10/10).

    Two documents [a b <sep>] [c d e <sep>] packed into T = 8 (0 = padding); `rate` of the
    non-special tokens are selected; a selected `b` became <mask>, a selected `d` stayed:

        tokens       a  b  S  c  d  e  S  0     inputs   a  M  S  c  d  e  S  0
        segment_ids  1  1  1  2  2  2  2  0     targets  a  b  S  c  d  e  S  0
        positions    0  1  2  0  1  2  3  0     weights  0  1  0  0  1  0  0  0
    """
    return _mlm_features(batch, _row_keys(rng, len(batch["tokens"])), tokenizer=tokenizer,
                         rate=rate)


def _mlm_features(batch, keys, *, tokenizer, rate):
    with jax.default_device(_cpu()):
        inputs, targets, weights = _mlm(
            keys, batch["tokens"], vocab_size=tokenizer.vocab_size,
            special_ids=tuple(tokenizer.special_ids), rate=rate)
    return {"inputs": np.asarray(inputs), "targets": np.asarray(targets),
            "weights": np.asarray(weights), "segment_ids": batch["tokens_segment_ids"],
            "positions": batch["tokens_positions"]}


def span_corruption_features(batch, rng, *, tokenizer, noise_density, mean_span_length):
    """Full rows of raw length L -> T5 features (`objectives.span_corrupt`).

    The encoder reads the corrupted row; the decoder reads the targets shifted right behind
    <bos> (teacher forcing). For raw tokens [a b c d e f g] (L = 7, one span `c d`):

        encoder_inputs   a  b  X0 e  f  g  E          (X0 = <extra_id_0>, E = <eos>)
        decoder_inputs   B  X0 c  d                   (B = <bos>)
        targets          X0 c  d  E                   weights 1 1 1 1
    """
    return _span_corruption_features(batch, _row_keys(rng, len(batch["tokens"])),
                                     tokenizer=tokenizer, noise_density=noise_density,
                                     mean_span_length=mean_span_length)


def _span_corruption_features(batch, keys, *, tokenizer, noise_density, mean_span_length):
    with jax.default_device(_cpu()):
        enc, dec, targets = _span(
            keys, batch["tokens"], vocab_size=tokenizer.vocab_size,
            noise_density=noise_density, mean_span_length=mean_span_length)
    return {"encoder_inputs": np.asarray(enc), "decoder_inputs": np.asarray(dec),
            "targets": np.asarray(targets), "weights": np.ones(targets.shape, np.float32)}


def prefix_lm_features(batch, rng):
    """One document chunk per row (T + 1 tokens, right-padded) -> prefix-LM features.

    A split point p is drawn per row (`objectives.prefix_lm_split`): attention is bidirectional
    over the first p inputs and the loss covers only what follows (position p - 1 predicts the
    first continuation token). Row [a b c d e <eos> 0 0 0] with p = 2:

        inputs       a  b  c  d  e  E  0  0       prefix_lengths  2
        targets      b  c  d  e  E  0  0  0
        weights      0  1  1  1  1  0  0  0
        segment_ids  1  1  1  1  1  1  0  0
    """
    return _prefix_lm_features(batch, _row_keys(rng, len(batch["tokens"])))


def _prefix_lm_features(batch, keys):
    tokens = batch["tokens"]
    with jax.default_device(_cpu()):
        prefix_lengths, weights = _prefix_split(keys, tokens)
    segments = (tokens[:, :-1] != tokenizers_lib.PAD_ID).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.asarray(weights),
            "prefix_lengths": np.asarray(prefix_lengths), "segment_ids": segments,
            "positions": np.broadcast_to(np.arange(tokens.shape[1] - 1, dtype=np.int32),
                                         segments.shape).copy()}


# --- the pipeline ---------------------------------------------------------------------------


def _chunks(tokens: np.ndarray, length: int) -> list[np.ndarray]:
    """A document's tokens cut into pieces of at most `length` (longer documents are split)."""
    return [tokens[i:i + length] for i in range(0, len(tokens), length)]


def _stream_seeds(seed: int, row: int) -> tuple[int, np.ndarray]:
    """(shuffle seed, raw threefry noise key [2] uint32) of global batch row `row`'s stream,
    both derived from (seed, row)."""
    state = np.random.SeedSequence((seed % 2**64, row)).generate_state(3)
    return int(state[0]), state[1:].astype(np.uint32)


@jax.jit
def _fold_in(keys, index):
    """Raw threefry keys [B, 2] -> each folded in with `index`: the keys of a stream's row."""
    def one(key):
        key = jax.random.wrap_key_data(key, impl="threefry2x32")
        return jax.random.key_data(jax.random.fold_in(key, index))
    return jax.vmap(one)(keys)


class _Batches(grain.IterDataset):
    """The zipped streams -> local batches: each batch stacks the streams' next rows, then
    `convert`s them into the objective's features.

    With `stream_keys` (one raw threefry key per stream) `convert` also gets one noise key per
    row: the row's stream key folded in with the row's position in its stream (which is the
    batch index: every stream yields one row per batch). So a row's noise depends only on its
    stream and position, and, as the converters corrupt rows independently (`_per_row_keys`),
    converting the stacked rows equals converting each row in its stream on its own. The batch
    count is part of the iterator state, so a restored iterator draws the same noise again.
    """

    def __init__(self, parent: grain.IterDataset, convert, stream_keys: np.ndarray | None):
        super().__init__(parent)
        self._convert, self._stream_keys = convert, stream_keys

    def __iter__(self):
        return _BatchesIterator(self._parent.__iter__(), self._convert, self._stream_keys)


class _BatchesIterator(grain.DatasetIterator):
    def __init__(self, parent, convert, stream_keys):
        super().__init__(parent)
        self._convert, self._stream_keys = convert, stream_keys
        self._index = 0

    def __next__(self) -> dict[str, np.ndarray]:
        rows = next(self._parent)
        batch = {k: np.stack([row[k] for row in rows]) for k in rows[0]}
        if self._stream_keys is None:
            features = self._convert(batch)
        else:
            with jax.default_device(_cpu()):
                keys = np.asarray(_fold_in(self._stream_keys, np.uint32(self._index)))
            features = self._convert(batch, keys)
        self._index += 1
        return features

    def get_state(self):
        return {"parent": self._parent.get_state(), "batches": self._index}

    def set_state(self, state):
        self._parent.set_state(_tuple_slices(state["parent"]))
        self._index = state["batches"]


def _tuple_slices(state):
    """A copy of an iterator state with ConcatThenSplit's `remainder_slices` pairs as tuples.

    `grain.checkpoint` saves the state as JSON, which turns them into lists, and Grain's
    ConcatThenSplit tests "no remainder" as `slices != (-1, -1)`: a list [-1, -1] restored
    as-is makes the packer re-emit a finished document's tail. With a packer per batch row, some
    row is often at a document boundary when a checkpoint is taken.
    """
    if isinstance(state, dict):
        return {k: {f: tuple(v) for f, v in value.items()} if k == "remainder_slices"
                else _tuple_slices(value) for k, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_tuple_slices(value) for value in state)
    return state


def _check_rows(rows, batch_size: int) -> list[int]:
    rows = list(rows)
    if not rows:
        raise ValueError(f"rows={rows}: expected at least one global batch row")
    for row in rows:
        if isinstance(row, bool) or not isinstance(row, int | np.integer) \
                or not 0 <= row < batch_size:
            raise ValueError(f"rows contains {row!r}: expected ints in [0, {batch_size}) "
                             f"(global batch rows)")
    if len(set(rows)) != len(rows):
        duplicates = sorted({int(r) for r in rows if rows.count(r) > 1})
        raise ValueError(f"rows repeats {duplicates}: expected each global batch row once")
    return [int(r) for r in rows]


def make_dataset(
    token_source: Sequence[np.ndarray] | grain.MapDataset,
    *,
    objective: str,
    tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    num_epochs: int | None = None,
    shuffle: bool = True,
    rows: Sequence[int] | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    mlm_rate: float = 0.15,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
    prefetch: int = 2,
) -> grain.IterDataset:
    """A Grain dataset of this process's rows of the global batches of objective features.

    `token_source` holds one int32 token array per document (EOS already appended), e.g.
    `tokenize_documents(...)` or an ArrayRecord source. `batch_size` is the *global* batch B.
    Global batch row r is fed by its own stream: documents r, r + B, r + 2B, ... shuffled (each
    epoch anew) with a seed derived from (seed, r), packed into rows, and turned into features
    with noise seeded from (seed, r). So the global batches depend only on the data, B and the
    seed, never on how many processes read them; each process reads only its rows' documents.

    A local batch stacks the next row of each stream in `rows` (global row indices, in that
    order); by default the contiguous block range(p * B // P, (p + 1) * B // P) of process p of
    P (`process_index` / `process_count`, default JAX's). `num_epochs=None` repeats forever
    (training); with 1 (eval) the iteration ends when any of the `rows`' streams runs out (so
    processes may yield different numbers of batches: bound a multi-host pass by a step count).
    The same seed gives the same batches. The data needs at least `batch_size` documents.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: expected one of {OBJECTIVES}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2")
    if rows is None:
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
        if batch_size % process_count:
            raise ValueError(f"batch_size={batch_size}: expected a multiple of the process "
                             f"count {process_count}")
        rows = range(process_index * batch_size // process_count,
                     (process_index + 1) * batch_size // process_count)
    rows = _check_rows(rows, batch_size)

    docs = token_source if isinstance(token_source, grain.MapDataset) else \
        grain.MapDataset.source(token_source)
    if len(docs) < batch_size:
        raise ValueError(f"the data has {len(docs)} documents, fewer than batch_size="
                         f"{batch_size} (each batch row streams its own documents): use more, "
                         f"smaller documents (data.unit='paragraph') or a smaller batch_size")
    streams = [_stream(docs, row, objective=objective, seq_len=seq_len, batch_size=batch_size,
                       seed=seed, num_epochs=num_epochs, shuffle=shuffle,
                       noise_density=noise_density, mean_span_length=mean_span_length)
               for row in rows]
    if objective == "next_token":
        convert = next_token_features
    elif objective == "prefix_lm":
        convert = _prefix_lm_features
    elif objective == "mlm":
        convert = functools.partial(_mlm_features, tokenizer=tokenizer, rate=mlm_rate)
    else:
        convert = functools.partial(_span_corruption_features, tokenizer=tokenizer,
                                    noise_density=noise_density,
                                    mean_span_length=mean_span_length)
    stream_keys = None if objective == "next_token" else \
        np.stack([_stream_seeds(seed, row)[1] for row in rows])
    batches = _Batches(grain_experimental.ZipIterDataset(streams, strict=False), convert,
                       stream_keys)
    if prefetch:
        batches = grain_experimental.ThreadPrefetchIterDataset(batches,
                                                               prefetch_buffer_size=prefetch)
    return batches


def _stream(docs: grain.MapDataset, row: int, *, objective, seq_len, batch_size, seed,
            num_epochs, shuffle, noise_density, mean_span_length) -> grain.IterDataset:
    """Global batch row `row`'s packed rows: its documents, shuffled each epoch, packed."""
    shuffle_seed = _stream_seeds(seed, row)[0]
    docs = docs[row::batch_size]
    if shuffle:  # a new order each epoch
        docs = shuffle_each_epoch(docs, shuffle_seed)
    docs = docs.repeat(num_epochs)
    # Read in the calling thread: one reader thread pool (and read-ahead buffer) per stream
    # would be batch_size pools fighting over the GIL; the batches are prefetched as a whole.
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

    if objective == "prefix_lm":  # one (padded) document chunk per row: the prefix is per row
        rows = docs.to_iter_dataset(read)
        rows = grain_experimental.FlatMapIterDataset(rows, _ChunkTransform(seq_len + 1))
        rows = rows.map(lambda t: {"tokens": _padded(t, seq_len + 1)})
    else:
        if objective == "span_corruption":
            row_len = objectives.span_corruption_lengths(seq_len, noise_density,
                                                         mean_span_length)[0]
        else:
            row_len = seq_len + 1 if objective == "next_token" else seq_len
        rows = grain_experimental.ConcatThenSplitIterDataset(
            docs.map(lambda t: {"tokens": np.asarray(t, np.int32)}).to_iter_dataset(read),
            length_struct={"tokens": row_len})
        if objective == "span_corruption":  # T5 corrupts full rows only
            rows = rows.filter(lambda r: bool(r["tokens_segment_ids"][-1]))
    return rows


# Grain's shuffle permutes index by index (a Feistel network), which costs milliseconds per index
# on a stream of a few documents (~10 ms for 4); below this size a stream draws each epoch's
# permutation once instead.
_SMALL_STREAM = 1 << 16


def shuffle_each_epoch(dataset: grain.MapDataset, seed: int) -> grain.MapDataset:
    """`dataset` shuffled so that a following `.repeat()` gives every epoch its own order.
    (Shuffling *after* repeat would sample across epochs, some items twice before others
    once.)"""
    return dataset.shuffle(seed=seed) if len(dataset) >= _SMALL_STREAM else \
        _ShuffleEachEpoch(dataset, seed)


class _ShuffleEachEpoch(grain.MapDataset):
    """`parent.shuffle(seed)` for small datasets: under `.repeat()` each epoch gets its own
    permutation, drawn once per epoch with NumPy (seeded by (seed, epoch))."""

    def __init__(self, parent: grain.MapDataset, seed: int):
        super().__init__(parent)
        self._seed = seed
        self._length = len(parent)
        self._epoch_order = (-1, np.arange(0))

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        return f"ShuffleEachEpoch(seed={self._seed})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, index_in_epoch = divmod(index, self._length)
        cached_epoch, order = self._epoch_order
        if cached_epoch != epoch:
            order = np.random.default_rng((self._seed, epoch)).permutation(self._length)
            self._epoch_order = (epoch, order)
        return self._parent[int(order[index_in_epoch]) + epoch * self._length]


class _ChunkTransform(grain_experimental.FlatMapTransform):
    """Splits a document into rows of at most `length` tokens."""

    def __init__(self, length: int):
        self.length = length
        self.max_fan_out = 1 << 20

    def flat_map(self, tokens):
        return _chunks(np.asarray(tokens, np.int32), self.length)


def tokenize_documents(documents, tokenizer) -> grain.MapDataset:
    """Documents -> a lazy MapDataset of int32 token arrays, each ending with <eos>."""
    texts = [d.text for d in documents]
    eos = np.array([tokenizers_lib.EOS_ID], np.int32)
    return grain.MapDataset.source(texts).map(
        lambda text: np.concatenate([np.asarray(tokenizer.encode(text), np.int32), eos]))


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
