"""Grain input pipelines: documents -> one token sequence -> windows -> objective features ->
global batches.

A split's documents are laid end to end (`windows.Corpus`) and read as windows of the row
length (`windows.Windows`), each epoch in a new seeded order; the rows become the objective's
features (`features`). Global batch b holds samples b * B .. b * B + B - 1, so the batches
depend only on the data, the batch size and the seed: each process computes just its rows
(`global_batches.process_rows`), and the iterator's state (Grain's `get_state`) is one batch index
that resumes on any number of processes. The objectives that need randomness (MLM, span
corruption, prefix split) run here on the host CPU, each row keyed by its sample index, so a
restored iterator draws the same noise again. A weighted mixture of sources
(`mixture.Mixture`) gives each source its own windows and says which source each sample reads.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grain
import jax
import ml_collections
import numpy as np
from grain import experimental as grain_experimental

from transformer.data import features, mixture, windows
from transformer.models import FAMILIES
from transformer.nn import objectives

OBJECTIVES = ("next_token", "prefix_lm", "mlm", "span_corruption")
TASK_OBJECTIVES = ("classification", "text2text")  # labeled tasks: transformer.data.tasks
IMAGE_OBJECTIVES = ("image_classification", "contrastive", "captioning")  # data.images
CHAT_OBJECTIVES = ("sft",)  # supervised fine-tuning on chat JSONL: transformer.data.chat


def check_span_sentinels(data: ml_collections.ConfigDict, seq_len: int,
                         name: str = "seq_len", tokenizer=None) -> None:
    """One line unless span corruption of `seq_len` tokens (`name`: the setting that gives it)
    makes at most data.num_sentinels noise spans a row, and at most `tokenizer`'s sentinels if
    given (a prepared directory's or a workdir's keeps its own count): each span gets its own
    sentinel, and span i's past the count would be a real token's id."""
    _check_sentinels(data.num_sentinels, f"data.num_sentinels={data.num_sentinels}", seq_len,
                     name, data.noise_density, data.mean_span_length, "data.num_sentinels >=")
    if tokenizer is not None:
        _check_tokenizer_sentinels(tokenizer, seq_len, name, data.noise_density,
                                   data.mean_span_length)


def _check_tokenizer_sentinels(tokenizer, seq_len, name, noise_density, mean_span_length):
    _check_sentinels(tokenizer.num_sentinels, f"the tokenizer has {tokenizer.num_sentinels} "
                     "sentinels", seq_len, name, noise_density, mean_span_length,
                     "a tokenizer with sentinels (data.num_sentinels, or a T5 tokenizer's "
                     "<extra_id_i>) >=")


def _check_sentinels(count: int, what: str, seq_len: int, name: str, noise_density: float,
                     mean_span_length: float, expected: str) -> None:
    spans = objectives.span_corruption_spans(seq_len, noise_density, mean_span_length)
    if spans > count:
        raise ValueError(f"{what}: span corruption of {name}={seq_len} makes {spans} noise "
                         f"spans a row (data.noise_density={noise_density}, "
                         f"data.mean_span_length={mean_span_length}), each its own sentinel: "
                         f"expected {expected} {spans}, or a smaller {name} or noise_density")


def objective_for(config: ml_collections.ConfigDict) -> str:
    """`data.objective`, or the model family's pretraining objective when it is empty."""
    family = FAMILIES.get(config.model.family)
    objective = config.data.get("objective") or (family and family.objective)
    known = OBJECTIVES + TASK_OBJECTIVES + IMAGE_OBJECTIVES + CHAT_OBJECTIVES
    if objective not in known:
        raise ValueError(f"data.objective={objective!r}: expected one of {known}")
    return objective


