"""The model knobs researchers ablate (QK-norm, logit soft-caps, parallel blocks, GPT-2's scaled
residual init, norm placements, per-layer sliding windows): a float64 NumPy reference of the
whole decoder LM, every attention kernel, scan and remat, KV-cache decoding, and the errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf
from test_decode_cache import cached_logits

from transformer.configs import base_config, validate_config
from transformer.models import build_model
from transformer.nn import attention, kernels, masks
from transformer.nn.chunked_attention import chunked_attention
from transformer.nn.layers import stack_layers

VOCAB, LENGTH = 40, 12

# name -> model overrides. Each case turns knobs on over a small RoPE GPT.
CASES = {
    "baseline": {},
    "qk_norm": dict(qk_norm=True),
    "qk_norm_projection": dict(qk_norm=True, qk_norm_scope="projection",
                               norm_placement="post_sublayer"),  # OLMo 2's block
    "softcaps": dict(attention_softcap=2.0, final_logit_softcap=3.0),
    "gemma2_block": dict(norm_placement="sandwich", attention_softcap=2.0, sliding_window=3,
                         sliding_window_pattern=2, activation="geglu", final_logit_softcap=3.0),
    "parallel_block": dict(parallel_block=True),
    "parallel_block_layernorm": dict(parallel_block=True, norm="layernorm", use_bias=True),
    "sinks": dict(attention_sinks=True, attention_softcap=2.0),
}


def model_config(**overrides):
    config = base_config().model
    config.update(family="gpt", vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
                  num_kv_heads=2, d_ff=48, position="rope", norm="rmsnorm", use_bias=False,
                  activation="gelu", dropout_rate=0.0, init_std=0.3)
    config.update(overrides)
    return config


def tokens(shape=(2, LENGTH), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def perturbed(params, seed=1):
    """Norm scales away from 1 (a freshly initialised scale of ones would hide a wrong one), and
    attention sinks spread over [-2, 2] (their small init would hide a missing one)."""
    rng = np.random.default_rng(seed)
    change = {"scale": lambda x: x * (1 + 0.3 * rng.standard_normal(x.shape)),
              "sinks": lambda x: x + rng.uniform(-2, 2, x.shape)}
    return jax.tree_util.tree_map_with_path(
        lambda path, x: next((f(x).astype(x.dtype) for name, f in change.items()
                              if name in jax.tree_util.keystr(path)), x), params)


# --- the float64 NumPy reference -------------------------------------------------------------


def norm(x, p, cfg, axes=-1):
    if cfg.norm == "layernorm":
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + cfg.norm_epsilon) * p["scale"] + p.get("bias", 0.0)
    return x / np.sqrt((x**2).mean(axes, keepdims=True) + cfg.norm_epsilon) * p["scale"]


def rope(x, theta=10000.0):
    """Half-layout RoPE of x [B, T, N, H] at positions 0..T-1."""
    half = x.shape[-1] // 2
    angles = np.arange(x.shape[1])[:, None] * theta ** (-np.arange(half) * 2 / x.shape[-1])
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_attention(x, p, cfg, window):
    q = np.einsum("btd,dnh->btnh", x, p["query"])
    k = np.einsum("btd,dkh->btkh", x, p["key"])
    v = np.einsum("btd,dkh->btkh", x, p["value"])
    if cfg.qk_norm:  # before RoPE, over each head or over the whole projection
        axes = (-2, -1) if cfg.qk_norm_scope == "projection" else -1
        q, k = norm(q, p["query_norm"], cfg, axes), norm(k, p["key_norm"], cfg, axes)
    q, k = rope(q), rope(k)
    k, v = (np.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))
    logits = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    if cfg.attention_softcap:
        logits = cfg.attention_softcap * np.tanh(logits / cfg.attention_softcap)
    t = np.arange(x.shape[1])
    allowed = t[None, :] <= t[:, None]
    if window:
        allowed &= t[None, :] > t[:, None] - window
    logits = np.where(allowed, logits, -np.inf)
    sink = np.full((*logits.shape[:3], 1), -np.inf)  # exp(sink) = 0 without sinks
    if cfg.attention_sinks:  # a logit per head in the denominator, with no value
        sink = np.broadcast_to(p["sinks"][None, :, None, None], sink.shape)
    top = np.maximum(logits.max(-1, keepdims=True), sink)
    weights = np.exp(logits - top)
    weights /= weights.sum(-1, keepdims=True) + np.exp(sink - top)
    return np.einsum("bnqk,bknh,nhd->bqd", weights, v, p["out"])


def reference_mlp(x, p, cfg):
    gelu = lambda z: 0.5 * z * (1 + erf(z / np.sqrt(2)))
    gelu_tanh = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
    if cfg.activation == "geglu":
        return (gelu_tanh(x @ p["wi_gate"]) * (x @ p["wi_up"])) @ p["wo"]
    hidden = x @ p["wi"] + p.get("wi_bias", 0.0)
    return gelu(hidden) @ p["wo"] + p.get("wo_bias", 0.0)


def reference_logits(params, tokens_BT, cfg):
    """The decoder LM's logits in float64, written from the formulas."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = p["embed"]["embedding"][np.asarray(tokens_BT)]
    for i in range(cfg.num_layers):
        lp = p["decoder"][f"layers_{i}"]
        window = cfg.sliding_window if cfg.sliding_window and (
            not cfg.sliding_window_pattern or (i + 1) % cfg.sliding_window_pattern) else None
        attend = lambda h, lp=lp, window=window: reference_attention(h, lp["self_attention"],
                                                                     cfg, window)
        mlp = lambda h, lp=lp: reference_mlp(h, lp["mlp"], cfg)
        if cfg.parallel_block:  # x + attn(N(x)) + mlp(N(x))
            h = norm(x, lp["self_attention_norm"], cfg)
            x = x + attend(h) + mlp(h)
            continue
        for name, f in (("self_attention", attend), ("mlp", mlp)):
            if cfg.norm_placement == "pre":  # x + f(N(x))
                x = x + f(norm(x, lp[f"{name}_norm"], cfg))
            elif cfg.norm_placement == "sandwich":  # x + N'(f(N(x)))
                x = x + norm(f(norm(x, lp[f"{name}_norm"], cfg)), lp[f"{name}_output_norm"], cfg)
            else:  # post_sublayer: x + N'(f(x))
                x = x + norm(f(x), lp[f"{name}_output_norm"], cfg)
    x = norm(x, p["decoder"]["final_norm"], cfg)
    logits = x @ p["embed"]["embedding"].T
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * np.tanh(logits / cfg.final_logit_softcap)
    return logits


