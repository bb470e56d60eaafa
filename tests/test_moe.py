"""The mixture-of-experts feed-forward block against a plain loop over tokens and experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import moe

B, T, D, F = 2, 8, 8, 12


def decisions(logits_BTE: np.ndarray, top_k: int, slots: int, normalize: bool):
    """The routing a loop makes: for each row, first choices of every token, then second
    choices, ..., each taking a slot of its expert while there are any. Returns the kept
    (row, token, expert) triples and, per row, the (token, expert) pairs chosen and dropped."""
    kept, chosen, dropped = [], 0, 0
    for b in range(logits_BTE.shape[0]):
        order = np.argsort(-logits_BTE[b], axis=-1, kind="stable")[:, :top_k]
        used = np.zeros(logits_BTE.shape[-1], int)
        for k in range(top_k):
            for t in range(logits_BTE.shape[1]):
                e = int(order[t, k])
                chosen += 1
                if used[e] < slots:
                    used[e] += 1
                    kept.append((b, t, e, tuple(order[t])))
                else:
                    dropped += 1
    return kept, dropped / chosen


def reference(params, x, kept, *, gated, normalize, shared):
    """y[b, t] = sum over the kept (b, t, e) of gate(b, t, e) * FFN_e(x[b, t]), one token and
    one expert at a time."""
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, params["router"]), -1)

    def ffn(token, wi, wo, wi_up=None):
        h = nn.gelu(token @ wi)
        return (h if wi_up is None else h * (token @ wi_up)) @ wo

    out = {(b, t): [] for b in range(x.shape[0]) for t in range(x.shape[1])}
    for b, t, e, top in kept:
        gate = probs[b, t, e] / (sum(probs[b, t, j] for j in top) if normalize else 1.0)
        if gated:
            y = ffn(x[b, t], params["wi_gate"][e], params["wo"][e], params["wi_up"][e])
        else:
            y = ffn(x[b, t], params["wi"][e], params["wo"][e])
        out[b, t].append(gate * y)
    if shared:
        for (b, t), parts in out.items():
            parts.append(ffn(x[b, t], params["shared_wi"], params["shared_wo"],
                             params["shared_wi_up"] if gated else None))
    rows = [sum(parts) if parts else jnp.zeros(x.shape[-1]) for parts in out.values()]
    return jnp.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("experts, top_k, capacity_factor, gated, normalize, shared", [
    (4, 2, 1.25, False, True, 0),
    (4, 2, 0.5, True, True, 0),  # tight: many (token, expert) pairs are dropped
    (5, 1, 1.0, False, False, 0),  # Switch: top-1, raw probabilities as gates
    (4, 3, 0.0, True, True, 1),  # dropless, with a shared expert
])
def test_the_block_equals_a_loop_over_tokens_and_experts(experts, top_k, capacity_factor,
                                                         gated, normalize, shared):
    layer = moe.MoEFeedForward(num_experts=experts, d_ff=F, top_k=top_k,
                               capacity_factor=capacity_factor, num_shared=shared,
                               activation=nn.gelu, gated=gated, normalize_gates=normalize,
                               init_std=0.5)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, D)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    slots = moe.capacity(T, experts, top_k, capacity_factor)
    logits = np.asarray(jnp.einsum("btd,de->bte", x, params["router"]))
    kept, dropped = decisions(logits, top_k, slots, normalize)
    if capacity_factor == 0.5:
        assert dropped > 0.2  # the case really drops
    if capacity_factor == 0.0:
        assert dropped == 0

    (y, routing), vjp = jax.vjp(lambda p, x: layer.apply({"params": p}, x), params, x)
    want, want_vjp = jax.vjp(lambda p, x: reference(p, x, kept, gated=gated,
                                                    normalize=normalize, shared=shared),
                             params, x)
    np.testing.assert_allclose(y, want, atol=1e-5)
    assert float(routing.dropped) == pytest.approx(dropped)
    probe = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape), jnp.float32)
    zero = jax.tree.map(jnp.zeros_like, routing)
    got_grads, want_grads = vjp((probe, zero)), want_vjp(probe)
    for got, expected in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads),
                             strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_auxiliary_losses_equal_their_formulas():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 16, 6)).astype(np.float32) * 2
    routing = moe.route(jnp.asarray(logits), top_k=2, slots=4)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top2 = np.argsort(-logits, -1)[..., :2]
    fraction = np.array([(top2 == e).sum() for e in range(6)]) / top2.size
    np.testing.assert_allclose(routing.load_balance,
                               6 * np.sum(fraction * probs.mean((0, 1))), rtol=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(routing.router_z, np.mean(lse**2), rtol=1e-6)
    # A uniform router is perfectly balanced (1), however ties are broken.
    assert float(moe.route(jnp.zeros((2, 8, 4)), top_k=2, slots=8).load_balance) == (
        pytest.approx(1.0))


def test_the_router_runs_in_float32_and_experts_carry_the_expert_axis():
    layer = moe.MoEFeedForward(num_experts=4, d_ff=F, dtype=jnp.bfloat16)
    x = jnp.ones((B, T, D), jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x)
    boxed = variables["params"]
    assert boxed["router"].value.dtype == jnp.float32
    assert boxed["wi"].names == ("expert", "embed", "mlp")
    assert boxed["wo"].names == ("expert", "mlp", "embed")
    (y, routing), _ = jax.vjp(lambda v: layer.apply(v, x), nn.unbox(variables))
    assert y.dtype == jnp.bfloat16 and routing.combine_BTEC.dtype == jnp.float32


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4, d_ff=F, top_k=5), "top_k=5: expected 1 <= top_k <= num_experts=4"),
    (dict(num_experts=4, d_ff=F, capacity_factor=-1.0), "capacity_factor=-1.0: expected >= 0"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        moe.MoEFeedForward(**kwargs).init(jax.random.key(0), jnp.ones((1, 4, D)))
