"""Import Hugging Face's Qwen3-Next (`qwen3_next`) into `DecoderLM`: Gated DeltaNet layers
(`linear_attention`, transformer.nn.mixers.gated_deltanet) with one full-attention layer in
four, that attention gated per element (`model.attention_gate="element"`) with partial RoPE
(`model.rope_fraction`), zero-centred RMSNorms (weight + 1, as Gemma's), and experts with a
gated shared expert in every layer. `convert.from_hf` dispatches here, `export.to_hf` to
`to_hf`."""

from __future__ import annotations

import ml_collections
import numpy as np

from transformer.hf.common import Checkpoint, maybe_scan, split_heads
from transformer.hf.convert_llama import (
    LLAMA_LIKE,
    _llama_like_config,
    _moe,
    _moe_params,
    mlp_params,
)


def qwen3_next(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict,
                                                                  dict]:
    """Qwen3NextForCausalLM / Qwen3NextModel -> (config for `DecoderLM`, params). Settings
    this model cannot represent are refused, naming them."""
    types = list(hf_config.layer_types)
    if set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"qwen3_next layer_types={types}: expected linear_attention and "
                         "full_attention layers")
    g, n = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    k, v = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
    linear = dict(num_key_heads=g, num_value_heads=n, key_head_dim=k, value_head_dim=v,
                  conv_kernel=hf_config.linear_conv_kernel_dim)
    fraction = float((hf_config.rope_parameters or {}).get("partial_rotary_factor", 1.0))
    config = _llama_like_config("Qwen3Next", hf_config, state_dict, layer_types=",".join(types),
                                linear_attention=linear, attention_gate="element",
                                rope_fraction=fraction, moe=_moe("Qwen3Next", hf_config))
    heads, d = config.num_heads, config.d_model
    kv, head_dim = config.num_kv_heads or heads, config.head_dim or d // heads
    root = "model." if any(key.startswith("model.") for key in state_dict) else ""
    ckpt = Checkpoint(state_dict, ("lm_head.weight",) if config.tie_embeddings else (), dtype)
    offset = LLAMA_LIKE["Qwen3Next"].norm_offset
    norm = lambda name: {"scale": ckpt(name) + offset}
    decoder = {"final_norm": norm(f"{root}norm.weight")}
    for i, kind in enumerate(types):
        p = f"{root}layers.{i}."
        mixer = "self_attention" if kind == "full_attention" else "linear_attention"
        params = _attention(ckpt, p + "self_attn.", heads, kv, head_dim, d) \
            if kind == "full_attention" else _gated_deltanet(ckpt, p + "linear_attn.", g, n, k, v)
        every = config.moe.every_n_layers
        decoder[f"layers_{i}"] = {
            f"{mixer}_norm": norm(p + "input_layernorm.weight"),
            "mlp_norm": norm(p + "post_attention_layernorm.weight"), mixer: params,
            **({"moe": _moe_params(ckpt, p + "mlp.", config.moe)} if (i + 1) % every == 0 else
               {"mlp": mlp_params(ckpt, p + "mlp.")})}
    out = {"embed": {"embedding": ckpt(f"{root}embed_tokens.weight")}, "decoder": decoder}
    if config.head != "none" and not config.tie_embeddings:
        out["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, maybe_scan(config, out, "decoder")


def _attention(ckpt, prefix, heads, kv, head_dim, d) -> dict[str, np.ndarray]:
    """q_proj [N * 2H, D] holds each head's H query rows then its H gate rows."""
    query_gate = split_heads(ckpt(prefix + "q_proj.weight", True), heads)
    return {"query": query_gate[..., :head_dim], "gate": query_gate[..., head_dim:],
            "key": split_heads(ckpt(prefix + "k_proj.weight", True), kv),
            "value": split_heads(ckpt(prefix + "v_proj.weight", True), kv),
            "out": ckpt(prefix + "o_proj.weight", True).reshape(heads, head_dim, d),
            "query_norm": {"scale": ckpt(prefix + "q_norm.weight") + 1.0},
            "key_norm": {"scale": ckpt(prefix + "k_norm.weight") + 1.0}}


def _gated_deltanet(ckpt, prefix, g, n, k, v) -> dict[str, np.ndarray]:
    """Qwen3NextGatedDeltaNet's fused projections split per key-head group: in_proj_qkvz
    [D, G x (q K, k K, v rV, z rV)] and in_proj_ba [D, G x (b r, a r)], r = N / G value heads
    per group; conv1d's channels q, k, v; its gated norm's weight as it is (not offset)."""
    r = n // g
    qkvz = ckpt(prefix + "in_proj_qkvz.weight", True)
    d = qkvz.shape[0]
    q, key, value, z = np.split(qkvz.reshape(d, g, 2 * k + 2 * r * v),
                                [k, 2 * k, 2 * k + r * v], axis=-1)
    b, a = np.split(ckpt(prefix + "in_proj_ba.weight", True).reshape(d, g, 2 * r), 2, axis=-1)
    conv = ckpt(prefix + "conv1d.weight")[:, 0].T  # [W, channels]
    width = conv.shape[0]
    return {"query": q, "key": key, "value": value.reshape(d, n, v), "gate": z.reshape(d, n, v),
            "decay": a.reshape(d, n), "beta": b.reshape(d, n),
            "query_conv": conv[:, :g * k].reshape(width, g, k),
            "key_conv": conv[:, g * k:2 * g * k].reshape(width, g, k),
            "value_conv": conv[:, 2 * g * k:].reshape(width, n, v),
            "A_log": ckpt(prefix + "A_log"), "dt_bias": ckpt(prefix + "dt_bias"),
            "norm": ckpt(prefix + "norm.weight"),
            "out": ckpt(prefix + "out_proj.weight", True).reshape(n, v, d)}


def exporter():
    """Qwen3-Next's allowlist (`allowlist.check`): Gated DeltaNet and full layers, the full
    ones element-gated with per-head qk-norm and (partial) RoPE, experts with a gated shared
    expert, SwiGLU, pre-RMSNorm, no biases."""
    from transformer.hf.allowlist import ANY, SHAPES, Exporter

    return Exporter("qwen3_next", "Qwen3-Next", {
        "family": ("gpt",), "head": ("mlm",), "position": ("rope",), "norm": ("rmsnorm",),
        "norm_placement": ("pre",), "activation": ("swiglu",), "use_bias": (False,),
        "qkv_bias": (None, False), "layer_types": ANY, "attention_gate": ("element",),
        "qk_norm": (True,), "qk_norm_scope": ("head",), "rope_theta": ANY,
        "rope_layout": ("half",), "rope_fraction": ANY, "num_kv_heads": ANY, "head_dim": ANY,
        **{f"linear_attention.{k}": ANY for k in (
            "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
            "conv_kernel")},
        "moe.shared_gate": (True,), **{f"moe.{k}": ANY for k in (
            "num_experts", "top_k", "capacity_factor", "d_ff", "num_shared", "normalize_gates",
            "every_n_layers")},
        **SHAPES, "tie_embeddings": ANY})


def to_hf(config, params, transformers):
    """(Qwen3NextConfig, state dict): the inverse of `qwen3_next` above, the experts one
    tensor each as the hub's files hold them."""
    from transformer.hf.export_llama import _moe_state, mlp_state
    from transformer.nn.config import parse_layer_types

    types = list(parse_layer_types(config.layer_types))
    types = (types * (config.num_layers // len(types)))[:config.num_layers]
    if set(types) - {"linear_attention", "full_attention"}:  # (no experts: refused before)
        raise ValueError(f"export to qwen3_next: model.layer_types={config.layer_types!r}: "
                         "expected linear_attention and full_attention layers")
    lin, moe = config.linear_attention, config.moe
    g, n = lin.num_key_heads or config.num_heads, lin.num_value_heads or config.num_heads
    head_dim = config.head_dim or config.d_model // config.num_heads
    k, v = lin.key_head_dim or head_dim, lin.value_head_dim or lin.key_head_dim or head_dim
    d_ff = moe.d_ff or config.d_ff
    hf_config = transformers.Qwen3NextConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        moe_intermediate_size=d_ff, shared_expert_intermediate_size=moe.num_shared * d_ff,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads or config.num_heads, head_dim=head_dim,
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.normalize_gates and moe.top_k > 1,  # our top-1 gate: its probability
        decoder_sparse_step=moe.every_n_layers,
        mlp_only_layers=[], linear_num_key_heads=g, linear_num_value_heads=n,
        linear_key_head_dim=k, linear_value_head_dim=v, linear_conv_kernel_dim=lin.conv_kernel,
        layer_types=types, max_position_embeddings=config.max_len,
        rms_norm_eps=config.norm_epsilon, tie_word_embeddings=config.tie_embeddings,
        router_aux_loss_coef=moe.load_balance_loss / moe.top_k or 0.001,
        output_router_logits=moe.load_balance_loss > 0,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta),
                         "partial_rotary_factor": float(config.rope_fraction)},
        initializer_range=config.init_std or 0.02, architectures=["Qwen3NextForCausalLM"])
    decoder, one = params["decoder"], np.float32(1.0)
    out = {"model.embed_tokens.weight": params["embed"]["embedding"],
           "model.norm.weight": decoder["final_norm"]["scale"] - one}
    for i, kind in enumerate(types):
        layer, p = decoder[f"layers_{i}"], f"model.layers.{i}."
        mixer = "self_attention" if kind == "full_attention" else "linear_attention"
        out[p + "input_layernorm.weight"] = layer[f"{mixer}_norm"]["scale"] - one
        out[p + "post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"] - one
        out.update(_attention_state(layer[mixer], p + "self_attn.") if kind == "full_attention"
                   else _gated_deltanet_state(layer[mixer], p + "linear_attn.", g, n))
        if "moe" in layer:
            out.update(_moe_state(layer["moe"], p + "mlp."))
        else:
            out.update(mlp_state(layer["mlp"], p + "mlp."))
    if not config.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    return hf_config, out