@pytest.mark.parametrize("case", list(CASES))
def test_decoder_lm_equals_the_float64_numpy_reference(case):
    config = model_config(**CASES[case])
    model = build_model(config)
    sequence = tokens()
    params = perturbed(nn.unbox(jax.jit(model.init)(jax.random.key(0), sequence)["params"]))
    ours = np.asarray(jax.jit(model.apply)({"params": params}, sequence))
    want = reference_logits(params, sequence, config)
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=2e-4)
    if config.final_logit_softcap:  # the cap binds: some logits beyond half of it
        assert np.abs(want).max() > config.final_logit_softcap / 2


@pytest.mark.parametrize("case", ["qk_norm_projection", "gemma2_block", "parallel_block"])
def test_scanned_and_rematerialised_layers_equal_unrolled_ones(case):
    sequence = tokens()
    unrolled = build_model(model_config(**CASES[case]))
    params = perturbed(nn.unbox(jax.jit(unrolled.init)(jax.random.key(0), sequence)["params"]))
    want = np.asarray(jax.jit(unrolled.apply)({"params": params}, sequence))
    config = model_config(**CASES[case], scan_layers=True, remat_policy="full")
    scanned = build_model(config)
    decoder = dict(params["decoder"])
    if config.sliding_window_pattern:  # one scan step runs a (local, global) pair of layers
        pairs = {f"layers_{i}": {"block_0": decoder.pop(f"layers_{2 * i}"),
                                 "block_1": decoder.pop(f"layers_{2 * i + 1}")}
                 for i in range(config.num_layers // 2)}
        decoder = stack_layers({**decoder, **pairs}, config.num_layers // 2)
    else:
        decoder = stack_layers(decoder, config.num_layers)
    stacked = {**params, "decoder": decoder}
    expected_shapes = jax.eval_shape(scanned.init, jax.random.key(0), sequence)["params"]
    assert jax.tree.structure(nn.unbox(expected_shapes)) == jax.tree.structure(stacked)
    got = jax.jit(scanned.apply)({"params": stacked}, sequence)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    grad = lambda model, p: jax.jit(jax.grad(
        lambda p: jnp.sum(model.apply({"params": p}, sequence) ** 2)))(p)
    want_grads, got_grads = grad(unrolled, params), grad(scanned, stacked)
    np.testing.assert_allclose(np.asarray(got_grads["embed"]["embedding"]),
                               np.asarray(want_grads["embed"]["embedding"]), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "baseline"])
def test_cached_decoding_equals_full_recomputation(case):
    model = build_model(model_config(**CASES[case]))
    sequence = tokens()
    params = perturbed(nn.unbox(jax.jit(model.init)(jax.random.key(0), sequence)["params"]))
    full = np.asarray(jax.jit(model.apply)({"params": params}, sequence))
    cached = cached_logits(model, params, sequence, [3, 6])
    np.testing.assert_allclose(cached, full, atol=3e-5, rtol=3e-5)


def test_cached_decoding_of_a_gemma2_block_equals_full_recomputation():
    """The fast tier's decode check: soft-caps, sandwich norms, a local and a global layer."""
    test_cached_decoding_equals_full_recomputation("gemma2_block")


# --- attention soft-cap on every kernel --------------------------------------------------------


def softcap_reference(q, k, v, cap, allowed):
    logits = np.einsum("bqnh,bknh->bnqk", q, np.repeat(k, q.shape[2] // k.shape[2], 2))
    logits = cap * np.tanh(logits / np.sqrt(q.shape[-1]) / cap)
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", weights, np.repeat(v, q.shape[2] // v.shape[2], 2))


def qkv(length=128, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, length, 4, 16)).astype(np.float32) * 2  # logits beyond the cap
    k, v = (rng.standard_normal((2, length, 2, 16)).astype(np.float32) for _ in range(2))
    return q, k, v


KERNELS = {
    "dense": lambda q, k, v, m, cap: attention.attend(q, k, v, mask=m, impl="dense",
                                                     softcap=cap),
    "chunked": lambda q, k, v, m, cap: chunked_attention(q, k, v, m, q_chunk=32, kv_chunk=32,
                                                         softcap=cap),
    "splash": lambda q, k, v, m, cap: kernels.splash_attention(q, k, v, m, interpret=True,
                                                               block_size=128, softcap=cap),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_every_kernel_soft_caps_the_attention_logits_as_the_reference(kernel):
    q, k, v = qkv()
    mask = masks.Causal() & masks.SlidingWindow(left=40)
    allowed = np.asarray(mask.dense(128, 128))
    want = softcap_reference(*(x.astype(np.float64) for x in (q, k, v)), 1.5, allowed)
    got = jax.jit(lambda q, k, v: KERNELS[kernel](q, k, v, mask, 1.5))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    uncapped = softcap_reference(*(x.astype(np.float64) for x in (q, k, v)), 1e9, allowed)
    assert np.abs(uncapped - want).max() > 0.1  # the cap binds


@pytest.mark.parametrize("kernel", ["chunked", "splash"])
def test_soft_capped_gradients_equal_the_dense_kernels(kernel):
    """Chunked attention's hand-written backward pass goes through the tanh too."""
    q, k, v = qkv(seed=1)
    probe = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    mask = masks.Causal()
    grads = lambda fn: jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask, 1.5) * probe),
                                        argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads(KERNELS[kernel]), grads(KERNELS["dense"]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5, rtol=5e-5)


def test_auto_skips_cudnn_under_a_soft_cap_and_an_explicit_cudnn_is_refused():
    args = dict(platform="gpu", mask=masks.Causal(), bias=None, dropout=0.0, q_len=256,
                kv_len=256, head_dim=64, dtype=jnp.bfloat16)
    assert kernels.select("auto", **args) == "cudnn"
    assert kernels.select("auto", **args, softcap=50.0) == "dense"
    with pytest.raises(ValueError, match=r"impl='cudnn' has no logit soft-cap "
                                         r"\(attention_softcap=50.0\)"):
        kernels.select("cudnn", **args, softcap=50.0)


# --- GPT-2's scaled residual init -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("init_std", [0.02, None])
def test_scale_residual_init_divides_the_residual_writers_std_by_sqrt_2L(init_std):
    layers = 6
    config = model_config(num_layers=layers, d_model=128, d_ff=512, num_heads=4, num_kv_heads=4,
                          init_std=init_std)
    stds = {}
    for scaled in (False, True):
        config.scale_residual_init = scaled
        model = build_model(config)
        params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens())["params"])
        layer = params["decoder"]["layers_3"]
        stds[scaled] = {name: float(np.std(np.asarray(x))) for name, x in (
            ("out", layer["self_attention"]["out"]), ("wo", layer["mlp"]["wo"]),
            ("query", layer["self_attention"]["query"]), ("wi", layer["mlp"]["wi"]))}
    for name in ("out", "wo"):  # 1 / sqrt(2 L): GPT-2's 0.02 / sqrt(2 n_layer)
        assert stds[True][name] / stds[False][name] == pytest.approx((2 * layers) ** -0.5,
                                                                     rel=0.05), name
    for name in ("query", "wi"):  # the others as they were
        assert stds[True][name] == pytest.approx(stds[False][name], rel=1e-6), name


