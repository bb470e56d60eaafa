"""Gated DeltaNet ("Gated Delta Networks", Yang, Kautz and Hatamizadeh 2024), the linear
attention layers of Qwen3-Next, parametrised as Hugging Face's `Qwen3NextGatedDeltaNet` so that
its import is a reshape of each weight.

Each value head keeps a state S [K, V] and, per token t,

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T        o_t = S_t^T q_t

a_t = exp(g_t) in (0, 1] the decay (g the log decay), b_t in (0, 1) the delta rule's step.
`recurrent_gated_delta_rule` runs it token by token (decode steps); `chunked_gated_delta_rule`
runs it chunk by chunk (the WY / UT form): within a chunk of L tokens the deltas come out of one
unit-triangular solve, and only the state crosses chunks, so memory is O(T L), never [T, T].

The layer: q, k, v, z (output gate), a and b are projections of x; q, k, v go through a causal
depthwise convolution (W taps) and SiLU; q and k are L2-normalised, q scaled by 1 / sqrt(K);
g = -exp(A_log) softplus(a + dt_bias), b = sigmoid(b); the delta rule gives o; then
RMSNorm(o) * norm * SiLU(z) per head and the out projection. Each query/key head serves
N / G consecutive value heads (Hugging Face's repeat_interleave).

Packed documents (`segment_ids`): a document start resets the state (a = 0 across it), and the
convolution's taps never reach into the previous document; padding (segment 0) leaves the state
as it is (a = 1, b = 0). The state passed in belongs to the row's first document.

Shapes: B batch, T length, G query/key heads, N value heads (N % G == 0), K key head width,
V value head width, C convolution channels (2 G K + N V), W taps, M chunks, L chunk length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer.nn.attention import matmul, projection_init
from transformer.nn.mixers.base import Mixer, no_sequence_axis
from transformer.nn.mixers.conv import causal_conv
from transformer.utils.keys import check_fields, int_, key

Array = jax.Array
L2_EPSILON = 1e-6  # q and k: x / sqrt(|x|^2 + eps), as Hugging Face's and FLA's l2norm


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet layers' settings (`model.linear_attention.*`). Zeros take the model's
    shapes, so a small model needs none of them; Qwen3-Next-80B sets 16 key heads, 32 value
    heads, 128 wide each."""

    num_key_heads: int = key(0, "Query/key heads (G); 0: model.num_heads.",
                             int_(ge=0, note="0: model.num_heads"))
    num_value_heads: int = key(
        0, "Value heads (N), a multiple of num_key_heads: each query/key head serves N / G "
        "consecutive value heads; 0: num_key_heads.", int_(ge=0, note="0: num_key_heads"))
    key_head_dim: int = key(0, "Query/key head width (K); 0: the model's head_dim.",
                            int_(ge=0, note="0: model head_dim"))
    value_head_dim: int = key(0, "Value head width (V); 0: key_head_dim.",
                              int_(ge=0, note="0: key_head_dim"))
    conv_kernel: int = key(4, "Taps of the causal depthwise convolution on q, k and v.",
                           int_(ge=1))
    chunk_size: int = key(64, "Tokens per chunk of the chunkwise-parallel delta rule (memory "
                          "and work per token grow with it; results do not change).", int_(ge=1),
                          structural=False, export_neutral=True)

    # what its keys act only with (`utils.keys.Key.needs`), given the stack's config
    NEEDS = (lambda cfg: "linear_attention" in cfg.used_layer_types,
             "a linear_attention layer (model.layer_types)")

    def __post_init__(self):
        check_fields(self, prefix="linear_attention.")
        self.check()

    def check(self, config=None) -> None:
        """The rule across keys: num_value_heads a multiple of the key heads (num_key_heads,
        or the model's `config.num_heads` when that is 0 and a config is given)."""
        key_heads = self.num_key_heads or (config.num_heads if config is not None else 0)
        if key_heads and self.num_value_heads and self.num_value_heads % key_heads:
            source = "" if self.num_key_heads else " (model.num_heads)"
            raise ValueError(f"linear_attention.num_value_heads={self.num_value_heads}: expected "
                             f"a multiple of num_key_heads={key_heads}{source}")


