"""Text generation with a KV cache: sampling (greedy, temperature, top-k, top-p) and beam search.

    python -m transformer.generate --workdir=DIR --prompt="..." [--max_new_tokens=N]
        [--temperature=T] [--top_k=K] [--top_p=P] [--seed=S] [--num_samples=N] [--beam_size=K]

loads the latest checkpoint of a training workdir and its tokenizer and prints continuations
(streamed as they are produced when stdout is a terminal).

The prompt is prefilled in one pass, then a jitted `lax.while_loop` emits one token per step
(no Python per token), stopping at `max_new_tokens` or when every row has emitted `eos_id`.
Prompts of different lengths share a batch: each row writes and reads its own cache positions.

Layers:
  * `sample_tokens` / `kept_tokens`: logits -> tokens (temperature, top-k, top-p), pure.
  * `generate_tokens` / `beam_search_tokens`: the loops over any `step_fn(params, context, cache,
    tokens_B1, positions_B1) -> (logits_BV, cache)`, pure and jittable.
  * `decode` / `beam_search`: those loops over a `DecoderLM` (gpt, prefix_lm) or `EncoderDecoder`
    (t5), each compiled once per shape and setting.
  * `sample_texts` / `beam_search_text`: text in, texts out, for a model of any family (LSTM:
    full recomputation). They never emit ids without text (`banned_ids`: specials other than
    <eos>, sentinels, ids past the tokenizer), and warn on prompt characters the tokenizer lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.data import tokenizers as tokenizers_lib
from transformer.models import FAMILIES, DecoderLM, EncoderDecoder, family_of, init_cache

PAD_ID, BOS_ID, EOS_ID = tokenizers_lib.PAD_ID, tokenizers_lib.BOS_ID, tokenizers_lib.EOS_ID
# Top-p counts a set as reaching p when its mass is within this of p (float32 cumsum rounding).
_TOP_P_TOLERANCE = 1e-6

Array = jax.Array
StepFn = Callable[[Any, Any, Any, Array, Array], tuple[Array, Any]]


# --- sampling -----------------------------------------------------------------------------------


class Sampling(NamedTuple):
    """How a token is drawn from logits: temperature 0 is greedy (argmax); otherwise sample
    softmax(logits / temperature) restricted to the top_k best tokens (0: all) and then to the
    smallest best-first set whose probability reaches top_p (1.0: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    """A validated `Sampling` (one-line ValueErrors naming the bad value)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}: expected a finite float >= 0")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k={top_k!r}: expected an int >= 0 (0: no top-k filter)")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: expected a float in (0, 1] (1: no top-p filter)")
    return Sampling(float(temperature), int(top_k), float(top_p))


class _Mode(NamedTuple):
    """The part of a `Sampling` that shapes the compiled program; temperature, the top_p value
    and the EOS id are traced (`_Knobs`), so changing them does not recompile."""

    greedy: bool
    top_k: int
    top_p: bool  # filter by top-p


class _Knobs(NamedTuple):
    temperature: Array  # float32 scalar
    top_p: Array  # float32 scalar
    eos_id: Array  # int32 scalar; -1: none
    banned_V: Array  # bool [V]: ids never drawn (a traced array: another set does not recompile)


def _split(s: Sampling, vocab_size: int, eos_id: int | None = None,
           banned_ids: Sequence[int] | None = None) -> tuple[_Mode, _Knobs]:
    mode = _Mode(s.temperature == 0.0, s.top_k, s.top_p < 1.0)
    knobs = _Knobs(np.float32(s.temperature or 1.0), np.float32(s.top_p),
                   np.int32(-1 if eos_id is None else eos_id),
                   _banned_mask(banned_ids, vocab_size))
    return mode, knobs


def _banned_mask(banned_ids: Sequence[int] | None, vocab_size: int) -> np.ndarray:
    """bool [vocab_size], True at `banned_ids` (None: none)."""
    mask = np.zeros(vocab_size, bool)
    if banned_ids is not None:
        ids = np.asarray(banned_ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"banned_ids with {int(ids.min())}..{int(ids.max())}: expected "
                             f"ids in [0, {vocab_size})")
        mask[ids] = True
    return mask


def _allowed(logits_BV: Array, banned_V: Array) -> Array:
    """Banned ids get -inf, before temperature and filters: no setting can draw them."""
    return jnp.where(banned_V, -jnp.inf, logits_BV.astype(jnp.float32))


def _candidates(logits_BV: Array, top_k: int, top_p: Array | None) -> tuple[Array, Array | None]:
    """(logits [B, C], their token ids [B, C] or None for the identity) of the tokens that top-k
    and top-p keep; the others are -inf. Ties keep the lower token id first."""
    vocab = logits_BV.shape[-1]
    if 0 < top_k < vocab:
        values_BC, ids_BC = jax.lax.top_k(logits_BV, top_k)  # sorted, ties: lower index first
    elif top_p is not None:
        ids_BC = jnp.argsort(-logits_BV, axis=-1, stable=True)
        values_BC = jnp.take_along_axis(logits_BV, ids_BC, axis=-1)
    else:
        return logits_BV, None
    if top_p is not None:
        probs_BC = jax.nn.softmax(values_BC, axis=-1)
        before_BC = jnp.cumsum(probs_BC, axis=-1) - probs_BC  # mass of the better tokens
        keep_BC = before_BC < top_p - _TOP_P_TOLERANCE
        keep_BC = keep_BC.at[:, 0].set(True)
        values_BC = jnp.where(keep_BC, values_BC, -jnp.inf)
    return values_BC, ids_BC


def _filtered(logits_BV: Array, mode: _Mode, knobs: _Knobs):
    return _candidates(logits_BV.astype(jnp.float32) / knobs.temperature, mode.top_k,
                       knobs.top_p if mode.top_p else None)


def _pick(logits_BV: Array, keys_B: Array, mode: _Mode, knobs: _Knobs) -> Array:
    logits_BV = _allowed(logits_BV, knobs.banned_V)
    if mode.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    values_BC, ids_BC = _filtered(logits_BV, mode, knobs)
    choice_B = jax.vmap(jax.random.categorical)(keys_B, values_BC)
    if ids_BC is not None:
        choice_B = jnp.take_along_axis(ids_BC, choice_B[:, None], axis=-1)[:, 0]
    return choice_B.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="mode")
def _kept(logits_BV, knobs, *, mode):
    logits_BV = _allowed(logits_BV, knobs.banned_V)
    if mode.greedy:
        return jax.nn.one_hot(jnp.argmax(logits_BV, -1), logits_BV.shape[-1], dtype=bool)
    values_BC, ids_BC = _filtered(logits_BV, mode, knobs)
    if ids_BC is None:
        return jnp.ones(logits_BV.shape, bool)
    rows = jnp.arange(logits_BV.shape[0])[:, None]
    return jnp.zeros(logits_BV.shape, bool).at[rows, ids_BC].set(values_BC > -jnp.inf)


def kept_tokens(logits_BV: Array, *, top_k: int = 0, top_p: float = 1.0,
                temperature: float = 1.0) -> Array:
    """bool [B, V]: the tokens sampling may draw (top-k, then the smallest set reaching top_p).

    >>> logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
    >>> kept_tokens(logits, top_p=0.7).astype(int).tolist()
    [[0, 1, 0, 1]]
    """
    mode, knobs = _split(sampling(temperature, top_k, top_p), logits_BV.shape[-1])
    return _kept(logits_BV, knobs, mode=mode)


@functools.partial(jax.jit, static_argnames="mode")
def _sample(logits_BV, keys_B, knobs, *, mode):
    return _pick(logits_BV, keys_B, mode, knobs)


def sample_tokens(logits_BV: Array, keys: Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> Array:
    """One token per row of logits [B, V]: int32 [B]. `keys` is one PRNG key (split per row)
    or B keys, one per row."""
    mode, knobs = _split(sampling(temperature, top_k, top_p), logits_BV.shape[-1])
    if keys.ndim == 0:
        keys = jax.random.split(keys, logits_BV.shape[0])
    return _sample(logits_BV, keys, knobs, mode=mode)


# --- the sampling loop --------------------------------------------------------------------------


class DecodeState(NamedTuple):
    """The while-loop carry. `step` tokens have been emitted into `tokens` [B, N]; the last one
    (`last`) is fed next, at position start + step - 1. Rows that emitted EOS are `done` and
    emit PAD_ID from then on."""

    cache: Any
    context: Any  # per-row model inputs every step needs (prefix lengths, encoder segment ids)
    tokens: Array  # [B, N] int32
    last: Array  # [B]
    step: Array  # scalar int32
    done: Array  # [B] bool
    start: Array  # [B]: position of the first new token
    keys: Array  # [B] PRNG keys
    knobs: _Knobs


def _emit(state: DecodeState, logits_BV: Array, mode: _Mode) -> DecodeState:
    keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.keys, state.step)
    token_B = _pick(logits_BV, keys_B, mode, state.knobs)
    token_B = jnp.where(state.done, PAD_ID, token_B).astype(jnp.int32)
    tokens = jax.lax.dynamic_update_slice_in_dim(state.tokens, token_B[:, None], state.step, 1)
    done = state.done | (token_B == state.knobs.eos_id)
    return state._replace(tokens=tokens, last=token_B, step=state.step + 1, done=done)


def _start_state(cache, context, first_logits_BV, start_B, seed, knobs, *, max_new_tokens,
                 mode) -> DecodeState:
    batch = first_logits_BV.shape[0]
    keys = jax.random.split(jax.random.key(seed), batch)
    state = DecodeState(cache, context, jnp.full((batch, max_new_tokens), PAD_ID, jnp.int32),
                        jnp.zeros(batch, jnp.int32), jnp.zeros((), jnp.int32),
                        jnp.zeros(batch, bool), jnp.asarray(start_B, jnp.int32), keys, knobs)
    return _emit(state, first_logits_BV, mode)


def _run(step_fn: StepFn, params, state: DecodeState, limit, mode: _Mode) -> DecodeState:
    """Steps until `limit` tokens are emitted or every row is done."""
    def cond(state):
        return (state.step < limit) & ~jnp.all(state.done)

    def body(state):
        positions_B1 = (state.start + state.step - 1)[:, None]
        logits_BV, cache = step_fn(params, state.context, state.cache, state.last[:, None],
                                   positions_B1)
        return _emit(state._replace(cache=cache), logits_BV, mode)

    return jax.lax.while_loop(cond, body, state)


def _lengths(tokens_BN, eos_id: int | None):
    """Tokens up to and including the first EOS (all N without one), NumPy or JAX."""
    xp = np if isinstance(tokens_BN, np.ndarray) else jnp
    n = tokens_BN.shape[1]
    if eos_id is None:
        return xp.full(tokens_BN.shape[0], n, np.int32)
    is_eos = tokens_BN == eos_id
    return xp.where(is_eos.any(1), xp.argmax(is_eos, 1) + 1, n).astype(np.int32)


def generate_tokens(step_fn: StepFn, params, context, cache, first_logits_BV: Array,
                    start_B: Array, *, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | Array = 0,
                    eos_id: int | None = EOS_ID,
                    banned_ids: Sequence[int] | None = None) -> tuple[Array, Array]:
    """The sampling loop over any model: (tokens [B, N], lengths [B]), pure and jittable.

    `first_logits_BV` predict the first new token (from the prefill); `step_fn(params, context,
    cache, tokens_B1, positions_B1) -> (logits_BV, cache)` feeds token t of each row at position
    start_B + t. Each row samples with its own key (`seed` split per row, folded with the step),
    so a row's tokens do not depend on the rest of the batch. After EOS a row emits PAD_ID;
    lengths count the tokens up to and including EOS. `banned_ids` are never drawn.
    """
    mode, knobs = _split(sampling(temperature, top_k, top_p), first_logits_BV.shape[-1], eos_id,
                         banned_ids)
    state = _start_state(cache, context, first_logits_BV, start_B, seed, knobs,
                         max_new_tokens=max_new_tokens, mode=mode)
    state = _run(step_fn, params, state, max_new_tokens, mode)
    return state.tokens, _lengths(state.tokens, eos_id)


# --- beam search --------------------------------------------------------------------------------


def length_penalty_factor(length, alpha: float):
    """GNMT's ((5 + length) / 6) ** alpha: beam scores are log-probability / this."""
    return ((5.0 + length) / 6.0) ** alpha


class _Beams(NamedTuple):
    cache: Any
    context: Any
    step: Array  # tokens in each alive sequence
    start: Array  # [B * K]
    alive: Array  # [B, K, N]
    alive_logp: Array  # [B, K], best first
    finished: Array  # [B, K, N]
    finished_scores: Array  # [B, K], best first; -inf: empty slot


def _expand(beams: _Beams, logits_RV: Array, banned_V: Array, *, alpha, eos_id,
            cache_batch_axis) -> _Beams:
    """Extends every alive beam by every allowed token, keeps the 2K best: those ending in EOS
    compete for the finished set, the others for the alive set; reorders the cache rows to
    match. Log-probabilities are renormalized over the allowed tokens."""
    batch, k, n = beams.alive.shape
    vocab = logits_RV.shape[-1]
    t = beams.step
    logp_BKV = jax.nn.log_softmax(_allowed(logits_RV, banned_V), -1).reshape(batch, k, vocab)
    scores_BX = (beams.alive_logp[:, :, None] + logp_BKV).reshape(batch, k * vocab)
    top_B2, flat_B2 = jax.lax.top_k(scores_BX, 2 * k)
    beam_B2, token_B2 = flat_B2 // vocab, (flat_B2 % vocab).astype(jnp.int32)
    seqs_B2N = jnp.take_along_axis(beams.alive, beam_B2[:, :, None], axis=1)
    seqs_B2N = jax.lax.dynamic_update_slice_in_dim(seqs_B2N, token_B2[:, :, None], t, 2)
    is_eos = (token_B2 == eos_id) if eos_id is not None else jnp.zeros_like(token_B2, bool)

    ended = jnp.where(is_eos, top_B2 / length_penalty_factor(t + 1, alpha), -jnp.inf)
    finished_scores, pick = jax.lax.top_k(
        jnp.concatenate([beams.finished_scores, ended], 1), k)
    finished = jnp.take_along_axis(jnp.concatenate([beams.finished, seqs_B2N], 1),
                                   pick[:, :, None], axis=1)

    alive_logp, pick = jax.lax.top_k(jnp.where(is_eos, -jnp.inf, top_B2), k)
    alive = jnp.take_along_axis(seqs_B2N, pick[:, :, None], axis=1)
    rows = (jnp.arange(batch)[:, None] * k + jnp.take_along_axis(beam_B2, pick, 1)).reshape(-1)
    cache = jax.tree.map(lambda x: jnp.take(x, rows, axis=cache_batch_axis), beams.cache)
    return beams._replace(cache=cache, step=t + 1, alive=alive, alive_logp=alive_logp,
                          finished=finished, finished_scores=finished_scores)


def beam_search_tokens(step_fn: StepFn, params, context, cache, first_logits_RV: Array,
                       start_R: Array, *, beam_size: int, max_new_tokens: int,
                       length_penalty: float = 0.6, eos_id: int | None = EOS_ID,
                       cache_batch_axis: int = 0,
                       banned: Array | Sequence[int] | None = None) -> tuple[Array, Array, Array]:
    """Beam search over any model: the best sequence of each of B inputs, (tokens [B, N],
    lengths [B], scores [B]); pure and jittable.

    The inputs are R = B * K rows, input b repeated in rows b*K .. b*K + K-1 (cache, context,
    first logits, start positions), with `step_fn` as in `generate_tokens`. A sequence's score
    is its log-probability / ((5 + length) / 6) ** length_penalty (GNMT), length counting the
    EOS; a sequence reaching N tokens without EOS also finishes. The search stops early once no
    alive beam can beat the K finished ones. `banned`: ids never chosen, as a list or a bool
    [V] mask (an array, which may be traced).
    """
    k, n = beam_size, max_new_tokens
    batch = first_logits_RV.shape[0] // k
    vocab = first_logits_RV.shape[-1]
    if not isinstance(banned, jax.Array | np.ndarray) or banned.dtype != bool:
        banned = _banned_mask(banned, vocab)  # ids (or None) -> bool [V]
    empty = jnp.full((batch, k, n), PAD_ID, jnp.int32)
    first_logp = jnp.full((batch, k), -jnp.inf).at[:, 0].set(0.0)  # the K copies are one beam
    beams = _Beams(cache, context, jnp.zeros((), jnp.int32), jnp.asarray(start_R, jnp.int32),
                   empty, first_logp, empty, jnp.full((batch, k), -jnp.inf))
    expand = functools.partial(_expand, banned_V=banned, alpha=length_penalty, eos_id=eos_id,
                               cache_batch_axis=cache_batch_axis)
    beams = expand(beams, first_logits_RV)
    best_possible = length_penalty_factor(n, length_penalty)  # logp only falls as beams grow

    def cond(beams):
        hopeless = beams.finished_scores[:, -1] > beams.alive_logp[:, 0] / best_possible
        return (beams.step < n) & ~jnp.all(hopeless)

    def body(beams):
        tokens_R1 = jax.lax.dynamic_index_in_dim(beams.alive, beams.step - 1, 2).reshape(-1, 1)
        positions_R1 = (beams.start + beams.step - 1)[:, None]
        logits_RV, cache = step_fn(params, beams.context, beams.cache, tokens_R1, positions_R1)
        return expand(beams._replace(cache=cache), logits_RV)

    beams = jax.lax.while_loop(cond, body, beams)
    full = jnp.where(beams.step == n, beams.alive_logp / best_possible, -jnp.inf)
    scores, pick = jax.lax.top_k(jnp.concatenate([beams.finished_scores, full], 1), 1)
    tokens = jnp.take_along_axis(jnp.concatenate([beams.finished, beams.alive], 1),
                                 pick[:, :, None], axis=1)[:, 0]
    return tokens, _lengths(tokens, eos_id), scores[:, 0]


# --- models -------------------------------------------------------------------------------------


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
        logits_BPV, cache = self._apply(params, context, cache, prompts_BP, positions_BP)
        first_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        return first_BV, cache, context, lengths_B

    def step(self, params, context, cache, tokens_B1, positions_B1):
        logits_B1V, cache = self._apply(params, context, cache, tokens_B1, positions_B1)
        return logits_B1V[:, -1], cache

    def _apply(self, params, context, cache, tokens, positions):
        logits, mutated = self.model.apply(
            {"params": params, "cache": cache}, tokens, positions=positions, decode=True,
            cache_length=self.cache_length, prefix_lengths=context, mutable=["cache"])
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
def _prefill(params, inputs, lengths, seed, knobs, *, program, mode, max_new_tokens):
    first, cache, context, start = program.prefill(params, inputs, lengths)
    return _start_state(cache, context, first, start, seed, knobs, max_new_tokens=max_new_tokens,
                        mode=mode)


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


def _check_seed_and_eos(seed, eos_id) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not (
            -2**31 <= seed < 2**31):
        raise ValueError(f"seed={seed!r}: expected an int32")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(
            eos_id, numbers.Integral) or eos_id < 0):
        raise ValueError(f"eos_id={eos_id!r}: expected a token id >= 0 or None")


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