# --- configuration errors --------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (dict(qk_norm_scope="tensor"), "model.qk_norm_scope='tensor': expected one of 'head', "
                                   "'projection'"),
    (dict(attention_softcap=-1.0), "model.attention_softcap=-1.0: expected a number >= 0 "
                                   "(0: off)"),
    (dict(parallel_block=True, norm_placement="post"),
     "model.parallel_block=True with norm_placement='post': expected 'pre' (one norm feeds "
     "both branches)"),
    (dict(sliding_window_pattern=2), "model.sliding_window_pattern=2: expected a "
                                     "sliding_window"),
    (dict(sliding_window=4, sliding_window_pattern=3, num_layers=4, scan_layers=True),
     "model.sliding_window_pattern=3: with scan_layers, expected a period (3, with "
     "moe.every_n_layers) dividing num_layers=4"),
    (dict(family="bert", final_logit_softcap=30.0),
     "final_logit_softcap=30.0 with family='bert': expected family 'gpt' or 'prefix_lm'"),
])
def test_bad_knob_values_are_one_line_errors(overrides, message):
    config = base_config()
    config.model.update(overrides)
    with pytest.raises(ValueError) as error:
        validate_config(config)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_kernel_without_attention_sinks_is_refused_in_one_line():
    model = build_model(model_config(attention_sinks=True, attention_impl="cudnn"))
    with pytest.raises(ValueError) as error:
        model.init(jax.random.key(0), tokens())
    assert str(error.value) == ("impl='cudnn' has no attention sinks; use impl='chunked' or "
                                "'dense' or 'auto'")


