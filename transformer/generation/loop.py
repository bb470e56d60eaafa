"""The sampling loop over any model: a jitted `lax.while_loop` emitting one token per row and
step (its carry: `DecodeState`), stopping at `max_new_tokens` or when every row emitted a stop
id (EOS, or any of several: `eos_id` may list them).
`generate_tokens` runs it over any `step_fn(params, context, cache, tokens_B1, positions_B1)
-> (logits_BV, cache)`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer.generation.sampling import (
    EOS_ID,
    PAD_ID,
    Array,
    _Knobs,
    _Mode,
    _pick,
    _split,
    _stop_ids,
    sampling,
)

StepFn = Callable[[Any, Any, Any, Array, Array], tuple[Array, Any]]


class DecodeState(NamedTuple):
    """The while-loop carry. `step` tokens have been emitted into `tokens` [B, N]; the last one
    (`last`) is fed next, at position start + step - 1. Rows that emitted a stop id are `done`
    and emit PAD_ID from then on."""

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
    done = state.done | jnp.asarray(state.knobs.stop_V)[token_B]
    return state._replace(tokens=tokens, last=token_B, step=state.step + 1, done=done)


def _start_state(cache, context, first_logits_BV, start_B, seed, knobs, *, max_new_tokens,
                 mode, keys=None) -> DecodeState:
    """The state after the first token. `keys` [B]: the rows' PRNG keys, in place of `seed`'s
    split (`programs.decode` passes a row its key in the whole batch when it decodes the rows
    in groups)."""
    batch = first_logits_BV.shape[0]
    keys = jax.random.split(jax.random.key(seed), batch) if keys is None else keys
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


def _lengths(tokens_BN, eos_id: int | Sequence[int] | None):
    """Tokens up to and including the first stop id (all N without one), NumPy or JAX."""
    xp = np if isinstance(tokens_BN, np.ndarray) else jnp
    n, stops = tokens_BN.shape[1], _stop_ids(eos_id)
    if not stops:
        return xp.full(tokens_BN.shape[0], n, np.int32)
    is_eos = xp.isin(tokens_BN, xp.asarray(stops))
    return xp.where(is_eos.any(1), xp.argmax(is_eos, 1) + 1, n).astype(np.int32)


def generate_tokens(step_fn: StepFn, params, context, cache, first_logits_BV: Array,
                    start_B: Array, *, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | Array = 0,
                    eos_id: int | Sequence[int] | None = EOS_ID,
                    banned_ids: Sequence[int] | None = None) -> tuple[Array, Array]:
    """The sampling loop over any model: (tokens [B, N], lengths [B]), pure and jittable.

    `first_logits_BV` predict the first new token (from the prefill); `step_fn(params, context,
    cache, tokens_B1, positions_B1) -> (logits_BV, cache)` feeds token t of each row at position
    start_B + t. Each row samples with its own key (`seed` split per row, folded with the step),
    so a row's tokens do not depend on the rest of the batch. A row stops at `eos_id` (an id,
    several ids, or None: never) and emits PAD_ID after; lengths count the tokens up to and
    including it. `banned_ids` are never drawn.
    """
    mode, knobs = _split(sampling(temperature, top_k, top_p), first_logits_BV.shape[-1], eos_id,
                         banned_ids)
    state = _start_state(cache, context, first_logits_BV, start_B, seed, knobs,
                         max_new_tokens=max_new_tokens, mode=mode)
    state = _run(step_fn, params, state, max_new_tokens, mode)
    return state.tokens, _lengths(state.tokens, eos_id)
