"""Gated attention (`model.attention_gate`, Qwen3-Next): a float64 NumPy reference of the whole
layer (forward and gradients, per head and per element, GQA, cross-attention), Hugging Face's
Qwen3NextAttention, KV-cache decoding, a scanned stack, the params' sharding and the errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec
from test_decode_cache import cached_logits
from test_model_knobs import model_config, perturbed, tokens

from transformer.configs import base_config, validate_config
from transformer.models import build_model
from transformer.nn import masks
from transformer.nn.attention import AttentionSettings, MultiHeadAttention
from transformer.nn.layers import stack_layers
from transformer.parallel import sharding

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LENGTH = 16, 4, 2, 8, 6
MODES = ["head", "element"]


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def reference_layer(p, x, memory=None, causal=True, gate=True):
    """The layer in float64 from the formula: per query head n (reading KV head n // G),
    o_n = softmax(q_n k^T / sqrt(H)) v, then y = sum_n (o_n * sigmoid(x W_gate + b)_n) W_o[n]
    + b_o, the gate a scalar per head ([D, N] kernel) or per element ([D, N, H])."""
    kv_in = x if memory is None else memory
    q = np.einsum("btd,dnh->btnh", x, p["query"]) + p["query_bias"]
    k = np.einsum("bsd,dkh->bskh", kv_in, p["key"]) + p["key_bias"]
    v = np.einsum("bsd,dkh->bskh", kv_in, p["value"]) + p["value_bias"]
    k, v = (np.repeat(a, HEADS // a.shape[2], axis=2) for a in (k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(HEAD_DIM)
    if causal:
        t, s = np.arange(q.shape[1]), np.arange(k.shape[1])
        logits = np.where(s[None, :] <= t[:, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", weights, v)
    if gate:
        g = sigmoid(np.einsum("btd,d...->bt...", x, p["gate"]) + p["gate_bias"])
        out = out * (g if g.ndim == 4 else g[..., None])
    return np.einsum("btnh,nhd->btd", out, p["out"]) + p["out_bias"]


def gated_layer(mode, seed=0, **kwargs):
    """The layer (biases on, GQA), its params as float32 and float64 with every bias and the
    gate kernel away from their init, and an input."""
    layer = MultiHeadAttention(AttentionSettings(num_heads=HEADS, head_dim=HEAD_DIM,
                                                 num_kv_heads=KV_HEADS, use_bias=True,
                                                 gate=mode, **kwargs))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, LENGTH, D_MODEL)).astype(np.float32)
    memory = (x[:, :4],) if kwargs.get("cross") else ()
    params = nn.unbox(jax.jit(layer.init)(jax.random.key(seed + 1), x, *memory)["params"])
    params = {k: (np.asarray(v) + 0.5 * rng.standard_normal(v.shape)).astype(np.float32)
              for k, v in params.items()}
    return layer, params, x


@pytest.mark.parametrize("mode", MODES)
def test_the_gated_layer_equals_the_float64_reference_forward_and_backward(mode):
    layer, params, x = gated_layer(mode)
    assert params["gate"].shape == ((D_MODEL, HEADS, HEAD_DIM) if mode == "element"
                                    else (D_MODEL, HEADS))
    p64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x64 = np.asarray(x, np.float64)
    want = reference_layer(p64, x64)
    probe = np.random.default_rng(5).standard_normal(want.shape)

    @jax.jit
    def forward_and_backward(p, x):  # y and the gradients of <probe, y>
        y, backward = jax.vjp(lambda p, x: layer.apply({"params": p}, x, mask=masks.Causal()),
                              p, x)
        return y, backward(jnp.asarray(probe, y.dtype))

    got, (grads, grad_x) = forward_and_backward(params, x)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    assert np.abs(want - reference_layer(p64, x64, gate=False)).max() > 0.1  # the gate acts
    # Gradients of <probe, y> against the reference's directional derivatives (central
    # differences in float64), for every param and the input.
    rng, eps = np.random.default_rng(6), 1e-6
    for name, grad in [*grads.items(), ("input", grad_x)]:
        value = x64 if name == "input" else p64[name]
        direction = rng.standard_normal(value.shape)
        moved = [value + sign * eps * direction for sign in (1, -1)]
        ys = [reference_layer(p64, m) if name == "input" else
              reference_layer({**p64, name: m}, x64) for m in moved]
        want_slope = np.sum((ys[0] - ys[1]) * probe) / (2 * eps)
        got_slope = float(np.sum(np.asarray(grad, np.float64) * direction))
        assert got_slope == pytest.approx(want_slope, rel=1e-4, abs=1e-4), name


@pytest.mark.parametrize("mode", MODES)
def test_cross_attention_gates_from_the_query_side_and_decodes_as_it_recomputes(mode):
    layer, params, x = gated_layer(mode, seed=2, cross=True)
    memory = np.random.default_rng(7).standard_normal((2, 4, D_MODEL)).astype(np.float32)

    @jax.jit
    def full_and_decoded(params, x, memory):
        cache = layer.init(jax.random.key(0), x[:, :1], memory, decode=True)["cache"]
        steps = []
        for t in range(LENGTH):  # the memory only at the first step; then the cached K/V
            out, mutated = layer.apply({"params": params, "cache": cache}, x[:, t:t + 1],
                                       memory if t == 0 else None, decode=True,
                                       mutable=["cache"])
            cache = mutated["cache"]
            steps.append(out[:, 0])
        return layer.apply({"params": params}, x, memory), jnp.stack(steps, 1)

    full, decoded = map(np.asarray, full_and_decoded(params, x, memory))
    want = reference_layer({k: np.asarray(v, np.float64) for k, v in params.items()},
                           np.asarray(x, np.float64), np.asarray(memory, np.float64), False)
    np.testing.assert_allclose(full, want, atol=2e-5, rtol=2e-5)
    for t in range(LENGTH):
        np.testing.assert_allclose(decoded[:, t], full[:, t], atol=2e-5)


def test_the_element_gate_is_hugging_faces_qwen3_next_gate_by_the_documented_reshape():
    """Our layer (no RoPE, per-head q/k norms of scale 1) with query and gate cut out of HF's
    fused q_proj as `MultiHeadAttention._gated` says gives Qwen3NextAttention's output."""
    torch = pytest.importorskip("torch")
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    config = qwen3_next.Qwen3NextConfig(hidden_size=D_MODEL, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                        rms_norm_eps=1e-6, attn_implementation="eager")
    torch.manual_seed(0)
    hf = qwen3_next.Qwen3NextAttention(config, layer_idx=3).eval()
    x = np.random.default_rng(3).standard_normal((2, LENGTH, D_MODEL)).astype(np.float32)
    causal = torch.triu(torch.full((LENGTH, LENGTH), float("-inf")), 1)[None, None]
    no_rope = (torch.ones(2, LENGTH, HEAD_DIM), torch.zeros(2, LENGTH, HEAD_DIM))
    with torch.no_grad():
        want = hf(torch.from_numpy(x), no_rope, causal)[0].numpy()
    w = lambda m: m.weight.detach().numpy()
    fused = w(hf.q_proj).reshape(HEADS, 2, HEAD_DIM, D_MODEL)  # each head: H query, H gate rows
    params = {"query": fused[:, 0].transpose(2, 0, 1), "gate": fused[:, 1].transpose(2, 0, 1),
              "key": w(hf.k_proj).reshape(KV_HEADS, HEAD_DIM, D_MODEL).transpose(2, 0, 1),
              "value": w(hf.v_proj).reshape(KV_HEADS, HEAD_DIM, D_MODEL).transpose(2, 0, 1),
              "out": w(hf.o_proj).T.reshape(HEADS, HEAD_DIM, D_MODEL),
              "query_norm": {"scale": np.ones(HEAD_DIM, np.float32)},
              "key_norm": {"scale": np.ones(HEAD_DIM, np.float32)}}
    layer = MultiHeadAttention(AttentionSettings(num_heads=HEADS, head_dim=HEAD_DIM,
                                                 num_kv_heads=KV_HEADS, qk_norm="head",
                                                 gate="element"))
    got = jax.jit(lambda p, x: layer.apply({"params": p}, x, mask=masks.Causal()))(params, x)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", MODES)
def test_cached_decoding_of_a_gated_gqa_lm_equals_full_recomputation(mode):
    model = build_model(model_config(attention_gate=mode))
    sequence = tokens()
    params = perturbed(jax.tree.map(np.asarray, nn.unbox(
        jax.jit(model.init)(jax.random.key(0), sequence)["params"])))
    assert "gate" in params["decoder"]["layers_0"]["self_attention"]
    full = np.asarray(jax.jit(model.apply)({"params": params}, sequence))
    cached = cached_logits(model, params, sequence, [3, 6])
    np.testing.assert_allclose(cached, full, atol=3e-5, rtol=3e-5)


def test_a_scanned_gated_stack_equals_the_unrolled_one_and_its_gate_shards_over_tensor():
    sequence = tokens()
    unrolled = build_model(model_config(attention_gate="element"))
    params = nn.unbox(jax.jit(unrolled.init)(jax.random.key(0), sequence)["params"])
    want = np.asarray(jax.jit(unrolled.apply)({"params": params}, sequence))
    scanned = build_model(model_config(attention_gate="element", scan_layers=True))
    boxed = jax.eval_shape(scanned.init, jax.random.key(0), sequence)["params"]
    gate = boxed["decoder"]["layers"]["self_attention"]["gate"]
    assert gate.names == ("layers", "embed", "heads", "kv")
    # tensor=4 splits the gate's heads as it does the query's
    mesh = AbstractMesh((1, 1, 1, 1, 1, 4), sharding.MESH_AXES)
    query = boxed["decoder"]["layers"]["self_attention"]["query"]
    specs = [sharding.mesh_spec(PartitionSpec(*p.names), p.value.shape, mesh,
                                sharding.LOGICAL_AXIS_RULES) for p in (gate, query)]
    assert specs[0] == specs[1] and specs[0][2] == "tensor", specs
    got = jax.jit(lambda p, s: scanned.apply(
        {"params": {**p, "decoder": stack_layers(dict(p["decoder"]), 2)}}, s))(params, sequence)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_a_bad_gate_is_a_one_line_error():
    config = base_config()
    config.model.attention_gate = "scalar"
    with pytest.raises(ValueError) as error:
        validate_config(config)
    message = str(error.value)
    assert "model.attention_gate='scalar': expected one of '', 'head', 'element'" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"gate='scalar': expected '', 'head' or 'element'"):
        jax.eval_shape(  # traced, not run: the error comes at the gate's kernel
            MultiHeadAttention(AttentionSettings(num_heads=2, head_dim=4, gate="scalar")).init,
            jax.random.key(0), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32))


def test_lora_targets_the_gate_by_name_and_not_by_default():
    def adapted(**lora):
        model = build_model(model_config(attention_gate="head", lora=dict(rank=2, **lora)))
        shapes = jax.eval_shape(model.init, jax.random.key(0), tokens())["params"]
        return {k for k in shapes["decoder"]["layers_0"]["self_attention"] if "_lora_" in k}
    assert "gate_lora_a" not in adapted()
    assert adapted(targets=r"attention/(query|gate)$") == {
        "query_lora_a", "query_lora_b", "gate_lora_a", "gate_lora_b"}
