"""Multi-head latent attention (nn.mixers.mla) against a float64 NumPy reference written from
the DeepSeek-V2 paper's formulas, against Hugging Face's DeepseekV3Attention (YaRN RoPE, both
query parametrisations), and its absorbed latent-cache decode against the full forward."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from transformer.models.gpt import decode_mask
from transformer.nn import kernels, masks, positions
from transformer.nn.config import TransformerConfig
from transformer.nn.mixers import mla
from transformer.nn.mixers.mla import MLAConfig, MLASettings, MultiHeadLatentAttention
from transformer.parallel import sharding

B, T, D, N = 2, 7, 32, 4
SHAPES = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def settings(**overrides) -> MLASettings:
    return MLASettings(**{**dict(num_heads=N, q_lora_rank=16, impl="dense", **SHAPES),
                          **overrides})


def inputs(seed=0, length=T):
    """[B, length, D] float32 NumPy (the layer converts it; NumPy slices compile nothing)."""
    return np.random.default_rng(seed).normal(size=(B, length, D)).astype(np.float32)


def random_params(layer, seed=1, length=T):
    """The layer's params with every leaf random (norm scales around 1), as a plain dict of
    float32 NumPy arrays. Only init's shapes are used (jax.eval_shape: nothing runs)."""
    init = lambda x: layer.init(jax.random.key(0), x)  # noqa: E731
    params = nn.unbox(jax.eval_shape(init, inputs(0, length))["params"])
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if path[-1].key == "scale" or path[-1].key == "sinks":
            return (1 + 0.3 * rng.normal(size=leaf.shape)).astype(np.float32)
        return (rng.normal(size=leaf.shape) / np.sqrt(leaf.shape[0])).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, params)


# --- a float64 reference from the paper (DeepSeek-V2, section 2.1, eqs. 9-19) -------------------


