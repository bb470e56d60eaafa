"""dot_product_attention, attend and MultiHeadAttention against references and the theory."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import ints, on_device

from transformer.nn import attention as attention_lib
from transformer.nn import dense_attention, kernels, masks
from transformer.nn.attention import AttentionSettings, MultiHeadAttention, attend
from transformer.nn.config import TransformerConfig
from transformer.nn.dense_attention import dot_product_attention


def random_qkv(seed, batch=2, q_len=5, kv_len=6, heads=4, kv_heads=2, head_dim=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, q_len, heads, head_dim))
    k = rng.normal(size=(batch, kv_len, kv_heads, head_dim))
    v = rng.normal(size=(batch, kv_len, kv_heads, head_dim))
    return q, k, v


def f32(*arrays):
    """NumPy float32 copies: a jitted function takes them as they are (`jnp.asarray` would
    compile a conversion per shape)."""
    return tuple(np.asarray(x, np.float32) for x in arrays)


def numpy_attention(q, k, v, allowed=None, bias=None):
    """The seeds' formula in float64, one head at a time: softmax(Q K^T / sqrt(d_k) + bias) V.

    Masked logits are excluded from the softmax; a row with no allowed key returns zeros.
    """
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    weights = np.zeros((batch, heads, q_len, kv_len))
    for b in range(batch):
        for n in range(heads):
            kv = n // (heads // kv_heads)  # query head n reads kv head n // group
            logits = q[b, :, n] @ k[b, :, kv].T / np.sqrt(head_dim)
            if bias is not None:
                logits = logits + np.broadcast_to(bias, (batch, heads, q_len, kv_len))[b, n]
            ok = np.ones_like(logits, bool) if allowed is None else np.broadcast_to(
                allowed, (batch, heads, q_len, kv_len))[b, n]
            for t in range(q_len):
                if not ok[t].any():
                    continue
                e = np.exp(logits[t, ok[t]] - logits[t, ok[t]].max())
                weights[b, n, t, ok[t]] = e / e.sum()
            out[b, :, n] = weights[b, n] @ v[b, :, kv]
    return out, weights


MASKS = {
    "none": None,
    "causal": masks.Causal(),
    "prefix_padding": masks.PrefixLM(jnp.array([2, 4])) & masks.Padding(
        kv_lengths=jnp.array([6, 3])),
    "window": masks.SlidingWindow(left=1, right=1),
}


@jax.jit
def attention_weights_and_allowed(q, k, v, mask, bias):
    """dot_product_attention's output and weights, and the mask's dense [B, 1, T, S] (None
    without a mask), compiled as one program."""
    out, w = dot_product_attention(q, k, v, mask, bias, return_weights=True)
    return out, w, None if mask is None else mask.dense(q.shape[1], k.shape[1])


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_attention_equals_float64_numpy_reference(mask_name, kv_heads):
    q, k, v = random_qkv(0, kv_heads=kv_heads)
    bias = np.random.default_rng(1).normal(size=(1, 4, 5, 6))
    q32, k32, v32, bias32 = f32(q, k, v, bias)
    out, w, allowed = attention_weights_and_allowed(q32, k32, v32, MASKS[mask_name], bias32)
    allowed = None if allowed is None else np.asarray(allowed)
    expected_out, expected_w = numpy_attention(q, k, v, allowed, bias)
    np.testing.assert_allclose(out, expected_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(w, expected_w, atol=2e-6, rtol=2e-5)


@jax.jit
def ours_and_jax_nn(q, k, v, allowed, bias):
    """dot_product_attention and jax.nn.dot_product_attention, with `allowed` and bias, then
    causal alone."""
    dense = allowed.dense(q.shape[1], k.shape[1])
    return (dot_product_attention(q, k, v, allowed, bias),
            jax.nn.dot_product_attention(q, k, v, bias=bias, mask=dense),
            dot_product_attention(q, k, v, masks.Causal()),
            jax.nn.dot_product_attention(q, k, v, is_causal=True))  # square: same alignment


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_equals_jax_nn_dot_product_attention(kv_heads):
    q, k, v = f32(*random_qkv(2, q_len=6, kv_heads=kv_heads))
    bias = f32(np.random.default_rng(0).normal(size=(2, 4, 6, 6)))[0]
    allowed = masks.Causal() & masks.Padding(kv_lengths=ints(6, 4))
    ours, theirs, ours_causal, theirs_causal = ours_and_jax_nn(q, k, v, allowed, bias)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ours_causal, theirs_causal, atol=1e-5, rtol=1e-5)


BLOCKED_MASKS = {  # (mask, q_len, kv_len): blocks of 8 queries
    "causal": (masks.Causal(), 20, 20),  # the last block has 4 queries
    "bottom_right_causal": (masks.Causal(), 12, 20),
    "queries_without_keys": (masks.Causal(), 20, 12),  # queries 0-7 see no key
    "sliding_window": (masks.SlidingWindow(left=3, right=0), 20, 20),  # blocks start past key 0
    "chunked_causal": (masks.ChunkedCausal(chunk_size=8), 24, 24),
    "packed_documents": (masks.Causal() & masks.Segment(jnp.array(  # uneven documents, padding
        [[1] * 7 + [2] * 11 + [0] * 2, [1] * 3 + [2] * 4 + [3] * 13])), 20, 20),
}


@pytest.mark.parametrize("name", list(BLOCKED_MASKS))
def test_query_blocks_skip_masked_keys_and_equal_the_reference(name):
    """Blocks of 8 queries over only the keys their mask allows: the float64 NumPy reference's
    output, the one-block kernel's gradients, and fewer logits than the whole [T, S]."""
    mask, q_len, kv_len = BLOCKED_MASKS[name]
    q, k, v = random_qkv(5, q_len=q_len, kv_len=kv_len)
    bias = np.random.default_rng(6).normal(size=(1, 4, q_len, kv_len))
    cotangent = np.random.default_rng(1).normal(size=q.shape)
    blocked = lambda q, k, v, b: dot_product_attention(q, k, v, mask, b, q_block=8)
    whole = lambda q, k, v, b: dot_product_attention(q, k, v, mask, b)

    def outputs(q, k, v, b, cotangent):  # the blocked output, both kernels' gradients, the mask
        grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2, 3))(
            q, k, v, b) for f in (blocked, whole)]
        return blocked(q, k, v, b), grads, mask.dense(q_len, kv_len)

    # compiled (op by op, the blocks' gathers and masks take 3x the time)
    out, grads, allowed = jax.jit(outputs)(*f32(q, k, v, bias, cotangent))
    expected, _ = numpy_attention(q, k, v, np.asarray(allowed), bias)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    q, k, v, bias = f32(q, k, v, bias)
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    def logits_computed(f):  # entries of the [.., T, S] query-key products in the forward
        eqns = jax.make_jaxpr(f)(q, k, v, bias).eqns
        return sum(np.prod(e.outvars[0].aval.shape[-2:]) for e in eqns
                   if e.primitive.name == "dot_general" and e.params["dimension_numbers"][0][0]
                   == (3,))
    assert logits_computed(blocked) < logits_computed(whole)