# --- the math ------------------------------------------------------------------------------------


def _compute_dtype(x: Array):
    return jnp.promote_types(x.dtype, jnp.float32)  # float32, or float64 given float64


def _segments(segment_ids: Array | None, batch: int, length: int) -> tuple[Array, Array]:
    """(valid, starts), [B, T] bools: a token not padding; a token starting a document (its
    segment differs from the previous token's; never the first token, which continues the state
    passed in, nor padding)."""
    if segment_ids is None:
        valid = jnp.ones((batch, length), bool)
        return valid, ~valid
    segment_ids = jnp.broadcast_to(segment_ids, (batch, length))
    valid = segment_ids != 0
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return valid, jnp.pad(changed, ((0, 0), (1, 0))) & valid


def _prepare(q, k, v, log_alpha, beta, initial_state, segment_ids):
    """The inputs in the compute dtype, q and k repeated to the N value heads, g and b masked:
    padding gets g = 0 and b = 0 (the state stays), a document start g = 0 (its decay meets a
    zeroed state). Returns (q, k, v, g, b, starts [B, T], state [B, N, K, V])."""
    batch, length, num_heads, width = v.shape
    if num_heads % k.shape[2]:
        raise ValueError(f"value heads={num_heads}: expected a multiple of the key heads "
                         f"{k.shape[2]}")
    dtype = _compute_dtype(q)
    repeat = num_heads // k.shape[2]
    q, k = (jnp.repeat(x, repeat, axis=2).astype(dtype) for x in (q, k))
    valid_BT, starts_BT = _segments(segment_ids, batch, length)
    g_BTN = jnp.where((valid_BT & ~starts_BT)[..., None], log_alpha.astype(dtype), 0)
    beta_BTN = jnp.where(valid_BT[..., None], beta.astype(dtype), 0)
    if initial_state is None:
        initial_state = jnp.zeros((batch, num_heads, k.shape[-1], width), dtype)
    return q, k, v.astype(dtype), g_BTN, beta_BTN, starts_BT, initial_state.astype(dtype)


def recurrent_gated_delta_rule(q: Array, k: Array, v: Array, log_alpha: Array, beta: Array,
                               initial_state: Array | None = None,
                               segment_ids: Array | None = None) -> tuple[Array, Array]:
    """The gated delta rule token by token (decode steps; the reference of the chunked form).

    Args:
      q, k: [B, T, G, K] (q already scaled); v: [B, T, N, V]; log_alpha (g <= 0), beta: [B, T, N].
      initial_state: [B, N, K, V] (zeros when None); segment_ids: [B, T] or None (module doc).
    Returns (out [B, T, N, V] in v's dtype, final state [B, N, K, V] in float32 or wider).
    """
    q, k, v_c, g, b, starts_BT, state = _prepare(q, k, v, log_alpha, beta, initial_state,
                                                 segment_ids)

    def step(state_BNKV, inputs):
        q_BNK, k_BNK, v_BNV, g_BN, b_BN, start_B = inputs
        state_BNKV = jnp.where(start_B[:, None, None, None], 0, state_BNKV)
        state_BNKV = state_BNKV * jnp.exp(g_BN)[..., None, None]
        error_BNV = v_BNV - jnp.einsum("bnk,bnkv->bnv", k_BNK, state_BNKV)
        state_BNKV = state_BNKV + jnp.einsum("bnk,bnv->bnkv", k_BNK, b_BN[..., None] * error_BNV)
        return state_BNKV, jnp.einsum("bnk,bnkv->bnv", q_BNK, state_BNKV)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v_c, g, b, starts_BT)]
    state, out_TBNV = lax.scan(step, state, time_major)
    return jnp.moveaxis(out_TBNV, 0, 1).astype(v.dtype), state