def rms_norm(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def rope_interleaved(x, pos, theta):
    """RoFormer's rotation of the pairs (x_2i, x_2i+1) by pos * theta^(-2i/R), as complex
    numbers."""
    R = x.shape[-1]
    freq = theta ** (-np.arange(R // 2) * 2.0 / R)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, None, None] * freq)
    return np.stack([z.real, z.imag], -1).reshape(x.shape)


def reference_weights(p, x, s: MLASettings):
    """Causal MLA's softmax weights [N, T, T] of one sequence x [T, D], float64, and c^KV
    [T, C] (eqs. 9-18): softmax([q^C; q^R] . [k^C; k^R] / sqrt(P + R)) under the causal mask."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64)
    length, C, P, R = x.shape[0], s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim
    pos = np.arange(length, dtype=np.float64)
    if s.q_lora_rank:
        c_q = rms_norm(x @ p["q_a"], p["q_a_norm"]["scale"], s.norm_epsilon)  # eq. 12
        q = np.einsum("tq,qnk->tnk", c_q, p["q_b"])  # q^C and q^R (eqs. 13, 14)
    else:
        q = np.einsum("td,dnk->tnk", x, p["query"])
    q_c, q_r = q[..., :P], rope_interleaved(q[..., P:], pos, s.rope_theta)
    kv = x @ p["kv_a"]
    c_kv = rms_norm(kv[:, :C], p["kv_a_norm"]["scale"], s.norm_epsilon)  # eq. 9
    k_r = rope_interleaved(kv[:, None, C:], pos, s.rope_theta)[:, 0]  # eq. 15, one for all
    k_c = np.einsum("tc,cnp->tnp", c_kv, p["k_b"])  # eq. 10: k^C = W^UK c^KV
    logits = (np.einsum("tnp,snp->nts", q_c, k_c)
              + np.einsum("tnr,sr->nts", q_r, k_r)) / np.sqrt(P + R)  # eqs. 16-18
    logits = np.where(np.tril(np.ones((length, length), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True), c_kv


def reference_mla(p, x, s: MLASettings):
    """Causal MLA of one sequence x [T, D], float64, head by head."""
    w, c_kv = reference_weights(p, x, s)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    y = np.zeros((x.shape[0], x.shape[1]))
    for h in range(s.num_heads):
        v_c = c_kv @ p["v_b"][:, h]  # eq. 11: v^C = W^UV c^KV
        y += (w[h] @ v_c) @ p["out"][h]  # eq. 19: u = W^O [o_1; ...; o_N]
    return y


@pytest.mark.parametrize("overrides", [
    dict(), dict(q_lora_rank=0), dict(v_head_dim=16),  # V > P + R: q and k padded instead
    dict(impl="chunked"), dict(impl="reference"),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "q_lora")
def test_forward_equals_the_papers_formulas(overrides):
    s = settings(rope_layout="interleaved", rope_theta=100.0, **overrides)
    layer = MultiHeadLatentAttention(s)
    params = random_params(layer)
    x = inputs()
    got = np.asarray(jax.jit(functools.partial(layer.apply, mask=masks.Causal()))(
        {"params": params}, x))
    want = np.stack([reference_mla(params, x[b], s) for b in range(B)])
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert np.abs(want).mean() > 0.1


@pytest.mark.parametrize("overrides", [dict(), dict(q_lora_rank=0, impl="chunked")],
                         ids=["q_lora", "chunked"])
def test_sows_its_softmax_weights_as_attention_does(overrides):
    """With 'intermediates' mutable (what transformer.visualize draws) the layer sows its
    softmax weights [B, N, T, S], the paper's, whatever kernel it names; the output is the same."""
    s = settings(rope_layout="interleaved", rope_theta=100.0, **overrides)
    layer = MultiHeadLatentAttention(s)
    params = random_params(layer)
    x = inputs(5)
    out, state = jax.jit(functools.partial(layer.apply, mask=masks.Causal(),
                                           mutable=["intermediates"]))({"params": params}, x)
    (weights,) = state["intermediates"]["attention_weights"]
    assert weights.shape == (B, N, T, T)
    want = np.stack([reference_weights(params, x[b], s)[0] for b in range(B)])
    np.testing.assert_allclose(np.asarray(weights), want, atol=2e-6)
    assert not np.allclose(want[:, 0], want[:, 1], atol=1e-2)  # the heads differ
    np.testing.assert_allclose(np.asarray(out), np.stack(
        [reference_mla(params, x[b], s) for b in range(B)]), atol=2e-5, rtol=2e-5)


def test_splash_kernel_runs_it_too():
    """Splash (Pallas interpret mode on CPU), which needs lengths of 128: the dense result."""
    s = settings()
    layer = MultiHeadLatentAttention(s)
    params = random_params(layer, length=128)
    x = inputs(3, 128)
    run = lambda impl: np.asarray(jax.jit(functools.partial(  # noqa: E731
        MultiHeadLatentAttention(dataclasses.replace(s, impl=impl)).apply,
        mask=masks.Causal()))({"params": params}, x))
    with kernels.recording() as chosen:
        splash = run("splash")
    assert chosen == ["splash"]
    np.testing.assert_allclose(splash, run("dense"), atol=2e-5, rtol=2e-5)


# --- YaRN ----------------------------------------------------------------------------------------


YARNS = [  # (rope_parameters beyond rope_type and theta, our keys)
    (dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
          mscale=1.0, mscale_all_dim=1.0), {}),  # DeepSeek-V3
    (dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
          mscale_all_dim=0.707), {}),  # DeepSeek-V2
    (dict(factor=8.0, original_max_position_embeddings=512, beta_fast=16, beta_slow=2), {}),
    (dict(factor=32.0, original_max_position_embeddings=4096, truncate=False), {}),  # gpt-oss
]


def hf_deepseek_config(rope, q_lora_rank=16, interleave=True, shapes=SHAPES, theta=100.0):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=D, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=q_lora_rank or
        None, max_position_embeddings=64, rope_interleave=interleave, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="yarn", rope_theta=theta, **rope), **shapes)


def yarn_args(rope) -> dict:
    """Our keyword arguments (apply_rope's) for HF's rope_parameters."""
    return dict(scale=rope["factor"], scaling="yarn",
                original_max_len=rope["original_max_position_embeddings"],
                beta_fast=rope.get("beta_fast", 32.0), beta_slow=rope.get("beta_slow", 1.0),
                mscale=rope.get("mscale", 1.0), mscale_all_dim=rope.get("mscale_all_dim", 0.0),
                truncate=rope.get("truncate", True))