def test_query_blocks_are_one_block_where_nothing_can_be_skipped():
    from transformer.nn.dense_attention import _query_blocks
    assert _query_blocks(masks.Causal(), 16, 16, 8) == [(0, 8, 0, 8), (8, 16, 0, 16)]
    assert _query_blocks(masks.Causal(), 8, 8, 8) == [(0, 8, 0, 8)]  # one block already
    assert _query_blocks(masks.PrefixLM(ints(3)), 16, 16, 8) == [(0, 16, 0, 16)]
    assert _query_blocks(masks.Causal(), 1, 16, 8) == [(0, 1, 0, 16)]  # a decoding step
    assert _query_blocks(masks.Full(), 16, 16, 8) == [(0, 16, 0, 16)]


def test_attend_on_cpu_runs_dense_in_at_most_8_query_blocks():
    q = np.ones((1, 256, 2, 8), np.float32)
    jaxpr = jax.make_jaxpr(lambda q: attend(q, q, q, mask=masks.Causal(), impl="dense"))(q)
    logits = [e.outvars[0].aval.shape[-2:] for e in jaxpr.eqns if e.primitive.name ==
              "dot_general" and e.outvars[0].aval.shape[-1] != 8]
    assert logits == [(64, 64), (64, 128), (64, 192), (64, 256)]
    assert dense_attention.cpu_query_block(4096, "cpu") == 512
    assert dense_attention.cpu_query_block(256, "gpu") is None


