"""Mamba 2 (transformer.nn.mixers.mamba2): the chunked SSD against a float64 NumPy recurrence
written from the paper, documents and padding, the convolution, decode against the full forward,
Hugging Face's Mamba2Mixer with its weights mapped in, and gradients."""

import dataclasses
import functools
import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.nn.mixers import conv
from transformer.nn.mixers import mamba2 as m2

BATCH, LENGTH, HEADS, WIDTH, GROUPS, STATE = 2, 13, 4, 3, 2, 5


def reference_ssd(x, dt, A, B, C, h0=None, segment_ids=None, D=None):
    """Dao & Gu 2024, eq. (1) per head: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
    y_t = h_t C_t + D x_t; head i reads group i // (H / G). A token whose segment differs from
    the previous one's (and is not 0) starts from h = 0; a padding token (0) keeps h."""
    batch, length, heads, width = x.shape
    per_group = heads // B.shape[2]
    h = np.zeros((batch, heads, width, B.shape[3])) if h0 is None else np.array(h0, np.float64)
    y = np.zeros(x.shape)
    for i in range(batch):
        for t in range(length):
            seg = None if segment_ids is None else segment_ids[i, t]
            if seg is not None and t > 0 and seg != 0 and seg != segment_ids[i, t - 1]:
                h[i] = 0
            for n in range(heads):
                g = n // per_group
                if seg != 0:
                    h[i, n] = (np.exp(dt[i, t, n] * A[n]) * h[i, n]
                               + dt[i, t, n] * np.outer(x[i, t, n], B[i, t, g]))
                y[i, t, n] = h[i, n] @ C[i, t, g] + (0 if D is None else D[n] * x[i, t, n])
    return y, h


def ssm_inputs(seed=0, length=LENGTH, groups=GROUPS):
    rng = np.random.default_rng(seed)
    return dict(
        x=rng.normal(size=(BATCH, length, HEADS, WIDTH)),
        dt=np.log1p(np.exp(rng.normal(size=(BATCH, length, HEADS)))),
        A=-np.exp(rng.normal(size=HEADS) * 0.5),
        B=rng.normal(size=(BATCH, length, groups, STATE)),
        C=rng.normal(size=(BATCH, length, groups, STATE)),
        h0=rng.normal(size=(BATCH, HEADS, WIDTH, STATE)), D=rng.normal(size=HEADS))


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def chunked(x, dt, A, B, C, h0, D, segment_ids=None, chunk_size=4):
    return m2.ssd_chunked(x, dt, A, B, C, h0, chunk_size, segment_ids, D)


@jax.jit
def recurrent(x, dt, A, B, C, h0, D, segment_ids=None):
    return m2.ssd_recurrent(x, dt, A, B, C, h0, segment_ids, D)


def run(fn, v, **kw):
    """`fn` on the NumPy inputs `v` (a jitted function takes them as they are: no eager
    transfer op per shape), its outputs as NumPy arrays."""
    return tuple(map(np.asarray, fn(*(v[k] for k in ("x", "dt", "A", "B", "C", "h0", "D")),
                                    **kw)))


PACKED = np.array([[1] * 5 + [2] * 6 + [0] * 2, [3] * 13])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunked_and_recurrent_are_the_recurrence_in_float64(groups):
    v = ssm_inputs(groups=groups)
    want_y, want_h = reference_ssd(v["x"], v["dt"], v["A"], v["B"], v["C"], v["h0"], PACKED,
                                   v["D"])
    with jax.enable_x64():
        for chunk in (1, 4, 5, 13, 64):  # 4, 5: chunks not dividing T = 13
            y, h = run(chunked, v, segment_ids=PACKED, chunk_size=chunk)
            assert y.dtype == jnp.float64
            np.testing.assert_allclose(y, want_y, rtol=1e-11, atol=1e-11, err_msg=f"Q={chunk}")
            np.testing.assert_allclose(h, want_h, rtol=1e-11, atol=1e-11, err_msg=f"Q={chunk}")
        y, h = run(recurrent, v, segment_ids=PACKED)
        np.testing.assert_allclose(y, want_y, rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(h, want_h, rtol=1e-11, atol=1e-11)


def test_chunked_in_float32_without_segments():
    v = ssm_inputs(1)
    want_y, want_h = reference_ssd(v["x"], v["dt"], v["A"], v["B"], v["C"], v["h0"], None, v["D"])
    for chunk in (3, 8):
        y, h = run(chunked, {k: a.astype(np.float32) for k, a in v.items()}, chunk_size=chunk)
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)