class _GlobalBatches(grain.MapDataset):
    """Item b: this process's `rows` of global batch b, converted into the objective's
    features. Global batch b holds samples b * B .. b * B + B - 1 (row r is sample b * B + r),
    so a batch depends only on the data, B and the seed, never on the processes, and the
    iterator's state is one batch index that any number of processes can resume from.

    With `noise_base` (a raw threefry key) `convert` also gets one noise key per row: the base
    folded in with the row's sample index, so a row's noise depends on nothing else either.
    """

    def __init__(self, source, convert, *, batch_size: int, rows: list[int],
                 num_batches: int, noise_base: np.ndarray | None):
        super().__init__()
        self._source, self._convert = source, convert
        self._batch_size, self._rows = batch_size, np.asarray(rows, np.int64)
        self._length, self._noise_base = num_batches, noise_base

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        return f"GlobalBatches(batch_size={self._batch_size}, rows={len(self._rows)})"

    def __getitem__(self, b):
        if isinstance(b, slice):
            return self.slice(b)
        samples = int(b) * self._batch_size + self._rows
        rows = [self._source.row(int(i)) for i in samples]
        batch = {k: np.stack([row[k] for row in rows]) for k in rows[0]}
        valid = batch.get("tokens_segment_ids", batch["tokens"]).any(axis=1)
        if self._noise_base is None:
            out = self._convert(batch)
        else:
            out = self._convert(batch, features.sample_keys(self._noise_base, samples))
        out["weights"] = out["weights"] * valid[:, None]  # padding rows count 0
        return out


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
    corpus: windows.Corpus | Sequence[np.ndarray] | Sequence[windows.Corpus],
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
    weights: Sequence[float] | None = None,
) -> grain.IterDataset:
    """A Grain dataset of this process's rows of the global batches of objective features.

    `corpus` is a `windows.Corpus` or a list of int32 token arrays, one per document (EOS already
    appended). `batch_size` is the *global* batch B. The rows are windows through the split's
    token sequence (`Windows`; prefix_lm: document chunks, `Chunks`): next_token reads
    seq_len + 1 tokens every seq_len (so each token is a target once), mlm seq_len, and span
    corruption the raw length its targets need, every width.

    `num_epochs=None` trains: an endless stream of batches, every epoch in a new order.
    `num_epochs=1` evaluates: every token of the split exactly once, the last batch padded with
    rows of weight 0; `len()` of the underlying pass is ceil(windows / B). With `shuffle` (the
    default) the windows come in a fixed seeded order, so the first batches of a pass are a
    sample of the split; without, in order.

    A local batch stacks global rows `rows` (in that order); by default the contiguous block
    range(p * B // P, (p + 1) * B // P) of process p of P (`process_index` / `process_count`,
    default JAX's). The same seed gives the same batches; the iterator state (Grain's
    `get_state`) is the next batch index, the same on every process.

    With `weights` (training only), `corpus` is a list of `windows.Corpus`, one per source of a
    weighted mixture: each source gets its own rows (windows or chunks, its own epochs) and
    `mixture.Mixture(weights, seed)` says which source each global sample reads.
    """
    _check_arguments(objective, seq_len, num_epochs, tokenizer, noise_density, mean_span_length)
    if rows is None:
        rows = _process_block(batch_size, process_index, process_count)
    rows = _check_rows(rows, batch_size)
    training = num_epochs is None
    if weights is not None and not training:
        raise ValueError("weights: a mixture is for training (num_epochs=None); evaluate each "
                         "source's split on its own")
    corpora = list(corpus) if weights is not None else [corpus]
    if weights is not None and len(corpora) != len(weights):
        raise ValueError(f"weights={list(weights)}: expected one per corpus ({len(corpora)})")
    corpora = [c if isinstance(c, windows.Corpus) else windows.Corpus.from_documents(list(c))
               for c in corpora]
    per_corpus = [_rows_of(c, objective, seq_len, seed, training, shuffle, noise_density,
                           mean_span_length,
                           f"source {i} of the mixture" if weights is not None else "the split")
                  for i, c in enumerate(corpora)]
    source = per_corpus[0] if weights is None else \
        mixture.MixedRows(per_corpus, mixture.Mixture(weights, seed))
    convert = features.keyed_converter(objective, tokenizer=tokenizer, mlm_rate=mlm_rate,
                                       noise_density=noise_density,
                                       mean_span_length=mean_span_length)
    noise_base = None if objective == "next_token" else \
        np.random.SeedSequence((seed % 2**64, 1)).generate_state(2).astype(np.uint32)
    num_batches = sys.maxsize if training else -(-source.rows // batch_size)
    batches = _GlobalBatches(source, convert, batch_size=batch_size, rows=rows,
                             num_batches=num_batches, noise_base=noise_base)
    dataset = batches.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if prefetch:
        dataset = grain_experimental.ThreadPrefetchIterDataset(dataset,
                                                               prefetch_buffer_size=prefetch)
    return dataset


def _check_arguments(objective, seq_len, num_epochs, tokenizer, noise_density,
                     mean_span_length) -> None:
    """`make_dataset`'s one-line errors; span corruption's spans need the sentinels of the
    tokenizer read (a prepared directory's or a workdir's keeps its own count)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: expected one of {OBJECTIVES}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2")
    if num_epochs not in (None, 1):
        raise ValueError(f"num_epochs={num_epochs!r}: expected None (training) or 1 (a pass)")
    if objective == "span_corruption":
        _check_tokenizer_sentinels(tokenizer, seq_len, "seq_len", noise_density,
                                   mean_span_length)


def _process_block(batch_size: int, process_index: int | None,
                   process_count: int | None) -> range:
    """make_dataset's default rows: process p of P reads global rows [p B / P, (p + 1) B / P)."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if batch_size % process_count:
        raise ValueError(f"batch_size={batch_size}: expected a multiple of the process "
                         f"count {process_count}")
    return range(process_index * batch_size // process_count,
                 (process_index + 1) * batch_size // process_count)


def _rows_of(corpus: windows.Corpus, objective: str, seq_len: int, seed: int, training: bool,
             shuffle: bool, noise_density: float, mean_span_length: float, which: str):
    """make_dataset's rows of one corpus (`which`, for the error): document chunks for
    prefix_lm, else windows as wide as the objective reads (next_token: seq_len + 1 every
    seq_len)."""
    if objective == "prefix_lm":
        rows = windows.Chunks(corpus, width=seq_len + 1, seed=seed, training=training,
                              shuffle=shuffle)
    else:
        width = (objectives.span_corruption_lengths(seq_len, noise_density, mean_span_length)[0]
                 if objective == "span_corruption" else
                 seq_len + 1 if objective == "next_token" else seq_len)
        rows = windows.Windows(corpus, width=width,
                               stride=seq_len if objective == "next_token" else width, seed=seed,
                               training=training, shuffle=shuffle,
                               full_only=objective == "span_corruption")
    if rows.rows == 0:
        raise ValueError(f"{which} has {len(corpus)} tokens, too few for one row of "
                         f"seq_len={seq_len}: expected more text or a smaller seq_len")
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