@pytest.mark.parametrize("rope", [r for r, _ in YARNS], ids=range(len(YARNS)))
def test_yarn_frequencies_and_mscale_equal_hugging_faces(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    shapes = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=64, v_head_dim=8)
    config = hf_deepseek_config(rope, shapes=shapes, theta=10000.0)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = yarn_args(rope)
    freq = positions.rope_frequencies(64, theta=10000.0, **{
        k: ours[k] for k in ("scale", "scaling", "original_max_len", "beta_fast", "beta_slow",
                             "truncate")})
    np.testing.assert_allclose(freq, inv_freq.numpy(), rtol=1e-6)
    assert not np.allclose(freq, positions.rope_frequencies(64, theta=10000.0))  # it scales
    factor = positions.rope_attention_factor("yarn", ours["scale"], ours["mscale"],
                                             ours["mscale_all_dim"])
    assert factor == pytest.approx(attention_factor, rel=1e-12)
    s = settings(qk_rope_head_dim=64, rope_scale=ours["scale"], rope_scaling="yarn",
                 rope_yarn_mscale_all_dim=ours["mscale_all_dim"])
    hf_scale = DeepseekV3Attention(config, layer_idx=0).scaling
    assert s.softmax_scale == pytest.approx(hf_scale, rel=1e-12)


def test_yarn_with_factor_one_is_plain_rope():
    plain = positions.rope_frequencies(16, theta=500.0)
    np.testing.assert_allclose(positions.rope_frequencies(16, theta=500.0, scaling="yarn"),
                               plain, rtol=1e-15)
    assert positions.rope_attention_factor("yarn", 1.0, 0.5, 0.7) == 1.0


# --- Hugging Face's DeepseekV3Attention -----------------------------------------------------------


def hf_params(attention, q_lora_rank, s: MLASettings) -> dict:
    """DeepseekV3Attention's weights as this layer's params (the layer docstring's reshapes)."""
    w = {k: v.detach().numpy().astype(np.float32) for k, v in attention.state_dict().items()}
    C, P, V, K = s.kv_lora_rank, s.qk_nope_head_dim, s.v_head_dim, s.qk_head_dim
    kv_b = w["kv_b_proj.weight"].reshape(N, P + V, C)
    params = {"kv_a": w["kv_a_proj_with_mqa.weight"].T,
              "kv_a_norm": {"scale": w["kv_a_layernorm.weight"]},
              "k_b": kv_b[:, :P].transpose(2, 0, 1), "v_b": kv_b[:, P:].transpose(2, 0, 1),
              "out": w["o_proj.weight"].T.reshape(N, V, D)}
    if q_lora_rank:
        params.update(q_a=w["q_a_proj.weight"].T, q_a_norm={"scale": w["q_a_layernorm.weight"]},
                      q_b=w["q_b_proj.weight"].T.reshape(q_lora_rank, N, K))
    else:
        params["query"] = w["q_proj.weight"].T.reshape(D, N, K)
    return params


@pytest.mark.parametrize("q_lora_rank", [0, 16])
@pytest.mark.parametrize("interleave", [True, False])
def test_equals_hugging_faces_deepseek_v3_attention(q_lora_rank, interleave):
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    rope = dict(factor=4.0, original_max_position_embeddings=16, beta_fast=8, beta_slow=1,
                mscale=0.8, mscale_all_dim=0.5)  # an attention factor and an mscale^2
    config = hf_deepseek_config(rope, q_lora_rank, interleave)
    config._attn_implementation = "eager"
    torch.manual_seed(q_lora_rank + interleave)
    attention = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5 if param.ndim == 2
                        else 1 + 0.3 * torch.randn_like(param))
    x = np.random.default_rng(5).normal(size=(B, T, D)).astype(np.float32)
    position_ids = torch.arange(T)[None].expand(B, T) + 20  # past original_max_position
    hidden = torch.from_numpy(x)
    cos_sin = DeepseekV3RotaryEmbedding(config)(hidden, position_ids)
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        want = attention(hidden, cos_sin, causal.expand(B, 1, T, T))[0].numpy()

    ours = yarn_args(rope)
    s = settings(q_lora_rank=q_lora_rank, rope_theta=100.0, norm_epsilon=1e-6,
                 rope_layout="interleaved" if interleave else "half", rope_scale=ours["scale"],
                 rope_scaling="yarn", rope_original_max_len=16, rope_yarn_beta_fast=8.0,
                 rope_yarn_mscale=0.8, rope_yarn_mscale_all_dim=0.5)
    layer = MultiHeadLatentAttention(s)
    got = jax.jit(functools.partial(layer.apply, mask=masks.Causal()))(
        {"params": hf_params(attention, q_lora_rank, s)}, x,
        q_positions=position_ids.numpy())
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


