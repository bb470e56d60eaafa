"""The models' prefill/step programs (`DecoderLM`: gpt, prefix LM; `EncoderDecoder`: t5) and the
library calls over them, `decode` (sampling) and `beam_search`, each compiled once per shape
and setting."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.generation.beam import beam_search_tokens
from transformer.generation.loop import _lengths, _run, _start_state
from transformer.generation.sampling import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    _banned_mask,
    _split,
    _stop_ids,
    sampling,
)
from transformer.models import DecoderLM, EncoderDecoder, init_cache


@dataclasses.dataclass(frozen=True)
class _DecoderProgram:
    """Prefill and step of a `DecoderLM`: the prompt is the start of the sequence (for a prefix
    LM also the bidirectional prefix)."""

    model: DecoderLM
    cache_length: int
    prefix_lm: bool = False
    repeat: int = 1  # rows per prompt (beams)
    cache_batch_axis: int = 0

    def prefill(self, params, prompts_BP, lengths_B):
        prompts_BP = jnp.repeat(prompts_BP, self.repeat, axis=0)
        lengths_B = jnp.repeat(lengths_B, self.repeat, axis=0)
        batch, length = prompts_BP.shape
        cache = init_cache(self.model, batch, self.cache_length)
        positions_BP = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompts_BP.shape)
        context = lengths_B if self.prefix_lm else None
        # which tokens are the prompt's: a recurrent layer's state skips the padding after it
        segments_BP = (positions_BP < lengths_B[:, None]).astype(jnp.int32)
        logits_BPV, cache = self._apply(params, context, cache, prompts_BP, positions_BP,
                                        segments_BP)
        first_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        return first_BV, cache, context, lengths_B

    def step(self, params, context, cache, tokens_B1, positions_B1):
        logits_B1V, cache = self._apply(params, context, cache, tokens_B1, positions_B1)
        return logits_B1V[:, -1], cache

    def _apply(self, params, context, cache, tokens, positions, segments=None):
        logits, mutated = self.model.apply(
            {"params": params, "cache": cache}, tokens, positions=positions, decode=True,
            cache_length=self.cache_length, prefix_lengths=context, segment_ids=segments,
            mutable=["cache"])
        return logits, mutated["cache"]


@dataclasses.dataclass(frozen=True)
class _Seq2SeqProgram:
    """Prefill and step of an `EncoderDecoder`: encode the prompts, then decode from BOS (the
    prefill caches the cross-attention keys and values)."""

    model: EncoderDecoder
    cache_length: int
    repeat: int = 1
    cache_batch_axis: int = 0
    start_id: int = BOS_ID  # what the decoder reads first (the tokenizer's decoder_start_id)

    def prefill(self, params, inputs_BS, lengths_B):
        segments_BS = (jnp.arange(inputs_BS.shape[1]) < lengths_B[:, None]).astype(jnp.int32)
        encoded_BSD = self.model.apply({"params": params}, inputs_BS, segment_ids=segments_BS,
                                       method="encode")
        encoded_BSD = jnp.repeat(encoded_BSD, self.repeat, axis=0)
        segments_BS = jnp.repeat(segments_BS, self.repeat, axis=0)
        batch, length = segments_BS.shape
        cache = init_cache(self.model, batch, self.cache_length, encoder_length=length)
        bos_B1 = jnp.full((batch, 1), self.start_id, jnp.int32)
        logits_B1V, cache = self._apply(params, segments_BS, cache, bos_B1,
                                        jnp.zeros((batch, 1), jnp.int32), encoded_BSD)
        return logits_B1V[:, 0], cache, segments_BS, jnp.ones(batch, jnp.int32)

    def step(self, params, context, cache, tokens_B1, positions_B1):
        logits_B1V, cache = self._apply(params, context, cache, tokens_B1, positions_B1, None)
        return logits_B1V[:, -1], cache

    def _apply(self, params, segments_BS, cache, tokens, positions, encoded):
        logits, mutated = self.model.apply(
            {"params": params, "cache": cache}, encoded, tokens, encoder_segment_ids=segments_BS,
            decoder_positions=positions, decode=True, cache_length=self.cache_length,
            method="decode", mutable=["cache"])
        return logits, mutated["cache"]


@functools.partial(jax.jit, static_argnames=("program", "mode", "max_new_tokens"))
def _prefill(params, inputs, lengths, keys, knobs, *, program, mode, max_new_tokens):
    first, cache, context, start = program.prefill(params, inputs, lengths)
    return _start_state(cache, context, first, start, None, knobs, max_new_tokens=max_new_tokens,
                        mode=mode, keys=keys)


@functools.partial(jax.jit, static_argnames=("program", "mode"), donate_argnums=1)
def _continue(params, state, limit, *, program, mode):
    return _run(program.step, params, state, limit, mode)


@functools.partial(jax.jit, static_argnames=("program", "beam_size", "max_new_tokens",
                                             "length_penalty", "eos_id"))
def _beam_search(params, inputs, lengths, banned_V, *, program, beam_size, max_new_tokens,
                 length_penalty, eos_id):
    first, cache, context, start = program.prefill(params, inputs, lengths)
    return beam_search_tokens(program.step, params, context, cache, first, start,
                              beam_size=beam_size, max_new_tokens=max_new_tokens,
                              length_penalty=length_penalty, eos_id=eos_id,
                              cache_batch_axis=program.cache_batch_axis, banned=banned_V)


def _as_batch(prompts, lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int32 [B, P] prompts and their lengths, from token lists or an array."""
    if lengths is None and not isinstance(prompts, np.ndarray | jax.Array):
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        if not rows:
            raise ValueError("prompts=[]: expected at least one prompt")
        lengths = np.array([len(r) for r in rows])
        batch = np.full((len(rows), max(lengths.max(), 1)), PAD_ID, np.int64)
        for i, r in enumerate(rows):
            batch[i, :len(r)] = r
    else:
        batch = np.asarray(prompts, np.int64)
        if batch.ndim != 2:
            raise ValueError(f"prompts of shape {batch.shape}: expected [batch, length]")
        lengths = np.full(len(batch), batch.shape[1]) if lengths is None else np.asarray(lengths)
        if lengths.shape != (len(batch),) or (lengths > batch.shape[1]).any():
            raise ValueError(f"lengths={lengths.tolist()}: expected {len(batch)} lengths "
                             f"<= {batch.shape[1]}")
    if (lengths < 1).any():
        raise ValueError(f"prompt lengths {lengths.tolist()}: expected every prompt to have >= 1 "
                         "token (start a document with EOS_ID)")
    valid = np.arange(batch.shape[1]) < lengths[:, None]
    bad = batch[valid & ((batch < 0) | (batch >= vocab_size))]
    if bad.size:
        raise ValueError(f"prompt token {int(bad[0])}: expected ids in [0, {vocab_size})")
    return batch.astype(np.int32), lengths.astype(np.int32)


