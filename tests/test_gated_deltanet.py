"""Gated DeltaNet (transformer.nn.mixers.gated_deltanet): the chunked delta rule against a
float64 NumPy recurrence written from the paper, documents and padding, the convolution, the
layer's decode against its full forward, and Hugging Face's Qwen3NextGatedDeltaNet."""

import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.nn.mixers import gated_deltanet as gdn
from transformer.nn.mixers.conv import causal_conv
from transformer.training.metrics import program_matmul_flops

B, G, N, K, V = 2, 2, 4, 8, 6  # batch, query/key heads, value heads, key and value widths


def reference(q, k, v, log_alpha, beta, state=None, segment_ids=None):
    """The gated delta rule as the paper writes it, S [V, K] per head:
    S_t = S_{t-1} (a_t (I - b_t k_t k_t^T)) + b_t v_t k_t^T, o_t = S_t q_t; value head n reads
    query/key head n // (N / G). A document start zeroes S first; padding leaves S alone.
    Returns (o [B, T, N, V], final S transposed to [B, N, K, V])."""
    q, k, v, log_alpha, beta = (np.asarray(x, np.float64) for x in (q, k, v, log_alpha, beta))
    batch, length, heads, width = v.shape
    group = heads // k.shape[2]
    s = np.zeros((batch, heads, width, k.shape[-1])) if state is None else \
        np.swapaxes(np.asarray(state, np.float64), -1, -2).copy()
    seg = np.ones((batch, length), int) if segment_ids is None else np.asarray(segment_ids)
    out = np.zeros_like(v)
    for b in range(batch):
        for t in range(length):
            if t and seg[b, t] and seg[b, t] != seg[b, t - 1]:
                s[b] = 0
            for n in range(heads):
                qt, kt = q[b, t, n // group], k[b, t, n // group]
                if seg[b, t]:
                    a, bt = np.exp(log_alpha[b, t, n]), beta[b, t, n]
                    s[b, n] = s[b, n] @ (a * (np.eye(len(kt)) - bt * np.outer(kt, kt))) + \
                        bt * np.outer(v[b, t, n], kt)
                out[b, t, n] = s[b, n] @ qt
    return out, np.swapaxes(s, -1, -2)


def inputs(length, seed=0, batch=B):
    """q, k (unit keys, as the layer's), v, log decays, betas and a state, float64 NumPy."""
    r = np.random.default_rng(seed)
    k = r.normal(size=(batch, length, G, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return (r.normal(size=(batch, length, G, K)) * K**-0.5, k, r.normal(size=(batch, length, N, V)),
            -r.uniform(0.0, 1.5, (batch, length, N)), r.uniform(0.0, 1.0, (batch, length, N)),
            r.normal(size=(batch, N, K, V)))


@functools.cache
def chunked(chunk_size):
    return jax.jit(functools.partial(gdn.chunked_gated_delta_rule, chunk_size=chunk_size))


recurrent = jax.jit(gdn.recurrent_gated_delta_rule)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])  # 7 divides neither T nor a power of 2
def test_chunked_and_recurrent_equal_the_reference_float64(chunk_size):
    q, k, v, g, beta, state = inputs(23)
    want_out, want_state = reference(q, k, v, g, beta, state)
    with jax.enable_x64(True):
        for fn in (chunked(chunk_size), recurrent):
            out, final = fn(q, k, v, g, beta, state)
            assert out.dtype == jnp.float64
            np.testing.assert_allclose(out, want_out, atol=1e-11, rtol=0)
            np.testing.assert_allclose(final, want_state, atol=1e-11, rtol=0)


def test_chunked_float32():
    q, k, v, g, beta, state = inputs(37, seed=1)
    want_out, want_state = reference(q, k, v, g, beta, state)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)]
    for fn in (chunked(16), recurrent):
        out, final = fn(*args)
        assert out.dtype == jnp.float32 and final.dtype == jnp.float32
        np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
        np.testing.assert_allclose(final, want_state, atol=2e-5, rtol=0)


def test_strong_decay_stays_finite():
    """Log decays of -60 a token: cumulative sums of -3840 in a chunk, whose differences above
    the diagonal would overflow exp if they were not masked first."""
    q, k, v, g, beta, state = inputs(64, seed=2)
    g = np.full_like(g, -60.0)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)]
    out, final = chunked(64)(*args)
    want_out, want_state = reference(q, k, v, g, beta, state)
    assert np.isfinite(out).all() and np.isfinite(final).all()
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(final, want_state, atol=1e-5, rtol=0)
    # an exp before the mask gives inf there, and 0 x inf = NaN in the backward pass
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(chunked(64)(*a)[0] ** 2), argnums=(0, 3)))(*args)
    assert all(np.isfinite(g).all() for g in grads)


