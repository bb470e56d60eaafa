"""Position information for attention: absolute embeddings (sinusoidal, learned),
rotary embeddings (RoPE), and relative attention biases (ALiBi, T5 buckets).

Shapes: B=batch, T=query length, S=key length, N=heads, H=head dim, D=model dim.
"""

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("linear", "llama3", "yarn")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _as_batched(positions) -> jax.Array:
    """[T] -> [1, T]; [B, T] unchanged."""
    positions = jnp.asarray(positions)
    if positions.ndim not in (1, 2):
        raise ValueError(f"positions must have shape [T] or [B, T], got shape {positions.shape}")
    return positions[None] if positions.ndim == 1 else positions


# -----------------------------------------------------------------------------
# absolute position embeddings


def sinusoidal_positions(positions, dim: int, max_timescale: float = 10000.0) -> jax.Array:
    """Fixed sin/cos embeddings from "Attention Is All You Need", interleaved.

    PE(pos, 2i) = sin(pos / max_timescale^(2i/dim)), PE(pos, 2i+1) = cos(same).
    positions: int [T] or [B, T] -> float32 [..., T, dim].

    >>> np.round(np.asarray(sinusoidal_positions(jnp.arange(2), 4), float), 3).tolist()
    [[0.0, 1.0, 0.0, 1.0], [0.841, 0.54, 0.01, 1.0]]
    """
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0 or dim % 2:
        raise ValueError(f"dim must be a positive even int, got {dim!r}")
    if max_timescale <= 0:
        raise ValueError(f"max_timescale must be > 0, got {max_timescale}")
    i = np.arange(dim // 2, dtype=np.float64)
    inv_timescale = jnp.asarray(max_timescale ** (-2.0 * i / dim), jnp.float32)  # [dim/2]
    angle = jnp.asarray(positions, jnp.float32)[..., None] * inv_timescale  # [..., T, dim/2]
    pe = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)  # [..., T, dim/2, 2]
    return pe.reshape(*angle.shape[:-1], dim)


def check_learned_length(config, length: int) -> None:
    """One line where a model with a learned position table (`config`: a TransformerConfig)
    makes positions 0..length-1 itself past the table's `max_len` rows (they would read NaN).

    >>> from types import SimpleNamespace
    >>> check_learned_length(SimpleNamespace(position="learned", max_len=16), 17)
    Traceback (most recent call last):
    ValueError: 17 tokens: expected at most model.max_len=16, where the learned position table ends
    """
    if config.position == "learned" and length > config.max_len:
        raise ValueError(f"{length} tokens: expected at most model.max_len={config.max_len}, "
                         "where the learned position table ends")


class LearnedPositionEmbedding(nn.Module):
    """A trainable table of absolute position vectors, looked up by position id."""

    max_len: int
    features: int
    dtype: Any = jnp.float32  # output dtype
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, positions) -> jax.Array:
        """positions: int [T] or [B, T] -> [..., T, features]."""
        _check_positive_int("max_len", self.max_len)
        _check_positive_int("features", self.features)
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("length", "embed"))
        embedding = self.param("embedding", init, (self.max_len, self.features), self.param_dtype)
        # Out-of-range ids give NaN (jnp.take's default "fill" mode) rather than a silent clip.
        return jnp.take(embedding, jnp.asarray(positions), axis=0).astype(self.dtype)


# -----------------------------------------------------------------------------
# rotary position embeddings (RoPE)


