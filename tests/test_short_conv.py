"""LFM2's short convolution (`conv` layers, transformer/nn/mixers/short_conv.py): a float64 NumPy
reference of the formula and Hugging Face's Lfm2ShortConv with the same weights. Whole stacks
with `conv` layers (decoding, packed documents, scan, meshes) are in tests/test_mixer_stacks.py
and tests/mesh_check.py."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from test_model_knobs import model_config

from transformer.models import transformer_config
from transformer.nn.mixers import short_conv

D_MODEL, LENGTH = 16, 7


def layer_and_params(use_bias=True, dtype="float32"):
    config = transformer_config(model_config(d_model=D_MODEL, use_bias=use_bias,
                                             init_std=0.3, layer_types="conv", dtype=dtype,
                                             param_dtype=dtype))
    layer = short_conv.MIXER.layer(config, "conv")
    x = jax.random.normal(jax.random.key(1), (2, LENGTH, D_MODEL), dtype)
    params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    rng = np.random.default_rng(0)  # biases away from their zero init
    params = {k: (v + rng.normal(size=v.shape) if k.endswith("bias") else v).astype(dtype)
              for k, v in params.items()}
    return layer, params, x


def reference(p, x):
    """y_t = (C_t * sum_k w_k (B * x)_{t-K+1+k} + b_conv) W_out + b_out, in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    gate_b, gate_c, inner = (x @ p[n] + p[f"{n}_bias"] for n in ("B", "C", "x"))
    bx = gate_b * inner
    padded = np.pad(bx, ((0, 0), (short_conv.TAPS - 1, 0), (0, 0)))
    conv = sum(p["conv"][k] * padded[:, k:k + x.shape[1]] for k in range(short_conv.TAPS))
    return (gate_c * (conv + p["conv_bias"])) @ p["out"] + p["out_bias"]


def test_the_layer_is_the_formula_in_float64():
    with jax.enable_x64(True):
        layer, params, x = layer_and_params(dtype="float64")
        got = layer.apply({"params": params}, x)
        np.testing.assert_allclose(got, reference(params, x), rtol=1e-12, atol=1e-12)


def test_the_layer_equals_hugging_face_lfm2():
    import torch
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    layer, params, x = layer_and_params()
    hf = Lfm2ShortConv(Lfm2Config(hidden_size=D_MODEL, conv_bias=True, conv_L_cache=3,
                                  num_hidden_layers=1, layer_types=["conv"]), 0).eval()
    t = lambda a: torch.tensor(np.asarray(a))
    with torch.no_grad():  # HF's in_proj rows: B, then C, then x; Linear weights are [out, in]
        hf.in_proj.weight.copy_(t(np.concatenate([params[n].T for n in ("B", "C", "x")])))
        hf.in_proj.bias.copy_(t(np.concatenate([params[f"{n}_bias"] for n in ("B", "C", "x")])))
        hf.conv.weight.copy_(t(params["conv"].T[:, None, :]))
        hf.conv.bias.copy_(t(params["conv_bias"]))
        hf.out_proj.weight.copy_(t(params["out"].T))
        hf.out_proj.bias.copy_(t(params["out_bias"]))
        want = hf(t(x)).numpy()
    np.testing.assert_allclose(layer.apply({"params": params}, x), want, atol=1e-5, rtol=1e-5)


def test_decoding_token_by_token_equals_the_whole_sequence():
    layer, params, x = layer_and_params()
    want = layer.apply({"params": params}, x)
    cache = jax.tree.map(jnp.zeros_like, layer.init(jax.random.key(0), x[:, :1],
                                                    decode=True)["cache"])
    outs = []
    for t in range(LENGTH):
        y, mutated = layer.apply({"params": params, "cache": cache}, x[:, t:t + 1],
                                 decode=True, mutable=["cache"])
        cache = mutated["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, atol=1e-5, rtol=1e-5)
