"""Kernel selection, splash attention (Pallas interpret mode on CPU) and the cuDNN mapping."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.nn import attention, kernels, masks
from transformer.nn.chunked_attention import chunked_attention
from transformer.nn.cudnn_attention import cudnn_arguments, cudnn_attention
from transformer.nn.dense_attention import dot_product_attention, reference_attention
from transformer.nn.kernels import IMPLS, select, splash_attention, supports

B, H, L = 2, 64, 256  # batch, head dim, sequence length (two 128-blocks)


def on_device(x, dtype=None) -> jax.Array:
    """A NumPy array (or list) as a JAX array: jax.device_put compiles nothing, where jnp.array
    and jnp.asarray compile a small XLA program per new shape."""
    return jax.device_put(np.asarray(x, dtype))


def ints(*values) -> jax.Array:
    return on_device(values, np.int32)


ZERO_BIAS = on_device(np.zeros((1, 1, 1, 1), np.float32))


def qkv(seed, q_len=L, kv_len=L, heads=2, kv_heads=2, batch=B, head_dim=H):
    rng = np.random.default_rng(seed)
    shapes = [(batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim),
              (batch, kv_len, kv_heads, head_dim), (batch, q_len, heads, head_dim)]
    return tuple(on_device(rng.normal(size=s), np.float32) for s in shapes)


def packed_ids():
    """Two rows of packed documents; the second ends in 56 padding positions (id 0)."""
    ids = np.repeat([[1] * 100 + [2] * 100 + [3] * 56], B, axis=0)
    ids[1, 200:] = 0
    return on_device(ids, np.int32)


def splash(q, k, v, mask, **kw):
    return splash_attention(q, k, v, mask, block_size=128, interpret=True, **kw)


# -----------------------------------------------------------------------------
# Splash attention against the reference kernel


SPLASH_CASES = {
    # name: (mask, q_len, kv_len, heads, kv_heads)
    "full": (masks.Full(), L, L, 2, 2),
    "causal": (masks.Causal(), L, L, 2, 2),
    "sliding_window": (masks.SlidingWindow(left=40, right=7), L, L, 2, 2),
    "chunked_causal": (masks.ChunkedCausal(chunk_size=96), L, L, 2, 2),
    "segment_causal": (masks.Segment(packed_ids()) & masks.Causal(), L, L, 2, 2),
    # Padded queries (rows 200.. of example 0) have no allowed key: the reference returns zeros
    # there (the raw kernel would average the masked values), so whole outputs are compared.
    "padding": (masks.Padding(q_lengths=ints(200, 256), kv_lengths=ints(130, 256)),
                L, L, 2, 2),
    "gqa": (masks.Causal(), L, L, 4, 2),
    "mqa": (masks.Causal(), L, L, 4, 1),
    # Per-example masks splash cannot express statically go through its dynamic-mask path.
    "prefix_lm": (masks.PrefixLM(prefix_lengths=ints(10, 150)), L, L, 2, 2),
    "or_static": (masks.SlidingWindow(left=10) | masks.ChunkedCausal(chunk_size=64), L, L, 2, 2),
    # Fewer queries than keys: bottom-right alignment via splash's mask offset.
    "causal_decode_aligned": (masks.Causal(), 128, L, 2, 2),
    "window_decode_aligned": (masks.SlidingWindow(left=30), 128, L, 2, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPLASH_CASES))
def test_splash_matches_reference(name):
    mask, q_len, kv_len, heads, kv_heads = SPLASH_CASES[name]
    q, k, v, _ = qkv(0, q_len, kv_len, heads, kv_heads)
    want = reference_attention(q, k, v, mask)
    got = splash(q, k, v, mask)
    assert got.shape == want.shape == q.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_splash_scale_and_empty_rows():
    """A custom scale is applied; rows of a fully masked query block (NaN in the raw kernel)
    come back as zeros, like the reference's."""
    mask = masks.Causal()  # 256 queries over 128 keys: the first 128 queries see nothing
    q, k, v, _ = qkv(1, q_len=L, kv_len=128)
    got, want = jax.jit(lambda q, k, v: (splash(q, k, v, mask, scale=0.3),
                                         reference_attention(q, k, v, mask, scale=0.3)))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.asarray(got)[:, :128].any()


