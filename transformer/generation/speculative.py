"""Speculative decoding with a decoder LM's own multi-token prediction modules as the draft
(`model.mtp.depth` = D, `transformer.nn.mtp`): each round the modules propose D tokens, the LM
checks them all in one forward pass of D + 1 tokens, and keeps the longest run it accepts plus
one token of its own. Greedy, the output equals plain greedy decoding token for token (the LM
decides every token); the modules only decide how many come out of a round, 1 to D + 1.

Sampling (temperature > 0; speculative sampling, Leviathan et al. 2023 and Chen et al. 2023):
module k draws its draft d_k from its own distribution q_k (the same temperature, top-k and
top-p), and with p_j the LM's distribution at verify position j the LM accepts d_{j+1} with
probability min(1, p_j(d_{j+1}) / q_{j+1}(d_{j+1})), in order, until one is rejected; at the
first rejection (position a) it draws its own token from max(0, p_a - q_{a+1}) renormalized,
after D acceptances from p_D. Every token then follows the LM's sampling distribution exactly,
as `programs.decode(temperature=...)` draws it: the same distribution, not the same tokens for
a seed. For example, with p_0 = (0.5, 0.5) and q_1 = (0.9, 0.1) over two ids, a drafted id 0
is kept with probability 0.5 / 0.9, and a rejection draws from (0, 0.4) / 0.4, i.e. id 1:
id 0 comes out with probability 0.9 x 0.5 / 0.9 = 0.5.

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
after a stop id (EOS). Only softmax-attention layers are accepted: a recurrent layer's state
cannot take back the rejected drafts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer.generation.loop import _lengths
from transformer.generation.programs import _as_batch, _check_seed_and_eos
from transformer.generation.sampling import (
    EOS_ID,
    PAD_ID,
    _allowed,
    _Knobs,
    _Mode,
    _probs,
    _split,
    sampling,
)
from transformer.models import DecoderLM

Array = jax.Array
ATTENTION_LAYERS = ("full_attention", "sliding_attention")


class SpeculativeStats(NamedTuple):
    """What the drafts bought, per row: `rounds` LM passes checking drafts (after the prompt's
    pass, which gives the first token), the `offered` drafts whose positions were still to come
    (D a round, fewer in a round that reaches max_new_tokens) and the `accepted` ones that
    became tokens. Acceptance rate = accepted / offered; tokens per checking pass =
    (accepted + rounds) / rounds; new tokens = accepted + rounds + 1 a row."""

    rounds: np.ndarray  # [B]
    accepted: np.ndarray  # [B]
    depth: int
    offered: np.ndarray  # [B]

    @property
    def acceptance_rate(self) -> float:
        return float(self.accepted.sum() / max(self.offered.sum(), 1))

    @property
    def tokens_per_pass(self) -> float:
        return float((self.accepted.sum() + self.rounds.sum()) / max(self.rounds.sum(), 1))

    @property
    def tokens(self) -> int:
        """New tokens in all, EOS included: the prompt's pass gives each row its first."""
        return int(self.accepted.sum() + self.rounds.sum() + len(self.rounds))


class _State(NamedTuple):
    cache: dict
    hidden: Array  # [B, L, D]: the LM's final-norm vectors at each position it has read
    seq: Array  # [B, L]: prompt and new tokens by position; drafts past `known` - 1
    known: Array  # [B]: tokens known (positions < known)
    start: Array  # [B]: the prompt's length, the position of the first new token
    done: Array  # [B]
    rounds: Array  # [B]
    accepted: Array  # [B]
    offered: Array  # [B]
    draft_probs: Array  # [B, D, V]: the distribution each draft was drawn from ([B, D, 0] greedy)
    key: Array  # the PRNG key of the next draws