def test_strong_decay_stays_finite():
    """Decays of exp(-1e4) within a chunk: the segment sums never exponentiate a positive."""
    v = ssm_inputs(2)
    v["A"] = -np.full(HEADS, 2e3)
    y, h = run(chunked, {k: a.astype(np.float32) for k, a in v.items()}, chunk_size=13)
    want_y, want_h = reference_ssd(v["x"], v["dt"], v["A"], v["B"], v["C"], v["h0"], None, v["D"])
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)


def test_packed_documents_run_as_if_alone_and_padding_keeps_the_state():
    v = {k: a.astype(np.float32) for k, a in ssm_inputs(3).items()}
    v["h0"] = np.zeros_like(v["h0"])
    y, h = run(chunked, v, segment_ids=PACKED)
    for start, stop in ((0, 5), (5, 11)):
        alone = {k: (a[:, start:stop] if a.ndim > 1 and a.shape[1] == LENGTH else a)
                 for k, a in v.items()}
        y_alone, h_alone = run(chunked, alone)
        np.testing.assert_allclose(y[0, start:stop], y_alone[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h[0], h_alone[0], rtol=1e-5, atol=1e-5)  # padding: 11, 12


def reference_conv(x, kernel, bias, state, segment_ids):
    taps, (batch, length, _) = kernel.shape[0], x.shape
    xp = np.concatenate([state, x], 1)
    seg = np.concatenate([np.repeat(segment_ids[:, :1], taps - 1, 1), segment_ids], 1)
    y = np.zeros(x.shape) + bias
    for i in range(batch):
        for t in range(length):
            run = seg[i, taps - 1 + t]
            for k in range(taps):
                j = t + k  # x_{t-K+1+k}
                same = np.all(seg[i, j:taps - 1 + t + 1] == run)  # no run start in between
                y[i, t] += kernel[k] * xp[i, j] * same
    return y / (1 + np.exp(-y))


silu_conv = functools.partial(conv.causal_conv, activation=jax.nn.silu)


@jax.jit
def conv_calls(x, kernel, bias, state, seg):
    """With segments; then without: in two calls (the first 2 tokens, then the rest, through
    the state) and in one."""
    y1, s1 = silu_conv(x[:, :2], kernel, bias, state)
    return (silu_conv(x, kernel, bias, state, seg), (y1, s1),
            silu_conv(x[:, 2:], kernel, bias, s1), silu_conv(x, kernel, bias, state))


def test_causal_conv():
    rng = np.random.default_rng(4)
    x, kernel = rng.normal(size=(2, 9, 6)), rng.normal(size=(4, 6))
    bias, state = rng.normal(size=6), rng.normal(size=(2, 3, 6))
    seg = np.array([[1, 1, 2, 2, 2, 2, 0, 0, 0], [1] * 7 + [0] * 2])
    calls = jax.tree.map(np.asarray, conv_calls(x, kernel, bias, state, seg))
    (y, new), (y1, _), (y2, s2), (y_all, s_all) = calls
    np.testing.assert_allclose(y, reference_conv(x, kernel, bias, state, seg), atol=1e-5)
    np.testing.assert_allclose(new[0], x[0, 3:6], atol=1e-6)  # the last 3 before the padding
    np.testing.assert_allclose(new[1], x[1, 4:7], atol=1e-6)
    # in two calls, through the state
    np.testing.assert_allclose(np.concatenate([y1, y2], 1), y_all, atol=1e-6)
    np.testing.assert_allclose(s2, s_all, atol=1e-6)


def test_gradients_agree_between_chunked_and_recurrent():
    v = {k: a.astype(np.float32) for k, a in ssm_inputs(5).items()}
    v["A"] = v["A"] * 20  # decays below exp(-50) across a chunk: the masked -inf paths
    w_y = np.random.default_rng(0).normal(size=v["x"].shape).astype(np.float32)

    def loss(fn, args, w_y, w_h=0.3):
        y, h = fn(*args, segment_ids=PACKED)
        return jnp.sum(y * w_y) + w_h * jnp.sum(h**2)

    @jax.jit
    def grads(args, w_y):
        return [jax.grad(lambda a, fn=fn: loss(fn, a, w_y))(args) for fn in (chunked, recurrent)]

    args = tuple(v[k] for k in ("x", "dt", "A", "B", "C", "h0", "D"))
    g_chunk, g_rec = jax.tree.map(np.asarray, grads(args, w_y))
    for name, a, b in zip("x dt A B C h0 D".split(), g_chunk, g_rec, strict=True):
        assert np.isfinite(a).all(), name
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


# --- the layer ---------------------------------------------------------------------------------

D_MODEL = 16
SETTINGS = m2.Mamba2Settings(num_heads=4, head_dim=8, num_groups=2, state_size=8,
                             conv_kernel=4, chunk_size=4, use_bias=True,
                             time_step_limit=(0.0, 0.5))


@pytest.fixture(scope="module")
def layer_and_params():
    """The layer, its params (NumPy) moved away from their init, and the boxed init."""
    layer = m2.Mamba2(SETTINGS)
    boxed = jax.jit(layer.init)(jax.random.key(0), np.ones((1, 3, D_MODEL), np.float32))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: (a + 0.2 * rng.normal(size=a.shape)).astype(a.dtype),
                          jax.tree.map(np.asarray, nn.unbox(boxed["params"])))
    return layer, params, boxed["params"]


