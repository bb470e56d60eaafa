"""chunked_attention against the dense dot_product_attention: outputs, gradients, tile skipping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.nn import masks, positions
from transformer.nn.chunked_attention import chunked_attention, chunked_attention_stats
from transformer.nn.dense_attention import dot_product_attention
from transformer.nn.tile_plan import plan_tiles

B, N, H = 2, 4, 8


def qkvw(seed, q_len=37, kv_len=37, kv_heads=2, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, q_len, N, H))
    k = rng.normal(size=(B, kv_len, kv_heads, H))
    v = rng.normal(size=(B, kv_len, kv_heads, H))
    w = rng.normal(size=(B, q_len, N, H))  # output cotangent
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, w))


def value_and_grads(attend, q, k, v, w, *extra, num_diff=None, jit=True):
    """Output and d(sum(out * w))/d(q, k, v, *extra[:num_diff - 3]).

    The dense reference runs eagerly (`jit=False`): its small ops are cached across tests, which
    is cheaper than compiling it for every case.
    """

    def loss(q, k, v, *extra):
        out = attend(q, k, v, *extra)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out

    argnums = tuple(range(num_diff or 3 + len(extra)))
    fn = jax.value_and_grad(loss, argnums, has_aux=True)
    (_, out), grads = (jax.jit(fn) if jit else fn)(q, k, v, *extra)
    return out, grads


def assert_matches(q, k, v, w, mask, *, atol=1e-5, q_chunk=16, kv_chunk=16):
    dense = value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, w,
                            jit=False)
    chunk = value_and_grads(
        lambda q, k, v: chunked_attention(q, k, v, mask, q_chunk=q_chunk, kv_chunk=kv_chunk),
        q, k, v, w)
    np.testing.assert_allclose(chunk[0], dense[0], atol=atol, rtol=0)
    for name, a, b in zip("qkv", chunk[1], dense[1], strict=True):
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=f"d{name}")
    return chunk


SEGMENTS = np.array([[1] * 10 + [2] * 20 + [3] * 5 + [0] * 2,
                     [1] * 37])
MASKS = {
    "none": lambda: None,
    "full": masks.Full,
    "causal": masks.Causal,
    "window": lambda: masks.SlidingWindow(left=5, right=18),
    "chunked_causal": lambda: masks.ChunkedCausal(chunk_size=10),
    "prefix_lm": lambda: masks.PrefixLM(jnp.array([20, 0])),
    "segment_causal": lambda: masks.Segment(jnp.asarray(SEGMENTS)) & masks.Causal(),
    "padding": lambda: masks.Padding(q_lengths=jnp.array([37, 25]),
                                     kv_lengths=jnp.array([30, 17])),
    "dense_bool": lambda: jnp.asarray(np.random.default_rng(3).random((1, N, 37, 37)) < 0.7),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MASKS))
def test_matches_dense_reference(name):
    """T = S = 37 with 16-tiles: ragged last tiles on both sides, GQA (4 query, 2 kv heads)."""
    assert_matches(*qkvw(0), MASKS[name]())


@pytest.mark.slow
@pytest.mark.parametrize("q_len,kv_len,mask", [
    (21, 37, masks.Causal()),
    (1, 37, masks.Causal()),
    (21, 37, masks.SlidingWindow(left=4)),
])
def test_fewer_queries_than_keys(q_len, kv_len, mask):
    """Bottom-right alignment (KV-cache style) with ragged tiles on both sides."""
    assert_matches(*qkvw(1, q_len=q_len, kv_len=kv_len), mask, q_chunk=8, kv_chunk=16)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 1])  # MHA, MQA (every other test is GQA)
def test_grouped_query_heads(kv_heads):
    assert_matches(*qkvw(2, kv_heads=kv_heads), masks.Causal())


@pytest.mark.slow
@pytest.mark.parametrize("q_chunk,kv_chunk", [(8, 16), (64, 64), (1, 5)])
def test_tile_sizes(q_chunk, kv_chunk):
    """Unequal tiles, tiles longer than the sequence, single-query tiles."""
    assert_matches(*qkvw(3), masks.Causal() & masks.Padding(kv_lengths=jnp.array([33, 9])),
                   q_chunk=q_chunk, kv_chunk=kv_chunk)


@pytest.mark.slow
def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v, w = qkvw(4)
    # Example 1: queries >= 10 see nothing; segment id 0 rows of example 0 see nothing either.
    mask = masks.Padding(q_lengths=jnp.array([37, 10])) & masks.Segment(
        jnp.asarray(SEGMENTS)) & masks.Causal()
    out, grads = assert_matches(q, k, v, w, mask)
    assert np.all(np.asarray(out)[1, 10:] == 0) and np.all(np.asarray(out)[0, 35:] == 0)
    assert np.all(np.asarray(grads[0])[1, 10:] == 0)
    # A mask that allows nothing at all: zeros everywhere, zero gradients.
    nothing = masks.Padding(kv_lengths=jnp.array([0, 0]))
    out, grads = value_and_grads(lambda q, k, v: chunked_attention(
        q, k, v, nothing, q_chunk=16, kv_chunk=16), q, k, v, w)
    assert not np.any(out) and not any(np.any(g) for g in grads)


def test_masks_with_traced_arrays_under_jit():
    """Per-example mask arrays passed as jit arguments (traced inside the kernel)."""
    q, k, v, w = qkvw(5)

    def run(attend):
        def f(q, k, v, seg, lengths):
            mask = masks.Segment(seg) & masks.Causal() & masks.Padding(kv_lengths=lengths)
            return attend(q, k, v, mask)
        return value_and_grads(f, q, k, v, w, jnp.asarray(SEGMENTS), jnp.array([30, 37]),
                               num_diff=3)

    chunk = run(lambda *a: chunked_attention(*a, q_chunk=16, kv_chunk=16))
    dense = run(dot_product_attention)  # (jitted: the mask arrays are traced here)
    np.testing.assert_allclose(chunk[0], dense[0], atol=1e-5)
    for a, b in zip(chunk[1], dense[1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("shape", [(N, 37, 37), (B, 1, 1, 37)])  # 3D: broadcast batch
def test_dense_bias_and_its_gradient(shape):
    q, k, v, w = qkvw(6)
    bias = jnp.asarray(np.random.default_rng(7).normal(size=shape), jnp.float32)
    mask = masks.Causal()
    dense = value_and_grads(lambda q, k, v, b: dot_product_attention(q, k, v, mask, b),
                            q, k, v, w, bias, jit=False)
    chunk = value_and_grads(
        lambda q, k, v, b: chunked_attention(q, k, v, mask, b, q_chunk=16, kv_chunk=16),
        q, k, v, w, bias)
    np.testing.assert_allclose(chunk[0], dense[0], atol=1e-5)
    for name, a, b in zip(["q", "k", "v", "bias"], chunk[1], dense[1], strict=True):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")


def test_dense_mask_and_bias_arrays_under_x64_match_the_dense_kernel_in_float64():
    """Under jax_enable_x64 a dense mask or bias array's tile windows are sliced with one int
    type (Python zeros are int64 there, the loop's tile index int32)."""
    mask = MASKS["dense_bool"]()
    bias = np.random.default_rng(8).normal(size=(B, N, 37, 37))
    with jax.enable_x64(True):
        q, k, v, w = qkvw(9, dtype=jnp.float64)
        for m, b in ((mask, None), (None, jnp.asarray(bias)), (mask, jnp.asarray(bias))):
            extra = () if b is None else (b,)
            dense = value_and_grads(lambda q, k, v, *b, m=m: dot_product_attention(q, k, v, m, *b),
                                    q, k, v, w, *extra, jit=False)
            chunk = value_and_grads(lambda q, k, v, *b, m=m: chunked_attention(
                q, k, v, m, *b, q_chunk=16, kv_chunk=16), q, k, v, w, *extra)
            assert chunk[0].dtype == jnp.float64
            for a, want in zip((chunk[0], *chunk[1]), (dense[0], *dense[1]), strict=True):
                np.testing.assert_allclose(a, want, atol=1e-10, rtol=0)


@pytest.mark.slow
def test_alibi_bias_callable():
    q, k, v, w = qkvw(8, q_len=21, kv_len=37)
    offset = 37 - 21  # queries are the last 21 positions
    alibi_fn = lambda qi, ki: positions.alibi_bias(qi + offset, ki, N)
    dense_bias = positions.alibi_bias(jnp.arange(21) + offset, jnp.arange(37), N)
    mask = masks.Causal()
    dense = value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask, dense_bias),
                            q, k, v, w, jit=False)
    chunk = value_and_grads(lambda q, k, v: chunked_attention(
        q, k, v, mask, alibi_fn, q_chunk=8, kv_chunk=16), q, k, v, w)
    for a, b in zip([chunk[0], *chunk[1]], [dense[0], *dense[1]], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_learned_t5_bias_callable_gets_gradients():
    """A bias callable closing over learned parameters: the table's gradient matches dense."""
    q, k, v, w = qkvw(9)
    t5 = positions.T5RelativePositionBias(num_heads=N, bidirectional=False, num_buckets=8,
                                          max_distance=20)
    params = t5.init(jax.random.key(0), jnp.arange(4), jnp.arange(4))
    mask = masks.Causal()

    def dense(q, k, v, params):
        bias = t5.apply(params, jnp.arange(37), jnp.arange(37))
        return dot_product_attention(q, k, v, mask, bias)

    def chunked(q, k, v, params):
        bias_fn = lambda qi, ki: t5.apply(params, qi, ki)
        return chunked_attention(q, k, v, mask, bias_fn, q_chunk=16, kv_chunk=16)

    want = value_and_grads(dense, q, k, v, w, params, jit=False)
    got = value_and_grads(chunked, q, k, v, w, params)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert np.any(jax.tree.leaves(got[1][3])[0])


def test_bfloat16_inputs():
    """bf16 in, bf16 out; error against a float32 reference comparable to the dense bf16 path."""
    q, k, v, w = qkvw(10, dtype=jnp.float32)
    mask = masks.Causal() & masks.Padding(kv_lengths=jnp.array([30, 37]))
    ref = value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, w)
    low = tuple(x.astype(jnp.bfloat16) for x in (q, k, v, w))
    dense = value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), *low)
    chunk = value_and_grads(lambda q, k, v: chunked_attention(
        q, k, v, mask, q_chunk=16, kv_chunk=16), *low)
    assert chunk[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in chunk[1])
    for c, d, r in zip([chunk[0], *chunk[1]], [dense[0], *dense[1]], [ref[0], *ref[1]],
                       strict=True):
        c, d, r = (np.asarray(x, np.float32) for x in (c, d, r))
        assert np.all(np.isfinite(c))
        err_chunk, err_dense = np.abs(c - r).max(), np.abs(d - r).max()
        assert err_chunk <= 2 * err_dense + 1e-2, (err_chunk, err_dense)
        np.testing.assert_allclose(c, d, atol=0.1)


