"""Greedy speculative decoding with a decoder LM's own multi-token prediction modules as the
draft (`model.mtp.depth` = D, `transformer.nn.mtp`): each round the modules propose D tokens,
the LM checks them all in one forward pass of D + 1 tokens, and keeps the longest run it agrees
with plus its own next token. The output equals plain greedy decoding token for token (the LM
decides every token); the modules only decide how many come out of a round, 1 to D + 1.

A round, for a row whose tokens are known up to position n - 1 (the LM's KV cache and final
hidden states up to n - 2):

1. draft: module k at position n - 2 reads h^{k-1} and token t_{n-2+k} (a draft for k >= 2)
   and proposes d_k for position n - 1 + k. Each module runs over a window of the last 2 D
   positions, so its own KV cache is rewritten wherever its inputs changed since the last
   round (new hidden states, drafts that became known tokens): the drafts are those of exact
   multi-token prediction over the true history.
2. verify: the LM reads t_{n-1}, d_1, ..., d_D at positions n - 1 .. n - 1 + D, giving its
   greedy tokens g_0..g_D. With a the number of leading drafts equal to the LM's choices
   (d_j = g_{j-1}), the row gains g_0..g_a. The cache slots the rejected drafts wrote are
   overwritten by the next round before anything reads them.

Rows advance independently (each has its own positions); a row stops at `max_new_tokens` or
after EOS. Only softmax-attention layers are accepted: a recurrent layer's state cannot take
back the rejected drafts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer.generation.loop import _lengths
from transformer.generation.programs import _as_batch, _check_seed_and_eos
from transformer.generation.sampling import EOS_ID, PAD_ID, _allowed, _banned_mask
from transformer.models import DecoderLM

Array = jax.Array
ATTENTION_LAYERS = ("full_attention", "sliding_attention")


class SpeculativeStats(NamedTuple):
    """What the drafts bought: `rounds` LM passes per row (each proposing D drafts) and the
    `accepted` drafts per row; acceptance rate = accepted / (rounds x D), tokens per LM pass =
    (accepted + rounds) / rounds."""

    rounds: np.ndarray  # [B]
    accepted: np.ndarray  # [B]
    depth: int

    @property
    def acceptance_rate(self) -> float:
        return float(self.accepted.sum() / max(self.rounds.sum() * self.depth, 1))

    @property
    def tokens_per_pass(self) -> float:
        return float((self.accepted.sum() + self.rounds.sum()) / max(self.rounds.sum(), 1))


class _State(NamedTuple):
    cache: dict
    hidden: Array  # [B, L, D]: the LM's final-norm vectors at each position it has read
    seq: Array  # [B, L]: prompt and new tokens by position; drafts past `known` - 1
    known: Array  # [B]: tokens known (positions < known)
    start: Array  # [B]: the prompt's length, the position of the first new token
    done: Array  # [B]
    rounds: Array  # [B]
    accepted: Array  # [B]


@dataclasses.dataclass(frozen=True)
class _Program:
    model: DecoderLM
    cache_length: int
    max_new_tokens: int

    @property
    def depth(self) -> int:
        return self.model.config.mtp.depth

    def apply(self, params, cache, *args, **kwargs):
        out, mutated = self.model.apply({"params": params, "cache": cache}, *args,
                                        mutable=["cache"], **kwargs)
        return out, mutated["cache"]

    def init_cache(self, batch: int):
        length = self.cache_length
        tokens = jnp.zeros((batch, length), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
        shapes = jax.eval_shape(lambda: self.model.init(
            jax.random.key(0), tokens, positions=positions, decode=True, cache_length=length,
            mtp_tokens=tokens))["cache"]
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def prefill(self, params, prompts_BP, lengths_B, eos_id, banned_V) -> _State:
        batch, length = prompts_BP.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompts_BP.shape)
        (logits_BPV, hidden_BPD), cache = self.apply(
            params, self.init_cache(batch), prompts_BP, positions=positions, decode=True,
            cache_length=self.cache_length, with_hidden=True)
        rows = jnp.arange(batch)
        first_B = _greedy(logits_BPV[rows, lengths_B - 1], banned_V)
        seq = jnp.zeros((batch, self.cache_length + self.depth), jnp.int32)
        seq = seq.at[:, :length].set(prompts_BP).at[rows, lengths_B].set(first_B)
        hidden = jnp.zeros((batch, self.cache_length, hidden_BPD.shape[-1]), hidden_BPD.dtype)
        hidden = hidden.at[:, :length].set(hidden_BPD)
        zeros = jnp.zeros(batch, jnp.int32)
        done = (first_B == eos_id) | (self.max_new_tokens == 1)
        state = _State(cache, hidden, seq, lengths_B + 1, lengths_B, done, zeros, zeros)
        # the modules' caches start with the whole prompt
        return self.draft(params, state, banned_V, window=max(length, 2 * self.depth))

    def draft(self, params, state: _State, banned_V, window: int | None = None) -> _State:
        """Each module's proposal at position known - 2, written to seq[known - 1 + k], from
        a run over the `window` positions up to there (default 2 D: all whose inputs changed
        since the last round)."""
        window = window or 2 * self.depth
        start_B = jnp.clip(state.known - 1 - window, 0, self.cache_length - window)
        positions_BW = start_B[:, None] + jnp.arange(window, dtype=jnp.int32)
        last_B1 = (state.known - 2 - start_B)[:, None]
        rows = jnp.arange(state.seq.shape[0])
        hidden_BWD = jnp.take_along_axis(state.hidden, positions_BW[..., None], axis=1)
        cache, seq = state.cache, state.seq
        for k in range(1, self.depth + 1):
            tokens_BW = jnp.take_along_axis(seq, positions_BW + k, axis=1)
            (hidden_BWD, logits_BWV), cache = self.apply(
                params, cache, k, hidden_BWD, tokens_BW, positions_BW, self.cache_length,
                method=DecoderLM.draft)
            logits_BV = jnp.take_along_axis(logits_BWV, last_B1[..., None], axis=1)[:, 0]
            seq = seq.at[rows, state.known - 1 + k].set(_greedy(logits_BV, banned_V))
        return state._replace(cache=cache, seq=seq)

    def verify(self, params, state: _State, eos_id, banned_V) -> _State:
        """The LM on t_{n-1} and the drafts; each row keeps the agreed drafts and one more, up
        to max_new_tokens and the first EOS."""
        depth, rows = self.depth, jnp.arange(state.seq.shape[0])
        positions_BT = state.known[:, None] - 1 + jnp.arange(depth + 1, dtype=jnp.int32)
        tokens_BT = jnp.take_along_axis(state.seq, positions_BT, axis=1)
        (logits_BTV, hidden_BTD), cache = self.apply(
            params, state.cache, tokens_BT, positions=positions_BT, decode=True,
            cache_length=self.cache_length, with_hidden=True)
        greedy_BT = _greedy(logits_BTV, banned_V)
        agreed_B = jnp.sum(jnp.cumprod(tokens_BT[:, 1:] == greedy_BT[:, :-1], axis=1), axis=1)
        new_BT = positions_BT + 1  # where g_0..g_D go
        keep_BT = (new_BT - state.known[:, None] <= agreed_B[:, None]) & (
            new_BT < (state.start + self.max_new_tokens)[:, None])
        eos_BT = (greedy_BT == eos_id) & keep_BT
        keep_BT &= jnp.cumsum(eos_BT, axis=1) - eos_BT == 0  # up to the first EOS, included
        active_B = ~state.done
        gained_B = jnp.where(active_B, jnp.sum(keep_BT, axis=1), 0).astype(jnp.int32)
        written_BT = jnp.where(active_B[:, None], greedy_BT,
                               jnp.take_along_axis(state.seq, new_BT, axis=1))
        known_B = state.known + gained_B
        return state._replace(
            cache=cache, hidden=state.hidden.at[rows[:, None], positions_BT].set(hidden_BTD),
            seq=state.seq.at[rows[:, None], new_BT].set(written_BT), known=known_B,
            done=state.done | jnp.any(eos_BT, axis=1) | (
                known_B >= state.start + self.max_new_tokens),
            rounds=state.rounds + active_B, accepted=state.accepted + jnp.maximum(gained_B - 1, 0))


def _greedy(logits, banned_V) -> Array:
    """argmax over the ids not banned, as `sampling._pick` chooses greedily."""
    return jnp.argmax(_allowed(logits, banned_V), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("program",))
def _run(params, prompts_BP, lengths_B, eos_id, banned_V, *, program: _Program):
    state = program.prefill(params, prompts_BP, lengths_B, eos_id, banned_V)

    def body(state):
        return program.draft(params, program.verify(params, state, eos_id, banned_V), banned_V)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return state.seq, state.rounds, state.accepted


def speculative_decode(model: DecoderLM, params, prompts, *, max_new_tokens: int,
                       eos_id: int | None = EOS_ID, lengths=None, banned_ids=None
                       ) -> tuple[np.ndarray, np.ndarray, SpeculativeStats]:
    """Greedy decoding drafted by the model's multi-token prediction modules: (tokens [B, N],
    lengths [B], stats), the tokens equal to `programs.decode(..., temperature=0)`'s (with the
    same `banned_ids`, never emitted). Prompts as in `decode`."""
    cfg = model.config
    if not cfg.mtp.depth:
        raise ValueError("speculative decoding: expected a model with model.mtp.depth > 0 (its "
                         "modules are the draft)")
    mixers = sorted({cfg.layer_type(i) for i in range(cfg.num_layers)} - set(ATTENTION_LAYERS))
    if mixers:
        raise ValueError(f"speculative decoding with {mixers[0]} layers: expected softmax "
                         "attention only (a recurrent state cannot take back rejected drafts)")
    if cfg.moe.num_experts and cfg.moe.capacity_factor:
        raise ValueError(f"speculative decoding with moe.capacity_factor="
                         f"{cfg.moe.capacity_factor}: expected 0 (dropless; with a capacity, "
                         "which tokens are dropped depends on how many are checked at once)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
    _check_seed_and_eos(0, eos_id)
    inputs, lengths = _as_batch(prompts, lengths, model.vocab_size)
    prompt_length = inputs.shape[1]
    # verify writes up to D positions past the last new token; the draft window is 2 D wide
    cache_length = prompt_length + max_new_tokens + 2 * cfg.mtp.depth
    if cfg.position == "learned" and cache_length > cfg.max_len:
        raise ValueError(f"prompt of {prompt_length} tokens + max_new_tokens={max_new_tokens} "
                         f"+ 2 x mtp.depth = {cache_length} positions: expected <= the model's "
                         f"max_len={cfg.max_len}")
    program = _Program(model, cache_length, max_new_tokens)
    eos = np.int32(-1 if eos_id is None else eos_id)
    seq, rounds, accepted = _run(params, inputs, lengths, eos,
                                 _banned_mask(banned_ids, model.vocab_size), program=program)
    seq = np.asarray(seq)
    tokens = np.full((len(inputs), max_new_tokens), PAD_ID, np.int32)
    for b, start in enumerate(lengths):
        tokens[b] = seq[b, start:start + max_new_tokens]
    out_lengths = _lengths(tokens, eos_id)
    tokens[np.arange(max_new_tokens)[None] >= out_lengths[:, None]] = PAD_ID
    return tokens, out_lengths, SpeculativeStats(np.asarray(rounds), np.asarray(accepted),
                                                 cfg.mtp.depth)
