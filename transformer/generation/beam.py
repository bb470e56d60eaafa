"""Beam search over any model (`beam_search_tokens`, the `step_fn` of `loop`): GNMT's length
penalty, finished and alive beams, stopping once no alive beam can win."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer.generation.loop import StepFn, _lengths
from transformer.generation.sampling import (
    EOS_ID,
    PAD_ID,
    Array,
    _allowed,
    _banned_mask,
    _stop_ids,
)


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


def _expand(beams: _Beams, logits_RV: Array, banned_V: Array, *, alpha, stops: tuple[int, ...],
            cache_batch_axis) -> _Beams:
    """Extends every alive beam by every allowed token, keeps the 2K best: those ending in one of
    the `stops` (EOS) compete for the finished set, the others for the alive set; reorders the
    cache rows to match. Log-probabilities are renormalized over the allowed tokens. K = 1 keeps
    only the best token: greedy decoding, as HF's num_beams=1 (with 2 candidates an EOS ranked
    second would finish, and could win, where greedy goes on)."""
    batch, k, n = beams.alive.shape
    vocab = logits_RV.shape[-1]
    t = beams.step
    allowed_RV = _allowed(logits_RV, banned_V)
    logp_BKV = jax.nn.log_softmax(allowed_RV, -1).reshape(batch, k, vocab)
    scores_BX = (beams.alive_logp[:, :, None] + logp_BKV).reshape(batch, k * vocab)
    if k == 1:  # [B, 1]: the argmax of the logits themselves, as greedy `decode` takes it
        flat_B2 = jnp.argmax(allowed_RV, -1)[:, None]
        top_B2 = jnp.take_along_axis(scores_BX, flat_B2, 1)
    else:
        top_B2, flat_B2 = jax.lax.top_k(scores_BX, 2 * k)
    beam_B2, token_B2 = flat_B2 // vocab, (flat_B2 % vocab).astype(jnp.int32)
    seqs_B2N = jnp.take_along_axis(beams.alive, beam_B2[:, :, None], axis=1)
    seqs_B2N = jax.lax.dynamic_update_slice_in_dim(seqs_B2N, token_B2[:, :, None], t, 2)
    is_eos = jnp.isin(token_B2, jnp.asarray(stops, jnp.int32)) if stops else \
        jnp.zeros_like(token_B2, bool)

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
                       length_penalty: float = 0.6, eos_id: int | Sequence[int] | None = EOS_ID,
                       cache_batch_axis: int = 0,
                       banned: Array | Sequence[int] | None = None) -> tuple[Array, Array, Array]:
    """Beam search over any model: the best sequence of each of B inputs, (tokens [B, N],
    lengths [B], scores [B]); pure and jittable.

    The inputs are R = B * K rows, input b repeated in rows b*K .. b*K + K-1 (cache, context,
    first logits, start positions), with `step_fn` as in `generate_tokens`. A sequence's score
    is its log-probability / ((5 + length) / 6) ** length_penalty (GNMT), length counting the
    EOS (`eos_id`: an id, several ids, or None); a sequence reaching N tokens without EOS also
    finishes. Each step keeps the 2K best extensions, and an EOS among them finishes a
    hypothesis (t2t's rule; HF admits one from the top K only). The search stops early once no
    alive beam can beat the K finished ones. `beam_size=1` is greedy decoding.
    `banned`: ids never chosen, as a list or a bool [V] mask (an array, which may be traced).
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
    stops = _stop_ids(eos_id)
    expand = functools.partial(_expand, banned_V=banned, alpha=length_penalty, stops=stops,
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
    return tokens, _lengths(tokens, stops), scores[:, 0]