def _check_seed_and_eos(seed, eos_id) -> tuple[int, ...]:
    """The stop ids of `eos_id` (`sampling._stop_ids`), after checking both."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not (
            -2**31 <= seed < 2**31):
        raise ValueError(f"seed={seed!r}: expected an int32")
    return _stop_ids(eos_id)


def _learned_max_len(config) -> int | None:
    return config.max_len if config.position == "learned" else None


def _program(model, prompt_length: int, max_new_tokens: int, *, prefix_lm: bool,
             repeat: int = 1, start_id: int = BOS_ID):
    """The model's prefill/step program, after checking that the lengths fit it."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
    max_new_tokens = int(max_new_tokens)
    if isinstance(model, DecoderLM):
        # The last new token is never fed back: the cache holds P + N - 1 positions.
        cache_length = prompt_length + max_new_tokens - 1
        max_len = _learned_max_len(model.config)
        if max_len is not None and cache_length > max_len:
            raise ValueError(f"prompt of {prompt_length} tokens + max_new_tokens="
                             f"{max_new_tokens} - 1 = {cache_length} positions: expected <= "
                             f"the model's max_len={max_len}")
        axis = 1 if model.config.scan_layers else 0
        return _DecoderProgram(model, cache_length, bool(prefix_lm), repeat, axis)
    if isinstance(model, EncoderDecoder):
        if prefix_lm:
            raise ValueError("prefix_lm=True: expected a DecoderLM, got an EncoderDecoder")
        for name, config, length in (("prompt", model.encoder_config, prompt_length),
                                     ("max_new_tokens", model.decoder_config, max_new_tokens)):
            max_len = _learned_max_len(config)
            if max_len is not None and length > max_len:
                raise ValueError(f"{name} of {length} tokens: expected <= max_len={max_len}")
        axis = 1 if model.decoder_config.scan_layers else 0
        return _Seq2SeqProgram(model, max_new_tokens, repeat, axis, int(start_id))
    raise ValueError(f"{type(model).__name__}: expected a DecoderLM or EncoderDecoder (the models "
                     "with a KV cache)")