def decode(model: nn.Module, params, prompts: Sequence[Sequence[int]] | np.ndarray, *,
           max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           seed: int = 0, eos_id: int | None = EOS_ID, prefix_lm: bool = False,
           lengths: Sequence[int] | None = None, chunk_size: int | None = None,
           callback: Callable[[np.ndarray], None] | None = None,
           banned_ids: Sequence[int] | None = None,
           start_id: int = BOS_ID) -> tuple[np.ndarray, np.ndarray]:
    """New tokens for a batch of prompts: (tokens [B, max_new_tokens], lengths [B]) as NumPy.

    `prompts` are token lists of any lengths, or a right-padded [B, P] array with `lengths`.
    For a `DecoderLM` they are the sequence's start (`prefix_lm=True`: the bidirectional prefix
    of a prefix LM); for an `EncoderDecoder` the encoder inputs, decoding starting from
    `start_id` (a tokenizer's `decoder_start_id`).
    Sampling is per `Sampling`, seeded per row. A row stops after `eos_id` (None: never) and is
    PAD_ID after; lengths count the tokens up to and including EOS. `banned_ids` are never
    emitted (for text, `banned_ids(tokenizer, ...)`); changing them does not recompile.

    With `chunk_size`, the jitted loop runs `chunk_size` tokens at a time and `callback` gets
    the tokens so far, [B, n], after each chunk (for streaming).
    """
    s = sampling(temperature, top_k, top_p)
    inputs, lengths = _as_batch(prompts, lengths, model.vocab_size)
    program = _program(model, inputs.shape[1], max_new_tokens, prefix_lm=prefix_lm,
                       start_id=start_id)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: expected an int >= 1 or None")
    _check_seed_and_eos(seed, eos_id)
    n = int(max_new_tokens)
    mode, knobs = _split(s, model.vocab_size, eos_id, banned_ids)
    state = _prefill(params, inputs, lengths, np.int32(seed), knobs, program=program, mode=mode,
                     max_new_tokens=n)
    streaming = callback is not None and chunk_size is not None
    if streaming:
        callback(np.array(state.tokens)[:, :1])
    step = 1
    while step < n and not np.asarray(state.done).all():
        limit = n if chunk_size is None else min(step + chunk_size, n)
        state = _continue(params, state, np.int32(limit), program=program, mode=mode)
        step = int(state.step)
        if streaming:
            callback(np.array(state.tokens)[:, :step])
    tokens = np.array(state.tokens)
    if callback is not None and not streaming:
        callback(tokens)
    return tokens, _lengths(tokens, eos_id)