def test_documents_and_padding():
    """Two packed documents (the second starting inside a chunk) and padding give each
    document's own outputs: the first continues the given state, the second starts from zero;
    the padding leaves the final state at the second document's."""
    lengths, pad = (9, 11), 3
    q, k, v, g, beta, state = inputs(sum(lengths) + pad, seed=3)
    seg = np.repeat([1, 2, 0], [*lengths, pad])[None].repeat(B, 0).astype(np.int32)
    want_out, want_state = reference(q, k, v, g, beta, state, seg)
    first, second = slice(0, 9), slice(9, 20)
    with jax.enable_x64(True):
        for fn in (chunked(4), chunked(8), recurrent):
            out, final = fn(q, k, v, g, beta, state, segment_ids=seg)
            np.testing.assert_allclose(out, want_out, atol=1e-11, rtol=0)
            np.testing.assert_allclose(final, want_state, atol=1e-11, rtol=0)
            alone = [fn(*(x[:, part] for x in (q, k, v, g, beta)), init)
                     for part, init in ((first, state), (second, None))]
            np.testing.assert_allclose(out[:, first], alone[0][0], atol=1e-11, rtol=0)
            np.testing.assert_allclose(out[:, second], alone[1][0], atol=1e-11, rtol=0)
            np.testing.assert_allclose(final, alone[1][1], atol=1e-11, rtol=0)


def test_gradients_of_chunked_equal_recurrent():
    q, k, v, g, beta, state = inputs(21, seed=4)
    seg = np.repeat([1, 2, 0], [8, 10, 3])[None].repeat(B, 0).astype(np.int32)
    weights = np.random.default_rng(5).normal(size=v.shape)

    def loss(fn, weights, *args):
        out, final = fn(*args, segment_ids=seg)
        return jnp.sum(out * weights) + jnp.sum(final**2)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(2, 8))), static_argnums=0)
    with jax.enable_x64(True):
        want = grad(recurrent, weights, q, k, v, g, beta, state)
        got = grad(chunked(4), weights, q, k, v, g, beta, state)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-10, rtol=0)
    got32 = grad(chunked(4), *(jnp.asarray(x, jnp.float32)
                               for x in (weights, q, k, v, g, beta, state)))
    for a, b in zip(got32, want, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def conv_reference(x, kernel, seg=None):
    """y_t = silu(sum_j kernel[j] x_{t-W+1+j}), taps before the row or in another document 0."""
    batch, length, _ = x.shape
    seg = np.ones((batch, length), int) if seg is None else seg
    y = np.zeros_like(x)
    for b in range(batch):
        for t in range(length):
            for j in range(len(kernel)):
                s = t - len(kernel) + 1 + j
                if s >= 0 and seg[b, s] == seg[b, t]:
                    y[b, t] += kernel[j] * x[b, s]
    return y / (1 + np.exp(-y))


def test_causal_conv():
    r = np.random.default_rng(6)
    x, kernel = r.normal(size=(B, 12, 5)), r.normal(size=(4, 5))
    seg = np.repeat([1, 2, 0], [5, 6, 1])[None].repeat(B, 0).astype(np.int32)
    conv = jax.jit(functools.partial(causal_conv, activation=jax.nn.silu))
    with jax.enable_x64(True):
        np.testing.assert_allclose(conv(x, kernel)[0], conv_reference(x, kernel), atol=1e-12)
        # packed documents (the padding token's output is anything)
        np.testing.assert_allclose(conv(x, kernel, segment_ids=seg)[0][:, :11],
                                   conv_reference(x, kernel, seg)[:, :11], atol=1e-12)
        # in two pieces through the state
        y1, state = conv(x[:, :2], kernel)
        y2, _ = conv(x[:, 2:], kernel, state=state)
        np.testing.assert_allclose(np.concatenate([y1, y2], 1), conv_reference(x, kernel),
                                   atol=1e-12)
        # right padding: the state is the last 3 valid inputs, also across the old state
        valid = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0]], np.int32)
        _, state = conv(x[:, 5:], kernel, state=x[:, 2:5], segment_ids=valid)
        np.testing.assert_allclose(state[0], x[0, 7:10])
        np.testing.assert_allclose(state[1], x[1, 3:6])