# --- decode: the absorbed latent cache ------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    dict(sinks=True), dict(q_lora_rank=0, sinks=True, softcap=3.0, impl="chunked"),
    dict(rope_scaling="yarn", rope_scale=4.0, rope_original_max_len=4,
         rope_yarn_mscale_all_dim=1.0),
], ids=["sinks", "softcap-chunked", "yarn"])
def test_absorbed_latent_cache_decode_equals_the_full_forward(overrides):
    s = settings(**overrides)
    layer = MultiHeadLatentAttention(s)
    params = random_params(layer)
    x = inputs(7)
    full = np.asarray(jax.jit(functools.partial(layer.apply, mask=masks.Causal()))(
        {"params": params}, x))

    slots = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    cache = jax.eval_shape(lambda x, slots: layer.init(
        jax.random.key(0), x, q_positions=slots, decode=True), x, slots)["cache"]
    assert jax.tree.map(lambda a: a.shape, cache) == {"latent": (B, T, 12 + 4)}  # C + R only
    cache = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), cache)

    @jax.jit
    def step(cache, x_BT, positions_BT):
        mask, _ = decode_mask(positions_BT, T)
        return layer.apply({"params": params, "cache": cache}, x_BT, mask=mask,
                           q_positions=positions_BT, decode=True, mutable=["cache"])

    prompt = 3
    out, mutated = step(cache, x[:, :prompt], slots[:, :prompt])  # prefill
    got = [np.asarray(out)]
    for t in range(prompt, T):
        out, mutated = step(mutated["cache"], x[:, t:t + 1], slots[:, t:t + 1])
        got.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(got, 1), full, atol=2e-5, rtol=2e-5)


def test_a_quantized_models_decode_equals_its_forward():
    """model.quantization=fp8 (Qwix): the absorbed decode's W_uk and W_uv products are float,
    so the training forward's are too (they went through the quantized projection: 9% of the
    largest logit apart)."""
    from transformer.configs import base_config
    from transformer.models import build_model

    config = base_config()
    config.model.update(family="gpt", num_layers=2, d_model=32, num_heads=4, d_ff=64,
                        vocab_size=64, max_len=16, position="rope", attention_kind="mla",
                        quantization="fp8")
    config.model.mla.update(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=8)
    model = build_model(config.model)
    ids = np.random.default_rng(0).integers(0, 64, (2, 8)).astype(np.int32)
    slots = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    params = jax.jit(model.init)(jax.random.key(0), ids)["params"]
    full = jax.jit(model.apply)({"params": params}, ids)
    cache = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, positions=slots,
                                              decode=True, cache_length=8))["cache"]
    cache = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), cache)
    prefill, _ = jax.jit(lambda p, c: model.apply(
        {"params": p, "cache": c}, ids, positions=slots, decode=True, cache_length=8,
        mutable=["cache"]))(params, cache)
    np.testing.assert_allclose(prefill, full, atol=1e-5 * float(np.abs(full).max()), rtol=0)


# --- the config group, the settings and the registry's record ------------------------------------


class _Config:
    """A TransformerConfig with the `mla` group (the registry's wiring adds the field)."""

    def __init__(self, mla_config=None, **fields):
        self.mla, self._config = mla_config or MLAConfig(), TransformerConfig(**fields)

    def __getattr__(self, name):
        return getattr(self._config, name)