def test_params_and_logical_axes(layer_and_params):
    layer, params, boxed = layer_and_params
    shapes = jax.tree.map(np.shape, params)
    assert shapes["z"] == shapes["x"] == (D_MODEL, 4, 8)
    assert shapes["B"] == shapes["C"] == (D_MODEL, 2, 8)
    assert shapes["conv_x"] == (4, 4, 8) and shapes["out"] == (4, 8, D_MODEL)
    names = {k: v.names for k, v in boxed.items()}
    assert names["x"] == ("embed", "heads", "kv") and names["B"] == ("embed", "kv_heads", "state")
    assert names["conv_C"] == ("conv", "kv_heads", "state") and names["A_log"] == ("heads",)
    a = -np.exp(np.asarray(boxed["A_log"].value))
    np.testing.assert_allclose(a, [-1, -2, -3, -4], rtol=1e-6)  # HF's init
    dt = np.log1p(np.exp(np.asarray(boxed["dt_bias"].value)))
    assert (dt >= 1e-3 - 1e-9).all() and (dt <= 0.1 + 1e-9).all()


def test_decode_equals_the_full_forward(layer_and_params):
    layer, params, _ = layer_and_params
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 12, D_MODEL)).astype(np.float32)
    full = np.asarray(jax.jit(layer.apply)({"params": params}, x))
    lengths = (5, 8)  # row 0's prefill is right-padded
    prefill = x[:, :8].copy()
    prefill[0, 5:] = rng.normal(size=(3, D_MODEL))
    seg = np.array([[1] * 5 + [0] * 3, [1] * 8])
    cache = jax.jit(functools.partial(layer.init, decode=True))(jax.random.key(0), prefill)[
        "cache"]
    assert all(not np.asarray(a).any() for a in jax.tree.leaves(cache))
    assert cache["ssm_state"].shape == (2, 4, 8, 8) and cache["conv_state"].shape == (2, 3, 64)
    step = jax.jit(functools.partial(layer.apply, decode=True, mutable=["cache"]))
    out, state = step({"params": params, "cache": cache}, prefill, segment_ids=seg)
    out = np.asarray(out)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(out[row, :n], full[row, :n], rtol=1e-5, atol=1e-5)
    for j in range(4):
        token = np.stack([x[row, n + j] for row, n in enumerate(lengths)])[:, None]
        out, state = step({"params": params, **state}, token)
        out = np.asarray(out)
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(out[row, 0], full[row, n + j], rtol=1e-5, atol=1e-5,
                                       err_msg=f"step {j}, row {row}")


def test_layer_gradients_are_finite_with_documents(layer_and_params):
    layer, params, _ = layer_and_params
    x = np.random.default_rng(9).normal(size=(2, 12, D_MODEL)).astype(np.float32)
    seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12])
    grads = jax.jit(jax.grad(
        lambda p: jnp.sum(layer.apply({"params": p}, x, segment_ids=seg) ** 2)))(params)
    assert all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in jax.tree.leaves(grads))