def beam_search(model: nn.Module, params, prompts: Sequence[Sequence[int]] | np.ndarray, *,
                beam_size: int = 4, max_new_tokens: int, length_penalty: float = 0.6,
                eos_id: int | None = EOS_ID, prefix_lm: bool = False,
                lengths: Sequence[int] | None = None, banned_ids: Sequence[int] | None = None,
                start_id: int = BOS_ID) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best of `beam_size` beams per prompt: (tokens [B, N], lengths [B], scores [B]) as
    NumPy; score = log-probability / ((5 + length) / 6) ** length_penalty. Prompts as in
    `decode` (encoder inputs of an `EncoderDecoder`, or the start of a `DecoderLM` sequence).
    `banned_ids` are never chosen; the log-probabilities are then over the allowed ids."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size={beam_size!r}: expected an int >= 1")
    if not isinstance(length_penalty, int | float) or not (
            math.isfinite(length_penalty) and length_penalty >= 0):
        raise ValueError(f"length_penalty={length_penalty!r}: expected a finite float >= 0")
    _check_seed_and_eos(0, eos_id)
    inputs, lengths = _as_batch(prompts, lengths, model.vocab_size)
    program = _program(model, inputs.shape[1], max_new_tokens, prefix_lm=prefix_lm,
                       repeat=beam_size, start_id=start_id)
    banned_V = _banned_mask(banned_ids, model.vocab_size)
    out = _beam_search(params, inputs, lengths, banned_V, program=program, beam_size=beam_size,
                       max_new_tokens=int(max_new_tokens), length_penalty=float(length_penalty),
                       eos_id=eos_id)
    tokens, _, scores = (np.asarray(x) for x in out)
    return tokens, _lengths(tokens, eos_id), scores