def test_cache_bytes_per_token_against_gqa_and_the_actual_cache():
    v3 = _Config(d_model=7168, num_heads=128, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert mla.cache_bytes_per_token(v3) == (512 + 64) * 2  # DeepSeek-V3's 576 values
    assert mla.gqa_cache_bytes_per_token(v3) == 2 * 8 * 128 * 2  # 8 KV heads: 3.6x more
    full_mha = _Config(d_model=7168, num_heads=128, head_dim=128, dtype="bfloat16")
    assert mla.gqa_cache_bytes_per_token(full_mha) / mla.cache_bytes_per_token(v3) == \
        pytest.approx(2 * 128 * 128 / 576)  # 57x

    small = _Config(MLAConfig(**SHAPES), d_model=D, num_heads=N)
    layer = mla.MIXER.layer(small, "self_attention")
    cache = jax.eval_shape(lambda x: layer.init(
        jax.random.key(0), x, decode=True, q_positions=np.arange(T)[None]), inputs(0))["cache"]
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert nbytes == B * T * mla.cache_bytes_per_token(small)


def test_settings_from_config():
    cfg = _Config(MLAConfig(q_lora_rank=16, **SHAPES), d_model=D, num_heads=N,
                  rope_scaling="yarn", rope_scale=40.0, rope_yarn_mscale_all_dim=1.0,
                  rope_yarn_truncate=False, attention_sinks=True, attention_impl="chunked",
                  norm_epsilon=1e-6, use_bias=False)
    s = MLASettings.from_config(cfg)
    assert (s.num_heads, s.q_lora_rank, s.kv_lora_rank, s.v_head_dim) == (N, 16, 12, 6)
    assert (s.rope_scaling, s.rope_scale, s.rope_yarn_truncate) == ("yarn", 40.0, False)
    assert s.sinks and s.impl == "chunked" and not s.qkv_bias and s.norm_epsilon == 1e-6
    assert s.softmax_scale == pytest.approx(12**-0.5 * (0.1 * np.log(40.0) + 1) ** 2)
    mup = _Config(MLAConfig(**SHAPES), d_model=64, num_heads=N, parametrization="mup",
                  mup_base_width=16)
    assert MLASettings.from_config(mup).softmax_scale == pytest.approx(12**-0.5 / 2)


def test_config_checks_and_refusals():
    with pytest.raises(ValueError, match=r"^mla.qk_rope_head_dim=5: expected an even int"):
        MLAConfig(qk_rope_head_dim=5)
    with pytest.raises(ValueError, match=r"^mla.q_lora_rank=48: expected a low rank, <= "
                       r"d_model=32$"):
        MLAConfig(q_lora_rank=48).check(_Config(d_model=D))
    with pytest.raises(ValueError, match="position='alibi': expected 'rope'"):
        MLAConfig(kv_lora_rank=8).check(_Config(d_model=D, position="alibi"))
    MLAConfig(kv_lora_rank=8, q_lora_rank=32).check(_Config(d_model=D))
    # an output gate or q/k norm MLA has no place for: refused, where both were silently idle
    for name, value in (("attention_gate", "head"), ("qk_norm", True)):
        with pytest.raises(ValueError, match=rf"^{name}={value!r} with attention_kind='mla': "
                                             "expected it off"):
            MLAConfig(kv_lora_rank=8).check(_Config(d_model=D, **{name: value}))

    cudnn = _Config(dtype="bfloat16", attention_impl="cudnn")
    assert "head_dim <= 128" in mla.refuses(cudnn, {})  # 192 wide in training
    small = _Config(MLAConfig(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                              v_head_dim=64), dtype="bfloat16", attention_impl="cudnn")
    assert mla.refuses(small, {}) is None  # 64 and 96 wide
    assert mla.refuses(_Config(), {"sequence": 4}) is None
    assert mla.MIXER.decode_state == "latent cache" and mla.MIXER.config is MLAConfig
    assert mla.MIXER.flops_per_token(_Config(), 100) == 6 * 4 * (192 + 128) * 100


def test_up_projections_split_over_fsdp():
    """On fsdp=4 (an abstract mesh: no devices needed) q_b, k_b and v_b [latent_in, heads, kv]
    split their input axis over fsdp as embed is split (they were whole on every device: for
    DeepSeek-V3 55M params a layer), while q_a and kv_a keep their latent output whole; each
    device holds the norm scales and a quarter of every other param."""
    layer = MultiHeadLatentAttention(settings())
    boxed = jax.eval_shape(lambda x: layer.init(jax.random.key(0), x), inputs())["params"]
    mesh = AbstractMesh(tuple(4 if a == "fsdp" else 1 for a in sharding.MESH_AXES),
                        sharding.MESH_AXES)
    shardings = sharding.logical_shardings(boxed, mesh)
    embed = ("fsdp", "expert", "sequence")
    for name in ("q_b", "k_b", "v_b"):
        assert shardings[name].spec == PartitionSpec(embed, "tensor", None), name
    for name in ("q_a", "kv_a"):
        assert shardings[name].spec == PartitionSpec(embed, None), name
    params = nn.unbox(boxed)
    nbytes = {k: v.size * v.dtype.itemsize for k, v in params.items() if "norm" not in k}
    norms = sum(x.size * x.dtype.itemsize
                for k in ("q_a_norm", "kv_a_norm") for x in jax.tree.leaves(params[k]))
    assert sharding.bytes_per_device(params, shardings) == norms + sum(nbytes.values()) // 4