def value_and_grads(attend, q, k, v, w):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) * w)
    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)


@pytest.mark.slow
@pytest.mark.parametrize("mask", [
    masks.Causal(),
    masks.Causal() & masks.Padding(q_lengths=ints(200, 256), kv_lengths=ints(130, 256)),
], ids=["causal", "causal_padding"])
def test_splash_gradients_match_reference(mask):
    q, k, v, w = qkv(2)
    got = value_and_grads(lambda q, k, v: splash(q, k, v, mask), q, k, v, w)
    want = value_and_grads(lambda q, k, v: reference_attention(q, k, v, mask), q, k, v, w)
    for name, g, r in zip(("dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5, err_msg=name)


def test_splash_refuses_what_it_cannot_run():
    q, k, v, _ = qkv(3)
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match="needs platform tpu"):
            splash_attention(q, k, v, masks.Causal())  # interpret=False off TPU
    q, k, v, _ = qkv(3, q_len=200, kv_len=200)
    with pytest.raises(ValueError, match="multiples of 128"):
        splash(q, k, v, masks.Causal())


# -----------------------------------------------------------------------------
# Selection


CAUSAL = masks.Causal()


def choose(impl="auto", *, platform="cpu", mask=CAUSAL, bias=None, dropout=0.0,
           q_len=4096, kv_len=4096, head_dim=128, **kw):
    return select(impl, platform=platform, mask=mask, bias=bias, dropout=dropout, q_len=q_len,
                  kv_len=kv_len, head_dim=head_dim, **kw)


def test_impls():
    assert IMPLS == ("auto", "dense", "chunked", "splash", "cudnn", "reference")


def test_auto_picks_the_platform_kernel():
    assert choose(platform="tpu") == "splash"
    assert choose(platform="tpu", mask=masks.Segment(packed_ids()) & masks.Causal()) == "splash"
    assert choose(platform="gpu", head_dim=64) == "cudnn"
    assert choose(platform="gpu", head_dim=64, dtype=jnp.bfloat16) == "cudnn"
    assert choose(platform="cpu") == "chunked"
    assert choose(platform="cpu", q_len=256, kv_len=256) == "dense"
    # the threshold is on the score block: a decode step's query against a long cache is dense
    assert choose(platform="cpu", q_len=1, kv_len=32768) == "dense"
    assert choose(platform="cpu", q_len=2048, kv_len=2048) == "chunked"
    assert choose(platform="cpu", q_len=1024, kv_len=4096) == "chunked"  # prefill into a cache
    assert choose(platform="cpu", q_len=1024, kv_len=2048) == "dense"
    assert choose(platform="cpu", kv_len=4096, chunk_threshold=8192) == "dense"


def test_auto_falls_back_when_the_kernel_cannot_run():
    bias = ZERO_BIAS
    prefix = masks.PrefixLM(prefix_lengths=ints(3, 5))
    assert choose(platform="tpu", bias=bias) == "chunked"
    assert choose(platform="tpu", bias=bias, q_len=256, kv_len=256) == "dense"
    assert choose(platform="tpu", mask=prefix) == "chunked"  # would need a dense splash mask
    assert choose(platform="tpu", q_len=4000, kv_len=4000) == "chunked"  # not 128-aligned
    assert choose(platform="gpu", head_dim=256) == "chunked"
    assert choose(platform="gpu", head_dim=60) == "chunked"
    assert choose(platform="gpu", dtype=jnp.float32) == "chunked"
    assert choose(platform="gpu", bias=bias) == "chunked"
    assert choose(platform="tpu", dropout=0.1) == "dense"  # only dense has attention dropout
    assert choose(platform="tpu", devices=8) == "chunked"  # 8 devices but no mesh to shard_map


@pytest.mark.parametrize("impl, kw, words", [
    ("splash", dict(platform="cpu"), ["impl='splash'", "tpu", "cpu"]),
    ("splash", dict(platform="tpu", bias=ZERO_BIAS), ["impl='splash'", "bias"]),
    ("splash", dict(platform="tpu", q_len=100, kv_len=100), ["impl='splash'", "128"]),
    ("splash", dict(platform="tpu", dropout=0.1), ["impl='splash'", "dropout"]),
    ("splash", dict(platform="tpu", devices=8), ["impl='splash'", "8 devices", "set_mesh"]),
    ("cudnn", dict(platform="tpu"), ["impl='cudnn'", "gpu"]),
    ("cudnn", dict(platform="gpu", head_dim=256), ["impl='cudnn'", "head_dim"]),
    ("cudnn", dict(platform="gpu", dtype=jnp.float32), ["impl='cudnn'", "float32"]),
    ("chunked", dict(dropout=0.1), ["impl='chunked'", "dropout", "'dense'"]),
    ("flash", dict(), ["impl='flash'", "auto"]),
])
def test_explicit_unsupported_impl_raises(impl, kw, words):
    with pytest.raises(ValueError) as info:
        choose(impl, **kw)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_explicit_supported_impl_is_kept():
    assert choose("dense", dropout=0.1, bias=ZERO_BIAS) == "dense"
    assert choose("chunked", q_len=8, kv_len=8) == "chunked"
    assert choose("splash", platform="tpu", mask=masks.PrefixLM(ints(3))) == "splash"
    assert choose("splash", platform="cpu", interpret=True) == "splash"
    assert choose("cudnn", platform="gpu", head_dim=64) == "cudnn"


def test_supports():
    common = dict(mask=masks.Causal(), bias=None, dropout=0.0, q_len=256, kv_len=256,
                  head_dim=64)
    assert [supports(i, platform="cpu", **common) for i in IMPLS] == [
        True, True, True, False, False, True]
    assert supports("splash", platform="cpu", interpret=True, **common)
    assert supports("splash", platform="tpu", **common)
    assert supports("cudnn", platform="gpu", **common)
    assert not supports("unknown", platform="cpu", **common)


# -----------------------------------------------------------------------------
# cuDNN: the argument mapping (pure) and the wrapper run through XLA on CPU


def test_cudnn_arguments_mapping():
    none = dict(is_causal=False, local_window_size=None, query_seq_lengths=None,
                key_value_seq_lengths=None, mask=None)
    assert cudnn_arguments(None, 8, 8) == none
    assert cudnn_arguments(masks.Full(), 8, 8) == none
    assert cudnn_arguments(masks.Causal(), 8, 8) == {**none, "is_causal": True}
    assert cudnn_arguments(masks.SlidingWindow(left=3), 8, 8) == {
        **none, "is_causal": True, "local_window_size": (3, 0)}
    assert cudnn_arguments(masks.SlidingWindow(left=5) & masks.SlidingWindow(left=3), 8, 8)[
        "local_window_size"] == (3, 0)

    args = cudnn_arguments(masks.Causal() & masks.Padding(q_lengths=ints(5, 8),
                                                          kv_lengths=ints(6, 7)), 8, 8)
    assert args["is_causal"] and args["mask"] is None
    assert args["query_seq_lengths"].dtype == jnp.int32
    np.testing.assert_array_equal(args["query_seq_lengths"], [5, 8])
    np.testing.assert_array_equal(args["key_value_seq_lengths"], [6, 7])


def traced_cudnn_arguments(mask, q_len, kv_len, dense_mask):
    """cudnn_arguments(mask, q_len, kv_len) and dense_mask.dense(q_len, kv_len) traced in one
    program (cudnn_attention runs the mapping under jit too) rather than op by op: (the
    arguments, its fields that are not arrays as the trace left them; the dense mask)."""
    fields = {}

    def arrays():
        args = cudnn_arguments(mask, q_len, kv_len)
        fields.update({k: v for k, v in args.items() if not isinstance(v, jax.Array)})
        return ({k: v for k, v in args.items() if isinstance(v, jax.Array)},
                dense_mask.dense(q_len, kv_len))

    traced, dense = jax.jit(arrays)()
    return {**fields, **traced}, dense


@pytest.mark.parametrize("mask, q_len, kv_len", [
    (masks.Causal(), 4, 8),  # jax's is_causal is top-left aligned: needs the dense mask
    (masks.SlidingWindow(left=3, right=1), 8, 8),  # cuDNN has no right window
    (masks.ChunkedCausal(chunk_size=3), 8, 8),
    (masks.PrefixLM(prefix_lengths=ints(3, 5)), 8, 8),
], ids=["causal_rect", "two_sided_window", "chunked", "prefix"])
def test_cudnn_arguments_dense_fallback(mask, q_len, kv_len):
    args, dense = traced_cudnn_arguments(mask, q_len, kv_len, mask)
    assert not args["is_causal"] and args["local_window_size"] is None
    np.testing.assert_array_equal(args["mask"], dense)


def test_cudnn_arguments_keep_structure_and_densify_the_rest():
    ids = on_device([[1, 1, 1, 2, 2, 2, 0, 0]], np.int32)
    args, dense = traced_cudnn_arguments(masks.Segment(ids) & masks.Causal(), 8, 8,
                                         masks.Segment(ids))
    assert args["is_causal"]
    np.testing.assert_array_equal(args["mask"], dense)


CUDNN_CASES = {
    "full": masks.Full(),
    "causal": masks.Causal(),
    "window": masks.SlidingWindow(left=3),
    "causal_padding": masks.Causal() & masks.Padding(q_lengths=ints(9, 16), kv_lengths=ints(5, 16)),
    "padding_only_keys": masks.Padding(kv_lengths=ints(5, 11)),
    "segment_causal": masks.Segment(on_device([[1] * 6 + [2] * 8 + [0] * 2] * 2, np.int32))
    & masks.Causal(),
    "two_sided_window": masks.SlidingWindow(left=2, right=2),
}


@pytest.mark.parametrize("name", list(CUDNN_CASES))
def test_cudnn_wrapper_matches_reference_through_xla(name):
    """The same jax.nn.dot_product_attention call with implementation="xla": checks that the
    mapped arguments mean what the mask means (alignment, windows, lengths, empty rows)."""
    mask = CUDNN_CASES[name]
    q, k, v, _ = qkv(4, q_len=16, kv_len=16, heads=4, kv_heads=2, head_dim=8)
    got, want = jax.jit(lambda q, k, v: (cudnn_attention(q, k, v, mask, implementation="xla"),
                                         dot_product_attention(q, k, v, mask)))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_cudnn_xla_decode_aligned():
    mask = masks.Causal()
    q, k, v, _ = qkv(5, q_len=4, kv_len=16, head_dim=8)
    got, want = jax.jit(lambda q, k, v: (cudnn_attention(q, k, v, mask, implementation="xla"),
                                         dot_product_attention(q, k, v, mask)))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the off-GPU error")
def test_cudnn_refuses_off_gpu():
    q, k, v, _ = qkv(6, q_len=16, kv_len=16, head_dim=8)
    with pytest.raises(ValueError, match="needs platform gpu"):
        cudnn_attention(q, k, v, masks.Causal())


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU with cuDNN")
@pytest.mark.parametrize("name", list(CUDNN_CASES))
def test_cudnn_kernel_matches_reference(name):
    mask = CUDNN_CASES[name]
    q, k, v, _ = qkv(7, q_len=16, kv_len=16, heads=4, kv_heads=2)
    want = dot_product_attention(q, k, v, mask)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = cudnn_attention(*bf16, mask).astype(jnp.float32)
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


# -----------------------------------------------------------------------------
# The kernels' table: selection only ever picks a kernel that declares what the call uses


def bias_fn(q_idx, kv_idx):
    return -0.1 * jnp.abs(q_idx[:, None] - kv_idx[None, :]).astype(jnp.float32)


FEATURE_MASKS = {"none": None, "causal": CAUSAL,
                 "segments": masks.Segment(packed_ids()) & masks.Causal(),
                 "prefix": masks.PrefixLM(ints(3, 5)),
                 "array": on_device(np.tril(np.ones((1, 1, L, L), bool)))}


def feature_calls(platform):
    """Calls over every combination of mask kind, bias kind, dropout, soft-cap, weights, GQA,
    sinks and length (aligned for splash or not, above the chunk threshold or not)."""
    for mask, bias, dropout, softcap, weights, gqa, sinks, length in itertools.product(
            FEATURE_MASKS.values(), (None, ZERO_BIAS, bias_fn), (0.0, 0.1),
            (0.0, 30.0), (False, True), (False, True), (False, True), (256, 250, 4096)):
        yield dict(platform=platform, mask=mask, bias=bias, dropout=dropout, q_len=length,
                   kv_len=length, head_dim=64, dtype=jnp.bfloat16, softcap=softcap,
                   weights=weights, gqa=gqa, sinks=sinks)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_selection_picks_only_kernels_that_declare_every_feature_in_use(platform):
    picked = set()
    for args in feature_calls(platform):
        used = set(kernels.Call(**args).features())
        chosen = select("auto", **args)
        picked.add(chosen)
        declared = kernels.KERNELS[chosen]
        assert used <= declared.features, (chosen, used)  # auto: never a named-only feature
        for impl in IMPLS[1:]:  # an explicit kernel runs the call only if it declares it all
            try:
                select(impl, **args)
            except ValueError as error:
                assert "\n" not in str(error)
                continue
            kernel = kernels.KERNELS[impl]
            assert used <= kernel.features | kernel.named_only, (impl, used)
    assert picked == {"cpu": {"dense", "chunked"}, "gpu": {"dense", "chunked", "cudnn"},
                      "tpu": {"dense", "chunked", "splash"}}[platform]


def test_a_feature_no_kernel_declares_is_refused_and_auto_falls_back(monkeypatch):
    """A new knob ("novel") that only dense declares: auto runs dense even where it would
    prefer splash or chunked, a named kernel without it refuses in one line, and with no kernel
    declaring it auto refuses too."""
    features = kernels.Call.features
    monkeypatch.setattr(kernels, "FEATURES", {**kernels.FEATURES, "novel": "has no novel"})
    monkeypatch.setattr(kernels.Call, "features", lambda call: (*features(call), "novel"))
    with pytest.raises(ValueError, match="no kernel"):
        choose(platform="tpu")
    dense = kernels.KERNELS["dense"]
    monkeypatch.setitem(kernels.KERNELS, "dense", dataclasses.replace(
        dense, features=dense.features | {"novel"}))
    assert choose(platform="tpu") == choose(platform="cpu") == "dense"
    with pytest.raises(ValueError, match=r"^impl='chunked' has no novel; use impl='dense' or"):
        choose("chunked")


def test_sinks_are_refused_by_the_kernels_without_them():
    """cuDNN and splash per device declare no sinks: named, cuDNN is refused in one line; auto
    on GPU runs chunked or dense instead, and under a sequence axis chunked per device."""
    with pytest.raises(ValueError, match=r"^impl='cudnn' has no attention sinks; use impl="):
        choose("cudnn", platform="gpu", sinks=True, dtype=jnp.bfloat16)
    assert choose(platform="gpu", sinks=True, dtype=jnp.bfloat16) == "chunked"
    assert choose(platform="gpu", sinks=True, dtype=jnp.bfloat16, q_len=256, kv_len=256) == (
        "dense")
    assert choose(platform="tpu", sinks=True) == "splash"
    call = kernels.Call("cpu", CAUSAL, q_len=L, kv_len=L, split=2, sinks=True)
    assert kernels.refusal("splash per device", call) == "has no attention sinks"
    assert kernels.refusal("chunked per device", call) is None


# -----------------------------------------------------------------------------
# Every kernel that runs on CPU against the reference kernel, over the features it declares

REFERENCE_CASES = {  # name: (mask, bias, softcap, sinks)
    "causal": (CAUSAL, None, 0.0, False),
    "window_softcap": (masks.SlidingWindow(left=40, right=7), None, 20.0, False),
    "segments": (masks.Segment(packed_ids()) & masks.Causal(), None, 0.0, False),
    "prefix_bias_fn": (masks.PrefixLM(ints(10, 150)), bias_fn, 0.0, False),
    "array_bias": (on_device(np.tril(np.ones((1, 1, L, L), bool))),
                   on_device(np.linspace(-1, 1, L)[None, None, None], np.float32), 5.0, False),
    "none": (None, None, 0.0, False),
    "segments_sinks": (masks.Segment(packed_ids()) & masks.Causal(), None, 0.0, True),
    "window_softcap_sinks": (masks.SlidingWindow(left=40, right=7), None, 20.0, True),
}


def case_inputs(case):
    """q, k, v, the loss weights w and the sinks (or None) of a REFERENCE_CASES case."""
    q, k, v, w = qkv(5, heads=4, kv_heads=2)
    sinks = on_device([-1.0, 0.5, 2.0, 4.0], np.float32) if REFERENCE_CASES[case][3] else None
    return q, k, v, w, sinks


def attend_case(case, impl):
    mask, bias, softcap, _ = REFERENCE_CASES[case]
    return lambda q, k, v, sinks: attention.attend(
        q, k, v, mask=mask, bias=bias, impl=impl, softcap=softcap, sinks=sinks)


def case_gradients(run, w, with_sinks):
    """The gradients of sum(run(q, k, v, sinks) * w): dq, dk, dv (and dsinks)."""
    return jax.grad(lambda q, k, v, s: jnp.sum(run(q, k, v, s) * w),
                    (0, 1, 2, 3) if with_sinks else (0, 1, 2))


@functools.cache
def reference_forward_and_gradients(case):
    """The reference kernel's output and gradients on a REFERENCE_CASES case, as NumPy: one
    program, compiled once for the kernels that are tested against it."""
    q, k, v, w, sinks = case_inputs(case)
    run = attend_case(case, "reference")
    grads = case_gradients(run, w, sinks is not None)
    out, got = jax.jit(lambda *args: (run(*args), grads(*args)))(q, k, v, sinks)
    return np.asarray(out), [np.asarray(g) for g in got]


@pytest.mark.parametrize("impl", ["dense", "chunked", "splash"])
@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_kernels_match_the_reference_forward_and_gradients(impl, case):
    mask, bias, softcap, with_sinks = REFERENCE_CASES[case]
    q, k, v, w, sinks = case_inputs(case)
    call = kernels.Call("cpu", mask, bias, q_len=L, kv_len=L, head_dim=H, interpret=True,
                        softcap=softcap, gqa=True, sinks=with_sinks)
    if kernels.refusal(impl, call) is not None:
        pytest.skip(f"{impl} does not declare {call.features()}")
    if impl == "splash" and case not in ("causal", "segments", "segments_sinks"):
        pytest.skip("splash in interpret mode is slow: three cases")
    with kernels.recording() as chosen:
        got = jax.jit(attend_case(case, impl))(q, k, v, sinks)
    assert chosen == [impl]
    want, want_grads = reference_forward_and_gradients(case)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    grads = jax.jit(case_gradients(attend_case(case, impl), w, with_sinks))(q, k, v, sinks)
    names = ("dq", "dk", "dv", "dsinks")[:4 if with_sinks else 3]
    for name, g, r in zip(names, grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=5e-5, err_msg=name)


def sinks_formula(q, k, v, allowed, sinks):
    """Attention with sinks in float64 NumPy, from the formula: row i of head n has weights
    exp(s_ij - m) / (exp(sink_n - m) + sum_j exp(s_ij - m)), m = max(sink_n, max_j s_ij), over
    its allowed keys j; output sum_j weights_ij v_j."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    sink = np.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
    m = np.maximum(s.max(-1, keepdims=True), sink)
    e, e_sink = np.exp(s - m), np.exp(sink - m)
    return np.einsum("bnts,bsnh->btnh", e / (e_sink + e.sum(-1, keepdims=True)), v)


@pytest.mark.slow
def test_sinks_match_the_float64_formula_forward_and_gradients():
    """dense, reference and chunked (in 4 x 4 tiles) with sinks against `sinks_formula`, and
    their gradients (the sinks' included) against its central differences: causal, padding,
    GQA and a row with no allowed key (all its weight on the sink: output 0, finite)."""
    rng = np.random.default_rng(0)
    b, t, n, kv, h = 2, 10, 4, 2, 8
    args = [rng.normal(size=s) for s in ((b, t, n, h), (b, t, kv, h), (b, t, kv, h))]
    args.append(rng.normal(size=n) * 2)
    w = rng.normal(size=(b, t, n, h))
    mask = masks.Causal() & masks.Padding(q_lengths=ints(10, 7), kv_lengths=ints(10, 6))
    allowed = np.broadcast_to(np.asarray(masks.as_dense(mask, t, t)), (b, n, t, t)).copy()
    allowed[0, :, 3] = False  # query 3 of example 0 sees no key
    loss = lambda *a: float((sinks_formula(*a[:3], allowed, a[3]) * w).sum())
    want_grads = []
    for arg in args:
        grad = np.zeros_like(arg)
        for index in np.ndindex(arg.shape):
            keep = arg[index]
            arg[index] = keep + 1e-6
            up = loss(*args)
            arg[index] = keep - 1e-6
            grad[index] = (up - loss(*args)) / 2e-6
            arg[index] = keep
        want_grads.append(grad)
    want = sinks_formula(*args[:3], allowed, args[3])
    assert not want[0, 3].any()
    kernels_ = {"dense": dot_product_attention, "reference": reference_attention,
                "chunked": functools.partial(chunked_attention, q_chunk=4, kv_chunk=4)}
    f32 = [jnp.asarray(a, jnp.float32) for a in args]
    for name, kernel in kernels_.items():
        run = functools.partial(kernel, mask=jnp.asarray(allowed))
        np.testing.assert_allclose(run(*f32[:3], sinks=f32[3]), want, atol=1e-6, err_msg=name)
        grads = jax.grad(lambda q, k, v, s, run=run: jnp.sum(run(q, k, v, sinks=s) * w),
                         (0, 1, 2, 3))(*f32)
        for what, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads, strict=True):
            assert np.isfinite(g).all()
            np.testing.assert_allclose(g, r, atol=1e-5, err_msg=f"{name} {what}")


def test_reference_kernel_has_no_custom_gradient():
    q, k, v, _ = qkv(6, q_len=8, kv_len=8)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(reference_attention(q, k, v))))(q))
    assert "custom_vjp" not in jaxpr and "custom_jvp" not in jaxpr
    # and it is the plain formula: softmax over keys, with weights out on request
    out, weights, dense = jax.jit(lambda q, k, v: (
        *reference_attention(q, k, v, masks.Causal(), return_weights=True),
        dot_product_attention(q, k, v, masks.Causal())))(q, k, v)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out, dense, atol=1e-6)