# --- text ---------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("apply_fn", "length", "mode"))
def _sample_loop(params, buffer, start, seed, knobs, *, apply_fn, length, mode):
    """Fills buffer[:, start:length] one token at a time, rerunning the whole prefix per token
    (models without a KV cache: the LSTM)."""
    keys = jax.random.split(jax.random.key(seed), buffer.shape[0])

    def step(t, buffer):
        logits = apply_fn(params, buffer)[:, t - 1]  # position t - 1 predicts token t
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)
        return buffer.at[:, t].set(_pick(logits, keys_B, mode, knobs).astype(buffer.dtype))

    return jax.lax.fori_loop(start, length, step, buffer)


@dataclasses.dataclass(frozen=True)
class _ApplyTokens:
    model: nn.Module

    def __call__(self, params, tokens):
        return self.model.apply({"params": params}, tokens)


@functools.lru_cache(maxsize=8)
def banned_ids(tokenizer: tokenizers_lib.Tokenizer, vocab_size: int, *,
               sentinels_allowed: bool = False) -> tuple[int, ...]:
    """The ids a text decoder never emits, below the model's `vocab_size`: the specials except
    <eos> (which ends a sample), the sentinels unless `sentinels_allowed`, and the ids past
    the tokenizer's vocabulary (a model's padded vocabulary), which have no text."""
    sentinels = set(tokenizer.sentinel_ids)
    banned = [i for i in tokenizer.special_ids if i != tokenizer.eos_id and
              not (sentinels_allowed and i in sentinels)]
    return tuple(banned + list(range(tokenizer.vocab_size, vocab_size)))


