"""Import Hugging Face's Qwen3-Next (`qwen3_next`) into `DecoderLM`: Gated DeltaNet layers
(`linear_attention`, transformer.nn.mixers.gated_deltanet) with one full-attention layer in
four, that attention gated per element (`model.attention_gate="element"`) with partial RoPE
(`model.rope_fraction`), zero-centred RMSNorms (weight + 1, as Gemma's), and experts with a
gated shared expert in every layer. `convert.from_hf` dispatches here."""

from __future__ import annotations

import ml_collections
import numpy as np

from transformer.hf.common import Checkpoint, maybe_scan, split_heads
from transformer.hf.convert_llama import LLAMA_LIKE, _llama_like_config, _moe, _moe_params


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
            **({"moe": _moe_params(ckpt, p + "mlp.", config.moe)} if (i + 1) % every == 0 else {
                "mlp": {"wi_gate": ckpt(p + "mlp.gate_proj.weight", True),
                        "wi_up": ckpt(p + "mlp.up_proj.weight", True),
                        "wo": ckpt(p + "mlp.down_proj.weight", True)}})}
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