def rope_frequencies(H: int, *, theta: float = 10000.0, scale: float = 1.0,
                     scaling: str = "linear", low_freq_factor: float = 1.0,
                     high_freq_factor: float = 4.0, original_max_len: int = 8192,
                     beta_fast: float = 32.0, beta_slow: float = 1.0,
                     truncate: bool = True) -> np.ndarray:
    """The angle per position of each pair of head dims, float64 [H/2]: theta^(-2i/H) / scale
    (scaling="linear": position interpolation), or Llama 3.1's scaling="llama3": wavelengths
    shorter than original_max_len / high_freq_factor are kept, longer than original_max_len /
    low_freq_factor divided by `scale`, and those between interpolated smoothly; or YaRN's
    scaling="yarn" (`yarn_frequencies`).

    >>> rope_frequencies(4, theta=100.0, scale=2.0).tolist()
    [0.5, 0.05]
    >>> rope_frequencies(4, theta=100.0, scale=8.0, scaling="llama3", original_max_len=16,
    ...                  low_freq_factor=1.0, high_freq_factor=4.0).round(4).tolist()
    [0.5761, 0.0125]
    """
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"scaling={scaling!r}: expected one of {ROPE_SCALINGS}")
    inv_freq = theta ** (-2.0 * np.arange(H // 2, dtype=np.float64) / H)
    if scaling == "linear":
        return inv_freq / scale
    if scaling == "yarn":
        return yarn_frequencies(inv_freq, theta=theta, scale=scale,
                                original_max_len=original_max_len, beta_fast=beta_fast,
                                beta_slow=beta_slow, truncate=truncate)
    if not 0 < low_freq_factor < high_freq_factor:
        raise ValueError(f"low_freq_factor={low_freq_factor}, high_freq_factor="
                         f"{high_freq_factor}: expected 0 < low < high")
    wavelength = 2 * np.pi / inv_freq
    smooth = (original_max_len / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / scale + smooth * inv_freq
    return np.where(wavelength < original_max_len / high_freq_factor, inv_freq,
                    np.where(wavelength > original_max_len / low_freq_factor, inv_freq / scale,
                             blended))


def yarn_frequencies(inv_freq: np.ndarray, *, theta: float, scale: float,
                     original_max_len: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
                     truncate: bool = True) -> np.ndarray:
    """YaRN's frequencies (Peng et al. 2023, "YaRN"; DeepSeek-V2/V3, HF's
    `_compute_yarn_parameters`), float64 [H/2] from RoPE's `inv_freq` = theta^(-2i/H).

    Pair i turns original_max_len * inv_freq_i / (2 pi) times over the trained context. Pairs
    turning more than `beta_fast` times keep their frequency (extrapolation), those turning
    fewer than `beta_slow` times are divided by `scale` (interpolation), and between them a
    linear ramp in i blends the two. The ramp's ends are the (fractional) pair indices
    d(r) = H ln(original_max_len / (2 pi r)) / (2 ln theta) of r = beta_fast and beta_slow
    turns, rounded outwards under `truncate` (HF's default; gpt-oss turns it off), clipped to
    [0, H - 1].

    >>> inv = 100.0 ** (-np.arange(4) / 4)  # H = 8
    >>> yarn_frequencies(inv, theta=100.0, scale=4.0, original_max_len=64).round(4).tolist()
    [1.0, 0.2372, 0.05, 0.0079]
    """
    H = 2 * len(inv_freq)

    def pair_index(rotations: float) -> float:
        return H * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, H - 1)
    if low == high:
        high += 0.001  # HF's and DeepSeek's guard against a zero-width ramp
    ramp = np.clip((np.arange(H // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq / scale * ramp + inv_freq * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(scale) + 1 (1 when scale <= 1).

    >>> round(yarn_mscale(40.0), 4)
    1.3689
    """
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: str, scale: float, mscale: float = 1.0,
                          mscale_all_dim: float = 0.0) -> float:
    """What `apply_rope` multiplies its rotated vectors by: 1, or under scaling="yarn" HF's
    `attention_factor`, yarn_mscale(scale, mscale) / yarn_mscale(scale, mscale_all_dim) where
    both are non-zero, else yarn_mscale(scale). (DeepSeek's own code takes the ratio always,
    with yarn_mscale(scale, 0) = 1: it differs only for mscale != 1 with mscale_all_dim = 0.)
    Query and key both carry it, so it multiplies the rotated part of a logit by its square.

    >>> rope_attention_factor("yarn", 40.0, mscale=1.0, mscale_all_dim=1.0)
    1.0
    """
    if scaling != "yarn":
        return 1.0
    if mscale and mscale_all_dim:
        return yarn_mscale(scale, mscale) / yarn_mscale(scale, mscale_all_dim)
    return yarn_mscale(scale)


# apply_rope's keyword arguments, as the config's rope_* keys (and the layers' settings) name them
ROPE_KEYS = {"theta": "rope_theta", "layout": "rope_layout", "scale": "rope_scale",
             "scaling": "rope_scaling", "low_freq_factor": "rope_low_freq_factor",
             "high_freq_factor": "rope_high_freq_factor",
             "original_max_len": "rope_original_max_len", "beta_fast": "rope_yarn_beta_fast",
             "beta_slow": "rope_yarn_beta_slow", "mscale": "rope_yarn_mscale",
             "mscale_all_dim": "rope_yarn_mscale_all_dim", "truncate": "rope_yarn_truncate",
             "fraction": "rope_fraction"}


def rope_args(settings) -> dict[str, Any]:
    """`apply_rope`'s keyword arguments read off `settings`' rope_* attributes (a
    `TransformerConfig` or a layer's settings)."""
    return {arg: getattr(settings, name) for arg, name in ROPE_KEYS.items()}


def apply_rope(
    x, positions, *, theta: float = 10000.0, layout: str = "half", scale: float = 1.0,
    scaling: str = "linear", low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
    original_max_len: int = 8192, beta_fast: float = 32.0, beta_slow: float = 1.0,
    mscale: float = 1.0, mscale_all_dim: float = 0.0, truncate: bool = True,
    fraction: float = 1.0,
) -> jax.Array:
    """Rotate pairs of head dims of x by angle pos * `rope_frequencies(...)`, by default
    (pos / scale) * theta^(-2i/H).

    x: [B, T, N, H]; positions: int [T] or [B, T] (absolute, e.g. decode offsets).
    fraction < 1: only the first 2 * floor(H * fraction / 2) dims rotate, with the frequencies
    of a head that wide; the rest pass unchanged (Qwen3-Next's partial_rotary_factor 0.25).
    layout="half" pairs dims (i, i + H/2) (GPT-NeoX / Llama "rotate_half");
    layout="interleaved" pairs dims (2i, 2i + 1) (RoFormer / GPT-J).
    scale > 1 is linear position interpolation (scaling="llama3": Llama 3.1's per-frequency
    version; scaling="yarn": YaRN's, whose rotated vectors are also multiplied by
    `rope_attention_factor`, as HF scales its cos and sin). Math in float32; returns x.dtype.
    """
    if fraction < 1.0:  # partial RoPE: the first (even) fraction of dims rotate, the rest pass
        rotated = 2 * int(x.shape[-1] * fraction / 2)
        return jnp.concatenate([apply_rope(
            x[..., :rotated], positions, theta=theta, layout=layout, scale=scale,
            scaling=scaling, low_freq_factor=low_freq_factor, high_freq_factor=high_freq_factor,
            original_max_len=original_max_len, beta_fast=beta_fast, beta_slow=beta_slow,
            mscale=mscale, mscale_all_dim=mscale_all_dim, truncate=truncate),
            x[..., rotated:]], axis=-1)
    if layout not in _ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {_ROPE_LAYOUTS}, got {layout!r}")
    if theta <= 0:
        raise ValueError(f"theta must be > 0, got {theta}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    x = jnp.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"x must have shape [B, T, N, H], got shape {x.shape}")
    H = x.shape[-1]
    if H % 2:
        raise ValueError(f"head dim H must be even for RoPE, got H={H}")
    pos_BT = _as_batched(positions)

    compute = jnp.promote_types(x.dtype, jnp.float32)  # float32 (float64 stays float64)
    inv_freq = jnp.asarray(rope_frequencies(
        H, theta=theta, scale=scale, scaling=scaling, low_freq_factor=low_freq_factor,
        high_freq_factor=high_freq_factor, original_max_len=original_max_len,
        beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate), compute)
    angle = pos_BT.astype(compute)[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    factor = rope_attention_factor(scaling, scale, mscale, mscale_all_dim)
    if factor != 1.0:  # yarn only: the other scalings stay bit for bit as they were
        cos, sin = cos * factor, sin * factor

    return _rotate(x, cos, sin, layout)


def _rotate_pairs(x, cos, sin, layout: str, inverse: bool = False):
    """x [B, T, N, H] with each pair of dims rotated by the angle of cos, sin [B, T, 1, H/2]
    (scaled by YaRN's factor), or with `inverse` by minus it: the math in cos's dtype, the
    result in x's."""
    H = x.shape[-1]
    xf = x.astype(cos.dtype)
    if layout == "half":
        x1, x2 = xf[..., : H // 2], xf[..., H // 2 :]
    else:
        pairs = xf.reshape(*xf.shape[:-1], H // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
    if inverse:  # written as autodiff writes the transpose, so that it rounds alike
        y1, y2 = x1 * cos + x2 * sin, x2 * cos - x1 * sin
    else:
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if layout == "half":
        out = jnp.concatenate([y1, y2], axis=-1)
    else:
        out = jnp.stack([y1, y2], axis=-1).reshape(xf.shape)
    return out.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotate(x, cos, sin, layout: str):
    return _rotate_pairs(x, cos, sin, layout)


def _rotate_fwd(x, cos, sin, layout):
    return _rotate_pairs(x, cos, sin, layout), (cos, sin)


def _rotate_bwd(layout, residuals, g):
    """A rotation's transpose is the rotation by minus the angle, so x's gradient is g rotated
    back: the same float32 math as autodiff's (bit for bit), but in one pass from g's dtype to
    x's, where autodiff of the casts and halves kept float32 gradients of q and k alive (1.5
    GiB a chip in a 1.7B's bfloat16 backward on TPU). cos and sin come from integer positions:
    no gradient flows to them."""
    cos, sin = residuals
    return (_rotate_pairs(g, cos, sin, layout, inverse=True), jnp.zeros_like(cos),
            jnp.zeros_like(sin))


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


# -----------------------------------------------------------------------------
# ALiBi (attention with linear biases)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Per-head ALiBi slopes, float32 [N] (static NumPy).

    Power of two n: 2^(-8/n), 2^(-16/n), ..., 2^(-8). Otherwise the slopes for the
    largest power of two p < n, then the first n - p of the 2p-head slopes [0::2].

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> np.log2(alibi_slopes(6)).tolist()
    [-2.0, -4.0, -6.0, -8.0, -1.0, -3.0]
    """
    _check_positive_int("num_heads", num_heads)

    def pow2_slopes(n: int) -> list[float]:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    p = 1 << (int(num_heads).bit_length() - 1)  # largest power of two <= num_heads
    slopes = pow2_slopes(p) + pow2_slopes(2 * p)[0::2][: num_heads - p]
    return np.asarray(slopes, dtype=np.float32)


def _take(positions_BT, idx):
    """Positions at indices `idx` (indices past the end repeat the last position)."""
    return jnp.take(positions_BT, jnp.minimum(idx, positions_BT.shape[1] - 1), axis=1)


@struct.dataclass(eq=False)  # hashed by identity: jax.closure_convert hashes it
class AlibiBiasFn:
    """`bias(q_idx, kv_idx)`: `alibi_bias` of the queries and keys at those indices, for
    chunked attention to evaluate per tile (never [T, S] at once). A pytree of arrays rather than
    a closure, so it can be passed through `nn.scan`, `nn.remat` and `jit`.

    >>> fn = alibi_bias_fn(jnp.arange(3), jnp.arange(3), 1)
    >>> np.asarray(fn(jnp.array([2]), jnp.arange(3))[0, 0] * 256).tolist()
    [[-2.0, -1.0, 0.0]]
    """

    q_BT: jax.Array
    kv_BS: jax.Array
    num_heads: int = struct.field(pytree_node=False)

    def __call__(self, q_idx, kv_idx) -> jax.Array:
        return alibi_bias(_take(self.q_BT, q_idx), _take(self.kv_BS, kv_idx), self.num_heads)


def alibi_bias_fn(q_positions, kv_positions, num_heads: int) -> AlibiBiasFn:
    """`alibi_bias` as a function of query and key indices (`AlibiBiasFn`)."""
    return AlibiBiasFn(_as_batched(q_positions), _as_batched(kv_positions), num_heads)


def alibi_bias(q_positions, kv_positions, num_heads: int) -> jax.Array:
    """ALiBi bias -slope_n * |q_pos - kv_pos|, float32 [B or 1, N, T, S].

    On the causal region (kv_pos <= q_pos) this is the usual ALiBi bias; for
    bidirectional attention it is the symmetric version.

    >>> np.asarray(alibi_bias(jnp.arange(3), jnp.arange(3), 1)[0, 0] * 256).tolist()
    [[0.0, -1.0, -2.0], [-1.0, 0.0, -1.0], [-2.0, -1.0, 0.0]]
    """
    slopes_N = jnp.asarray(alibi_slopes(num_heads))
    q_BT, kv_BS = _as_batched(q_positions), _as_batched(kv_positions)
    neg_dist_BTS = -jnp.abs(q_BT[:, :, None] - kv_BS[:, None, :])  # int: the diagonal is +0.0
    return slopes_N[None, :, None, None] * neg_dist_BTS[:, None].astype(jnp.float32)


# -----------------------------------------------------------------------------
# T5 relative position buckets


def t5_relative_position_bucket(
    relative_position,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> jax.Array:
    """Map relative_position = key_pos - query_pos to a T5 bucket id (int32, same shape).

    Bidirectional: buckets [0, nb) for rel <= 0 and [nb, 2nb) for rel > 0, nb = num_buckets//2.
    Causal: only rel <= 0 is distinguished, nb = num_buckets. Magnitudes below nb//2 get
    their own bucket; larger ones share log-spaced buckets up to max_distance.

    >>> t5_relative_position_bucket(jnp.array([-200, -16, -1, 0, 1, 16, 200])).tolist()
    [15, 10, 1, 0, 17, 26, 31]
    """
    _check_positive_int("num_buckets", num_buckets)
    _check_positive_int("max_distance", max_distance)
    if bidirectional and (num_buckets % 2 or num_buckets < 4):
        raise ValueError(f"num_buckets must be even and >= 4 if bidirectional, got {num_buckets}")
    if not bidirectional and num_buckets < 2:
        raise ValueError(f"num_buckets must be >= 2 if causal, got {num_buckets}")
    nb = num_buckets // 2 if bidirectional else num_buckets
    max_exact = nb // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must be > {max_exact} (the exact-bucket range), got {max_distance}"
        )

    rel = jnp.asarray(relative_position).astype(jnp.int32)
    if bidirectional:
        offset = jnp.where(rel > 0, nb, 0).astype(jnp.int32)
        mag = jnp.abs(rel)
    else:
        offset = jnp.zeros_like(rel)
        mag = jnp.maximum(-rel, 0)

    # log-spaced buckets for mag >= max_exact (clamp so log never sees 0)
    ratio = jnp.maximum(mag, max_exact).astype(jnp.float32) / max_exact
    log_bucket = max_exact + (
        jnp.log(ratio) / math.log(max_distance / max_exact) * (nb - max_exact)
    ).astype(jnp.int32)
    log_bucket = jnp.minimum(log_bucket, nb - 1)
    return offset + jnp.where(mag < max_exact, mag, log_bucket)


class T5RelativePositionBias(nn.Module):
    """Learned per-head attention bias indexed by T5 relative-position bucket."""

    num_heads: int
    bidirectional: bool = True
    num_buckets: int = 32
    max_distance: int = 128
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, q_positions, kv_positions, as_function: bool = False):
        """q_positions [T] or [B, T], kv_positions [S] or [B, S] -> bias [B or 1, N, T, S].

        `as_function=True` returns `bias(q_idx, kv_idx)` instead: the bias of the queries and
        keys at those indices, evaluated only where asked (per tile, by chunked attention).
        """
        _check_positive_int("num_heads", self.num_heads)
        names = ("relpos_buckets", "heads")
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), names)
        shape = (self.num_buckets, self.num_heads)
        table_KN = self.param("rel_embedding", init, shape, self.param_dtype)  # K=buckets
        bias = T5BiasFn(_as_batched(q_positions), _as_batched(kv_positions), table_KN,
                        self.bidirectional, self.num_buckets, self.max_distance,
                        jnp.dtype(self.dtype))
        return bias if as_function else bias.table(bias.q_BT, bias.kv_BS)


@struct.dataclass(eq=False)  # hashed by identity: jax.closure_convert hashes it
class T5BiasFn:
    """`bias(q_idx, kv_idx)`: T5's bucketed relative bias of the queries and keys at those
    indices (`T5RelativePositionBias(as_function=True)`); a pytree, like `AlibiBiasFn`."""

    q_BT: jax.Array
    kv_BS: jax.Array
    table_KN: jax.Array  # the learned embedding, [buckets, heads]
    bidirectional: bool = struct.field(pytree_node=False)
    num_buckets: int = struct.field(pytree_node=False)
    max_distance: int = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False)

    def table(self, q_BT, kv_BS) -> jax.Array:
        """The bias [B, N, T, S] of queries at positions q_BT and keys at kv_BS."""
        bucket_BTS = t5_relative_position_bucket(
            kv_BS[:, None, :] - q_BT[:, :, None],
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        bias_BTSN = jnp.take(self.table_KN, bucket_BTS, axis=0)
        return jnp.transpose(bias_BTSN, (0, 3, 1, 2)).astype(self.dtype)

    def __call__(self, q_idx, kv_idx) -> jax.Array:
        return self.table(_take(self.q_BT, q_idx), _take(self.kv_BS, kv_idx))