def routes_with_capacity(model: nn.Module) -> bool:
    """Whether a mixture-of-experts layer of `model` routes with a capacity (moe.num_experts > 0
    and moe.capacity_factor > 0): each row is one routing group whose slots per expert grow with
    its width, so padding a prompt changes which of its tokens are dropped."""
    configs = (getattr(model, name, None) for name in ("config", "encoder_config",
                                                       "decoder_config"))
    moes = [getattr(c, "moe", None) for c in configs]
    return any(m is not None and m.num_experts and m.capacity_factor for m in moes)


def _groups(model, inputs, lengths, max_new_tokens, **program_kw) -> list[tuple]:
    """(rows, inputs, lengths, program) of each batch the prompts decode in: all of them in one,
    or where the model `routes_with_capacity`, the prompts of each length in their own batch
    unpadded, so that a prompt's tokens do not depend on the other prompts. Every program is
    checked before any compiles."""
    if not routes_with_capacity(model):
        return [(np.arange(len(lengths)), inputs, lengths,
                 _program(model, inputs.shape[1], max_new_tokens, **program_kw))]
    groups = []
    for n in np.unique(lengths):
        rows = np.flatnonzero(lengths == n)
        groups.append((rows, inputs[rows, :n], lengths[rows],
                       _program(model, int(n), max_new_tokens, **program_kw)))
    return groups


def _scatter(groups, parts, batch: int) -> np.ndarray:
    """The groups' rows (`parts`, in `_groups`' order) put back in the batch's order."""
    out = np.empty((batch, *parts[0].shape[1:]), parts[0].dtype)
    for (rows, *_), part in zip(groups, parts, strict=True):
        out[rows] = part
    return out


