"""The feed-forward nonlinearities by name (`ACTIVATIONS`), and which of them are gated."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array

# GELUs with hand-written JVPs. Differentiating the formulas as written (jax.nn.gelu) gives
# XLA several elementwise passes over the [tokens, d_ff] activations (the exact one through
# erfc, divides and exps); these compute the derivative in one pass. They equal jax.nn.gelu to
# float32 rounding (tests/test_layers.py) and cut about 10% off a GPT train step on CPU
# (benchmarks/train_throughput.py). The derivative evaluates erf / tanh at -u (both are odd),
# not at the value's u: the same numbers, but not the same expression, so XLA cannot merge the
# two and keep erf(u) / tanh(u) from the forward pass alive until the backward pass beside the
# pre-activation x (one more [tokens, d_ff] tensor per layer). The backward pass recomputes the
# derivative from x alone. With the softmax's (dense_attention.softmax_values) this keeps a GPT
# 4/4/128 train step (batch 12 x 64) inside a 32 MiB L3 cache: 48 -> 34 ms on 2 cores.
_SQRT_HALF, _INV_SQRT_2PI, _SQRT_2_OVER_PI = math.sqrt(0.5), 1 / math.sqrt(2 * math.pi), \
    math.sqrt(2 / math.pi)


@jax.custom_jvp
def gelu(x: Array) -> Array:
    """Exact GELU, x Phi(x) (`jax.nn.gelu(x, approximate=False)`); derivative Phi + x phi.

    >>> float(gelu(jnp.float32(1.0)))  # doctest: +ELLIPSIS
    0.8413...
    """
    return x * (0.5 + 0.5 * jax.lax.erf(x * _SQRT_HALF))


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    cdf = 0.5 - 0.5 * jax.lax.erf(-x * _SQRT_HALF)  # Phi(x), at -u (see above)
    pdf = jnp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return gelu(x), t * (cdf + x * pdf)


@jax.custom_jvp
def gelu_tanh(x: Array) -> Array:
    """GPT-2's tanh GELU, x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2 (`jax.nn.gelu`)."""
    return 0.5 * x * (1 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


@gelu_tanh.defjvp
def _gelu_tanh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    th = -jnp.tanh(-_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))  # tanh(u), at -u (see above)
    slope = 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * _SQRT_2_OVER_PI * (1 + 0.134145 * x * x)
    return gelu_tanh(x), t * slope


ACTIVATIONS = {  # name -> nonlinearity (for gated variants: of the gate)
    "relu": nn.relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "swiglu": nn.silu,
    "geglu": gelu_tanh,
}
GATED = ("swiglu", "geglu")


def clamped_swiglu(gate: Array, up: Array, limit: float, alpha: float = 1.702) -> Array:
    """gpt-oss's expert activation: the gate clamped to <= limit and `up` to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate) (a GELU-like sigmoid gate; the + 1 keeps a
    path where `up` is 0).

    >>> y = clamped_swiglu(jnp.array([0.0, 10.0]), jnp.array([1.0, -9.0]), limit=7.0)
    >>> [round(v, 3) for v in y.tolist()]  # the second: (-7 + 1) * 7 * sigmoid(1.702 * 7)
    [0.0, -42.0]
    """
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)