@dataclasses.dataclass(frozen=True)
class _Program:
    model: DecoderLM
    cache_length: int
    max_new_tokens: int
    mode: _Mode  # greedy, or sampling with its top-k / top-p filters

    def choose(self, logits_BV, knobs: _Knobs, key) -> tuple[Array, Array]:
        """(a token per row [B], the distribution it was drawn from [B, V]; [B, 0] greedy)."""
        if self.mode.greedy:
            return _greedy(logits_BV, knobs.banned_V), jnp.zeros((len(logits_BV), 0))
        probs_BV = _probs(logits_BV, self.mode, knobs)
        return _draw(key, probs_BV), probs_BV

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

    def prefill(self, params, prompts_BP, lengths_B, knobs: _Knobs, key) -> _State:
        batch, length = prompts_BP.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompts_BP.shape)
        (logits_BPV, hidden_BPD), cache = self.apply(
            params, self.init_cache(batch), prompts_BP, positions=positions, decode=True,
            cache_length=self.cache_length, with_hidden=True)
        rows = jnp.arange(batch)
        key, first_key = jax.random.split(key)
        first_B, _ = self.choose(logits_BPV[rows, lengths_B - 1], knobs, first_key)
        seq = jnp.zeros((batch, self.cache_length + self.depth), jnp.int32)
        seq = seq.at[:, :length].set(prompts_BP).at[rows, lengths_B].set(first_B)
        hidden = jnp.zeros((batch, self.cache_length, hidden_BPD.shape[-1]), hidden_BPD.dtype)
        hidden = hidden.at[:, :length].set(hidden_BPD)
        zeros = jnp.zeros(batch, jnp.int32)
        done = jnp.asarray(knobs.stop_V)[first_B] | (self.max_new_tokens == 1)
        vocab = 0 if self.mode.greedy else logits_BPV.shape[-1]
        state = _State(cache, hidden, seq, lengths_B + 1, lengths_B, done, zeros, zeros, zeros,
                       jnp.zeros((batch, self.depth, vocab)), key)
        # the modules' caches start with the whole prompt
        return self.draft(params, state, knobs, window=max(length, 2 * self.depth))

    def draft(self, params, state: _State, knobs: _Knobs, window: int | None = None) -> _State:
        """Each module's proposal at position known - 2, written to seq[known - 1 + k], from
        a run over the `window` positions up to there (default 2 D: all whose inputs changed
        since the last round)."""
        window = window or 2 * self.depth
        start_B = jnp.clip(state.known - 1 - window, 0, self.cache_length - window)
        positions_BW = start_B[:, None] + jnp.arange(window, dtype=jnp.int32)
        last_B1 = (state.known - 2 - start_B)[:, None]
        rows = jnp.arange(state.seq.shape[0])
        hidden_BWD = jnp.take_along_axis(state.hidden, positions_BW[..., None], axis=1)
        cache, seq, draft_probs = state.cache, state.seq, state.draft_probs
        key, draft_key = jax.random.split(state.key)
        for k in range(1, self.depth + 1):
            tokens_BW = jnp.take_along_axis(seq, positions_BW + k, axis=1)
            (hidden_BWD, logits_BWV), cache = self.apply(
                params, cache, k, hidden_BWD, tokens_BW, positions_BW, self.cache_length,
                method="draft")  # by name: a quantized model wraps it
            logits_BV = jnp.take_along_axis(logits_BWV, last_B1[..., None], axis=1)[:, 0]
            token_B, probs_BV = self.choose(logits_BV, knobs, jax.random.fold_in(draft_key, k))
            seq = seq.at[rows, state.known - 1 + k].set(token_B)
            draft_probs = draft_probs.at[:, k - 1].set(probs_BV)
        return state._replace(cache=cache, seq=seq, draft_probs=draft_probs, key=key)

    def verify(self, params, state: _State, knobs: _Knobs) -> _State:
        """The LM on t_{n-1} and the drafts; each row keeps the accepted drafts and one more, up
        to max_new_tokens and the first stop id (EOS)."""
        depth, rows = self.depth, jnp.arange(state.seq.shape[0])
        positions_BT = state.known[:, None] - 1 + jnp.arange(depth + 1, dtype=jnp.int32)
        tokens_BT = jnp.take_along_axis(state.seq, positions_BT, axis=1)
        (logits_BTV, hidden_BTD), cache = self.apply(
            params, state.cache, tokens_BT, positions=positions_BT, decode=True,
            cache_length=self.cache_length, with_hidden=True)
        key, verify_key = jax.random.split(state.key)
        if self.mode.greedy:  # the LM's own tokens g_0..g_D; drafts accepted while d_j = g_{j-1}
            chosen_BT = _greedy(logits_BTV, knobs.banned_V)
            agreed_B = jnp.sum(jnp.cumprod(tokens_BT[:, 1:] == chosen_BT[:, :-1], axis=1), axis=1)
        else:
            agreed_B, chosen_BT = self.accept(logits_BTV, tokens_BT[:, 1:], state.draft_probs,
                                              knobs, verify_key)
        new_BT = positions_BT + 1  # where chosen_BT's tokens go
        keep_BT = (new_BT - state.known[:, None] <= agreed_B[:, None]) & (
            new_BT < (state.start + self.max_new_tokens)[:, None])
        eos_BT = jnp.asarray(knobs.stop_V)[chosen_BT] & keep_BT
        keep_BT &= jnp.cumsum(eos_BT, axis=1) - eos_BT == 0  # up to the first EOS, included
        active_B = ~state.done
        # drafts for positions still to come: those past max_new_tokens could not be kept
        to_come_B = state.start + self.max_new_tokens - state.known
        offered_B = jnp.where(active_B, jnp.minimum(depth, to_come_B - 1), 0)
        gained_B = jnp.where(active_B, jnp.sum(keep_BT, axis=1), 0).astype(jnp.int32)
        written_BT = jnp.where(active_B[:, None], chosen_BT,
                               jnp.take_along_axis(state.seq, new_BT, axis=1))
        known_B = state.known + gained_B
        return state._replace(
            cache=cache, hidden=state.hidden.at[rows[:, None], positions_BT].set(hidden_BTD),
            seq=state.seq.at[rows[:, None], new_BT].set(written_BT), known=known_B,
            done=state.done | jnp.any(eos_BT, axis=1) | (
                known_B >= state.start + self.max_new_tokens),
            rounds=state.rounds + active_B, accepted=state.accepted + jnp.maximum(gained_B - 1, 0),
            offered=state.offered + offered_B, key=key)

    def accept(self, logits_BTV, drafts_BD, draft_probs_BDV, knobs: _Knobs, key):
        """Speculative sampling: (accepted drafts a [B], tokens [B, D + 1]: the drafts, and at
        index a the LM's draw from max(0, p_a - q_{a+1}), from p_D when a = D)."""
        batch, width, vocab = logits_BTV.shape
        p_BTV = _probs(logits_BTV.reshape(batch * width, vocab), self.mode, knobs).reshape(
            batch, width, vocab)
        p_BD = jnp.take_along_axis(p_BTV[:, :-1], drafts_BD[..., None], axis=-1)[..., 0]
        q_BD = jnp.take_along_axis(draft_probs_BDV, drafts_BD[..., None], axis=-1)[..., 0]
        accept_key, draw_key = jax.random.split(key)
        # d is kept with probability min(1, p(d) / q(d)): u q(d) < p(d), u uniform in [0, 1)
        kept_BD = jax.random.uniform(accept_key, p_BD.shape) * q_BD < p_BD
        agreed_B = jnp.sum(jnp.cumprod(kept_BD, axis=1), axis=1)
        rows, depth = jnp.arange(batch), width - 1
        p_BV = p_BTV[rows, agreed_B]
        q_BV = jnp.where((agreed_B < depth)[:, None],
                         draft_probs_BDV[rows, jnp.minimum(agreed_B, depth - 1)], 0.0)
        residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
        # all zero only where p = q (up to rounding): then nothing is rejected; p stands in
        residual_BV = jnp.where(jnp.sum(residual_BV, -1, keepdims=True) > 0, residual_BV, p_BV)
        next_B = _draw(draw_key, residual_BV)  # categorical renormalizes
        chosen_BT = jnp.where(jnp.arange(width) < agreed_B[:, None],
                              jnp.pad(drafts_BD, ((0, 0), (0, 1))), next_B[:, None])
        return agreed_B, chosen_BT