def test_attention_sinks_param_shards_with_the_heads():
    """One `sinks` [N] per attention layer under logical axis `heads`, initialised as gpt-oss
    (normal, std init_std); none without the knob."""
    boxed = build_model(model_config(attention_sinks=True)).init(jax.random.key(0), tokens())
    sinks = boxed["params"]["decoder"]["layers_0"]["self_attention"]["sinks"]
    assert sinks.names == ("heads",) and sinks.value.shape == (4,)
    assert 0 < float(jnp.std(sinks.value)) < 1.0
    plain = build_model(model_config()).init(jax.random.key(0), tokens())
    assert "sinks" not in plain["params"]["decoder"]["layers_0"]["self_attention"]


@pytest.mark.slow
def test_a_gpt_with_attention_sinks_trains_through_the_cli_and_resumes(tmp_path):
    """Two steps with sinks on the chunked kernel, then a resume to four: the saved state has
    the sinks, the first-step line names the kernel, no step trains twice."""
    from test_train import (
        assert_succeeded,
        checkpoint_steps,
        flat,
        load_state,
        run_cli,
        tiny_flags,
        train_losses,
    )

    workdir = tmp_path / "workdir"
    train = lambda steps: run_cli(
        "transformer.train", "--config=experiments/gpt_tiny.py", f"--workdir={workdir}",
        *tiny_flags(steps, checkpoint_every=2), "--config.model.attention_sinks=True",
        "--config.model.attention_impl=chunked", logs=tmp_path / f"logs_{steps}")
    first = train(2)
    assert_succeeded(first)
    assert "attention chunked)" in first.stdout + first.stderr
    sinks = {k: v for k, v in flat(load_state(workdir, 2)["params"]).items() if "sinks" in k}
    assert sinks and all(v.shape == (2,) for v in sinks.values()), sinks.keys()
    assert_succeeded(train(4))
    assert checkpoint_steps(workdir) == [2, 4]
    losses = train_losses(workdir)
    assert sorted(losses) == [1, 2, 3, 4] and all(np.isfinite(list(losses.values())))
