"""How a mixture-of-experts router picks each token's experts and their gates.

A float32 router gives each token a logit per expert (E of them), turned into scores:

    softmax  p = softmax(logits)            (GShard, Switch, Mixtral, Qwen-MoE)
    sigmoid  p = sigmoid(logits)            (DeepSeek-V3: each expert's affinity on its own)

The experts chosen are the top k of `p + b`, where b is the expert bias of auxiliary-loss-free
balancing (DeepSeek-V3, zeros without it). With grouped routing (DeepSeek-V3's `n_group`,
`topk_group`) the E experts form G equal groups, a group scores the sum of its two best
`p + b`, and a token chooses among the experts of its `topk_group` best groups only. The gates
are the chosen experts' `p`, never `b`: renormalised to sum 1 (when `normalize` and k > 1),
then times `scale` (DeepSeek's routed_scaling_factor).

The bias is not trained by gradients (it only moves a choice): after every step it moves by
`rate * sign(mean load - load_e)` (`update_balance_bias`), towards balance.

Two groups of two experts, one token, top-2 from the best group: group 1 holds the best
expert (0.9) but group 0's two together score more (0.7 + 0.6 > 0.9 + 0.1), so both choices
come from group 0.

>>> p = jnp.array([0.7, 0.6, 0.9, 0.1])
>>> logits = jnp.log(p / (1 - p))[None, None]  # sigmoid(logits) = p
>>> r = route(logits, top_k=2, slots=None, score="sigmoid", groups=2, top_groups=1)
>>> r.choice_BTK.tolist(), [round(g, 3) for g in r.gates_BTK[0, 0].tolist()]
([[[0, 1]]], [0.538, 0.462])
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array
SCORES = ("softmax", "sigmoid")

_TOKEN_WEIGHT = contextvars.ContextVar("routing_token_weight", default=None)


@contextlib.contextmanager
def token_weight(weight: Array | float):
    """Inside, the MoE layers' token means (`Routing.router_z`, `dropped`, `load_E`) weigh each
    valid token by `weight` (a scalar, traced or not) rather than 1 / the valid tokens of the
    batch they see: the train step sets it so that its average over parts of the batch
    (gradient accumulation's micro-batches, the pipeline's microbatches) is the whole batch's
    token mean. The load-balance loss, a product of two means, stays each part's own."""
    token = _TOKEN_WEIGHT.set(weight)
    try:
        yield
    finally:
        _TOKEN_WEIGHT.reset(token)


def current_token_weight() -> Array | float | None:
    """`token_weight`'s weight in this context (None: outside one)."""
    return _TOKEN_WEIGHT.get()


