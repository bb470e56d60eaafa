"""Grain input pipelines: documents -> token ids -> packed rows -> objective features -> batches.

Each process reads only its shard of the documents; the iterator state (Grain's
`get_state`/`set_state`) is what a checkpoint saves to resume at exactly the next batch.
The objectives that need randomness (MLM, span corruption, prefix split) run in the pipeline on
the host CPU, seeded per batch by Grain so a restored iterator draws the same noise again.
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

OBJECTIVES = ("next_token", "prefix_lm", "mlm", "span_corruption")
FAMILY_OBJECTIVES = {"gpt": "next_token", "lstm": "next_token", "prefix_lm": "prefix_lm",
                     "bert": "mlm", "t5": "span_corruption"}


def objective_for(config: ml_collections.ConfigDict) -> str:
    """`data.objective`, or the model family's pretraining objective when it is empty."""
    objective = config.data.get("objective") or FAMILY_OBJECTIVES.get(config.model.family)
    if objective not in OBJECTIVES:
        raise ValueError(f"data.objective={objective!r}: expected one of {OBJECTIVES}")
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


# The randomized objectives are jitted once per shape and run on the host CPU device.
@functools.cache
def _cpu():
    return jax.devices("cpu")[0]


def _host_key(rng: np.random.Generator) -> jax.Array:
    return jax.device_put(jax.random.key(int(rng.integers(2**31))), _cpu())


@functools.partial(jax.jit, static_argnames=("vocab_size", "special_ids", "rate"))
def _mlm(key, tokens, *, vocab_size, special_ids, rate):
    return objectives.mlm_corrupt(key, tokens, vocab_size=vocab_size,
                                  mask_id=tokenizers_lib.MASK_ID, special_ids=special_ids,
                                  rate=rate)


@functools.partial(jax.jit, static_argnames=("vocab_size", "noise_density", "mean_span_length"))
def _span(key, tokens, *, vocab_size, noise_density, mean_span_length):
    inputs, targets = objectives.span_corrupt(
        key, tokens, vocab_size=vocab_size, eos_id=tokenizers_lib.EOS_ID,
        noise_density=noise_density, mean_span_length=mean_span_length)
    bos = jax.numpy.full_like(targets[:, :1], tokenizers_lib.BOS_ID)
    return inputs, jax.numpy.concatenate([bos, targets[:, :-1]], axis=1), targets


@jax.jit
def _prefix_split(key, tokens):
    return objectives.prefix_lm_split(key, tokens, pad_id=tokenizers_lib.PAD_ID)


def mlm_features(batch, rng, *, tokenizer, rate):
    """Packed rows of T tokens -> BERT MLM features (`objectives.mlm_corrupt`, 80/10/10).

    Two documents [a b <sep>] [c d e <sep>] packed into T = 8 (0 = padding); `rate` of the
    non-special tokens are selected; a selected `b` became <mask>, a selected `d` stayed:

        tokens       a  b  S  c  d  e  S  0     inputs   a  M  S  c  d  e  S  0
        segment_ids  1  1  1  2  2  2  2  0     targets  a  b  S  c  d  e  S  0
        positions    0  1  2  0  1  2  3  0     weights  0  1  0  0  1  0  0  0
    """
    with jax.default_device(_cpu()):
        inputs, targets, weights = _mlm(
            _host_key(rng), batch["tokens"], vocab_size=tokenizer.vocab_size,
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
    with jax.default_device(_cpu()):
        enc, dec, targets = _span(
            _host_key(rng), batch["tokens"], vocab_size=tokenizer.vocab_size,
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
    tokens = batch["tokens"]
    with jax.default_device(_cpu()):
        prefix_lengths, weights = _prefix_split(_host_key(rng), tokens)
    segments = (tokens[:, :-1] != tokenizers_lib.PAD_ID).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.asarray(weights),
            "prefix_lengths": np.asarray(prefix_lengths), "segment_ids": segments,
            "positions": np.broadcast_to(np.arange(tokens.shape[1] - 1, dtype=np.int32),
                                         segments.shape).copy()}


# --- the pipeline ---------------------------------------------------------------------------


def _chunks(tokens: np.ndarray, length: int) -> list[np.ndarray]:
    """A document's tokens cut into pieces of at most `length` (longer documents are split)."""
    return [tokens[i:i + length] for i in range(0, len(tokens), length)]


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
    process_index: int | None = None,
    process_count: int | None = None,
    mlm_rate: float = 0.15,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
    prefetch: int = 2,
) -> grain.IterDataset:
    """A Grain dataset of this process's batches of objective features.

    `token_source` holds one int32 token array per document (EOS already appended), e.g.
    `tokenize_documents(...)` or an ArrayRecord source. `batch_size` is the *global* batch; each
    of the `process_count` processes reads every process_count-th document and yields
    batch_size // process_count rows. `num_epochs=None` repeats forever (training); eval uses 1
    (the last, partial batch is dropped). The same seed gives the same batches.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: expected one of {OBJECTIVES}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2")
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if batch_size % process_count:
        raise ValueError(f"batch_size={batch_size}: expected a multiple of the process count "
                         f"{process_count}")
    local_batch = batch_size // process_count

    docs = token_source if isinstance(token_source, grain.MapDataset) else \
        grain.MapDataset.source(token_source)
    docs = docs[process_index::process_count]
    if len(docs) == 0:
        raise ValueError(f"process {process_index} of {process_count} has no documents")
    if shuffle:
        docs = docs.shuffle(seed=seed)
    docs = docs.repeat(num_epochs)

    if objective == "prefix_lm":  # one (padded) document chunk per row: the prefix is per row
        rows = docs.to_iter_dataset()
        rows = grain_experimental.FlatMapIterDataset(rows, _ChunkTransform(seq_len + 1))
        rows = rows.map(lambda t: {"tokens": _padded(t, seq_len + 1)})
    else:
        if objective == "span_corruption":
            row_len = objectives.span_corruption_lengths(seq_len, noise_density,
                                                         mean_span_length)[0]
        else:
            row_len = seq_len + 1 if objective == "next_token" else seq_len
        rows = grain_experimental.ConcatThenSplitIterDataset(
            docs.map(lambda t: {"tokens": np.asarray(t, np.int32)}).to_iter_dataset(),
            length_struct={"tokens": row_len})
        if objective == "span_corruption":  # T5 corrupts full rows only
            rows = rows.filter(lambda r: bool(r["tokens_segment_ids"][-1]))
    batches = rows.batch(local_batch, drop_remainder=True)

    if objective == "next_token":
        batches = batches.map(next_token_features)
    elif objective == "prefix_lm":
        batches = batches.random_map(prefix_lm_features, seed=seed)
    elif objective == "mlm":
        batches = batches.random_map(
            functools.partial(mlm_features, tokenizer=tokenizer, rate=mlm_rate), seed=seed)
    else:
        batches = batches.random_map(functools.partial(
            span_corruption_features, tokenizer=tokenizer, noise_density=noise_density,
            mean_span_length=mean_span_length), seed=seed)
    if prefetch:
        batches = grain_experimental.ThreadPrefetchIterDataset(batches,
                                                               prefetch_buffer_size=prefetch)
    return batches


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


def make_global_batch(local_batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Assembles each process's rows into global arrays laid out by `sharding`."""
    return {k: jax.make_array_from_process_local_data(sharding, v)
            for k, v in local_batch.items()}
