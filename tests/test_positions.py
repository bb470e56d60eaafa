"""Tests for transformer/nn/positions.py: each test pins one property against independent math."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.nn.positions import (
    LearnedPositionEmbedding,
    T5RelativePositionBias,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rope_frequencies,
    sinusoidal_positions,
    t5_relative_position_bucket,
)


def _randn(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# The code under test runs under jit, fed NumPy inputs: eager jnp ops compile one XLA program
# per op and shape, which is most of what these tests would otherwise spend.
_sinusoidal = jax.jit(sinusoidal_positions, static_argnames=("dim", "max_timescale"))
_rope = jax.jit(apply_rope, static_argnames=("theta", "layout", "scale", "scaling", "truncate",
                                             "fraction"))
_alibi = jax.jit(alibi_bias, static_argnames="num_heads")
_bucket = jax.jit(t5_relative_position_bucket,
                  static_argnames=("bidirectional", "num_buckets", "max_distance"))


# -----------------------------------------------------------------------------
# sinusoidal


@pytest.mark.parametrize("dim", [2, 6, 16])
def test_sinusoidal_matches_float64_formula_with_sin_on_even_cos_on_odd(dim):
    pos = np.array([0, 1, 2, 7, 50, 511])
    want = np.zeros((len(pos), dim))
    for t, p in enumerate(pos):
        for i in range(dim // 2):
            a = p / 10000.0 ** (2 * i / dim)
            want[t, 2 * i], want[t, 2 * i + 1] = np.sin(a), np.cos(a)
    got = _sinusoidal(pos, dim)
    assert got.shape == (len(pos), dim) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_sinusoidal_custom_max_timescale():
    got = _sinusoidal(np.array([3]), 4, max_timescale=100.0)
    want = [np.sin(3.0), np.cos(3.0), np.sin(0.3), np.cos(0.3)]
    np.testing.assert_allclose(np.asarray(got)[0], want, atol=1e-6)


def test_sinusoidal_position_zero_is_0101():
    np.testing.assert_array_equal(
        np.asarray(_sinusoidal(np.array([0]), 8))[0], [0, 1, 0, 1, 0, 1, 0, 1]
    )


def test_sinusoidal_batched_positions_give_per_row_embeddings():
    pos_BT = np.array([[0, 1, 2], [5, 6, 7]])
    got, row = jax.jit(lambda p: (sinusoidal_positions(p, 4), sinusoidal_positions(p[1], 4)))(
        pos_BT)
    assert got.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(got)[1], np.asarray(row))


# -----------------------------------------------------------------------------
# learned


def test_learned_output_is_embedding_rows_at_positions():
    mod = LearnedPositionEmbedding(max_len=10, features=4)
    pos_BT = np.array([[0, 3, 9], [2, 2, 1]])

    @jax.jit
    def run(pos_BT, pos_T):
        params = mod.init(jax.random.key(0), pos_BT)
        return params, mod.apply(params, pos_BT), mod.apply(params, pos_T)

    params, out, out_T = run(pos_BT, np.array([4, 5]))
    table = nn.unbox(params)["params"]["embedding"]
    assert table.shape == (10, 4)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(table)[pos_BT])
    np.testing.assert_array_equal(np.asarray(out_T), np.asarray(table)[[4, 5]])


def test_learned_param_has_logical_names_length_embed_and_small_init():
    mod = LearnedPositionEmbedding(max_len=256, features=64)
    params = jax.jit(lambda pos: mod.init(jax.random.key(0), pos))(np.arange(3))
    boxed = params["params"]["embedding"]
    assert isinstance(boxed, nn.LogicallyPartitioned)
    assert boxed.names == ("length", "embed")
    assert nn.get_partition_spec(params)["params"]["embedding"] == jax.sharding.PartitionSpec(
        "length", "embed"
    )
    assert 0.015 < float(np.std(np.asarray(boxed.value))) < 0.025  # normal(stddev=0.02)


def test_learned_output_dtype_follows_dtype_param_dtype_follows_param_dtype():
    mod = LearnedPositionEmbedding(max_len=8, features=4, dtype=jnp.bfloat16)

    @jax.jit
    def run(pos):
        params = mod.init(jax.random.key(0), pos)
        return params, mod.apply(params, pos)

    params, out = run(np.arange(3))
    assert nn.unbox(params)["params"]["embedding"].dtype == jnp.float32
    assert out.dtype == jnp.bfloat16


# -----------------------------------------------------------------------------
# RoPE


def _rope_np(x, pos, theta=10000.0, layout="half", scale=1.0):
    """Independent float64 reference: explicit 2x2 rotation of each dim pair."""
    x = np.asarray(x, np.float64)
    B, T, N, H = x.shape
    pos = np.broadcast_to(np.asarray(pos), (B, T))
    out = np.empty_like(x)
    for i in range(H // 2):
        a, b = (i, i + H // 2) if layout == "half" else (2 * i, 2 * i + 1)
        freq = theta ** (-2.0 * i / H)
        for bb in range(B):
            for t in range(T):
                ang = pos[bb, t] / scale * freq
                rot = np.array([[np.cos(ang), -np.sin(ang)], [np.sin(ang), np.cos(ang)]])
                out[bb, t, :, [a, b]] = rot @ x[bb, t, :, [a, b]]
    return out


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_matches_float64_rotation_matrices(layout):
    x = _randn(0, 2, 5, 3, 8)
    pos_BT = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 100, 1234]])
    got, got_scaled = jax.jit(lambda x, p: (
        apply_rope(x, p, layout=layout),
        apply_rope(x, p, layout=layout, theta=500.0, scale=3.0)))(x, pos_BT)
    np.testing.assert_allclose(np.asarray(got), _rope_np(x, pos_BT, layout=layout), atol=5e-4)
    want = _rope_np(x, pos_BT, theta=500.0, layout=layout, scale=3.0)
    np.testing.assert_allclose(np.asarray(got_scaled), want, atol=5e-4)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_dot_product_depends_only_on_relative_position(layout):
    N, H = 4, 16
    q, k = _randn(1, 1, 1, N, H), _randn(2, 1, 1, N, H)
    scale_qk = np.linalg.norm(q, axis=-1) * np.linalg.norm(k, axis=-1)  # [1, 1, N]

    @jax.jit
    def rotate(t, s):  # one program for every (t, s): the positions are traced
        return (apply_rope(q, jnp.reshape(t, (1,)), layout=layout),
                apply_rope(k, jnp.reshape(s, (1,)), layout=layout))

    def dots(t, s):
        qr, kr = rotate(np.int32(t), np.int32(s))
        return np.sum(np.asarray(qr) * np.asarray(kr), axis=-1)  # [1, 1, N]

    for t, s in [(3, 0), (5, 9), (0, 0)]:
        base = dots(t, s)
        for c in [1, 17, 1000, 10000, 100000]:
            # float32 angle error grows ~ position * 2^-24 rad, so tolerance grows with c
            tol = (1e-6 + (max(t, s) + c) * 2.0**-24) * scale_qk
            assert np.all(np.abs(dots(t + c, s + c) - base) <= tol), (t, s, c)
    assert not np.allclose(dots(3, 0), dots(0, 3), atol=1e-3)  # it is not a trivial rotation


def test_rope_preserves_norm_of_each_head_vector():
    x = _randn(3, 2, 6, 3, 8)
    out = _rope(x, np.arange(6) * 37)
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(out), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_position_zero_is_identity(layout):
    x = _randn(4, 2, 3, 2, 8)
    out = _rope(x, np.zeros((3,), np.int32), layout=layout)
    np.testing.assert_array_equal(np.asarray(out), x)


def test_rope_half_and_interleaved_are_same_rotation_up_to_dim_permutation():
    H = 8
    x = _randn(5, 2, 4, 3, H)
    pos = np.array([0, 3, 11, 400])
    perm = np.stack([np.arange(H // 2), np.arange(H // 2) + H // 2], -1).reshape(-1)  # 0,4,1,5..
    inv = np.argsort(perm)
    half, inter, unpermuted = jax.jit(lambda x, x_perm, pos: (
        apply_rope(x, pos, layout="half"),
        apply_rope(x_perm, pos, layout="interleaved"),
        apply_rope(x, pos, layout="interleaved")))(x, x[..., perm], pos)
    np.testing.assert_allclose(np.asarray(inter)[..., inv], np.asarray(half), atol=1e-6)
    assert not np.allclose(np.asarray(unpermuted), np.asarray(half), atol=1e-3)


def test_rope_scale_2_at_position_2p_equals_scale_1_at_position_p():
    x = _randn(6, 1, 4, 2, 8)
    p = np.array([0, 1, 5, 300])
    a, b = jax.jit(lambda x, p: (apply_rope(x, 2 * p, scale=2.0),
                                 apply_rope(x, p, scale=1.0)))(x, p)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_rope_T_positions_equal_broadcast_B_T_positions():
    x = _randn(7, 3, 4, 2, 8)
    pos_T = np.array([7, 8, 9, 10])
    a, b = jax.jit(lambda x, p: (apply_rope(x, p), apply_rope(x, jnp.broadcast_to(p, (3, 4)))))(
        x, pos_T)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rope_per_batch_positions_are_used_per_row():
    x = _randn(8, 2, 1, 1, 8)
    x[1] = x[0]
    out, single = jax.jit(lambda x, x1: (apply_rope(x, jnp.array([[0], [5]])),
                                         apply_rope(x1, jnp.array([5]))))(x, x[1:])
    out = np.asarray(out)
    np.testing.assert_array_equal(out[0], x[0])  # row 0 at position 0: unchanged
    np.testing.assert_allclose(out[1:], np.asarray(single), atol=1e-6)


def test_rope_bf16_in_bf16_out_computed_in_float32():
    x = _randn(9, 2, 16, 2, 8).astype(jnp.bfloat16)
    pos = np.arange(16) * 61
    out, f32 = jax.jit(lambda x, pos: (
        apply_rope(x, pos),
        apply_rope(x.astype(jnp.float32), pos).astype(jnp.bfloat16)))(x, pos)
    assert out.dtype == jnp.bfloat16
    want = _rope_np(np.asarray(x, np.float32), pos[None])
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2)
    # a single rounding at the end: same as rotating the upcast input in float32, then casting
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(f32, np.float32))


def _autodiff_rope(x, pos, layout, factor=1.0, H=None):
    """RoPE as plain jnp ops (float32 math, cast back), differentiated by JAX's autodiff."""
    H = H or x.shape[-1]
    inv = jnp.asarray(rope_frequencies(H), jnp.float32)  # the library's angles, as given
    angle = pos.astype(jnp.float32)[None, :, None, None] * inv
    cos, sin = jnp.cos(angle) * factor, jnp.sin(angle) * factor
    xf = x.astype(jnp.float32)
    if layout == "half":
        x1, x2 = xf[..., : H // 2], xf[..., H // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
    return out.astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_gradient_is_the_inverse_rotation_bit_for_bit_as_autodiff_gives_it(layout, dtype):
    """apply_rope's custom VJP (the cotangent rotated back, in its own dtype) against autodiff
    of the same float32 formula: equal bit for bit, in float32 and bfloat16."""
    x = _randn(3, 2, 12, 3, 16).astype(dtype)
    w = _randn(4, 2, 12, 3, 16).astype(dtype)
    pos = np.arange(12, dtype=np.int32) * 7

    @jax.jit
    def grads(x, w, pos):
        grad = jax.grad(lambda x: jnp.sum((apply_rope(x, pos, layout=layout) * w)
                                          .astype(jnp.float32)))(x)
        want = jax.grad(lambda x: jnp.sum((_autodiff_rope(x, pos, layout) * w)
                                          .astype(jnp.float32)))(x)
        yarn = jax.grad(lambda x: jnp.sum(apply_rope(x, pos, layout=layout, scaling="yarn",
                                                     scale=4.0, truncate=False) * w))(x)
        part = jax.grad(lambda x: jnp.sum((apply_rope(x, pos, layout=layout, fraction=0.5) * w)
                                          .astype(jnp.float32)))(x)
        return grad, want, yarn, part

    grad, want, yarn, part = grads(x, w, pos)
    assert grad.dtype == dtype
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want, np.float32))
    # YaRN scales the rotation (its transpose scales alike); partial RoPE passes the rest
    assert float(np.abs(np.asarray(yarn, np.float32)).max()) > 0
    np.testing.assert_array_equal(np.asarray(part, np.float32)[..., 8:],
                                  np.asarray(w[..., 8:], np.float32))


