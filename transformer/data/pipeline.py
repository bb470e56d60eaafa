"""Grain input pipelines: documents -> one token sequence -> windows -> objective features ->
global batches.

A split's documents are laid end to end (`Corpus`) and read as windows of the row length
(`_Windows`): in training each epoch shuffles the documents, shifts the windows by a seeded
offset and visits them in a seeded order, so every token is read once per epoch whatever the
document lengths; an evaluation pass reads every token exactly once. Global batch b holds
samples b * B .. b * B + B - 1, so the batches depend only on the data, the batch size and the
seed: each process computes just its rows, and the iterator's state (Grain's `get_state`) is
one batch index that resumes on any number of processes. The objectives that need randomness
(MLM, span corruption, prefix split) run here on the host CPU, each row keyed by its sample
index, so a restored iterator draws the same noise again. A weighted mixture of sources
(`Mixture`) gives each source its own windows and says which source each sample reads.
"""

from __future__ import annotations

import fractions
import functools
import math
import sys
from collections.abc import Sequence

import grain
import jax
import ml_collections
import numpy as np
from grain import experimental as grain_experimental

from transformer.models import FAMILIES
from transformer.nn import objectives

OBJECTIVES = ("next_token", "prefix_lm", "mlm", "span_corruption")
TASK_OBJECTIVES = ("classification", "text2text")  # labeled tasks: transformer.data.tasks
IMAGE_OBJECTIVES = ("image_classification", "contrastive", "captioning")  # data.images
CHAT_OBJECTIVES = ("sft",)  # supervised fine-tuning on chat JSONL: transformer.data.chat


def objective_for(config: ml_collections.ConfigDict) -> str:
    """`data.objective`, or the model family's pretraining objective when it is empty."""
    family = FAMILIES.get(config.model.family)
    objective = config.data.get("objective") or (family and family.objective)
    known = OBJECTIVES + TASK_OBJECTIVES + IMAGE_OBJECTIVES + CHAT_OBJECTIVES
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


@functools.partial(jax.jit, static_argnames=("vocab_size", "mask_id", "special_ids", "rate"))
def _mlm(keys, tokens, *, vocab_size, mask_id, special_ids, rate):
    return _per_row_keys(objectives.mlm_corrupt)(
        keys, tokens, vocab_size=vocab_size, mask_id=mask_id, special_ids=special_ids, rate=rate)


@functools.partial(jax.jit, static_argnames=("vocab_size", "eos_id", "start_id", "noise_density",
                                             "mean_span_length"))
def _span(keys, tokens, *, vocab_size, eos_id, start_id, noise_density, mean_span_length):
    inputs, targets = _per_row_keys(objectives.span_corrupt)(
        keys, tokens, vocab_size=vocab_size, eos_id=eos_id,
        noise_density=noise_density, mean_span_length=mean_span_length)
    start = jax.numpy.full_like(targets[:, :1], start_id)
    return inputs, jax.numpy.concatenate([start, targets[:, :-1]], axis=1), targets


@jax.jit
def _prefix_split(keys, segments):
    # The split only needs to know which slots hold tokens: it reads the segment ids as "tokens"
    # with pad_id 0, so no token id (a pretrained vocabulary's id 0 is a real token) is padding.
    return _per_row_keys(objectives.prefix_lm_split)(keys, segments, pad_id=0)


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
            mask_id=tokenizer.require("mask", "for data.objective='mlm'"),
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
            keys, batch["tokens"], vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
            start_id=tokenizer.decoder_start_id, noise_density=noise_density,
            mean_span_length=mean_span_length)
    return {"encoder_inputs": np.asarray(enc), "decoder_inputs": np.asarray(dec),
            "targets": np.asarray(targets), "weights": np.ones(targets.shape, np.float32)}


def prefix_lm_features(batch, rng):
    """One document chunk per row (T + 1 tokens, right-padded; `tokens_segment_ids` 1 on the
    chunk, 0 on padding) -> prefix-LM features.

    A split point p is drawn per row (`objectives.prefix_lm_split`): attention is bidirectional
    over the first p inputs and the loss covers only what follows (position p - 1 predicts the
    first continuation token). Row [a b c d e <eos> 0 0 0] (segment ids [1 1 1 1 1 1 0 0 0])
    with p = 2:

        inputs       a  b  c  d  e  E  0  0       prefix_lengths  2
        targets      b  c  d  e  E  0  0  0
        weights      0  1  1  1  1  0  0  0
        segment_ids  1  1  1  1  1  1  0  0
    """
    return _prefix_lm_features(batch, _row_keys(rng, len(batch["tokens"])))