@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA, MQA
def test_a_decode_steps_logits_read_the_cached_keys_in_place_on_cpu(kv_heads):
    """A step's few query rows take their logits as K Q^T on CPU (`CPU_KEY_FIRST_ROWS`): the same
    output as the float64 reference, and the compiled step never writes a transposed copy of
    the keys (with Q K^T, XLA:CPU copies them [H, S] on every call: a decode step's whole cache).
    """
    q, k, v = random_qkv(3, batch=1, q_len=1, kv_len=64, kv_heads=kv_heads)
    allowed = masks.Padding(kv_lengths=ints(50))
    outs, dense = jax.jit(lambda q, k, v: ([
        dot_product_attention(q, k, v, allowed, key_first_rows=rows)
        for rows in (dense_attention.CPU_KEY_FIRST_ROWS, 0)], allowed.dense(1, 64)))(*f32(q, k, v))
    expected, _ = numpy_attention(q, k, v, np.asarray(dense))
    for out in outs:
        np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    q, k, v = f32(q, k, v)  # NumPy: the transposes below compile nothing

    def key_sized_results(attention):
        """The instructions of a compiled step that write an array of the keys' size, given the
        keys and values as the cache stores them, [B, K, S, H] (`MultiHeadAttention._cache`)."""
        step = jax.jit(lambda q, k, v: attention(q, k.transpose(0, 2, 1, 3),
                                                 v.transpose(0, 2, 1, 3), allowed))
        hlo = step.lower(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)).compile().as_text()
        written = re.findall(r"= f32\[([0-9,]*)\]\{[0-9,]*\} (\w[\w-]*)\(", hlo)
        return [op for dims, op in written if op not in ("parameter", "bitcast")
                and np.prod([int(d) for d in dims.split(",") if d]) == k.size]

    assert key_sized_results(lambda q, k, v, m: attend(q, k, v, mask=m, impl="dense")) == []
    assert key_sized_results(dot_product_attention) != []  # Q K^T: K copied transposed


@pytest.mark.parametrize("shape, slots", [
    ((1, 1, 9, 3), [[4]]),  # one row, one KV head, one token: written twice (the CPU's path)
    ((1, 9, 3), [[8]]),  # MLA's latent [B, L, W]
    ((2, 3, 9, 3), [[0, 1, 2], [6, 7, 5]]),  # rows at their own slots, 3 KV heads
    ((2, 9, 3), [[2, 3], [0, 8]]),
])
def test_write_slots_writes_each_row_at_its_slots_and_nothing_else(shape, slots):
    rng = np.random.default_rng(0)
    buffer = rng.normal(size=shape).astype(np.float32)
    slots = np.asarray(slots, np.int32)
    new = rng.normal(size=(*shape[:-2], slots.shape[1], shape[-1])).astype(np.float32)
    expected = buffer.copy()
    for b, row in enumerate(slots):
        for t, slot in enumerate(row):
            expected[b, ..., slot, :] = new[b, ..., t, :]
    got = jax.jit(attention_lib.write_slots)(buffer, new, slots)
    np.testing.assert_array_equal(got, expected)


def test_rows_sum_to_one_and_masked_keys_get_exactly_zero_weight():
    q, k, v = f32(*random_qkv(3, q_len=6, kv_len=6))
    mask = masks.Causal() & masks.Padding(kv_lengths=ints(6, 4))
    _, w, allowed = attention_weights_and_allowed(q, k, v, mask, None)
    allowed = np.broadcast_to(np.asarray(allowed), w.shape)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    assert (np.asarray(w)[~allowed] == 0.0).all()
    assert (np.asarray(w)[allowed] > 0.0).all()


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = f32(*random_qkv(4, q_len=4, kv_len=4))
    mask = masks.Padding(q_lengths=ints(2, 4), kv_lengths=ints(0, 4))

    def outputs(q, k, v):
        return dot_product_attention(q, k, v, mask), jax.grad(
            lambda *a: dot_product_attention(*a, mask).sum(), argnums=(0, 1, 2))(q, k, v)

    out, grads = jax.jit(outputs)(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)  # no key allowed in example 0
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(grads[0])[0], 0.0)


def test_bfloat16_inputs_use_float32_softmax():
    q, k, v = random_qkv(5, q_len=16, kv_len=16)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out, w, allowed = attention_weights_and_allowed(*bf16, masks.Causal(), None)
    assert out.dtype == jnp.bfloat16 and w.dtype == jnp.float32
    expected, _ = numpy_attention(*(np.asarray(x, np.float64) for x in bf16), np.asarray(allowed))
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=3e-2, rtol=3e-2)