# -----------------------------------------------------------------------------
# Tile skipping


def test_static_plan_skips_empty_tiles():
    causal = plan_tiles(masks.Causal(), 1024, 1024, 128, 128)
    full = plan_tiles(masks.Full(), 1024, 1024, 128, 128)
    assert full.count() == 64 and causal.count() == 8 * 9 // 2  # 36 of 64 tiles
    assert causal.count(masks.FULL) == 28 and causal.count(masks.PARTIAL) == 8  # the diagonal
    assert full.count(masks.PARTIAL) == 0  # no mask evaluation at all
    # A sliding window visits O(T) tiles: 2 per query tile.
    window = plan_tiles(masks.SlidingWindow(left=100), 4096, 4096, 128, 128)
    assert window.count() == 2 * 32 - 1
    # Ragged keys: the last key tile must evaluate the (padding) mask.
    ragged = plan_tiles(None, 37, 37, 16, 16)
    assert ragged.classes[:, -1].tolist() == [masks.PARTIAL] * 3


def test_kernels_compute_only_the_planned_tiles():
    q, k, v, _ = qkvw(11, q_len=64, kv_len=64)

    def stats(mask):
        counts = jax.jit(lambda q, k, v, mask: {
            name: value for name, value in chunked_attention_stats(
                q, k, v, mask, q_chunk=8, kv_chunk=8).items() if name != "plan"})
        return counts(q, k, v, mask)

    full, causal = stats(masks.Full()), stats(masks.Causal())
    assert int(full["forward_tiles"]) == int(full["backward_tiles"]) == 64
    assert int(causal["forward_tiles"]) == int(causal["backward_tiles"]) == 36  # 8 * 9 / 2
    # Per-example masks: the plan is conservative, the run-time cond skips the empty tiles.
    # Example 0 has 20 valid keys (3 key tiles), example 1 has 4 (1 key tile).
    padded = stats(masks.Padding(kv_lengths=jnp.array([20, 4])))
    assert int(padded["planned_tiles"]) == 64
    assert int(padded["forward_tiles"]) == int(padded["backward_tiles"]) == 8 * 3
    seg = jnp.asarray(np.repeat(np.arange(1, 5), 16)[None].repeat(B, 0))  # 4 docs of 16
    packed = stats(masks.Segment(seg) & masks.Causal())
    assert int(packed["forward_tiles"]) == int(packed["backward_tiles"]) == 4 * 3