def _attention_state(a: dict, prefix: str) -> dict[str, np.ndarray]:
    """Qwen3NextAttention's tensors (the inverse of `_attention`)."""
    d = a["query"].shape[0]
    query_gate = np.concatenate([a["query"], a["gate"]], axis=-1).reshape(d, -1)
    return {prefix + "q_proj.weight": query_gate.T,
            prefix + "k_proj.weight": a["key"].reshape(d, -1).T,
            prefix + "v_proj.weight": a["value"].reshape(d, -1).T,
            prefix + "o_proj.weight": a["out"].reshape(-1, a["out"].shape[-1]).T,
            prefix + "q_norm.weight": a["query_norm"]["scale"] - np.float32(1.0),
            prefix + "k_norm.weight": a["key_norm"]["scale"] - np.float32(1.0)}


def _gated_deltanet_state(p: dict, prefix: str, g: int, n: int) -> dict[str, np.ndarray]:
    """Qwen3NextGatedDeltaNet's tensors (the inverse of `_gated_deltanet`)."""
    d = p["query"].shape[0]
    per_group = lambda x: x.reshape(d, g, -1)  # [D, N, V] or [D, N] -> [D, G, r ...]
    qkvz = np.concatenate([p["query"], p["key"], per_group(p["value"]), per_group(p["gate"])],
                          axis=-1).reshape(d, -1)
    ba = np.concatenate([per_group(p["beta"]), per_group(p["decay"])], axis=-1).reshape(d, -1)
    width = p["query_conv"].shape[0]
    conv = np.concatenate([p[f"{name}_conv"].reshape(width, -1)
                           for name in ("query", "key", "value")], axis=1)
    return {prefix + "in_proj_qkvz.weight": qkvz.T, prefix + "in_proj_ba.weight": ba.T,
            prefix + "conv1d.weight": conv.T[:, None, :], prefix + "A_log": p["A_log"],
            prefix + "dt_bias": p["dt_bias"], prefix + "norm.weight": p["norm"],
            prefix + "out_proj.weight": p["out"].reshape(-1, p["out"].shape[-1]).T}