@struct.dataclass
class Routing:
    """How one batch was routed: each token's k experts and gates, the dispatch / combine
    tensors (None when dropless: no slots), and the auxiliary quantities:

    load_balance  E * sum_e f_e * P_e: f_e the fraction of (token, choice) pairs routed to
                  expert e, P_e the mean of its score normalised over experts (Switch / GShard;
                  1 when balanced);
    router_z      mean over tokens of logsumexp(router logits)^2 (ST-MoE; with `per_token`,
                  this and the next two are weighted sums);
    dropped       the fraction of (token, choice) pairs dropped for capacity;
    load_E        f_e itself, before capacity drops anything (what the expert bias balances).
    """

    choice_BTK: Array
    gates_BTK: Array
    dispatch_BTEC: Array | None
    combine_BTEC: Array | None
    load_balance: Array
    router_z: Array
    dropped: Array
    load_E: Array


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per routing group (0 capacity_factor: every token fits).

    >>> capacity(tokens=64, num_experts=8, top_k=2, capacity_factor=1.25)
    20
    """
    if capacity_factor == 0:
        return tokens
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def choose(scores_BTE: Array, top_k: int, groups: int = 1, top_groups: int = 1) -> Array:
    """The top-k experts [B, T, K] by `scores_BTE` (the scores plus the bias), among the
    experts of each token's `top_groups` best groups (a group's score: its two best)."""
    if groups > 1:
        batch, tokens, experts = scores_BTE.shape
        grouped_BTGe = scores_BTE.reshape(batch, tokens, groups, experts // groups)
        best = min(2, experts // groups)
        group_BTG = jnp.sum(jax.lax.top_k(grouped_BTGe, best)[0], axis=-1)
        _, keep_BTg = jax.lax.top_k(group_BTG, top_groups)
        kept_BTG = jnp.sum(jax.nn.one_hot(keep_BTg, groups, dtype=jnp.bool_), axis=-2)
        # The other groups' experts are out of the running.
        scores_BTE = jnp.where(kept_BTG[..., None], grouped_BTGe, -jnp.inf).reshape(
            scores_BTE.shape)
    return jax.lax.top_k(scores_BTE, top_k)[1]


def route(logits_BTE: Array, top_k: int, slots: int | None, normalize: bool = True, *,
          score: str = "softmax", bias_E: Array | None = None, groups: int = 1,
          top_groups: int = 1, scale: float = 1.0, valid_BT: Array | None = None,
          per_token: Array | float | None = None) -> Routing:
    """Top-k routing of router logits [B, T, E] (module docstring) into `slots` per expert;
    `slots=None`: dropless, every choice kept and no dispatch tensors built. `valid_BT` (bool,
    None: all): padding (False) takes no slot and counts in none of the auxiliary quantities.
    `per_token` (None: 1 / the valid tokens): each valid token's weight in `router_z`,
    `dropped` and `load_E`, sums then rather than means (`token_weight`).

    Slots are handed out in priority order, every token's first choice before any token's
    second (GShard), and in token order within a choice; a choice that finds its expert's
    buffer full is dropped. Top-1 routing never normalizes: a gate of 1 would cut the router
    off from the task's gradient (Switch keeps the probability).

    Two tokens, two experts, one slot each, top-1: both prefer expert 0, so the second is
    dropped.

    >>> r = route(jnp.array([[[2.0, 0.0], [1.0, 0.0]]]), top_k=1, slots=1)
    >>> r.dispatch_BTEC[0, :, :, 0].astype(int).tolist(), float(r.dropped)
    ([[1, 0], [0, 0]], 0.5)
    """
    logits_BTE = logits_BTE.astype(jnp.float32)
    batch, tokens, experts = logits_BTE.shape
    if score == "softmax":
        probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    else:
        probs_BTE = jax.nn.sigmoid(logits_BTE)
    for_choice = probs_BTE if bias_E is None else probs_BTE + jax.lax.stop_gradient(bias_E)
    choice_BTK = choose(for_choice, top_k, groups, top_groups)
    gates_BTK = jnp.take_along_axis(probs_BTE, choice_BTK, axis=-1)
    if normalize and top_k > 1:
        gates_BTK = gates_BTK / jnp.sum(gates_BTK, axis=-1, keepdims=True)
    gates_BTK = gates_BTK * scale
    # Priority order: choice-major (all first choices, then all second ...), token order within.
    chosen_BKTE = jax.nn.one_hot(choice_BTK.transpose(0, 2, 1), experts, dtype=jnp.int32)
    valid_BT = (jnp.ones((batch, tokens), jnp.bool_) if valid_BT is None
                else jnp.broadcast_to(valid_BT, (batch, tokens)))
    chosen_BKTE = chosen_BKTE * valid_BT[:, None, :, None]  # padding chooses nothing
    flat_BNE = chosen_BKTE.reshape(batch, top_k * tokens, experts)
    real = jnp.maximum(jnp.sum(valid_BT), 1)  # (a batch of padding alone: no 0 / 0)
    pairs = top_k * real
    dispatch_BTEC = combine_BTEC = None
    dropped = jnp.zeros((), jnp.float32)
    if slots is not None:
        slot_BNE = jnp.cumsum(flat_BNE, axis=1) - 1  # this pair's slot in its expert's buffer
        kept_BNE = flat_BNE * (slot_BNE < slots)
        slot_onehot_BNEC = jax.nn.one_hot(jnp.where(kept_BNE > 0, slot_BNE, -1), slots,
                                          dtype=jnp.float32)  # -1: all zeros
        slot_onehot_BKTEC = slot_onehot_BNEC.reshape(batch, top_k, tokens, experts, slots)
        dispatch_BTEC = jnp.sum(slot_onehot_BKTEC, axis=1)
        combine_BTEC = jnp.einsum("bktec,btk->btec", slot_onehot_BKTEC, gates_BTK)
        dropped = (1.0 - jnp.sum(kept_BNE) / pairs if per_token is None
                   else (top_k * jnp.sum(valid_BT) - jnp.sum(kept_BNE)) * (per_token / top_k))
    fraction_E = jnp.sum(flat_BNE, axis=(0, 1)) / pairs
    z_BT = jax.nn.logsumexp(logits_BTE, axis=-1) ** 2 * valid_BT
    # P_e: the scores as a distribution over experts (softmax's already are).
    share_BTE = probs_BTE / jnp.sum(probs_BTE, axis=-1, keepdims=True)
    return Routing(
        choice_BTK=choice_BTK,
        gates_BTK=gates_BTK,
        dispatch_BTEC=dispatch_BTEC,
        combine_BTEC=combine_BTEC,
        load_balance=experts * jnp.sum(
            fraction_E * jnp.sum(share_BTE * valid_BT[..., None], axis=(0, 1)) / real),
        router_z=jnp.sum(z_BT) / real if per_token is None else jnp.sum(z_BT) * per_token,
        dropped=dropped,
        load_E=fraction_E if per_token is None
        else jnp.sum(flat_BNE, axis=(0, 1)) * (per_token / top_k),
    )


def imbalance(load_E: Array) -> Array:
    """Max over mean of the tokens per expert (1: balanced; E: all on one), over the last
    axis.

    >>> float(imbalance(jnp.array([0.5, 0.25, 0.25, 0.0])))
    2.0
    """
    return jnp.max(load_E, axis=-1) / jnp.mean(load_E, axis=-1)


def update_balance_bias(bias_E: Array, load_E: Array, rate: float) -> Array:
    """DeepSeek-V3's auxiliary-loss-free step: an overloaded expert's bias falls by `rate`, an
    underloaded one's rises by it (loads [..., E], fractions of the step's (token, choice)
    pairs; a balanced expert's bias stays).

    >>> update_balance_bias(jnp.zeros(3), jnp.array([0.5, 1 / 3, 1 / 6]), 0.01).tolist()
    [-0.009999999776482582, 0.0, 0.009999999776482582]
    """
    mean = jnp.mean(load_E, axis=-1, keepdims=True)
    # Within float rounding of the mean counts as balanced (1/3 is not exact in float32).
    error = jnp.where(jnp.abs(mean - load_E) <= 1e-6 * mean, 0.0, mean - load_E)
    return bias_E + rate * jnp.sign(error).astype(bias_E.dtype)


__all__ = ["Routing", "SCORES", "capacity", "choose", "current_token_weight", "imbalance",
           "route", "token_weight", "update_balance_bias"]