# --- the layer ----------------------------------------------------------------------------------

SETTINGS = gdn.GatedDeltaNetSettings(num_key_heads=G, num_value_heads=N, key_head_dim=K,
                                     value_head_dim=V, conv_kernel=4, chunk_size=4,
                                     norm_epsilon=1e-6, init_std=0.2)
D, T = 16, 10


def init_cache(model, x):
    """The decode cache `model.init` makes for prompts like `x`, under jit (eagerly, init's
    forward pass dispatches op by op: seconds, as for the params)."""
    return jax.jit(functools.partial(model.init, decode=True))(jax.random.key(1), x)["cache"]


@pytest.fixture(scope="module")
def layer():
    """(model, params, x [B, T, D], the full forward's output)."""
    model = gdn.GatedDeltaNet(SETTINGS)
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(1), x)["params"])
    return model, params, x, jax.jit(model.apply)({"params": params}, x)


def decode_apply(model):
    @functools.partial(jax.jit, static_argnums=0)
    def run(_, params, cache, x, segment_ids):
        return model.apply({"params": params, "cache": cache}, x, segment_ids=segment_ids,
                           decode=True, mutable=["cache"])
    return functools.partial(run, None)


def test_layer_params_and_cache(layer):
    model, params, x, _ = layer
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes["query"] == (D, G, K) and shapes["value"] == (D, N, V)
    assert shapes["decay"] == (D, N) and shapes["query_conv"] == (4, G, K)
    assert shapes["out"] == (N, V, D) and shapes["A_log"] == (N,) and shapes["norm"] == (V,)
    boxed = jax.eval_shape(model.init, jax.random.key(1), x)["params"]  # the names only
    assert boxed["value_conv"].names == ("conv", "heads", "kv")
    assert boxed["key"].names == ("embed", "kv_heads", "kv")
    cache = init_cache(model, x[:, :5])
    assert cache["conv_state"].shape == (B, 3, 2 * G * K + N * V)
    assert cache["recurrent_state"].shape == (B, N, K, V)
    assert all(not np.any(c) for c in jax.tree.leaves(cache))  # init only creates zeros


def test_decode_equals_full_forward(layer):
    model, params, x, want = layer
    step = decode_apply(model)
    cache = init_cache(model, x[:, :5])
    out, state = step(params, cache, x[:, :5], None)
    outs = [out]
    for t in range(5, T):
        out, state = step(params, state["cache"], x[:, t:t + 1], None)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), want, atol=2e-5, rtol=0)


def test_right_padded_prefill(layer):
    """Rows of 3 and 6 prompt tokens in one prefill of 6 (junk after the shorter), then steps:
    each row's outputs are its full forward's."""
    model, params, x, want = layer
    step = decode_apply(model)
    lengths = np.array([3, 6])
    junk = jax.random.normal(jax.random.key(2), (B, 6, D))
    seg = (np.arange(6)[None] < lengths[:, None]).astype(np.int32)
    prompt = jnp.where(seg[..., None] == 1, x[:, :6], junk)
    cache = init_cache(model, prompt)
    out, state = step(params, cache, prompt, seg)
    for b in range(B):
        np.testing.assert_allclose(out[b, :lengths[b]], want[b, :lengths[b]], atol=2e-5)
    for i in range(4):
        token = x[np.arange(B), lengths + i][:, None]
        out, state = step(params, state["cache"], token, None)
        np.testing.assert_allclose(out[:, 0], want[np.arange(B), lengths + i], atol=2e-5)


def test_layer_gradient_finite_with_documents(layer):
    model, params, x, _ = layer
    seg = jnp.asarray(np.repeat([1, 2, 0], [3, 5, 2])[None].repeat(B, 0))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(
        {"params": p}, x, segment_ids=seg) ** 2)))(params)
    assert all(np.isfinite(g).all() and np.any(g) for g in jax.tree.leaves(grads))


