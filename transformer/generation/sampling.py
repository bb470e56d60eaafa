"""Sampling filters: logits -> tokens (greedy, temperature, top-k, top-p), never drawing banned
ids. `Sampling` is the setting; its static part (`_Mode`) shapes a compiled program, its traced
part (`_Knobs`) does not, so changing a temperature, the banned ids or the ids that end a row
(`eos_id`: one id, several, or None) does not recompile."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data import tokenizers as tokenizers_lib

PAD_ID, BOS_ID, EOS_ID = tokenizers_lib.PAD_ID, tokenizers_lib.BOS_ID, tokenizers_lib.EOS_ID
# Top-p counts a set as reaching p when its mass is within this of p (float32 cumsum rounding).
_TOP_P_TOLERANCE = 1e-6

Array = jax.Array


class Sampling(NamedTuple):
    """How a token is drawn from logits: temperature 0 is greedy (argmax); otherwise sample
    softmax(logits / temperature) restricted to the top_k best tokens (0: all) and then to the
    smallest best-first set whose probability reaches top_p (1.0: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


_SMALLEST_TEMPERATURE = float(np.finfo(np.float32).tiny)


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    """A validated `Sampling` (one-line ValueErrors naming the bad value)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}: expected a finite float >= 0")
    if 0 < temperature < _SMALLEST_TEMPERATURE:  # float32 would flush it to 0 (logits / 0)
        raise ValueError(f"temperature={temperature!r}: expected 0 (greedy) or a float >= "
                         f"{_SMALLEST_TEMPERATURE:.3g} (float32's smallest normal number)")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k={top_k!r}: expected an int >= 0 (0: no top-k filter)")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: expected a float in (0, 1] (1: no top-p filter)")
    return Sampling(float(temperature), int(top_k), float(top_p))


class _Mode(NamedTuple):
    """The part of a `Sampling` that shapes the compiled program; temperature, the top_p value
    and the stop ids are traced (`_Knobs`), so changing them does not recompile."""

    greedy: bool
    top_k: int
    top_p: bool  # filter by top-p


class _Knobs(NamedTuple):
    temperature: Array  # float32 scalar
    top_p: Array  # float32 scalar
    stop_V: Array  # bool [V]: ids that end a row (all False: none)
    banned_V: Array  # bool [V]: ids never drawn (a traced array: another set does not recompile)


def _split(s: Sampling, vocab_size: int, eos_id: int | Sequence[int] | None = None,
           banned_ids: Sequence[int] | None = None) -> tuple[_Mode, _Knobs]:
    mode = _Mode(s.temperature == 0.0, s.top_k, s.top_p < 1.0)
    # (a stop id past the vocabulary is never drawn, so it never ends a row: it is left out)
    stops = [i for i in _stop_ids(eos_id) if i < vocab_size]
    knobs = _Knobs(np.float32(s.temperature or 1.0), np.float32(s.top_p),
                   _banned_mask(stops, vocab_size), _banned_mask(banned_ids, vocab_size))
    return mode, knobs


def _stop_ids(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """The ids that end a row, from `eos_id`: one id, a sequence of ids (a checkpoint's
    generation_config.json `eos_token_id` list), or None (none); a one-line error otherwise."""
    if eos_id is None:
        ids = ()
    else:
        ids = tuple(eos_id) if np.iterable(eos_id) and not isinstance(eos_id, str) else (eos_id,)
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in ids):
        raise ValueError(f"eos_id={eos_id!r}: expected a token id >= 0, a list of them, or None")
    return tuple(dict.fromkeys(int(i) for i in ids))


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
    and top-p keep; the others are -inf. Top-k keeps every token tied with the k-th best (as
    HF's TopKLogitsWarper); top-p ranks ties lower token id first."""
    vocab = logits_BV.shape[-1]
    if 0 < top_k < vocab:
        values_BK, ids_BK = jax.lax.top_k(logits_BV, top_k)  # sorted, ties: lower index first
        # (min, not values_BK[:, -1]: XLA:CPU turns a slice of top_k into a sort of the row)
        kth_B1 = jnp.min(values_BK, axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
        if top_p is not None:
            logits_BV = _top_p_of_top_k(logits_BV, values_BK, ids_BK, kth_B1, top_p)
        return logits_BV, None
    if top_p is None:
        return logits_BV, None
    ids_BC = jnp.argsort(-logits_BV, axis=-1, stable=True)
    values_BC = jnp.take_along_axis(logits_BV, ids_BC, axis=-1)
    probs_BC = jax.nn.softmax(values_BC, axis=-1)
    before_BC = jnp.cumsum(probs_BC, axis=-1) - probs_BC  # mass of the better tokens
    keep_BC = (before_BC < top_p - _TOP_P_TOLERANCE).at[:, 0].set(True)
    return jnp.where(keep_BC, values_BC, -jnp.inf), ids_BC


def _top_p_of_top_k(logits_BV: Array, values_BK: Array, ids_BK: Array, kth_B1: Array,
                    top_p: Array) -> Array:
    """Top-p over what top-k kept (`logits_BV`, -inf elsewhere), without sorting the vocabulary:
    best first, the k of `lax.top_k` come first, then the other tokens tied with the k-th
    (equal to the k-th value: the mass before each is the k's plus one share per earlier tie)."""
    rows = jnp.arange(logits_BV.shape[0])[:, None]
    total_B1 = jax.nn.logsumexp(logits_BV, -1, keepdims=True)
    probs_BK = jnp.exp(values_BK - total_B1)
    before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
    keep_BK = (before_BK < top_p - _TOP_P_TOLERANCE).at[:, 0].set(True)
    keep_BV = jnp.zeros(logits_BV.shape, bool).at[rows, ids_BK].set(keep_BK)
    tied_BV = (logits_BV == kth_B1).at[rows, ids_BK].set(False)
    before_BV = (jnp.sum(probs_BK, -1, keepdims=True)
                 + (jnp.cumsum(tied_BV, axis=-1) - 1) * jnp.exp(kth_B1 - total_B1))
    keep_BV |= tied_BV & (before_BV < top_p - _TOP_P_TOLERANCE)
    return jnp.where(keep_BV, logits_BV, -jnp.inf)


def _filtered(logits_BV: Array, mode: _Mode, knobs: _Knobs):
    # Less the row's max first: logits / a tiny temperature would overflow to inf (and
    # inf - inf is NaN in the softmax); these are <= 0 and go to -inf instead.
    logits_BV = logits_BV.astype(jnp.float32)
    top_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    top_B1 = jnp.where(jnp.isfinite(top_B1), top_B1, 0.0)  # a row with every id banned
    return _candidates((logits_BV - top_B1) / knobs.temperature, mode.top_k,
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


def _probs(logits_BV: Array, mode: _Mode, knobs: _Knobs) -> Array:
    """float32 [B, V]: the distribution `_pick` draws from when sampling (banned ids and the
    tokens top-k / top-p leave out have probability 0)."""
    values_BC, ids_BC = _filtered(_allowed(logits_BV, knobs.banned_V), mode, knobs)
    probs_BC = jax.nn.softmax(values_BC, axis=-1)
    if ids_BC is None:
        return probs_BC
    rows = jnp.arange(probs_BC.shape[0])[:, None]
    return jnp.zeros(logits_BV.shape, jnp.float32).at[rows, ids_BC].set(probs_BC)


@functools.partial(jax.jit, static_argnames="mode")
def _kept(logits_BV, knobs, *, mode):
    logits_BV = _allowed(logits_BV, knobs.banned_V)
    if mode.greedy:
        return jax.nn.one_hot(jnp.argmax(logits_BV, -1), logits_BV.shape[-1], dtype=bool)
    values_BC, ids_BC = _filtered(logits_BV, mode, knobs)
    if ids_BC is None:
        return values_BC > -jnp.inf
    rows = jnp.arange(logits_BV.shape[0])[:, None]
    return jnp.zeros(logits_BV.shape, bool).at[rows, ids_BC].set(values_BC > -jnp.inf)


def kept_tokens(logits_BV: Array, *, top_k: int = 0, top_p: float = 1.0,
                temperature: float = 1.0) -> Array:
    """bool [B, V]: the tokens sampling may draw (top-k, ties with the k-th best included, then
    the smallest set reaching top_p).

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