def test_bfloat16_attention_keeps_no_float32_scores_for_the_backward_pass():
    """The [B, N, T, S] tensors the backward pass keeps are bfloat16 (half the memory of float32
    scores), and the gradients still match the float32 computation's."""
    q, k, v = (jax.device_put(x.astype(jnp.bfloat16))
               for x in random_qkv(6, q_len=32, kv_len=32))
    mask = masks.And((masks.Causal(), masks.Segment(on_device([[0] * 20 + [1] * 12], np.int32))))

    def f(q, k, v):
        return dot_product_attention(q, k, v, mask)

    _, vjp = jax.vjp(f, q, k, v)  # eager: the residuals are what the backward pass keeps
    kept = [x for x in jax.tree.leaves(vjp) if x.ndim == 4 and x.shape[-2:] == (32, 32)]
    assert kept and all(x.dtype in (jnp.bfloat16, jnp.bool_) for x in kept), [
        (x.shape, x.dtype) for x in kept]

    def grads_and_float32_grads(vjp, cotangent, q, k, v):  # from those residuals, compiled
        want = jax.vjp(f, *(x.astype(jnp.float32) for x in (q, k, v)))[1](
            cotangent.astype(jnp.float32))
        return vjp(cotangent), want

    cotangent = random_qkv(7, q_len=32, kv_len=32)[0].astype(jnp.bfloat16)
    grads, want = jax.jit(grads_and_float32_grads)(vjp, cotangent, q, k, v)
    for got, ref in zip(grads, want, strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_values_gradients_equal_autodiff_of_the_plain_formula(dtype):
    """The hand-written backward pass (flash-attention identity) equals jax's derivative of
    softmax(x) @ v, for logits with masked (-inf-like) entries too."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 9)) * 3
    x[:, 1, 4:] = float(jnp.finfo(dtype).min)  # masked keys
    x, v = x.astype(jnp.dtype(dtype)), rng.normal(size=(2, 9, 4)).astype(jnp.dtype(dtype))
    g = rng.normal(size=(2, 5, 4)).astype(np.float32)
    reference = lambda x, v: jax.nn.softmax(x, axis=-1) @ v  # noqa: E731

    def outputs(x, v, g):
        out, vjp = jax.vjp(dense_attention.softmax_values, x, v)
        want, want_vjp = jax.vjp(reference, x.astype(jnp.float32), v.astype(jnp.float32))
        return out, want, vjp(g), want_vjp(g)

    out, want, grads, want_grads = jax.jit(outputs)(x, v, g)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
    for got, ref in zip(grads, want_grads, strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=tol * 4, rtol=tol)


def test_attention_keeps_one_weights_tensor_per_layer_for_the_backward_pass(monkeypatch):
    """softmax_values' weights written as exp(x - max - log sum), not exp(x - max) / sum: with
    the division XLA's fusions keep exp(x - max) beside the weights until the backward pass."""
    from test_layers import XLA_FUSIONS, backward_temp_bytes

    cfg = TransformerConfig(num_layers=3, d_model=32, num_heads=2, d_ff=128, use_bias=False)
    ours = backward_temp_bytes(cfg, batch=4, length=32, options=XLA_FUSIONS)

    def textbook_forward(logits, values, sink):  # no sink here (None)
        probs = jnp.exp(logits - logits.max(-1, keepdims=True))
        probs = probs / probs.sum(-1, keepdims=True)
        out = probs @ values
        return out, (probs, values, out)

    def backward(residuals, grad_out):  # the same flash-attention identity as ours
        probs, values, out = residuals
        grad_probs = grad_out @ jnp.swapaxes(values, -1, -2)
        row = jnp.sum(grad_out * out, axis=-1, keepdims=True)
        return probs * (grad_probs - row), jnp.swapaxes(probs, -1, -2) @ grad_out, None

    textbook = jax.custom_vjp(lambda logits, values, sink: textbook_forward(logits, values,
                                                                            sink)[0])
    textbook.defvjp(textbook_forward, backward)
    monkeypatch.setattr(dense_attention, "softmax_values", textbook)
    one_weights_tensor = 4 * 2 * 32 * 32 * 4  # [B, N, T, S] float32
    assert ours <= (backward_temp_bytes(cfg, batch=4, length=32, options=XLA_FUSIONS)
                   - 2 * one_weights_tensor)


def test_attention_dropout_needs_rng_and_rescales():
    q, k, v = f32(*random_qkv(6))
    with pytest.raises(ValueError, match="dropout_rng"):
        dot_product_attention(q, k, v, dropout_rate=0.5)
    dropped = jax.jit(lambda q, k, v, seed: dot_product_attention(
        q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(seed)))
    a, b = dropped(q, k, v, 0), dropped(q, k, v, 1)
    assert not np.allclose(a, b)


def test_bad_shapes_are_rejected():
    q, k, v = f32(*random_qkv(7, heads=3, kv_heads=2))
    with pytest.raises(ValueError, match="3 query heads: expected a multiple of 2"):
        dot_product_attention(q, k, v)


# --- attend: the kernel dispatcher ------------------------------------------------------------


def spy(monkeypatch, module, name):
    """Records the calls of `module.name` (which still runs)."""
    calls, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    return calls


ATTEND_KERNELS = {"chunked": (attention_lib, "chunked_attention"),
                  "splash": (kernels, "splash_attention")}  # splash: Pallas interpret mode


@pytest.mark.parametrize("impl", ["dense", "chunked", "splash"])
def test_attend_runs_the_named_kernel_and_matches_dense(impl, monkeypatch):
    # GQA (4 query heads, 2 KV heads), a causal mask, a non-default scale; splash needs
    # lengths that are multiples of 128.
    q, k, v = f32(*random_qkv(8, q_len=128, kv_len=128, head_dim=64))
    calls = spy(monkeypatch, *ATTEND_KERNELS[impl]) if impl in ATTEND_KERNELS else None
    out, want = jax.jit(lambda q, k, v: (
        attend(q, k, v, mask=masks.Causal(), impl=impl, scale=0.3),
        dot_product_attention(q, k, v, masks.Causal(), scale=0.3)))(q, k, v)
    assert out.shape == q.shape
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    if calls is not None:
        assert calls == [1]


def dense_as_attend_runs_it(q, *args, **kwargs):
    """The dense kernel with the arguments `attend` gives it on this backend (on CPU its query
    blocks and key_first_rows), so that the two agree to the bit."""
    layout = dense_attention.cpu_layout(q.shape[1], jax.default_backend())
    return dot_product_attention(q, *args, **kwargs, **layout)


def test_attend_callable_bias_is_evaluated_per_tile_on_chunked_and_materialised_on_dense(
        monkeypatch):
    q, k, v = f32(*random_qkv(9, q_len=5, kv_len=7))
    slopes_N = jax.device_put(np.array([0.5, 0.25, 0.125, 0.0625], np.float32))
    bias_fn = lambda q_idx, kv_idx: -slopes_N[None, :, None, None] * jnp.abs(
        q_idx[:, None] + 2 - kv_idx[None, :]).astype(jnp.float32)[None, None]
    calls = spy(monkeypatch, attention_lib, "chunked_attention")

    def outputs(q, k, v):  # the dense kernel given the bias materialised, attend dense, chunked
        bias_BNTS = bias_fn(jnp.arange(5), jnp.arange(7))
        return (dense_as_attend_runs_it(q, k, v, masks.Causal(), bias_BNTS),
                attend(q, k, v, mask=masks.Causal(), bias=bias_fn),
                attend(q, k, v, mask=masks.Causal(), bias=bias_fn, impl="chunked"))

    want, dense, out = jax.jit(outputs)(q, k, v)
    np.testing.assert_array_equal(dense, want)
    assert calls == [1]  # the chunked attend's alone
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-5)