def decode(model: nn.Module, params, prompts: Sequence[Sequence[int]] | np.ndarray, *,
           max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           seed: int = 0, eos_id: int | Sequence[int] | None = EOS_ID, prefix_lm: bool = False,
           lengths: Sequence[int] | None = None, chunk_size: int | None = None,
           callback: Callable[[np.ndarray], None] | None = None,
           banned_ids: Sequence[int] | None = None,
           start_id: int = BOS_ID) -> tuple[np.ndarray, np.ndarray]:
    """New tokens for a batch of prompts: (tokens [B, max_new_tokens], lengths [B]) as NumPy.

    `prompts` are token lists of any lengths, or a right-padded [B, P] array with `lengths`.
    For a `DecoderLM` they are the sequence's start (`prefix_lm=True`: the bidirectional prefix
    of a prefix LM); for an `EncoderDecoder` the encoder inputs, decoding starting from
    `start_id` (a tokenizer's `decoder_start_id`); where the model `routes_with_capacity`,
    the prompts of each length decode as their own unpadded batch.
    Sampling is per `Sampling`, seeded per row (a row's key is its key in the whole batch).
    A row stops after `eos_id` (an id, several ids such as a checkpoint's
    generation_config.json list, or None: never) and is PAD_ID after; lengths count the tokens
    up to and including that stop. `banned_ids` are never emitted (for text,
    `banned_ids(tokenizer, ...)`); changing them does not recompile.

    With `chunk_size`, the jitted loop runs `chunk_size` tokens at a time and `callback` gets
    the tokens so far, [B, n], after each chunk (for streaming).
    """
    s = sampling(temperature, top_k, top_p)
    inputs, lengths = _as_batch(prompts, lengths, model.vocab_size)
    groups = _groups(model, inputs, lengths, max_new_tokens, prefix_lm=prefix_lm,
                     start_id=start_id)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: expected an int >= 1 or None")
    _check_seed_and_eos(seed, eos_id)
    n = int(max_new_tokens)
    mode, knobs = _split(s, model.vocab_size, eos_id, banned_ids)
    # each row's key is its key in the whole batch, however the rows are grouped
    keys = jax.random.split(jax.random.key(np.int32(seed)), len(inputs))
    states = [_prefill(params, x, lx, keys if len(groups) == 1 else keys[rows], knobs,
                       program=program, mode=mode, max_new_tokens=n)
              for rows, x, lx, program in groups]

    def tokens_so_far(step):
        return _scatter(groups, [np.array(state.tokens)[:, :step] for state in states],
                        len(inputs))

    streaming = callback is not None and chunk_size is not None
    if streaming:
        callback(tokens_so_far(1))
    step = 1
    while step < n and not all(np.asarray(state.done).all() for state in states):
        limit = n if chunk_size is None else min(step + chunk_size, n)
        states = [state if np.asarray(state.done).all() else
                  _continue(params, state, np.int32(limit), program=group[3], mode=mode)
                  for group, state in zip(groups, states, strict=True)]
        step = max(int(state.step) for state in states)  # < limit once every row is done
        if streaming:
            callback(tokens_so_far(step))
    tokens = tokens_so_far(n)
    if callback is not None and not streaming:
        callback(tokens)
    return tokens, _lengths(tokens, eos_id)


def beam_search(model: nn.Module, params, prompts: Sequence[Sequence[int]] | np.ndarray, *,
                beam_size: int = 4, max_new_tokens: int, length_penalty: float = 0.6,
                eos_id: int | Sequence[int] | None = EOS_ID, prefix_lm: bool = False,
                lengths: Sequence[int] | None = None, banned_ids: Sequence[int] | None = None,
                start_id: int = BOS_ID) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best of `beam_size` beams per prompt: (tokens [B, N], lengths [B], scores [B]) as
    NumPy; score = log-probability / ((5 + length) / 6) ** length_penalty. Prompts as in
    `decode` (encoder inputs of an `EncoderDecoder`, or the start of a `DecoderLM` sequence;
    grouped by length where the model `routes_with_capacity`).
    `banned_ids` are never chosen; the log-probabilities are then over the allowed ids."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size={beam_size!r}: expected an int >= 1")
    if not isinstance(length_penalty, int | float) or not (
            math.isfinite(length_penalty) and length_penalty >= 0):
        raise ValueError(f"length_penalty={length_penalty!r}: expected a finite float >= 0")
    stops = _check_seed_and_eos(0, eos_id)
    inputs, lengths = _as_batch(prompts, lengths, model.vocab_size)
    groups = _groups(model, inputs, lengths, max_new_tokens, prefix_lm=prefix_lm,
                     repeat=beam_size, start_id=start_id)
    banned_V = _banned_mask(banned_ids, model.vocab_size)
    outs = [_beam_search(params, x, lx, banned_V, program=program, beam_size=beam_size,
                         max_new_tokens=int(max_new_tokens),
                         length_penalty=float(length_penalty),
                         eos_id=stops)  # a tuple: static, hashable
            for _, x, lx, program in groups]
    tokens = _scatter(groups, [np.asarray(out[0]) for out in outs], len(inputs))
    scores = _scatter(groups, [np.asarray(out[2]) for out in outs], len(inputs))
    return tokens, _lengths(tokens, stops), scores