def _chunk_terms(q, k, v, g, beta, starts):
    """Per chunk (leading dims any, then L): what the scan over chunks needs, with the state S
    before the chunk left out. With Gamma_ij = prod_{j < m <= i} a_m (zero across a document
    start) the deltas d_i = b_i (v_i - a_i S_{i-1}^T k_i) written at each token solve
    (I + A) d = b v - b Gamma_i0 k S, A_ij = b_i Gamma_ij k_i.k_j (j < i). Returns
    u = (I + A)^-1 b v and w = (I + A)^-1 b Gamma_i0 k (so d = u - w S), the intra-chunk scores
    (q_i.k_j) Gamma_ij (j <= i), q_i Gamma_i0, k_j Gamma_Lj and the chunk's decay Gamma_L0."""
    size, width = g.shape[-1], v.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start through token i (<= 0)
    docs = jnp.cumsum(starts, axis=-1)  # documents started in the chunk up to token i
    same = jnp.tril(jnp.ones((size, size), bool)) & (docs[..., :, None] == docs[..., None, :])
    # masked before exp: above the diagonal the difference is positive, possibly large
    decay_LL = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    from_start = jnp.where(docs == 0, jnp.exp(cum), 0)
    to_end = jnp.where(docs == docs[..., -1:], jnp.exp(cum[..., -1:] - cum), 0)
    eye = jnp.eye(size, dtype=bool)
    system = jnp.einsum("...ik,...jk->...ij", k, k) * jnp.where(eye, 0, decay_LL)
    system = beta[..., :, None] * system + eye
    rhs = jnp.concatenate([beta[..., None] * v, (beta * from_start)[..., None] * k], axis=-1)
    solved = unit_lower_inverse(system) @ rhs
    scores = jnp.einsum("...ik,...jk->...ij", q, k) * decay_LL
    return (solved[..., :width], solved[..., width:], scores, q * from_start[..., None],
            k * to_end[..., None], from_start[..., -1])


def unit_lower_inverse(m: Array) -> Array:
    """The inverse of unit lower-triangular matrices [..., L, L], by 2 x 2 blocks:
    [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]], down to 1 x 1 blocks (ones): the
    numbers of a triangular solve, as log2(L) levels of batched matmuls. XLA:CPU's batched
    triangular solve ran 27x slower at L = 64 (its backward too), and stalled at 512 batches.

    >>> m = jnp.array([[1.0, 0.0, 0.0], [2.0, 1.0, 0.0], [3.0, 4.0, 1.0]])
    >>> unit_lower_inverse(m).tolist()
    [[1.0, 0.0, 0.0], [-2.0, 1.0, 0.0], [5.0, -4.0, 1.0]]
    """
    size = m.shape[-1]
    if size == 1:
        return jnp.ones_like(m)
    half = size // 2
    top, bottom = unit_lower_inverse(m[..., :half, :half]), unit_lower_inverse(
        m[..., half:, half:])
    corner = -bottom @ m[..., half:, :half] @ top
    return jnp.concatenate([jnp.concatenate([top, jnp.zeros_like(corner.swapaxes(-1, -2))], -1),
                            jnp.concatenate([corner, bottom], -1)], -2)


def chunked_gated_delta_rule(q: Array, k: Array, v: Array, log_alpha: Array, beta: Array,
                             initial_state: Array | None = None, chunk_size: int = 64,
                             segment_ids: Array | None = None) -> tuple[Array, Array]:
    """The gated delta rule chunk by chunk: what `recurrent_gated_delta_rule` computes (same
    arguments, plus `chunk_size`), with the within-chunk work as [L, L] matmuls and a triangular
    solve for all chunks at once, then a `lax.scan` carrying the state across chunks. T need not
    be a multiple of L (the tail is padded with tokens that leave the state alone); L is at
    most T."""
    batch, length, num_heads, _ = v.shape
    q_c, k_c, v_c, g, b, starts_BT, state = _prepare(q, k, v, log_alpha, beta, initial_state,
                                                     segment_ids)
    size = max(1, min(chunk_size, length))
    pad = -length % size

    def chunks(x):  # [B, T, N, ...] -> [M, B, N, L, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, -1, size, *x.shape[2:]), (1, 3), (0, 2))

    starts_BTN = jnp.broadcast_to(starts_BT[..., None], g.shape)
    terms = _chunk_terms(*(chunks(x) for x in (q_c, k_c, v_c, g, b, starts_BTN)))

    def step(state_BNKV, terms):
        u_BNLV, w_BNLK, scores_BNLL, q_BNLK, k_BNLK, decay_BN = terms
        delta_BNLV = u_BNLV - w_BNLK @ state_BNKV
        out_BNLV = q_BNLK @ state_BNKV + scores_BNLL @ delta_BNLV
        state_BNKV = (decay_BN[..., None, None] * state_BNKV
                      + jnp.swapaxes(k_BNLK, -1, -2) @ delta_BNLV)
        return state_BNKV, out_BNLV

    state, out_MBNLV = lax.scan(step, state, terms)
    out_BTNV = jnp.moveaxis(out_MBNLV, (0, 2), (1, 3)).reshape(batch, -1, num_heads,
                                                                v.shape[-1])
    return out_BTNV[:, :length].astype(v.dtype), state