def test_matches_hugging_face_qwen3_next():
    """Hugging Face's layer (torch, float32, its PyTorch fallback kernels) with random weights,
    mapped into this layer's params: the same outputs, over more than one of its 64-token
    chunks."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=D, linear_num_key_heads=G, linear_num_value_heads=N, linear_key_head_dim=K,
        linear_value_head_dim=V, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
        layer_types=["linear_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=8, intermediate_size=8, moe_intermediate_size=8, num_experts=2)
    torch.manual_seed(0)
    hf = modeling.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.empty(N).uniform_(0.01, 16).log())
        hf.dt_bias.copy_(torch.rand(N))
    x = np.random.default_rng(7).normal(size=(B, 70, D)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).numpy()

    w = {n: p.detach().numpy() for n, p in hf.named_parameters()}
    r = N // G
    qkvz = w["in_proj_qkvz.weight"].T.reshape(D, G, 2 * K + 2 * r * V)
    q, k, v, z = np.split(qkvz, [K, 2 * K, 2 * K + r * V], axis=-1)
    b, a = np.split(w["in_proj_ba.weight"].T.reshape(D, G, 2 * r), 2, axis=-1)
    conv = w["conv1d.weight"][:, 0].T  # [W, C]: q, k, v channels
    params = dict(query=q, key=k, value=v.reshape(D, N, V), gate=z.reshape(D, N, V),
                  decay=a.reshape(D, N), beta=b.reshape(D, N),
                  query_conv=conv[:, :G * K].reshape(4, G, K),
                  key_conv=conv[:, G * K:2 * G * K].reshape(4, G, K),
                  value_conv=conv[:, 2 * G * K:].reshape(4, N, V), A_log=w["A_log"],
                  dt_bias=w["dt_bias"], norm=w["norm.weight"],
                  out=w["out_proj.weight"].T.reshape(N, V, D))
    model = gdn.GatedDeltaNet(gdn.GatedDeltaNetSettings(
        num_key_heads=G, num_value_heads=N, key_head_dim=K, value_head_dim=V, chunk_size=16,
        norm_epsilon=1e-6))
    got = jax.jit(model.apply)({"params": params}, jnp.asarray(x))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


# --- config and record --------------------------------------------------------------------------


def test_config_checks_and_record():
    cfg = gdn.GatedDeltaNetConfig(num_key_heads=2, num_value_heads=6)
    cfg.check(types.SimpleNamespace(num_heads=4))
    with pytest.raises(ValueError, match=r"^linear_attention.num_value_heads=6: expected a "
                                         r"multiple of num_key_heads=4$"):
        gdn.GatedDeltaNetConfig(num_key_heads=4, num_value_heads=6)
    with pytest.raises(ValueError, match=r"num_key_heads=4 \(model.num_heads\)"):
        gdn.GatedDeltaNetConfig(num_value_heads=6).check(types.SimpleNamespace(num_heads=4))
    with pytest.raises(ValueError, match=r"^linear_attention.conv_kernel=0: expected an int"):
        gdn.GatedDeltaNetConfig(conv_kernel=0)

    class Model:  # what from_config reads of a TransformerConfig
        num_heads, resolved_head_dim, norm_epsilon, init_std = 4, 16, 1e-6, None
        dtype = param_dtype = jnp.float32
        linear_attention = gdn.GatedDeltaNetConfig(num_value_heads=8, chunk_size=32)

        def init_scale(self, residual=False):
            return 0.5 if residual else 1.0

    s = gdn.GatedDeltaNetSettings.from_config(Model())
    assert (s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim) == (4, 8, 16, 16)
    assert s.out_init_scale == 0.5 and s.conv_channels == 2 * 4 * 16 + 8 * 16
    # the matmuls the chunked rule runs, counted in its program (8 heads of 16); a sequence
    # shorter than a chunk is one chunk of its length
    for length in (128, 8):
        shapes = [(1, length, 8, 16)] * 3 + [(1, length, 8)] * 2
        program = jax.make_jaxpr(lambda *a: gdn.chunked_gated_delta_rule(*a, chunk_size=32)[0])(
            *[jnp.full(shape, 0.5) for shape in shapes])
        forward = program_matmul_flops(program.jaxpr)
        assert gdn.flops_per_token(Model(), length) == 3 * forward / length
    assert gdn.MIXER.cache_bytes_per_token(Model()) == 0
    assert gdn.MIXER.refuses(Model(), {"sequence": 1, "tensor": 2}) is None
    assert gdn.MIXER.refuses(Model(), {"sequence": 2}) == (
        "linear_attention layers: mesh.sequence=2: expected 1 (the recurrent state is not "
        "passed between devices)")
    layer = gdn.MIXER.layer(Model(), "linear_attention")
    assert layer.name == "linear_attention" and layer.settings == s
