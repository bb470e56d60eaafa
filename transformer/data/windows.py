"""A split's tokens and the rows the pipeline reads from them.

A split's documents are laid end to end in one token sequence (`Corpus`) and read as windows of
the row length (`Windows`): in training each epoch shuffles the documents, shifts the windows by
a seeded offset and visits them in a seeded order, so every token is read once per epoch
whatever the document lengths (but up to about two strides at the sequence's ends, other ones
each epoch: `Windows`); an evaluation pass reads every token exactly once. prefix_lm
reads one document chunk per row instead (`Chunks`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


class Windows:
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


class Chunks:
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


def tokenize_documents(documents, tokenizer, *, stream: bool = False,
                       start: Sequence[int] = ()) -> Corpus:
    """Documents -> a `Corpus` of their tokens, each document ending with <eos> and beginning
    with the ids `start` (e.g. an imported checkpoint's BOS, `inputs.document_start`)."""
    eos = np.array([tokenizer.require("eos", "(or sep) to end each document")], np.int32)
    start = np.asarray(start, np.int32)
    return Corpus.from_documents(
        [np.concatenate([start, np.asarray(ids, np.int32), eos])
         for ids in tokenizer.encode_batch([d.text for d in documents])], stream=stream)