# -----------------------------------------------------------------------------
# ALiBi


def test_alibi_slopes_8_heads_are_halvings_from_one_half():
    s = alibi_slopes(8)
    assert isinstance(s, np.ndarray) and s.dtype == np.float32
    np.testing.assert_array_equal(
        s, [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    )


def test_alibi_slopes_12_heads_standard_values():
    want = [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8,
            2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]  # fmt: skip
    np.testing.assert_allclose(alibi_slopes(12), want, rtol=1e-6)


def test_alibi_slopes_small_head_counts():
    np.testing.assert_array_equal(alibi_slopes(1), [2**-8])
    np.testing.assert_array_equal(alibi_slopes(2), [2**-4, 2**-8])
    np.testing.assert_allclose(alibi_slopes(3), [2**-4, 2**-8, 2**-2], rtol=1e-6)


def test_alibi_bias_is_minus_slope_times_distance_zero_on_diagonal():
    N = 4
    q, kv = np.array([0, 1, 2]), np.array([0, 1, 2, 3, 4])
    bias = np.asarray(_alibi(q, kv, N))
    assert bias.shape == (1, N, 3, 5) and bias.dtype == np.float32
    slopes = alibi_slopes(N)
    want = -slopes[:, None, None] * np.abs(q[:, None] - kv[None, :])
    np.testing.assert_allclose(bias[0], want, rtol=1e-6)
    for t in range(3):
        assert np.all(bias[0, :, t, t] == 0)


def test_alibi_bias_batched_positions_decode_offset():
    q_BT = np.array([[7], [3]])  # decoding one token at different offsets
    kv_S = np.arange(8)
    bias = np.asarray(_alibi(q_BT, kv_S, 2))
    assert bias.shape == (2, 2, 1, 8)
    np.testing.assert_allclose(bias[0, 0, 0], -np.abs(7 - np.arange(8)) / 16.0)
    np.testing.assert_allclose(bias[1, 1, 0], -np.abs(3 - np.arange(8)) / 256.0)


# -----------------------------------------------------------------------------
# T5 relative position buckets


def test_t5_bucket_bidirectional_known_values():
    rel = [0, -1, -8, -12, -16, -32, -64, -127, -128, -500, -100000,
           1, 8, 16, 32, 64, 127, 128, 100000]  # fmt: skip
    want = [0, 1, 8, 9, 10, 12, 14, 15, 15, 15, 15,
            17, 24, 26, 28, 30, 31, 31, 31]  # fmt: skip
    got = _bucket(np.array(rel))
    assert got.dtype == jnp.int32
    assert got.tolist() == want


def test_t5_bucket_bidirectional_exact_range_is_identity():
    rel = np.arange(-7, 8)
    got = _bucket(rel).tolist()
    assert got == [-r if r <= 0 else 16 + r for r in rel]


def test_t5_bucket_causal_known_values():
    # causal: nb = 32, max_exact = 16, m = max(-rel, 0); m >= 16 -> 16 + int(log(m/16)/log(8)*16)
    #   -20:   log(1.25)/log(8)*16  = 1.72  -> 17
    #   -32:   log(2)/log(8)*16     = 5.33  -> 21
    #   -64:   log(4)/log(8)*16     = 10.67 -> 26
    #   -127:  log(7.94)/log(8)*16  = 15.94 -> 31
    #   -1000: log(62.5)/log(8)*16  = 31.8  -> 47, clipped to 31
    rel = [0, -1, -15, -16, -20, -32, -64, -127, -1000, 1, 5, 1000]
    want = [0, 1, 15, 16, 17, 21, 26, 31, 31, 0, 0, 0]
    assert _bucket(np.array(rel), bidirectional=False).tolist() == want


def test_t5_bucket_is_monotone_in_magnitude():
    m = np.arange(0, 300)
    neg, pos = map(np.asarray, jax.jit(lambda m: (t5_relative_position_bucket(-m),
                                                   t5_relative_position_bucket(m[1:])))(m))
    assert np.all(np.diff(neg) >= 0) and np.all(np.diff(pos) >= 0)
    assert set(neg.tolist()) == set(range(16)) and set(pos.tolist()) == set(range(17, 32))


@functools.cache  # one init per configuration, shared by the tests that use it
def _t5_setup(**kw):
    mod = T5RelativePositionBias(num_heads=3, **kw)
    params = jax.jit(lambda q, kv: mod.init(jax.random.key(0), q, kv))(np.arange(5), np.arange(7))
    return mod, params


@pytest.mark.slow
def test_t5_bias_equals_rel_embedding_gathered_by_bucket():
    for bidirectional in [True, False]:
        kw = dict(bidirectional=bidirectional, num_buckets=8, max_distance=20)
        mod, params = _t5_setup(**kw)
        table_KN = np.asarray(nn.unbox(params)["params"]["rel_embedding"])
        assert table_KN.shape == (8, 3)
        q_BT = np.array([[0, 1, 2, 3, 4], [40, 41, 42, 43, 44]])
        kv_S = np.arange(0, 70, 10)
        bias = np.asarray(jax.jit(mod.apply)(params, q_BT, kv_S))
        assert bias.shape == (2, 3, 5, 7)
        rel_BTS = kv_S[None, None, :] - q_BT[:, :, None]
        bucket_BTS = np.asarray(_bucket(rel_BTS, **kw))
        assert len(np.unique(bucket_BTS)) > 4  # the check below sees many distinct buckets
        for b, t, s in np.ndindex(2, 5, 7):
            np.testing.assert_array_equal(bias[b, :, t, s], table_KN[bucket_BTS[b, t, s]])


def test_t5_bias_depends_only_on_kv_minus_q():
    mod, params = _t5_setup()
    apply = jax.jit(mod.apply)  # one program for every shift: the positions are traced
    q, kv = np.arange(5), np.arange(7)
    base = np.asarray(apply(params, q, kv))
    assert base.shape == (1, 3, 5, 7)
    for c in [1, 13, 1000]:
        np.testing.assert_array_equal(np.asarray(apply(params, q + c, kv + c)), base)
    assert not np.array_equal(np.asarray(apply(params, q + 3, kv)), base)


def test_t5_bias_param_logical_names():
    _, params = _t5_setup()
    boxed = params["params"]["rel_embedding"]
    assert boxed.names == ("relpos_buckets", "heads")


# -----------------------------------------------------------------------------
# argument validation


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sinusoidal_positions(np.arange(3), 3), "dim must be a positive even int, got 3"),
        (lambda: sinusoidal_positions(np.arange(3), 0), "dim.*0"),
        (lambda: apply_rope(np.ones((1, 2, 1, 5)), np.arange(2)), "H=5"),
        (lambda: apply_rope(np.ones((1, 2, 1, 4)), np.arange(2), layout="neox"), "'neox'"),
        (lambda: apply_rope(np.ones((1, 2, 1, 4)), np.arange(2), scale=0.0), "scale.*0"),
        (lambda: apply_rope(np.ones((2, 1, 4)), np.arange(2)), r"\(2, 1, 4\)"),
        (lambda: alibi_slopes(0), "num_heads.*0"),
        (lambda: alibi_bias(np.arange(2), np.arange(2), -2), "num_heads.*-2"),
        (lambda: t5_relative_position_bucket(np.arange(2), num_buckets=7), "num_buckets.*7"),
        (lambda: t5_relative_position_bucket(np.arange(2), max_distance=4), "max_distance.*4"),
        (
            lambda: LearnedPositionEmbedding(0, 4).init(jax.random.key(0), np.arange(2)),
            "max_len.*0",
        ),
        (
            lambda: T5RelativePositionBias(0).init(jax.random.key(0), np.arange(2), np.arange(2)),
            "num_heads.*0",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -----------------------------------------------------------------------------
# the model config's RoPE keys


def _model_config(**keys):
    from transformer.nn.config import TransformerConfig

    return TransformerConfig(num_layers=1, d_model=8, num_heads=2, d_ff=16, **keys)


@pytest.mark.parametrize("position, key, value", [
    ("alibi", "rope_scale", 4.0), ("alibi", "rope_scaling", "yarn"),
    ("learned", "rope_theta", 5e5), ("t5", "rope_original_max_len", 4096),
    ("none", "rope_layout", "interleaved"), ("sinusoidal", "rope_yarn_beta_fast", 8.0)])
def test_rope_keys_without_rope_positions_are_refused_naming_the_key(position, key, value):
    with pytest.raises(ValueError) as error:
        _model_config(position=position, **{key: value})
    assert str(error.value) == f"{key}={value!r}: expected position='rope' (RoPE's keys do " \
        f"nothing with position={position!r})"
    _model_config(position=position)  # their defaults are no setting
    assert getattr(_model_config(position="rope", **{key: value}), key) == value


@pytest.mark.parametrize("value", [0.0, -2.0])
def test_rope_scale_must_be_positive_and_the_run_config_error_names_it(value):
    from transformer import configs

    with pytest.raises(ValueError, match=rf"^rope_scale={value}: expected a number > 0"):
        _model_config(rope_scale=value)
    config = configs.base_config()
    config.model.rope_scale = value
    with pytest.raises(ValueError) as error:
        configs.validate_config(config, num_devices=1, num_processes=1, files=False)
    assert str(error.value) == f"model.rope_scale={value}: expected a number > 0 (1: no scaling)"