# --- the layer -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetSettings:
    """One Gated DeltaNet layer's shapes, init and dtypes, resolved (no zeros)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64
    norm_epsilon: float = 1e-6  # the gated RMSNorm's
    init_std: float | None = None
    init_scale: float = 1.0  # the projections from x (projection_init's multiplier)
    out_init_scale: float = 1.0  # the out projection's
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @classmethod
    def from_config(cls, cfg) -> GatedDeltaNetSettings:
        """The settings of a `TransformerConfig` (its `linear_attention` group)."""
        group = cfg.linear_attention
        group.check(cfg)
        key_heads = group.num_key_heads or cfg.num_heads
        key_dim = group.key_head_dim or cfg.resolved_head_dim
        return cls(num_key_heads=key_heads, num_value_heads=group.num_value_heads or key_heads,
                   key_head_dim=key_dim, value_head_dim=group.value_head_dim or key_dim,
                   conv_kernel=group.conv_kernel, chunk_size=group.chunk_size,
                   norm_epsilon=cfg.norm_epsilon, init_std=cfg.init_std,
                   init_scale=cfg.init_scale(), out_init_scale=cfg.init_scale(residual=True),
                   dtype=cfg.dtype, param_dtype=cfg.param_dtype)

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * \
            self.value_head_dim


def _a_log_init(rng, shape, dtype):
    """log A, A ~ U[1, 16] (Mamba-2's range; Hugging Face's Qwen3-Next: U[0.01, 16])."""
    return jnp.log(jax.random.uniform(rng, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(rng, shape, dtype):
    """softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (Mamba-2 and FLA's Gated DeltaNet)."""
    dt = jnp.exp(jax.random.uniform(rng, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _l2_normalize(x: Array) -> Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPSILON)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer (module docstring), called as every mixer is
    (`mixers.base`); `mask`, `bias` and `q_positions` are not used.

    Params (logical axes): query, key [embed, kv_heads, kv]; value, gate (z) [embed, heads, kv];
    decay (a), beta (b) [embed, heads]; query_conv, key_conv [conv, kv_heads, kv], value_conv
    [conv, heads, kv]; A_log, dt_bias [heads]; norm [kv]; out [heads, kv, embed]. From Hugging
    Face's: in_proj_qkvz.weight.T.reshape(D, G, 2K + 2 (N/G) V) splits into q, k, v, z along the
    last axis (v, z then reshaped to [D, N, V]), in_proj_ba likewise into b, a; conv1d.weight
    [C, 1, W] is the q, k, v kernels' [W, C] concatenated, transposed.

    Decode ('cache'): `conv_state` [B, W - 1, C] (the last q, k, v inputs, concatenated in
    that order) and `recurrent_state` [B, N, K, V], float32. One token runs the recurrence, more
    (a prefill) the chunked form, both from the cached state.

    Precision: the module runs its conv, gates, delta rule and gated norm in float32 even in a
    float64 model, as Hugging Face's does (the pure functions above keep float64 when given it).
    """

    settings: GatedDeltaNetSettings

    @nn.compact
    def __call__(self, x_BTD: Array, *, mask=None, bias=None, q_positions=None,
                 segment_ids: Array | None = None, deterministic: bool = True,
                 decode: bool = False) -> Array:
        del mask, bias, q_positions, deterministic  # no attention, no dropout
        s = self.settings
        batch, length, _ = x_BTD.shape
        if s.num_value_heads % s.num_key_heads:
            raise ValueError(f"num_value_heads={s.num_value_heads}: expected a multiple of "
                             f"num_key_heads={s.num_key_heads}")
        q_BTGK = self._project("query", x_BTD, s.num_key_heads, s.key_head_dim, "kv_heads")
        k_BTGK = self._project("key", x_BTD, s.num_key_heads, s.key_head_dim, "kv_heads")
        v_BTNV = self._project("value", x_BTD, s.num_value_heads, s.value_head_dim, "heads")
        qkv_BTC = jnp.concatenate([x.reshape(batch, length, -1)
                                   for x in (q_BTGK, k_BTGK, v_BTNV)], axis=-1)
        cache = self._cache(batch) if decode else None
        qkv_BTC, conv_state = causal_conv(qkv_BTC.astype(jnp.float32), self._conv_kernel(),
                                          None, cache[1].value if cache else None, segment_ids,
                                          activation=jax.nn.silu)
        key_width = s.num_key_heads * s.key_head_dim
        q_BTGK, k_BTGK, v_BTNV = (x.reshape(y.shape) for x, y in zip(
            jnp.split(qkv_BTC, (key_width, 2 * key_width), axis=-1), (q_BTGK, k_BTGK, v_BTNV),
            strict=True))
        q_BTGK = _l2_normalize(q_BTGK) * s.key_head_dim**-0.5
        k_BTGK = _l2_normalize(k_BTGK)
        log_alpha_BTN, beta_BTN = self._gates(x_BTD)
        args = (q_BTGK, k_BTGK, v_BTNV, log_alpha_BTN, beta_BTN,
                cache[2].value if cache else None)
        if decode and length == 1:
            out_BTNV, state = recurrent_gated_delta_rule(*args, segment_ids=segment_ids)
        else:
            out_BTNV, state = chunked_gated_delta_rule(*args, chunk_size=s.chunk_size,
                                                       segment_ids=segment_ids)
        if cache is not None and cache[0]:  # `init` only creates the zero state
            cache[1].value, cache[2].value = conv_state, state.astype(jnp.float32)
        return self._output(self._gated_norm(out_BTNV, x_BTD), x_BTD.shape[-1])

    def _cache(self, batch: int):
        """(whether the cache existed before this call, conv_state, recurrent_state)."""
        s = self.settings
        ready = self.has_variable("cache", "recurrent_state")
        conv = self.variable("cache", "conv_state", jnp.zeros,
                             (batch, s.conv_kernel - 1, s.conv_channels), jnp.float32)
        recurrent = self.variable("cache", "recurrent_state", jnp.zeros, (
            batch, s.num_value_heads, s.key_head_dim, s.value_head_dim), jnp.float32)
        return ready, conv, recurrent

    def _param(self, name, init, shape, names):
        return self.param(name, nn.with_logical_partitioning(init, names), shape,
                          self.settings.param_dtype)

    def _project(self, name: str, x_BTD: Array, heads: int, width: int | None,
                 heads_axis: str) -> Array:
        """x [B, T, D] -> [B, T, heads, width] (or [B, T, heads] when width is None)."""
        names = ("embed", heads_axis, "kv")[:3 if width else 2]
        shape = (x_BTD.shape[-1], heads, width)[:len(names)]
        out_axes = tuple(range(1, len(names)))
        init = projection_init(self.settings.init_std, 0, out_axes, self.settings.init_scale)
        return matmul(x_BTD, self._param(name, init, shape, names), 1,
                      dtype=self.settings.dtype)

    def _conv_kernel(self) -> Array:
        """The q, k and v kernels as one [W, C] (torch's conv1d init: U[+-1 / sqrt(W)])."""
        s = self.settings
        init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=0,
                                                out_axis=(1, 2))
        kernels = [self._param(f"{name}_conv", init, (s.conv_kernel, heads, width),
                               ("conv", axis, "kv")) for name, heads, width, axis in (
            ("query", s.num_key_heads, s.key_head_dim, "kv_heads"),
            ("key", s.num_key_heads, s.key_head_dim, "kv_heads"),
            ("value", s.num_value_heads, s.value_head_dim, "heads"))]
        return jnp.concatenate([w.reshape(s.conv_kernel, -1) for w in kernels], axis=-1)

    def _gates(self, x_BTD: Array) -> tuple[Array, Array]:
        """(g = -exp(A_log) softplus(a + dt_bias), sigmoid(b)), [B, T, N] float32."""
        s = self.settings
        a_BTN = self._project("decay", x_BTD, s.num_value_heads, None, "heads")
        b_BTN = self._project("beta", x_BTD, s.num_value_heads, None, "heads")
        a_log = self._param("A_log", _a_log_init, (s.num_value_heads,), ("heads",))
        dt_bias = self._param("dt_bias", _dt_bias_init, (s.num_value_heads,), ("heads",))
        f32 = jnp.float32
        log_alpha = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a_BTN.astype(f32)
                                                                   + dt_bias.astype(f32))
        return log_alpha, jax.nn.sigmoid(b_BTN.astype(f32))

    def _gated_norm(self, out_BTNV: Array, x_BTD: Array) -> Array:
        """RMSNorm over each head's V values, times `norm`, times SiLU(z) (norm before gate, as
        Hugging Face's Qwen3NextRMSNormGated), in float32."""
        s = self.settings
        z_BTNV = self._project("gate", x_BTD, s.num_value_heads, s.value_head_dim, "heads")
        scale_V = self._param("norm", nn.initializers.ones, (s.value_head_dim,), ("kv",))
        out = out_BTNV.astype(jnp.float32)
        out = out * lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + s.norm_epsilon)
        return out * scale_V.astype(jnp.float32) * jax.nn.silu(z_BTNV.astype(jnp.float32))

    def _output(self, out_BTNV: Array, d_model: int) -> Array:
        s = self.settings
        names = ("heads", "kv", "embed")
        init = projection_init(s.init_std, (0, 1), 2, s.out_init_scale)
        kernel = self._param("out", init, (s.num_value_heads, s.value_head_dim, d_model),
                             names)
        return matmul(out_BTNV.astype(s.dtype), kernel, 2, dtype=s.dtype)