def _emits_sentinels(config) -> bool:
    """Whether the config's model legitimately writes sentinels: a T5-style encoder-decoder
    trained on span corruption, whose targets are `<extra_id_0> c d <extra_id_1> ... <eos>`.
    Every other text model saw sentinels never (or only as inputs)."""
    from transformer.data import pipeline

    return _decoding(config) == "encoder_decoder" and \
        pipeline.objective_for(config) == "span_corruption"


def _banned_for(tokenizer, model, config) -> tuple[int, ...]:
    return banned_ids(tokenizer, model.vocab_size, sentinels_allowed=_emits_sentinels(config))


def _encode_prompt(tokenizer, prompt: str) -> np.ndarray:
    """The prompt's ids, with one warning line on stderr naming the characters the tokenizer
    has no ids for (they become <unk>)."""
    missing = tokenizer.unknown_chars(prompt)
    if missing:
        print(f"warning: the tokenizer has no ids for {', '.join(map(repr, missing))} in the "
              "prompt; they become <unk>", file=sys.stderr)
    return tokenizer.encode(prompt)


def _start_id(tokenizer, decoding: str) -> int:
    """An encoder-decoder's first decoder token (the tokenizer's); decoder LMs read none."""
    return tokenizer.decoder_start_id if decoding == "encoder_decoder" else BOS_ID


