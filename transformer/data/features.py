"""Objective features: packed NumPy rows -> the named arrays the models read (`inputs`,
`targets`, `weights`, ...), one converter per pretraining objective.

next_token only slices its rows; MLM, span corruption and the prefix-LM split draw noise, jitted
on the host CPU with one key per row. The public converters draw the keys from a NumPy `rng`;
the pipeline's (`keyed_converter`) are given them: `sample_keys` folds the run's noise base with
each row's global sample index, so a restored iterator draws the same noise again.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from transformer.nn import objectives


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
# derives one per sample index and row (`sample_keys`). The rows are corrupted independently under
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
    # padding (segment 0) is no token, whatever its id: a pretrained vocabulary's id 0 is text
    real = batch["tokens_segment_ids"] > 0
    return {"inputs": np.where(real, inputs, batch["tokens"]), "targets": np.asarray(targets),
            "weights": np.where(real, weights, 0).astype(np.asarray(weights).dtype),
            "segment_ids": batch["tokens_segment_ids"],
            "positions": batch["tokens_positions"]}


def span_corruption_features(batch, rng, *, tokenizer, noise_density, mean_span_length):
    """Full rows of raw length L -> T5 features (`objectives.span_corrupt`).

    The encoder reads the corrupted row; the decoder reads the targets shifted right behind
    <bos> (teacher forcing). For raw tokens [a b c d e f g] (L = 7; density 0.15 gives one
    noise token, so one span, and a row always ends with noise):

        encoder_inputs   a  b  c  d  e  f  X0 E       (X0 = <extra_id_0>, E = <eos>)
        decoder_inputs   B  X0 g                      (B = <bos>)
        targets          X0 g  E                      weights 1 1 1

    >>> from transformer.data.tokenizers import ByteTokenizer
    >>> row = np.array([[97, 98, 99, 100, 101, 102, 103]])  # "abcdefg"
    >>> f = span_corruption_features({"tokens": row}, np.random.default_rng(0),
    ...     tokenizer=ByteTokenizer(), noise_density=0.15, mean_span_length=3.0)
    >>> f["encoder_inputs"].tolist(), f["decoder_inputs"].tolist()  # X0 362, E 2, B 1
    ([[97, 98, 99, 100, 101, 102, 362, 2]], [[1, 362, 103]])
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


def keyed_converter(objective: str, *, tokenizer, mlm_rate: float, noise_density: float,
                    mean_span_length: float):
    """The pipeline's converter of `objective`: batch -> features for next_token, and
    (batch, keys [B, 2] from `sample_keys`) -> features for the objectives that draw noise."""
    return {"next_token": next_token_features, "prefix_lm": _prefix_lm_features,
            "mlm": functools.partial(_mlm_features, tokenizer=tokenizer, rate=mlm_rate),
            "span_corruption": functools.partial(
                _span_corruption_features, tokenizer=tokenizer,
                noise_density=noise_density, mean_span_length=mean_span_length)}[objective]


@jax.jit
def _sample_keys(base, indices):
    key = jax.random.wrap_key_data(base, impl="threefry2x32")
    return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(indices)


def sample_keys(base: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Raw threefry key data [2] -> one key per global sample index [n], the base folded in
    with the index: [n, 2] uint32 (computed on the host CPU)."""
    with jax.default_device(_cpu()):
        return np.asarray(_sample_keys(base, samples.astype(np.uint32)))