# --- the registry's record -----------------------------------------------------------------------


def flops_per_token(cfg, seq_len: int) -> float:
    """Forward + backward FLOPs per token and layer beyond 6 x the matmul params: the chunked
    delta rule's matmuls (`chunked_gated_delta_rule`). Per value head and token, forward, with
    L = min(chunk_size, seq_len):

        2 L K   k k^T within the chunk          2 L K   q k^T (the intra-chunk scores)
        2 (L^2 - 1) / 3   inverting the unit-triangular [L, L] system (`unit_lower_inverse`:
                          2 x 2 blocks, two [s/2, s/2] products per block of side s; L a power
                          of 2, else about that)
        2 L (K + V)   the inverse times [b v, b k]
        2 L V   the scores times the deltas     6 K V   w S, q S and k^T d (the state's part)

    i.e. L (6 K + 4 V) + 2 (L^2 - 1) / 3 + 6 K V, counted in full ([L, L] blocks are computed
    whole, causal or not); backward twice forward. The convolution (2 W per channel and token
    forward) is its params' share of 6 N; norms and gates are elementwise and not counted."""
    s = GatedDeltaNetSettings.from_config(cfg)
    size = max(1, min(s.chunk_size, seq_len))
    width_k, width_v = s.key_head_dim, s.value_head_dim
    forward = (size * (6 * width_k + 4 * width_v) + 2 * (size * size - 1) / 3
               + 6 * width_k * width_v)
    return 3.0 * s.num_value_heads * forward


def cache_bytes_per_token(cfg) -> int:
    return 0  # the decode state does not grow: [N, K, V] and W - 1 inputs per layer


refuses = no_sequence_axis("linear_attention")


MIXER = Mixer(
    layer=lambda cfg, name: GatedDeltaNet(GatedDeltaNetSettings.from_config(cfg), name=name),
    param_name="linear_attention", flops_per_token=flops_per_token,
    decode_state="recurrent state", cache_bytes_per_token=cache_bytes_per_token,
    refuses=refuses, config=GatedDeltaNetConfig)