def _until_eos(ids: np.ndarray, eos_id: int) -> np.ndarray:
    ends = np.flatnonzero(ids == eos_id)
    return ids[:ends[0]] if ends.size else ids


def print_samples(model, params, tokenizer, config, prompt: str, num_samples: int = 3) -> None:
    """Prints samples with nanoGPT's settings (temperature 0.8, top-k 200) continuing `prompt`,
    shortened to at most half the context (room to continue); the end of a training run."""
    while len(tokenizer.encode(prompt)) > config.seq_len // 2:
        prompt = prompt[:-1]
    print(f"\nsamples (temperature 0.8, top-k 200, prompt {prompt!r}):")
    for text in sample_texts(model, params, tokenizer, config, num_samples=num_samples,
                             prompt=prompt, temperature=0.8, top_k=200):
        print("---\n" + text)


def sample_texts(model, params, tokenizer, config, *, num_samples: int = 3, prompt: str = "",
                 temperature: float = 0.8, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                 max_new_tokens: int | None = None, chunk_size: int | None = None,
                 callback: Callable[[list[str]], None] | None = None) -> list[str]:
    """`num_samples` continuations of `prompt`, each ending at EOS or after `max_new_tokens`.

    Decoder LMs continue the prompt after an <eos> (a document start) and return prompt +
    continuation; by default they fill the training context of config.seq_len tokens. An
    encoder-decoder reads prompt + <eos> and returns what it decodes (default: seq_len tokens).
    With `chunk_size`, `callback` gets the texts so far after every chunk of tokens.
    """
    decoding = _decoding(config)
    s = sampling(temperature, top_k, top_p)
    _check_seed_and_eos(seed, None)
    check_max_new_tokens(max_new_tokens)
    encoded = _encode_prompt(tokenizer, prompt)
    banned = _banned_for(tokenizer, model, config)
    eos = tokenizer.eos_id
    if decoding == "encoder_decoder":
        prompt_ids = np.concatenate([encoded, [eos]]).astype(np.int32)
        keep = np.zeros(0, np.int32)
    else:
        prompt_ids = np.concatenate([[eos], encoded]).astype(np.int32)
        keep = prompt_ids[1:]
    n = _new_tokens(max_new_tokens, config, decoding, len(prompt_ids))

    def to_texts(rows):
        return [tokenizer.decode(np.concatenate([keep, _until_eos(r, eos)])) for r in rows]
    if n == 0:
        texts = to_texts(np.zeros((num_samples, 0), np.int32))
        if callback is not None:
            callback(texts)
        return texts
    if decoding == "recompute":
        length = len(prompt_ids) + n
        buffer = np.zeros((num_samples, length), np.int32)
        buffer[:, :len(prompt_ids)] = prompt_ids
        mode, knobs = _split(s, model.vocab_size, banned_ids=banned)
        out = _sample_loop(params, jnp.asarray(buffer), len(prompt_ids), np.int32(seed), knobs,
                           apply_fn=_ApplyTokens(model), length=length, mode=mode)
        texts = to_texts(np.asarray(out)[:, len(prompt_ids):])
        if callback is not None:
            callback(texts)
        return texts
    on_tokens = None if callback is None else (lambda tokens: callback(to_texts(tokens)))
    tokens, _ = decode(model, params, [prompt_ids] * num_samples, max_new_tokens=n,
                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed,
                       prefix_lm=decoding == "prefix", chunk_size=chunk_size,
                       callback=on_tokens, banned_ids=banned, eos_id=eos,
                       start_id=_start_id(tokenizer, decoding))
    return to_texts(tokens)