def test_mask_spec_is_traced_per_loop_body_not_per_tile():
    """The kernels are loops: the mask spec is traced once per loop body however many tiles."""
    q, k, v, w = qkvw(12, q_len=64, kv_len=64)
    traced = {"n": 0}
    original = masks.Causal._allowed

    def counting(self, q_idx, *args):
        traced["n"] += isinstance(q_idx, jax.core.Tracer)  # NumPy calls are the block map
        return original(self, q_idx, *args)

    masks.Causal._allowed = counting
    try:
        jax.jit(jax.grad(lambda q, k, v: jnp.sum(chunked_attention(
            q, k, v, masks.Causal(), q_chunk=8, kv_chunk=8) * w))).lower(q, k, v)
    finally:
        masks.Causal._allowed = original
    assert 1 <= traced["n"] <= 2  # forward PARTIAL loop and backward PARTIAL loop, 36 tiles


@pytest.mark.slow
@pytest.mark.parametrize("impl, position, length", [
    ("chunked", "rope", 37), ("chunked", "alibi", 37), ("chunked", "t5", 37),
    ("splash", "rope", 128),  # the Pallas TPU kernel in interpret mode; lengths of 128k
])
def test_a_model_with_chunked_attention_equals_the_dense_model(impl, position, length):
    """`model.attention_impl="chunked"` (or "splash"): same params, same logits and gradients
    as the dense model, on packed rows (segment ids + causal). With chunked attention the ALiBi
    and T5 biases are per-tile functions, not [B, N, T, S] arrays."""
    from transformer.configs import base_config
    from transformer.models import build_model

    config = base_config().model
    config.update(family="gpt", vocab_size=50, num_layers=2, d_model=32, num_heads=4,
                  num_kv_heads=2, d_ff=64, position=position)
    dense = build_model(config)
    config.attention_impl = impl
    chunked = build_model(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 50, (2, length)), jnp.int32)
    first = length * 5 // 9
    segments = jnp.asarray(np.repeat([[1] * first + [2] * (length - first)], 2, axis=0),
                           jnp.int32)
    params = jax.jit(dense.init)(jax.random.key(0), tokens)["params"]

    def loss(model, p):
        logits = model.apply({"params": p}, tokens, segment_ids=segments)
        return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

    (_, dense_logits), dense_grads = jax.jit(jax.value_and_grad(
        lambda p: loss(dense, p), has_aux=True))(params)
    (_, chunked_logits), chunked_grads = jax.jit(jax.value_and_grad(
        lambda p: loss(chunked, p), has_aux=True))(params)
    np.testing.assert_allclose(chunked_logits, dense_logits, atol=1e-5)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(dense_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("position", ["alibi", "t5"])
def test_chunked_models_never_hold_a_full_position_bias(position, monkeypatch):
    """At 2048 tokens a [1, 4, T, T] float32 bias is 64 MiB; the chunked model's whole forward
    pass (compiled memory analysis) needs less than that, the dense model's (as one query
    block, as on accelerators) more."""
    from transformer.configs import base_config
    from transformer.models import build_model
    from transformer.nn import dense_attention

    monkeypatch.setattr(dense_attention, "cpu_query_block", lambda q_len, platform: None)
    config = base_config().model
    config.update(family="gpt", vocab_size=50, num_layers=1, d_model=32, num_heads=4,
                  d_ff=64, position=position)
    tokens = jnp.zeros((1, 2048), jnp.int32)
    params = build_model(config).init(jax.random.key(0), tokens[:, :8])["params"]
    temp = {}
    for impl in ("dense", "chunked"):
        config.attention_impl = impl
        model = build_model(config)
        compiled = jax.jit(lambda p, t, m=model: m.apply({"params": p}, t)).lower(
            params, tokens).compile()
        temp[impl] = compiled.memory_analysis().temp_size_in_bytes
    full_bias = 4 * 2048 * 2048 * 4
    assert temp["chunked"] < full_bias < temp["dense"], temp