def test_attend_return_weights_runs_dense_whatever_the_impl():
    q, k, v = f32(*random_qkv(10))
    out, weights, want_out, want_weights = jax.jit(lambda q, k, v: (
        *attend(q, k, v, mask=masks.Causal(), impl="chunked", return_weights=True),
        *dense_as_attend_runs_it(q, k, v, masks.Causal(), return_weights=True)))(q, k, v)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(weights, want_weights)


def test_attend_records_the_kernel_it_runs_also_when_dropout_forces_dense():
    """What the train log's first-step line and launch.aot name (`kernels.recording`)."""
    q, k, v = f32(*random_qkv(10))

    def attends(q, k, v):
        return (attend(q, k, v, mask=masks.Causal(), impl="chunked"),
                attend(q, k, v, mask=masks.Causal(), impl="chunked", dropout_rate=0.2,
                       dropout_rng=jax.random.key(0)),
                attend(q, k, v, impl="chunked", return_weights=True))

    with kernels.recording() as chosen:  # recorded as they are traced: nothing need compile
        jax.eval_shape(attends, q, k, v)
    assert chosen == ["chunked", "dense", "dense"]


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_attend_dropout_needs_an_rng(impl):
    q, k, v = f32(*random_qkv(11))
    with pytest.raises(ValueError, match="dropout_rng"):
        attend(q, k, v, impl=impl, dropout_rate=0.1)
    dropped, want = jax.jit(lambda q, k, v, seed: (
        attend(q, k, v, impl=impl, dropout_rate=0.1, dropout_rng=jax.random.key(seed)),
        dense_as_attend_runs_it(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(seed))))(
            q, k, v, 0)
    np.testing.assert_array_equal(dropped, want)