def check_max_new_tokens(max_new_tokens) -> None:
    """One-line error unless `max_new_tokens` is None (the default length) or an int >= 0
    (0: no new tokens, the prompt alone)."""
    if max_new_tokens is not None and (
            isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer)
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 0 "
                         "(0: the prompt alone)")


def _new_tokens(max_new_tokens: int | None, config, decoding: str, prompt_length: int) -> int:
    """`max_new_tokens`, or by default seq_len tokens (an encoder-decoder's output) or what
    fills the training context after the prompt (a decoder LM)."""
    if max_new_tokens is not None:
        return int(max_new_tokens)
    if decoding == "encoder_decoder":
        return config.seq_len
    if prompt_length >= config.seq_len:
        raise ValueError(f"prompt of {prompt_length} tokens: expected < seq_len="
                         f"{config.seq_len} (or pass max_new_tokens)")
    return config.seq_len - prompt_length


def _decoding(config) -> str:
    """How the config's model family generates (`Family.decoding`), or a one-line error."""
    family = family_of(config)
    if family.decoding is None:
        raise ValueError(f"model.family={family.name!r} does not generate text: expected one of "
                         f"{[name for name, f in FAMILIES.items() if f.decoding]}")
    return family.decoding


def beam_search_text(model, params, tokenizer, config, *, prompt: str, beam_size: int = 4,
                     max_new_tokens: int | None = None, length_penalty: float = 0.6) -> str:
    """The best beam for `prompt` (an encoder-decoder reads prompt + <eos>; a decoder LM
    continues <eos> + prompt and the result includes the prompt)."""
    decoding = _decoding(config)
    check_max_new_tokens(max_new_tokens)
    encoded = _encode_prompt(tokenizer, prompt)
    eos = tokenizer.eos_id
    if decoding == "encoder_decoder":
        ids, keep = np.concatenate([encoded, [eos]]), np.zeros(0, np.int32)
    else:
        ids = np.concatenate([[eos], encoded])
        keep = ids[1:]
    n = _new_tokens(max_new_tokens, config, decoding, len(ids))
    if n == 0:
        return tokenizer.decode(keep)
    tokens, _, _ = beam_search(model, params, [ids.astype(np.int32)], beam_size=beam_size,
                               max_new_tokens=n, length_penalty=length_penalty,
                               prefix_lm=decoding == "prefix",
                               banned_ids=_banned_for(tokenizer, model, config), eos_id=eos,
                               start_id=_start_id(tokenizer, decoding))
    return tokenizer.decode(np.concatenate([keep, _until_eos(tokens[0], eos)]))


def chat_replies(model, params, tokenizer, config, conversation, *, num_samples: int = 1,
                 temperature: float = 0.8, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                 max_new_tokens: int | None = None) -> list[str]:
    """`num_samples` assistant replies to `conversation` (a list of {"role", "content"}): the
    conversation rendered with the tokenizer's chat template and the assistant turn open
    (`add_generation_prompt`), exactly as `data.objective="sft"` renders training data, then
    sampled until the template's end of turn (or <eos>), which the reply leaves out."""
    from transformer.data import chat

    if _decoding(config) not in ("causal", "prefix"):
        raise ValueError(f"model.family={config.model.family!r}: --chat expected a decoder LM")
    check_max_new_tokens(max_new_tokens)
    prompt = chat.encode_chat(tokenizer, conversation, add_generation_prompt=True,
                              where="--chat")
    end = chat.end_of_turn_id(tokenizer)
    n = _new_tokens(max_new_tokens, config, "causal", len(prompt))
    banned = tuple(i for i in _banned_for(tokenizer, model, config) if i != end)
    tokens, _ = decode(model, params, [prompt] * num_samples, max_new_tokens=n,
                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       prefix_lm=_decoding(config) == "prefix", banned_ids=banned, eos_id=end)
    stops = [i for i in (end, tokenizer.eos_id) if i is not None]
    replies = []
    for row in tokens:
        cut = [int(np.flatnonzero(row == i)[0]) for i in stops if (row == i).any()]
        replies.append(tokenizer.decode(row[:min(cut, default=len(row))]))
    return replies


