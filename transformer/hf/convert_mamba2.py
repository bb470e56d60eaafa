"""Hugging Face's Mamba 2 (`mamba2`) in and out of `DecoderLM`: every layer a `mamba2` mixer
(transformer.nn.mixers.mamba2) behind an RMSNorm, no feed-forward sublayer (`model.d_ff=0`)
and no positions. `convert.from_hf` dispatches here, and `export.to_hf` to `to_hf`."""

from __future__ import annotations

import math

import ml_collections
import numpy as np

from transformer.hf.common import Checkpoint, head_tied, maybe_scan, model_config

NO_LIMIT = 0.0  # our time_step_limit_max for HF's (0, inf)


def mamba2(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Mamba2ForCausalLM / Mamba2Model -> (config for `DecoderLM`, params). Settings this model
    cannot represent are refused, naming them."""
    d, heads, width = hf_config.hidden_size, hf_config.num_heads, hf_config.head_dim
    if heads * width != hf_config.expand * d:
        raise ValueError(f"mamba2 num_heads={heads} x head_dim={width}: expected expand x "
                         f"hidden_size = {hf_config.expand * d}")
    if getattr(hf_config, "use_bias", False):
        raise ValueError("mamba2 use_bias=True: expected False (no bias on in_proj / out_proj)")
    if (act := getattr(hf_config, "hidden_act", "silu")) != "silu":
        raise ValueError(f"mamba2 hidden_act={act!r}: expected 'silu' (the convolution's "
                         "activation)")
    low, high = (float(x) for x in getattr(hf_config, "time_step_limit", (0.0, math.inf)))
    mixer = dict(state_size=hf_config.state_size, expand=hf_config.expand, head_dim=width,
                 num_groups=hf_config.n_groups, conv_kernel=hf_config.conv_kernel,
                 use_conv_bias=bool(hf_config.use_conv_bias),
                 # HF's Mamba 2 gates before its norm whatever config.json says (Codestral's
                 # says norm_before_gate: true), and its outputs are the reference
                 norm_before_gate=False,
                 time_step_min=float(hf_config.time_step_min),
                 time_step_max=float(hf_config.time_step_max),
                 time_step_floor=float(hf_config.time_step_floor),
                 time_step_limit_min=low,
                 time_step_limit_max=NO_LIMIT if math.isinf(high) else high)
    root = "backbone." if any(k.startswith("backbone.") for k in state_dict) else ""
    tie = head_tied(bool(getattr(hf_config, "tie_word_embeddings", True)), state_dict,
                    f"{root}embeddings.weight")
    config = model_config(
        family="gpt", vocab_size=hf_config.vocab_size, tie_embeddings=tie,
        head="none" if not tie and "lm_head.weight" not in state_dict else "mlm",
        num_layers=hf_config.num_hidden_layers, d_model=d, num_heads=1, d_ff=0,
        layer_types="mamba2", mamba2=mixer, position="none", norm="rmsnorm",
        norm_epsilon=hf_config.layer_norm_epsilon, use_bias=False, max_len=1 << 17,
        init_std=hf_config.initializer_range, dropout_rate=0.0)
    ckpt = Checkpoint(state_dict, ("lm_head.weight",) if tie else (), dtype)
    decoder = {"final_norm": {"scale": ckpt(f"{root}norm_f.weight")}}
    for i in range(config.num_layers):
        p = f"{root}layers.{i}."
        decoder[f"layers_{i}"] = {
            "mamba2_norm": {"scale": ckpt(p + "norm.weight")},
            "mamba2": mixer_params(ckpt, p + "mixer.", heads, width, hf_config.n_groups,
                                   hf_config.state_size)}
    params = {"embed": {"embedding": ckpt(f"{root}embeddings.weight")}, "decoder": decoder}
    if config.head != "none" and not tie:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, maybe_scan(config, params, "decoder")


def mixer_params(ckpt: Checkpoint, prefix: str, heads: int, width: int, groups: int,
                 state: int) -> dict[str, np.ndarray]:
    """`mamba2.Mamba2`'s params from Mamba2Mixer's tensors: the rows of the fused in_proj
    [z, x, B, C, dt] and of the depthwise conv1d [x, B, C], split, transposed and reshaped per
    head (x, z: [heads, head_dim]) or group (B, C: [groups, state]); the in_proj's dt bias, if
    any, folded into dt_bias; the gated norm's weight per head."""
    inner, gn = heads * width, groups * state
    w = ckpt(prefix + "in_proj.weight", True)  # [D, rows]
    d_model = w.shape[0]
    bias = ckpt(prefix + "in_proj.bias") if ckpt.has(prefix + "in_proj.bias") else \
        np.zeros(w.shape[1], w.dtype)
    cut = np.cumsum([inner, inner, gn, gn])
    (z, x, b, c, dt), (zb, xb, bb, cb, dtb) = np.split(w, cut, axis=1), np.split(bias, cut)
    conv = ckpt(prefix + "conv1d.weight")[:, 0].T  # [K, E + 2 G N]
    hp, gs = (heads, width), (groups, state)
    params = {"z": z.reshape(d_model, *hp), "x": x.reshape(d_model, *hp),
              "B": b.reshape(d_model, *gs), "C": c.reshape(d_model, *gs), "dt": dt,
              "A_log": ckpt(prefix + "A_log"), "D": ckpt(prefix + "D"),
              "dt_bias": ckpt(prefix + "dt_bias") + dtb,
              "norm": ckpt(prefix + "norm.weight").reshape(hp),
              "out": ckpt(prefix + "out_proj.weight", True).reshape(*hp, d_model)}
    for name, part, shape in zip(("x", "B", "C"), np.split(conv, [inner, inner + gn], axis=1),
                                 (hp, gs, gs), strict=True):
        params[f"conv_{name}"] = part.reshape(-1, *shape)
    if ckpt.has(prefix + "conv1d.bias"):
        for name, part, shape in zip(("x", "B", "C"), np.split(ckpt(prefix + "conv1d.bias"),
                                                               [inner, inner + gn]),
                                     (hp, gs, gs), strict=True):
            params[f"conv_{name}_bias"] = part.reshape(shape)
    if ckpt.has(prefix + "in_proj.bias"):
        params.update(z_bias=zb.reshape(hp), x_bias=xb.reshape(hp), B_bias=bb.reshape(gs),
                      C_bias=cb.reshape(gs))
    if ckpt.has(prefix + "out_proj.bias"):
        params["out_bias"] = ckpt(prefix + "out_proj.bias")
    return params


def exporter():
    """Mamba 2's allowlist (`allowlist.check`): a GPT of `mamba2` layers alone, no positions,
    no feed-forward sublayer, pre-RMSNorm, no projection biases."""
    from transformer.hf.allowlist import ANY, SHAPES, Exporter

    return Exporter("mamba2", "Mamba 2", {
        "family": ("gpt",), "head": ("mlm",), "position": ("none",), "norm": ("rmsnorm",),
        "norm_placement": ("pre",), "layer_types": ("mamba2",), **SHAPES, "d_ff": (0,),
        "use_bias": (False,), "tie_embeddings": ANY, "mamba2.norm_before_gate": (False,),
        "activation": ANY,  # the feed-forward sublayer's, and d_ff 0 leaves none to use it
        **{f"mamba2.{key}": ANY for key in (
            "state_size", "expand", "head_dim", "num_groups", "conv_kernel", "use_conv_bias",
            "time_step_limit_min", "time_step_limit_max")}})


def to_hf(config, params, transformers):
    """(Mamba2Config, state dict) of a Mamba 2 stack: the inverse of `mamba2` above."""
    m = config.mamba2
    inner = m.expand * config.d_model
    heads = inner // m.head_dim
    limit = (float(m.time_step_limit_min), float(m.time_step_limit_max) or math.inf)
    hf_config = transformers.Mamba2Config(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        num_hidden_layers=config.num_layers, state_size=m.state_size, expand=m.expand,
        head_dim=m.head_dim, num_heads=heads, n_groups=m.num_groups, conv_kernel=m.conv_kernel,
        use_conv_bias=m.use_conv_bias, norm_before_gate=m.norm_before_gate, use_bias=False,
        time_step_min=m.time_step_min, time_step_max=m.time_step_max,
        time_step_floor=m.time_step_floor, time_step_limit=limit,
        layer_norm_epsilon=config.norm_epsilon, tie_word_embeddings=config.tie_embeddings,
        initializer_range=config.init_std or 0.02, architectures=["Mamba2ForCausalLM"])
    decoder = params["decoder"]
    out = {"backbone.embeddings.weight": params["embed"]["embedding"],
           "backbone.norm_f.weight": decoder["final_norm"]["scale"]}
    for i in range(config.num_layers):
        layer, p = decoder[f"layers_{i}"], f"backbone.layers.{i}."
        out[p + "norm.weight"] = layer["mamba2_norm"]["scale"]
        out.update(_mixer_state(layer["mamba2"], p + "mixer.", config.d_model))
    if not config.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    return hf_config, out


def _mixer_state(mixer: dict, prefix: str, d_model: int) -> dict[str, np.ndarray]:
    """Mamba2Mixer's tensors from this layer's params (the inverse of `mixer_params`)."""
    flat = lambda name: mixer[name].reshape(d_model, -1)
    conv = np.concatenate([mixer[f"conv_{n}"].reshape(mixer["conv_x"].shape[0], -1)
                           for n in ("x", "B", "C")], axis=1)  # [K, channels]
    state = {prefix + "in_proj.weight": np.concatenate(
                 [flat("z"), flat("x"), flat("B"), flat("C"), mixer["dt"]], axis=1).T,
             prefix + "conv1d.weight": conv.T[:, None, :],
             prefix + "A_log": mixer["A_log"], prefix + "D": mixer["D"],
             prefix + "dt_bias": mixer["dt_bias"],
             prefix + "norm.weight": mixer["norm"].reshape(-1),
             prefix + "out_proj.weight": mixer["out"].reshape(-1, d_model).T}
    if "conv_x_bias" in mixer:
        state[prefix + "conv1d.bias"] = np.concatenate(
            [mixer[f"conv_{n}_bias"].reshape(-1) for n in ("x", "B", "C")])
    return state