# --- the Linen layer -------------------------------------------------------------------------

D_MODEL, HEADS = 16, 4


@functools.cache
def mha_and_init(**kwargs):
    """The layer and its compiled init, (seed, x) -> variables: one compile for all seeds."""
    layer = MultiHeadAttention(AttentionSettings(num_heads=HEADS, head_dim=D_MODEL // HEADS,
                                                 **kwargs))
    return layer, jax.jit(lambda seed, x: layer.init(jax.random.key(seed), x))


def init_mha(seed=0, **kwargs):
    layer, init = mha_and_init(**kwargs)
    x = np.random.default_rng(seed).normal(size=(2, 6, D_MODEL)).astype(np.float32)
    return layer, init(seed + 1, x), x


@pytest.mark.slow
def test_mha_equals_per_head_projection_concat_and_output_projection():
    layer, variables, x = init_mha(num_kv_heads=2, use_bias=True)
    p = nn.unbox(variables)["params"]
    xs = np.asarray(x, np.float64)
    q = np.einsum("btd,dnh->btnh", xs, p["query"]) + p["query_bias"]
    k = np.einsum("btd,dnh->btnh", xs, p["key"]) + p["key_bias"]
    v = np.einsum("btd,dnh->btnh", xs, p["value"]) + p["value_bias"]
    heads, _ = numpy_attention(q, k, v, np.asarray(masks.Causal().dense(6, 6)))
    concat = heads.reshape(2, 6, -1)  # concatenation of the heads
    expected = concat @ np.asarray(p["out"]).reshape(-1, D_MODEL) + p["out_bias"]
    out = jax.jit(lambda variables, x: layer.apply(variables, x, mask=masks.Causal()))(
        variables, x)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_mha_params_carry_logical_axis_names():
    _, variables, _ = init_mha(num_kv_heads=2, use_bias=True)
    names = {k: v.names for k, v in variables["params"].items()}
    assert names["query"] == ("embed", "heads", "kv")
    assert names["key"] == names["value"] == ("embed", "kv_heads", "kv")
    assert names["out"] == ("heads", "kv", "embed")
    assert names["out_bias"] == ("embed",)
    assert variables["params"]["key"].value.shape == (D_MODEL, 2, D_MODEL // HEADS)


def test_mha_returns_and_sows_attention_weights():
    layer, variables, x = init_mha()
    (out, weights), state = jax.jit(lambda variables, x: layer.apply(
        variables, x, mask=masks.Causal(), return_weights=True, mutable=["intermediates"]))(
            variables, x)
    assert out.shape == x.shape and weights.shape == (2, HEADS, 6, 6)
    np.testing.assert_array_equal(state["intermediates"]["attention_weights"][0], weights)


def test_attention_is_not_symmetric():
    layer, variables, x = init_mha(seed=3)
    _, weights = jax.jit(lambda variables, x: layer.apply(variables, x, return_weights=True))(
        variables, x)
    weights = np.asarray(weights)
    assert not np.allclose(weights, np.swapaxes(weights, -1, -2), atol=1e-3)


def test_cross_attention_reads_keys_and_values_from_the_other_sequence():
    layer, variables, x = init_mha(seed=4)
    memory = np.random.default_rng(9).normal(size=(2, 3, D_MODEL)).astype(np.float32)
    changed = memory.copy()
    changed[1, 2] = 100.0  # a padded encoder position changes nothing
    mask = masks.Padding(kv_lengths=ints(3, 2))
    (out, weights), out_changed = jax.jit(lambda variables, x, memory, changed: (
        layer.apply(variables, x, memory, mask=mask, return_weights=True),
        layer.apply(variables, x, changed, mask=mask)))(variables, x, memory, changed)
    assert out.shape == (2, 6, D_MODEL) and weights.shape == (2, HEADS, 6, 3)
    assert (np.asarray(weights)[1, :, :, 2] == 0).all()
    np.testing.assert_allclose(np.asarray(out_changed)[1], np.asarray(out)[1], atol=1e-6)