gated_rms_norm = jax.jit(m2.gated_rms_norm, static_argnums=(3, 4, 5))


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_norm_per_group(norm_before_gate):
    """RMSNorm over each group's R heads x P values, with SiLU(z) after or before it."""
    rng = np.random.default_rng(11)
    y, z, w = rng.normal(size=(2, 3, 4, 8)), rng.normal(size=(2, 3, 4, 8)), rng.normal(size=(4, 8))
    gate = z / (1 + np.exp(-z))
    g = y.reshape(2, 3, 2, 16) * (1 if norm_before_gate else gate.reshape(2, 3, 2, 16))
    want = (g / np.sqrt((g**2).mean(-1, keepdims=True) + 1e-5)).reshape(y.shape) * w
    want = want * gate if norm_before_gate else want
    got = gated_rms_norm(y, z, w, 2, 1e-5, norm_before_gate)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def hf_to_params(mixer, s: m2.Mamba2Settings) -> dict:
    """HF Mamba2Mixer weights -> this layer's params, as the checkpoint importer maps them
    (transformer.hf.convert_mamba2.mixer_params)."""
    from transformer.hf.common import Checkpoint
    from transformer.hf.convert_mamba2 import mixer_params

    ckpt = Checkpoint(mixer.state_dict(), dtype=np.float64)
    p = mixer_params(ckpt, "", s.num_heads, s.head_dim, s.num_groups, s.state_size)
    ckpt.check_all_used()
    return {k: np.asarray(v, np.float32) for k, v in p.items()}


def test_matches_hugging_face_mamba2_mixer():
    """HF's torch path (no mamba_ssm kernels), random weights, a time_step_limit that clips."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    from transformers import Mamba2Config

    cfg = Mamba2Config(hidden_size=D_MODEL, num_heads=4, head_dim=8, expand=2, n_groups=2,
                       state_size=8, conv_kernel=4, chunk_size=4, use_bias=True,
                       num_hidden_layers=1, vocab_size=32, time_step_limit=(0.0, 0.5),
                       layer_norm_epsilon=1e-5)
    torch.manual_seed(0)
    mixer = hf.Mamba2Mixer(cfg, 0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(0.4 * torch.randn_like(p))
    x = np.random.default_rng(10).normal(size=(2, 11, D_MODEL)).astype(np.float32)
    with torch.no_grad():
        want = mixer(torch.from_numpy(x)).numpy()
    settings = dataclasses.replace(SETTINGS, norm_epsilon=1e-5)
    got = jax.jit(m2.Mamba2(settings).apply)({"params": hf_to_params(mixer, settings)}, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# --- config and the registry's record ----------------------------------------------------------


class _Cfg:  # the TransformerConfig fields the layer and the record read
    d_model, mamba2 = 2048, m2.Mamba2Config()
    use_bias, norm_epsilon, init_std, dtype, param_dtype = False, 1e-6, None, jnp.bfloat16, "f"

    @staticmethod
    def init_scale(residual=False):
        return 0.5 if residual else 1.0


def test_config_checks_and_record():
    assert m2.Mamba2Config(time_step_limit_max=1).time_step_limit == (0.0, 1.0)
    assert m2.Mamba2Config().time_step_limit == (0.0, math.inf)  # 0: no limit
    with pytest.raises(ValueError, match=r"mamba2.time_step_limit_max=1: expected 0 \(no "):
        m2.Mamba2Config(time_step_limit_min=1, time_step_limit_max=1)
    with pytest.raises(ValueError, match="mamba2.state_size=0: expected an int >= 1"):
        m2.Mamba2Config(state_size=0)
    with pytest.raises(ValueError, match="mamba2.num_groups=3: expected a divisor of the heads"):
        m2.Mamba2Config(num_groups=3).check(types.SimpleNamespace(d_model=2048))
    with pytest.raises(ValueError, match="mamba2.head_dim=48: expected a divisor"):
        m2.Mamba2Config(head_dim=48).check(types.SimpleNamespace(d_model=2048))
    s = m2.Mamba2Settings.from_config(_Cfg)
    assert (s.num_heads, s.head_dim, s.state_size, s.out_init_scale) == (64, 64, 128, 0.5)
    assert s.conv_channels == 64 * 64 + 2 * 128 and s.dtype == jnp.bfloat16
    assert m2.refuses(_Cfg, {"sequence": 2}) == (
        "mamba2 layers: mesh.sequence=2: expected 1 (the recurrent state is not passed between "
        "devices)")
    assert m2.refuses(_Cfg, {"tensor": 4}) is None
    # H = 64 heads of P = 64, N = 128, G = 1, Q = 64: forward 2QGN + 2QHP + 4HPN, x 3
    inner = 64 * 64
    assert m2.flops_per_token(_Cfg, 4096) == 3 * (2 * 64 * 128 + 2 * 64 * inner
                                                  + 4 * inner * 128)
    assert m2.flops_per_token(_Cfg, 16) < m2.flops_per_token(_Cfg, 4096)  # Q = min(64, T)
    assert m2.MIXER.cache_bytes_per_token(_Cfg) == 0 and m2.MIXER.param_name == "mamba2"
    assert m2.MIXER.config is m2.Mamba2Config and math.isinf(_Cfg.mamba2.time_step_limit[1])