def _prefix_lm_features(batch, keys):
    tokens, row_segments = batch["tokens"], batch["tokens_segment_ids"]
    with jax.default_device(_cpu()):
        prefix_lengths, weights = _prefix_split(keys, row_segments)
    segments = row_segments[:, :-1]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.asarray(weights),
            "prefix_lengths": np.asarray(prefix_lengths), "segment_ids": segments,
            "positions": np.broadcast_to(np.arange(tokens.shape[1] - 1, dtype=np.int32),
                                         segments.shape).copy()}


# --- the pipeline ---------------------------------------------------------------------------


class Corpus:
    """One split's tokens: its documents laid end to end in one token sequence.

    `tokens` is an int32 array or anything with `len()` and `read(start, stop)` (e.g.
    `shards.TokenShards`, memory-mapped); document d is tokens[doc_starts[d]:doc_starts[d + 1]]
    (the last runs to the end). `stream=True` reads it as one continuous text: windows cross
    document ends without masking and the order is never shuffled (nanoGPT's train.bin).

    >>> corpus = Corpus.from_documents([np.array([5, 6, 2]), np.array([7, 2])])
    >>> len(corpus), corpus.doc_starts.tolist(), corpus.read(1, 4).tolist()
    (5, [0, 3], [6, 2, 7])
    """

    def __init__(self, tokens, doc_starts=None, *, stream: bool = False):
        self.tokens = tokens
        n = len(tokens)
        starts = np.zeros(1, np.int64) if doc_starts is None else \
            np.asarray(doc_starts, np.int64)
        if n and (len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0)
                  or starts[-1] >= n):
            raise ValueError("doc_starts: expected ascending offsets starting at 0, each "
                             f"inside the {n} tokens")
        self.doc_starts, self.stream = starts, stream
        self.doc_lengths = np.diff(np.append(starts, n))

    @classmethod
    def from_documents(cls, documents: Sequence[np.ndarray], *, stream: bool = False) -> Corpus:
        lengths = [len(d) for d in documents]
        tokens = np.concatenate([np.asarray(d, np.int32) for d in documents]) if documents \
            else np.zeros(0, np.int32)
        starts = np.cumsum([0] + lengths[:-1], dtype=np.int64)
        keep = np.asarray(lengths) > 0  # empty documents have no place in the sequence
        return cls(tokens, starts[keep] if len(starts) else None, stream=stream)

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        if isinstance(self.tokens, np.ndarray):
            return self.tokens[start:stop]
        return self.tokens.read(start, stop)


