"""Import Hugging Face's gpt-oss (`gpt_oss`) into `DecoderLM`: GQA with biases and a learned
sink logit per head (`model.attention_sinks`), sliding and full layers alternating
(`sliding_window_pattern=2`), YaRN RoPE, and in every layer experts with biases and the clamped
SwiGLU (`moe.use_bias`, `moe.swiglu_limit`). `convert.from_hf` dispatches here."""

from __future__ import annotations

import ml_collections
import numpy as np

from transformer.hf.common import Checkpoint, maybe_scan, split_heads
from transformer.hf.convert_deepseek import yarn_settings
from transformer.hf.convert_llama import _llama_like_config, _windows

ALPHA = 1.702  # the sigmoid's slope in gpt-oss's SwiGLU (activations.clamped_swiglu)


def gpt_oss(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """GptOssForCausalLM / GptOssModel -> (config for `DecoderLM`, params). The router takes
    the softmax of its top-k logits: our renormalised top-k gates (`normalize_gates`). Settings
    this model cannot represent are refused, naming them."""
    if getattr(hf_config, "swiglu_alpha", ALPHA) != ALPHA:
        raise ValueError(f"gpt_oss swiglu_alpha={hf_config.swiglu_alpha}: expected {ALPHA} "
                         "(the only value this model represents)")
    top_k = hf_config.num_experts_per_tok
    aux = getattr(hf_config, "router_aux_loss_coef", 0.0) * top_k \
        if getattr(hf_config, "output_router_logits", False) else 0.0
    moe = dict(num_experts=hf_config.num_local_experts, top_k=top_k, capacity_factor=0.0,
               use_bias=True, swiglu_limit=float(hf_config.swiglu_limit),
               load_balance_loss=float(aux), router_z_loss=0.0)
    if top_k == 1:
        raise ValueError("gpt_oss num_experts_per_tok=1: expected >= 2 (its top-1 gate is 1, "
                         "ours the router probability)")
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError("gpt_oss attention_bias=False: expected True (model.use_bias puts "
                         "biases on q, k, v and the output together)")
    config = _llama_like_config("GptOss", hf_config, state_dict, mapped=("attention_bias",),
                                rope=yarn_settings(hf_config, "gpt_oss"),
                                attention_sinks=True, moe=moe, **_windows("GptOss", hf_config))
    config.use_bias = True  # q, k, v and the output (there is no dense feed-forward layer)
    n, d = config.num_heads, config.d_model
    kv, head_dim = config.num_kv_heads or n, config.head_dim or d // n
    root = "model." if any(k.startswith("model.") for k in state_dict) else ""
    ckpt = Checkpoint(state_dict, ("lm_head.weight",) if config.tie_embeddings else (), dtype)
    decoder = {"final_norm": {"scale": ckpt(f"{root}norm.weight")}}
    for i in range(config.num_layers):
        p = f"{root}layers.{i}."
        attention = {"sinks": ckpt(p + "self_attn.sinks"),
                     "out": ckpt(p + "self_attn.o_proj.weight", True).reshape(n, head_dim, d),
                     "out_bias": ckpt(p + "self_attn.o_proj.bias")}
        for ours, theirs, heads in (("query", "q", n), ("key", "k", kv), ("value", "v", kv)):
            attention[ours] = split_heads(ckpt(f"{p}self_attn.{theirs}_proj.weight", True), heads)
            attention[f"{ours}_bias"] = ckpt(f"{p}self_attn.{theirs}_proj.bias").reshape(
                heads, head_dim)
        e = p + "mlp.experts."
        gate_up, gate_up_bias = ckpt(e + "gate_up_proj"), ckpt(e + "gate_up_proj_bias")
        decoder[f"layers_{i}"] = {
            "self_attention_norm": {"scale": ckpt(p + "input_layernorm.weight")},
            "mlp_norm": {"scale": ckpt(p + "post_attention_layernorm.weight")},
            "self_attention": attention,
            # [E, D, 2F] with the gate and up columns interleaved; [E, F, D] down.
            "moe": {"router": ckpt(p + "mlp.router.weight", True),
                    "router_bias": ckpt(p + "mlp.router.bias"),
                    "wi_gate": gate_up[..., ::2], "wi_up": gate_up[..., 1::2],
                    "wi_gate_bias": gate_up_bias[:, ::2], "wi_up_bias": gate_up_bias[:, 1::2],
                    "wo": ckpt(e + "down_proj"), "wo_bias": ckpt(e + "down_proj_bias")}}
    params = {"embed": {"embedding": ckpt(f"{root}embed_tokens.weight")}, "decoder": decoder}
    if config.head != "none" and not config.tie_embeddings:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, maybe_scan(config, params, "decoder")