def read_chat(value: str) -> list[list[dict]]:
    """--chat's conversations: inline JSON (a messages list, or {"messages": [...]}), a .json
    file holding the same, or a JSONL file of one conversation per line."""
    import os

    from transformer.data import chat

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        try:
            json.loads(text)
        except json.JSONDecodeError:  # several lines: JSONL
            return [list(c.messages) for c in chat.read_conversations(value)]
        return [list(chat.parse_conversation(text, value).messages)]
    if not value.lstrip().startswith(("[", "{")):
        raise ValueError(f"--chat={value!r}: expected a JSON/JSONL file of conversations or "
                         'inline JSON, e.g. \'[{"role": "user", "content": "Hi"}]\'')
    return [list(chat.parse_conversation(value, "--chat").messages)]


# --- command line -------------------------------------------------------------------------------


def load_workdir(workdir: str, step: int | None = None):
    """(model, params, tokenizer, config) of checkpoint `step` (default: the latest) of a
    training workdir, with the tokenizer saved beside the checkpoints."""
    from transformer.data import inputs
    from transformer.models import build_model
    from transformer.training import finetune
    from transformer.utils import fileio

    saved = finetune.restore_params(workdir, step)
    tokenizer = tokenizers_lib.load_tokenizer(fileio.join(workdir, inputs.TOKENIZER_DIR))
    return build_model(saved.config.model), saved.params, tokenizer, saved.config


class _Streamer:
    """Prints the growing text of one sample, holding back a trailing partial UTF-8 character."""

    def __init__(self, out=sys.stdout):
        self.out, self.printed = out, ""

    def __call__(self, texts: list[str]) -> None:
        text = texts[0].rstrip("\ufffd")
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def main(argv) -> None:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    s = sampling(f.temperature, f.top_k, f.top_p)  # bad flags fail before any loading
    check_max_new_tokens(f.max_new_tokens)
    if f.num_samples < 1:
        raise ValueError(f"num_samples={f.num_samples}: expected >= 1")
    if f.beam_size < 0:
        raise ValueError(f"beam_size={f.beam_size}: expected an int >= 0 (0: sampling, no beam "
                         "search)")
    model, params, tokenizer, config = load_workdir(f.workdir, f.step)
    if f.chat is not None:
        conversations = read_chat(f.chat)
        if f.prompt:  # one more user turn
            conversations = [c + [{"role": "user", "content": f.prompt}] for c in conversations]
        for i, conversation in enumerate(conversations):
            for j, reply in enumerate(chat_replies(
                    model, params, tokenizer, config, conversation, num_samples=f.num_samples,
                    temperature=s.temperature, seed=f.seed, top_k=s.top_k, top_p=s.top_p,
                    max_new_tokens=f.max_new_tokens)):
                print(("---\n" if i or j else "") + reply)
        return
    if f.beam_size:
        print(beam_search_text(model, params, tokenizer, config, prompt=f.prompt,
                               beam_size=f.beam_size, max_new_tokens=f.max_new_tokens,
                               length_penalty=f.length_penalty))
        return
    stream = sys.stdout.isatty() and f.num_samples == 1 and _decoding(config) != "recompute"
    streamer = _Streamer() if stream else None
    texts = sample_texts(model, params, tokenizer, config, num_samples=f.num_samples,
                         prompt=f.prompt, temperature=s.temperature, seed=f.seed, top_k=s.top_k,
                         top_p=s.top_p, max_new_tokens=f.max_new_tokens,
                         chunk_size=f.chunk_size if stream else None, callback=streamer)
    if stream:
        streamer([texts[0]])
        print()
        return
    for i, text in enumerate(texts):
        if i:
            print("---")
        print(text)


if __name__ == "__main__":
    from absl import flags

    from transformer.utils import cli

    flags.DEFINE_string("workdir", None, "Training workdir to sample from.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_string("prompt", "", "Text to continue (t5: the encoder input).")
    flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate (default: fill the "
                         "training context seq_len; 0: print the prompt alone).")
    flags.DEFINE_float("temperature", 0.8, "0: greedy.")
    flags.DEFINE_integer("top_k", 0, "Sample among the k best tokens (0: all).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set reaching p (1: all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("num_samples", 1, "Continuations to generate (as one batch).")
    flags.DEFINE_integer("beam_size", 0, "Beam search with this many beams (0: sample).")
    flags.DEFINE_float("length_penalty", 0.6, "Beam search: GNMT length penalty alpha.")
    flags.DEFINE_string("chat", None, "Answer as the assistant: a JSON/JSONL file of "
                        "conversations ({\"messages\": [...]} per line) or inline JSON, rendered "
                        "with the tokenizer's chat template (--prompt: one more user turn).")
    flags.DEFINE_integer("chunk_size", 8, "Streaming: tokens per jitted chunk on a terminal.")
    cli.run(main)