class _Windows:
    """The rows of one split: windows of `width` tokens every `stride` tokens through the
    split's token sequence, as global sample indices 0, 1, 2, ... (epoch after epoch).

    Training (`training=True`): each epoch lays the documents end to end in a new seeded order
    (a stream keeps its order), starts the windows at a new seeded offset in [0, stride), and
    visits them in a new seeded order; every epoch has the same number of windows, so sample i
    is window perm_e[i % R] of epoch e = i // R. Every token is read once per epoch (except up
    to about 2 * stride tokens the offset leaves out at the ends), whatever the document lengths.
    Evaluation (`training=False`): offset 0, documents in order, every token exactly once, the
    last window padded; still a fixed seeded window order, so a prefix of the pass is a sample.

    With `pack`, a window's pieces of different documents get their own segment ids (1, 2, ...)
    and positions from 0; a stream's window is one segment with positions 0..width-1.
    """

    def __init__(self, corpus: Corpus, *, width: int, stride: int, seed: int, training: bool,
                 shuffle: bool, full_only: bool = False):
        self.corpus, self.width, self.stride = corpus, width, stride
        self.seed, self.training, self.shuffle = seed, training, shuffle
        n, overlap = len(corpus), width - stride
        if training:
            self.max_offset = stride if n >= width + stride else 1  # tiny splits: offset 0
            self.rows = (n - width - (self.max_offset - 1)) // stride + 1 if n >= width else 0
        elif full_only:  # a partial window would be padded: drop it (span corruption)
            self.rows = (n - width) // stride + 1 if n >= width else 0
        else:
            self.rows = -(-(n - overlap) // stride) if n > overlap else 0
        self._epochs: dict[int, tuple] = {}

    def _epoch(self, epoch: int):
        """(document order, their ends in it, window offset, window order) of an epoch."""
        if epoch not in self._epochs:
            rng = np.random.default_rng((self.seed, epoch))
            docs = len(self.corpus.doc_lengths)
            order = rng.permutation(docs) if self.training and self.shuffle and \
                not self.corpus.stream else np.arange(docs)
            ends = np.cumsum(self.corpus.doc_lengths[order])
            offset = int(rng.integers(self.max_offset)) if self.training and self.shuffle else 0
            windows = rng.permutation(self.rows) if self.shuffle else np.arange(self.rows)
            if len(self._epochs) >= 2:  # consecutive samples touch at most two epochs
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (order, ends, offset, windows)
        return self._epochs[epoch]

    def row(self, i: int) -> dict[str, np.ndarray]:
        """Sample i: {"tokens", "tokens_segment_ids", "tokens_positions"}, each [width]; past
        the end of an evaluation pass, a row of padding (segment 0)."""
        tokens = np.zeros(self.width, np.int32)
        segments = np.zeros(self.width, np.int32)
        positions = np.zeros(self.width, np.int32)
        if self.rows == 0 or (not self.training and i >= self.rows):
            return {"tokens": tokens, "tokens_segment_ids": segments,
                    "tokens_positions": positions}
        epoch, k = divmod(i, self.rows)
        order, ends, offset, windows = self._epoch(epoch)
        start = offset + int(windows[k]) * self.stride
        stop = min(start + self.width, len(self.corpus))
        if self.corpus.stream:
            tokens[:stop - start] = self.corpus.read(start, stop)
            segments[:stop - start] = 1
            positions[:stop - start] = np.arange(stop - start)
        else:
            j, at, segment = int(np.searchsorted(ends, start, side="right")), start, 1
            while at < stop:
                doc = int(order[j])
                doc_begin = int(ends[j]) - int(self.corpus.doc_lengths[doc])
                piece_end = min(int(ends[j]), stop)
                source = int(self.corpus.doc_starts[doc]) + at - doc_begin
                out = slice(at - start, piece_end - start)
                tokens[out] = self.corpus.read(source, source + piece_end - at)
                segments[out] = segment
                positions[out] = np.arange(piece_end - at)
                at, j, segment = piece_end, j + 1, segment + 1
        return {"tokens": tokens, "tokens_segment_ids": segments, "tokens_positions": positions}


class _Chunks:
    """prefix_lm's rows: one document chunk of at most `width` tokens each (documents cut into
    pieces of `width`; a stream into consecutive pieces), right-padded, in a seeded order per
    epoch. Every token is in exactly one chunk."""

    def __init__(self, corpus: Corpus, *, width: int, seed: int, training: bool,
                 shuffle: bool):
        self.corpus, self.width, self.seed = corpus, width, seed
        self.training, self.shuffle = training, shuffle
        if corpus.stream:
            starts = np.arange(0, len(corpus), width, dtype=np.int64)
            lengths = np.minimum(width, len(corpus) - starts)
        else:
            pieces = -(-corpus.doc_lengths // width)
            doc = np.repeat(np.arange(len(pieces)), pieces)
            index = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            starts = corpus.doc_starts[doc] + index * width
            lengths = np.minimum(width, corpus.doc_starts[doc] + corpus.doc_lengths[doc]
                                 - starts)
        self.starts, self.lengths, self.rows = starts, lengths, len(starts)
        self._order: tuple[int, np.ndarray] = (-1, np.arange(0))

    def row(self, i: int) -> dict[str, np.ndarray]:
        tokens = np.zeros(self.width, np.int32)
        segments = np.zeros(self.width, np.int32)  # 1 on the chunk's tokens, 0 on padding
        if self.rows and (self.training or i < self.rows):
            epoch, k = divmod(i, self.rows)
            if self._order[0] != epoch:
                rng = np.random.default_rng((self.seed, epoch))
                self._order = (epoch, rng.permutation(self.rows) if self.shuffle
                               else np.arange(self.rows))
            chunk = int(self._order[1][k])
            start, length = int(self.starts[chunk]), int(self.lengths[chunk])
            tokens[:length] = self.corpus.read(start, start + length)
            segments[:length] = 1
        return {"tokens": tokens, "tokens_segment_ids": segments}


class Mixture:
    """Which source each training sample of a weighted mixture comes from: a deterministic
    schedule with random access (sample i's source needs no scan of samples 0..i-1).

    The samples are cut into blocks of K = ceil(1 / smallest normalized weight). Source s's
    samples before block b, C_s(b), are the largest-remainder apportionment of the b * K
    samples by the weights (ties go to the source whose turn it is, a rotation by b), so
    |C_s(b) - w_s * b * K| < 1 at every block boundary: the mixture meets its weights to within
    one sample per source, however long it runs. Block b holds C_s(b + 1) - C_s(b) samples of
    each source (w_s * K rounded down or up, give or take one) in a seeded order; the k-th of
    source s's slots in block b is that source's own sample C_s(b) + k. Each source thus reads
    its own rows 0, 1, 2, ... (its own epochs) at its own rate. Weights (0.6, 0.25, 0.15) give
    K = 7; the first blocks (one row each, A/B/C = sources 0/1/2, slots in seeded order):

        block 0   B A C A A B A      C(1) = 4 2 1    (quotas  4.2  1.75 1.05)
        block 1   C B A A A A B      C(2) = 8 4 2    (quotas  8.4  3.5  2.1)
        block 2   B A A C A A A      C(3) = 13 5 3   (quotas 12.6  5.25 3.15)

    >>> mixture = Mixture((0.6, 0.25, 0.15), seed=0)
    >>> mixture.block, mixture.counts(7).tolist(), mixture.counts(70).tolist()
    (7, [4, 2, 1], [42, 18, 10])
    """

    def __init__(self, weights: Sequence[float], seed: int):
        weights = [fractions.Fraction(w).limit_denominator(2**20) for w in weights]
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"weights={[float(w) for w in weights]}: expected at least one "
                             "weight, each > 0")
        # Integer weights m_s (exact arithmetic: float quotas drift on long runs).
        denominator = math.lcm(*(w.denominator for w in weights))
        self._m = [int(w * denominator) for w in weights]
        self._total = sum(self._m)
        # K * w_s >= 1 for every s keeps C_s(b) non-decreasing (no source loses a sample).
        self.block = -(-self._total // min(self._m))
        if self.block > 2**20:
            raise ValueError(f"weights={[float(w) for w in weights]}: the smallest is "
                             f"{min(self._m) / self._total:.2e} of the total: expected at "
                             "least 2**-20")
        self.weights = np.array(self._m) / self._total
        self.seed = seed
        self._cached: tuple[int, np.ndarray, np.ndarray] = (-1, np.zeros(0), np.zeros(0))

    def _before(self, b: int) -> np.ndarray:
        """C(b): each source's samples in blocks 0..b-1 (largest remainder over b * K)."""
        n = b * self.block
        quotas = [divmod(m * n, self._total) for m in self._m]  # Python ints: exact
        counts = np.array([whole for whole, _ in quotas], np.int64)
        left = n - int(counts.sum())  # in [0, S): the seats the remainders share
        sources = len(self._m)
        ranked = sorted(range(sources), key=lambda s: (-quotas[s][1], (s - b) % sources))
        counts[ranked[:left]] += 1
        return counts

    def _layout(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's slots: (source [K], that source's own sample index [K])."""
        if self._cached[0] != b:
            first = self._before(b)
            per_source = self._before(b + 1) - first
            rng = np.random.default_rng((self.seed, _MIXTURE_STREAM, b))
            source = rng.permutation(np.repeat(np.arange(len(first)), per_source))
            local = np.empty(self.block, np.int64)
            for s in range(len(first)):
                slots = np.flatnonzero(source == s)
                local[slots] = first[s] + np.arange(len(slots))
            self._cached = (b, source, local)
        return self._cached[1], self._cached[2]

    def locate(self, i: int) -> tuple[int, int]:
        """Global sample i -> (its source, that source's own sample index)."""
        b, j = divmod(int(i), self.block)
        source, local = self._layout(b)
        return int(source[j]), int(local[j])

    def counts(self, n: int) -> np.ndarray:
        """Each source's samples among global samples 0..n-1: [S] int64, in closed form."""
        b, j = divmod(int(n), self.block)
        counts = self._before(b)
        if j:
            counts += np.bincount(self._layout(b)[0][:j], minlength=len(counts))
        return counts


_MIXTURE_STREAM = 0x6D6978  # "mix": keeps the block orders' seeds apart from the epochs'


class _Mixed:
    """A mixture's rows: sample i is row `Mixture.locate(i)` of that source's rows."""

    def __init__(self, sources: Sequence, mixture: Mixture):
        self.sources, self.mixture = list(sources), mixture
        self.rows = min(source.rows for source in self.sources)

    def row(self, i: int) -> dict[str, np.ndarray]:
        source, local = self.mixture.locate(i)
        return self.sources[source].row(local)


@jax.jit
def _sample_keys(base, indices):
    """Raw threefry key data [2] -> one key per global sample index: [n, 2]."""
    key = jax.random.wrap_key_data(base, impl="threefry2x32")
    return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(indices)


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
            features = self._convert(batch)
        else:
            with jax.default_device(_cpu()):
                keys = np.asarray(_sample_keys(self._noise_base,
                                               samples.astype(np.uint32)))
            features = self._convert(batch, keys)
        features["weights"] = features["weights"] * valid[:, None]  # padding rows count 0
        return features


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
    corpus: Corpus | Sequence[np.ndarray] | Sequence[Corpus],
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

    `corpus` is a `Corpus` or a list of int32 token arrays, one per document (EOS already
    appended). `batch_size` is the *global* batch B. The rows are windows through the split's
    token sequence (`_Windows`; prefix_lm: document chunks, `_Chunks`): next_token reads
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

    With `weights` (training only), `corpus` is a list of `Corpus`, one per source of a
    weighted mixture: each source gets its own rows (windows or chunks, its own epochs) and
    `Mixture(weights, seed)` says which source each global sample reads.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: expected one of {OBJECTIVES}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2")
    if num_epochs not in (None, 1):
        raise ValueError(f"num_epochs={num_epochs!r}: expected None (training) or 1 (a pass)")
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
    corpora = [c if isinstance(c, Corpus) else Corpus.from_documents(list(c)) for c in corpora]
    per_corpus = [_rows_of(c, objective, seq_len, seed, training, shuffle, noise_density,
                           mean_span_length,
                           f"source {i} of the mixture" if weights is not None else "the split")
                  for i, c in enumerate(corpora)]
    source = per_corpus[0] if weights is None else _Mixed(per_corpus, Mixture(weights, seed))
    convert = {"next_token": next_token_features, "prefix_lm": _prefix_lm_features,
               "mlm": functools.partial(_mlm_features, tokenizer=tokenizer, rate=mlm_rate),
               "span_corruption": functools.partial(
                   _span_corruption_features, tokenizer=tokenizer,
                   noise_density=noise_density, mean_span_length=mean_span_length)}[objective]
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


def _rows_of(corpus: Corpus, objective: str, seq_len: int, seed: int, training: bool,
             shuffle: bool, noise_density: float, mean_span_length: float, which: str):
    """make_dataset's rows of one corpus (`which`, for the error): document chunks for
    prefix_lm, else windows as wide as the objective reads (next_token: seq_len + 1 every
    seq_len)."""
    if objective == "prefix_lm":
        rows = _Chunks(corpus, width=seq_len + 1, seed=seed, training=training, shuffle=shuffle)
    else:
        width = (objectives.span_corruption_lengths(seq_len, noise_density, mean_span_length)[0]
                 if objective == "span_corruption" else
                 seq_len + 1 if objective == "next_token" else seq_len)
        rows = _Windows(corpus, width=width, stride=seq_len if objective == "next_token" else
                        width, seed=seed, training=training, shuffle=shuffle,
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


def tokenize_documents(documents, tokenizer, *, stream: bool = False) -> Corpus:
    """Documents -> a `Corpus` of their tokens, each document ending with <eos>."""
    eos = np.array([tokenizer.require("eos", "(or sep) to end each document")], np.int32)
    return Corpus.from_documents(
        [np.concatenate([np.asarray(ids, np.int32), eos])
         for ids in tokenizer.encode_batch([d.text for d in documents])], stream=stream)


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