def _greedy(logits, banned_V) -> Array:
    """argmax over the ids not banned, as `sampling._pick` chooses greedily."""
    return jnp.argmax(_allowed(logits, banned_V), axis=-1).astype(jnp.int32)


def _draw(key, probs_BV) -> Array:
    """A token per row drawn from the (unnormalized) distributions [B, V]."""
    return jax.random.categorical(key, jnp.log(probs_BV), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("program",))
def _run(params, prompts_BP, lengths_B, knobs: _Knobs, key, *, program: _Program):
    state = program.prefill(params, prompts_BP, lengths_B, knobs, key)

    def body(state):
        return program.draft(params, program.verify(params, state, knobs), knobs)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return state.seq, state.rounds, state.accepted, state.offered


def new_tokens_that_fit(model_config, prompt_length: int) -> int:
    """How many new tokens a learned position table (max_len) holds after a prompt: verify
    writes up to D positions past the last new token, and the draft window is 2 D wide."""
    return model_config.max_len - prompt_length - 2 * model_config.mtp.depth


def speculative_decode(model: DecoderLM, params, prompts, *, max_new_tokens: int,
                       eos_id: int | Sequence[int] | None = EOS_ID, lengths=None,
                       banned_ids=None,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int = 0) -> tuple[np.ndarray, np.ndarray, SpeculativeStats]:
    """Decoding drafted by the model's multi-token prediction modules: (tokens [B, N], lengths
    [B], stats). Greedy (temperature 0), the tokens equal `programs.decode(..., temperature=0)`'s
    (with the same `banned_ids`, never emitted); sampling, they follow the distribution
    `decode` samples with the same temperature, top_k and top_p. Prompts and `eos_id` (one stop
    id, several, or None) as in `decode`."""
    cfg = model.config
    mode, knobs = _split(sampling(temperature, top_k, top_p), model.vocab_size, eos_id,
                         banned_ids)
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
    _check_seed_and_eos(seed, eos_id)
    inputs, lengths = _as_batch(prompts, lengths, model.vocab_size)
    prompt_length = inputs.shape[1]
    cache_length = prompt_length + max_new_tokens + 2 * cfg.mtp.depth
    if cfg.position == "learned" and cache_length > cfg.max_len:
        fits = new_tokens_that_fit(cfg, prompt_length)
        raise ValueError(f"prompt of {prompt_length} tokens + max_new_tokens={max_new_tokens} "
                         f"+ 2 x mtp.depth = {cache_length} positions: expected <= the model's "
                         f"max_len={cfg.max_len} (" + (f"max_new_tokens <= {fits}" if fits > 0
                                                       else "a shorter prompt") + ")")
    program = _Program(model, cache_length, max_new_tokens, mode)
    seq, rounds, accepted, offered = _run(params, inputs, lengths, knobs,
                                          jax.random.key(seed), program=program)
    seq = np.asarray(seq)
    tokens = np.full((len(inputs), max_new_tokens), PAD_ID, np.int32)
    for b, start in enumerate(lengths):
        tokens[b] = seq[b, start:start + max_new_tokens]
    out_lengths = _lengths(tokens, eos_id)
    tokens[np.arange(max_new_tokens)[None] >= out_lengths[:, None]] = PAD_ID
    return tokens, out_lengths, SpeculativeStats(np.asarray(rounds), np.asarray(accepted),
                                                 cfg.mtp.depth, np.asarray(offered))
