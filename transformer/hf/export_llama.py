"""Export to the Llama-like Hugging Face classes: a RoPE GPT becomes Llama (RMSNorm, SwiGLU, no
biases), with q/k/v biases Qwen2, with a sliding window Mistral, with per-head qk-norm Qwen3,
with sandwich norms Gemma 2 (and q / k norms Gemma 3), with post-sublayer norms OLMo 2 (and
windows OLMo 3); with MoE layers Mixtral, with
shared experts Qwen2-MoE, with per-head qk-norm Qwen3-MoE. `EXPORTERS` holds each class's
allowlist (`allowlist.check`); `transformer.hf.export.to_hf` dispatches here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transformer.hf import allowlist
from transformer.hf.allowlist import ANY, SHAPES, Exporter
from transformer.hf.common import flat_heads
from transformer.hf.convert_llama import LLAMA_LIKE

# What every Llama-like class maps: RMSNorm, RoPE (default, linear, llama3 or yarn: see
# `_rope_parameters`), no biases, GQA.
_BASE = dict(family=("gpt",), head=("mlm",), position=("rope",), norm=("rmsnorm",))
_ROPE = dict(rope_layout=("half",), rope_theta=ANY, rope_scale=ANY,
             rope_scaling=("linear", "llama3", "yarn"), rope_low_freq_factor=ANY,
             rope_high_freq_factor=ANY, rope_original_max_len=ANY,
             **{f"rope_yarn_{k}": ANY for k in ("beta_fast", "beta_slow", "mscale",
                                                "mscale_all_dim", "truncate")})
# The classes whose RoPE is written per layer type (transformers 5 reads it so)
_PER_LAYER_TYPE_ROPE = ("Olmo3", "Gemma3")
_MAPPED = dict(**SHAPES, tie_embeddings=ANY, num_kv_heads=ANY, head_dim=ANY)
_NO_BIAS = dict(qkv_bias=(None, False))
_WINDOW = dict(sliding_window=ANY)
_LAYER_WINDOWS = dict(sliding_window=ANY, sliding_window_pattern=ANY)
_QK_NORM = dict(qk_norm=(True,), qk_norm_scope=("head",))
# A mixture of experts (model.moe): HF routes dropless whatever moe.capacity_factor (its loss
# weights are export-neutral); moe.top_k and moe.d_ff are checked in _moe_settings.
_MOE = {"moe.num_experts": ANY, "moe.top_k": ANY, "moe.d_ff": ANY, "moe.capacity_factor": ANY}
# Per class (LLAMA_LIKE's key): (model_type, title, what it maps beyond Llama's settings).
_CLASSES = {
    "Llama": ("llama", "Llama", _NO_BIAS),
    "Mistral": ("mistral", "Mistral", dict(_NO_BIAS, **_WINDOW)),
    "Qwen2": ("qwen2", "Qwen2", dict(qkv_bias=(True,))),
    "Qwen3": ("qwen3", "Qwen3", dict(_QK_NORM, **_NO_BIAS, **_LAYER_WINDOWS)),
    # attention_scale: 1 / sqrt(query_pre_attn_scalar), checked in _llama_like_settings
    "Gemma2": ("gemma2", "Gemma 2", dict(scale_embeddings=(True,), **_NO_BIAS, **_LAYER_WINDOWS,
                                         attention_scale=ANY, attention_softcap=ANY,
                                         final_logit_softcap=ANY)),
    "Olmo2": ("olmo2", "OLMo 2", dict(qk_norm=(True,), qk_norm_scope=("projection",),
                                       **_NO_BIAS)),
    "Olmo3": ("olmo3", "OLMo 3", dict(qk_norm=(True,), qk_norm_scope=("projection",),
                                       **_NO_BIAS, **_LAYER_WINDOWS)),
    # Gemma 2's settings without soft-caps, with q / k norms and the local layers' RoPE base
    "Gemma3": ("gemma3_text", "Gemma 3", dict(scale_embeddings=(True,), **_NO_BIAS, **_QK_NORM,
                                              **_LAYER_WINDOWS, attention_scale=ANY,
                                              rope_local_theta=ANY)),
    "Mixtral": ("mixtral", "Mixtral", {**_NO_BIAS, **_WINDOW, "moe.num_shared": (0,),
                                       "moe.shared_gate": (False,),
                                       "moe.normalize_gates": (True,),
                                       "moe.every_n_layers": (1,), **_MOE}),
    # sinks, biases everywhere, alternating windows, YaRN, experts with the clamped SwiGLU
    "GptOss": ("gpt_oss", "gpt-oss", {
        "use_bias": (True,), "qkv_bias": (None, True), "attention_sinks": (True,),
        **_LAYER_WINDOWS, "rope_scaling": ("linear", "yarn"), "moe.use_bias": (True,),
        "moe.swiglu_limit": ANY, "moe.normalize_gates": (True,), "moe.every_n_layers": (1,),
        **_MOE}),
    # moe.num_shared >= 1: checked in _moe_settings
    "Qwen2Moe": ("qwen2_moe", "Qwen2-MoE", {"qkv_bias": ANY, "moe.shared_gate": (True,),
                                            "moe.num_shared": ANY, "moe.normalize_gates": ANY,
                                            "moe.every_n_layers": ANY, **_MOE}),
    "Qwen3Moe": ("qwen3_moe", "Qwen3-MoE", {**_QK_NORM, **_NO_BIAS, **_WINDOW,
                                            "moe.num_shared": (0,), "moe.shared_gate": (False,),
                                            "moe.normalize_gates": ANY,
                                            "moe.every_n_layers": ANY, **_MOE}),
}


def _exporter(kind: str, name: str, title: str, maps: dict) -> Exporter:
    """A class's allowlist: the block's norm placement and activation (LLAMA_LIKE's) first,
    then what the class maps beyond Llama, then the settings every Llama-like class maps."""
    family = LLAMA_LIKE[kind]
    return Exporter(name, title, {
        **_BASE, "norm_placement": (family.placement,),
        "activation": (family.activations[0][1],), "use_bias": (False,), **_ROPE, **maps,
        **_MAPPED})


EXPORTERS = {kind: _exporter(kind, *spec) for kind, spec in _CLASSES.items()}


def llama_kind(config) -> str:
    """The Llama-like class a RoPE GPT exports as: the norm placement, then qk-norm, biases
    and the window pick it, and with MoE layers qk-norm and shared experts or biases (the
    class's other requirements are checked after)."""
    if config.get("attention_sinks") and config.get("moe") and config.moe.num_experts:
        return "GptOss"
    if config.get("moe") and config.moe.num_experts and config.norm_placement == "pre":
        shared = config.moe.num_shared or config.qkv_bias
        return "Qwen3Moe" if config.qk_norm else "Qwen2Moe" if shared else "Mixtral"
    if config.norm_placement == "sandwich":
        return "Gemma3" if config.qk_norm or config.get("rope_local_theta") else "Gemma2"
    if config.norm_placement == "post_sublayer":
        return "Olmo3" if config.sliding_window is not None else "Olmo2"
    if config.qk_norm:
        return "Qwen3"
    if config.qkv_bias and config.sliding_window is not None:
        raise ValueError("model.qkv_bias=True with model.sliding_window: no Hugging Face class "
                         "has both (Qwen2 has the biases, Mistral the window)")
    return "Qwen2" if config.qkv_bias else "Mistral" if config.sliding_window else "Llama"


def _llama_like_settings(config, kind: str, head_dim: int) -> dict[str, Any]:
    """The HF config keys of `kind` beyond Llama's: windows, soft-caps, logit scale."""
    window, pattern = config.sliding_window, config.sliding_window_pattern
    layer_types = ["full_attention" if window is None or pattern and (i + 1) % pattern == 0
                   else "sliding_attention" for i in range(config.num_layers)]
    if kind == "Olmo3":
        return dict(sliding_window=window, layer_types=layer_types)
    if kind == "GptOss":
        moe = config.moe
        if moe.d_ff not in (0, config.d_ff) or moe.top_k == 1:
            name, value = ("moe.d_ff", moe.d_ff) if moe.top_k > 1 else ("moe.top_k", 1)
            raise allowlist.refusal(EXPORTERS[kind], name, value, f"0 or {config.d_ff} for "
                                    "d_ff, >= 2 for top_k")
        if not moe.swiglu_limit > 0:  # HF's experts always clamp, and add 1 to up
            raise allowlist.refusal(EXPORTERS[kind], "moe.swiglu_limit", moe.swiglu_limit,
                                    "> 0: gpt-oss's clamped SwiGLU")
        return dict(sliding_window=window, layer_types=layer_types, attention_bias=True,
                    num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                    swiglu_limit=float(moe.swiglu_limit),
                    router_aux_loss_coef=moe.load_balance_loss / moe.top_k or 0.001,
                    output_router_logits=moe.load_balance_loss > 0)
    if kind in ("Gemma2", "Gemma3"):
        scalar = head_dim
        if config.attention_scale is not None:
            scalar = round(config.attention_scale ** -2)
            if not np.isclose(scalar ** -0.5, config.attention_scale, rtol=1e-9, atol=0):
                raise allowlist.refusal(EXPORTERS[kind], "attention_scale",
                                        config.attention_scale, "1 / sqrt(an integer): "
                                        "query_pre_attn_scalar")
        return dict(sliding_window=window, layer_types=layer_types,
                    query_pre_attn_scalar=scalar,
                    attn_logit_softcapping=float(config.attention_softcap) or None,
                    final_logit_softcapping=float(config.final_logit_softcap) or None)
    if kind.endswith(("Moe", "Mixtral")):
        return _moe_settings(config, kind, window)
    return {"Mistral": {"sliding_window": window}, "Qwen2": {"use_sliding_window": False},
            "Qwen3": {"use_sliding_window": window is not None, "sliding_window": window,
                      "layer_types": layer_types}}.get(kind, {})


def _moe_settings(config, kind: str, window) -> dict[str, Any]:
    """The HF config keys of a Mixtral, Qwen2-MoE or Qwen3-MoE (see `convert_llama._moe`), after
    refusing what the class cannot hold: HF routes dropless whatever model.moe.capacity_factor,
    Mixtral renormalises the top-k gates of every layer's experts d_ff wide, Qwen2-MoE has a
    gated shared expert, Qwen3-MoE none (the rest of what each refuses: EXPORTERS)."""
    moe, d_ff, exporter = config.moe, config.moe.d_ff or config.d_ff, EXPORTERS[kind]
    if kind == "Mixtral" and moe.d_ff not in (0, config.d_ff):
        raise allowlist.refusal(exporter, "moe.d_ff", moe.d_ff, f"0 or {config.d_ff}: experts "
                                "as wide as model.d_ff")
    if kind == "Mixtral" and moe.top_k == 1:
        raise allowlist.refusal(exporter, "moe.top_k", 1, ">= 2: its top-1 gate is 1, ours the "
                                "router probability")
    if kind == "Qwen2Moe" and not moe.num_shared:
        raise allowlist.refusal(exporter, "moe.num_shared", 0, ">= 1")
    aux = dict(router_aux_loss_coef=moe.load_balance_loss / moe.top_k or 0.001,
               output_router_logits=moe.load_balance_loss > 0, num_experts_per_tok=moe.top_k)
    if kind == "Mixtral":
        return dict(aux, num_local_experts=moe.num_experts, sliding_window=window)
    settings = dict(aux, num_experts=moe.num_experts, moe_intermediate_size=d_ff,
                    norm_topk_prob=moe.normalize_gates and moe.top_k > 1, mlp_only_layers=[],
                    decoder_sparse_step=moe.every_n_layers, use_sliding_window=window is not None)
    if kind == "Qwen3Moe":
        settings.update(sliding_window=window)
    if kind == "Qwen2Moe":
        settings.update(shared_expert_intermediate_size=moe.num_shared * d_ff,
                        qkv_bias=bool(config.qkv_bias))
    return settings


def export(config, params, transformers):
    """(HF config, state dict) of a RoPE GPT as the Llama-like class `llama_kind` picks, after
    its allowlist's check."""
    kind = llama_kind(config)
    allowlist.check(EXPORTERS[kind], config)
    family = LLAMA_LIKE[kind]
    activation = family.activations[0]  # (HF's name, ours)
    head_dim = config.head_dim or config.d_model // config.num_heads
    rope = _rope_parameters(config, kind)
    hf_config = getattr(transformers, "Gemma3TextConfig" if kind == "Gemma3" else
                        f"{kind}Config")(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=config.d_ff, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads or config.num_heads, head_dim=head_dim,
        max_position_embeddings=config.max_len, rms_norm_eps=config.norm_epsilon,
        tie_word_embeddings=config.tie_embeddings, rope_parameters=rope,
        **{family.activation_key: activation[0]},
        attention_dropout=config.attention_dropout_rate,
        initializer_range=config.init_std or 0.02, architectures=[f"{kind}ForCausalLM"],
        **_llama_like_settings(config, kind, head_dim))
    return hf_config, _llama_like_state(config, params, family)


def _rope_parameters(config, kind: str) -> dict[str, Any]:
    """HF's `rope_parameters` of our RoPE (the inverse of `convert_llama._rope`). YaRN's
    attention factor is left to transformers to derive: mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) where both are set, else mscale(factor), as
    `positions.rope_attention_factor` says (so mscale and mscale_all_dim are written only
    where both are non-zero: otherwise neither changes it)."""
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=float(config.rope_scale),
                    low_freq_factor=float(config.rope_low_freq_factor),
                    high_freq_factor=float(config.rope_high_freq_factor),
                    original_max_position_embeddings=int(config.rope_original_max_len))
    elif config.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(config.rope_scale),
                    original_max_position_embeddings=int(config.rope_original_max_len),
                    beta_fast=float(config.rope_yarn_beta_fast),
                    beta_slow=float(config.rope_yarn_beta_slow),
                    truncate=bool(config.rope_yarn_truncate))
        if config.rope_yarn_mscale and config.rope_yarn_mscale_all_dim:
            rope.update(mscale=float(config.rope_yarn_mscale),
                        mscale_all_dim=float(config.rope_yarn_mscale_all_dim))
    elif config.rope_scale != 1.0:
        rope.update(rope_type="linear", factor=float(config.rope_scale))
    if kind not in _PER_LAYER_TYPE_ROPE:
        return rope
    # transformers reads YaRN's truncate off rope_parameters' top level, which holds none here
    if rope.get("truncate") is False:
        raise allowlist.refusal(EXPORTERS[kind], "rope_yarn_truncate", False, "True: its "
                                "RoPE is per layer type, and transformers then always truncates")
    local = config.get("rope_local_theta")
    return {"full_attention": rope, "sliding_attention": rope if local is None else {
        "rope_type": "default", "rope_theta": float(local)}}


def _llama_like_state(config, params, family) -> dict[str, np.ndarray]:
    """The state dict of a Llama-like class; Gemma's norm weights are our scales - 1."""
    decoder, out = params["decoder"], {"model.embed_tokens.weight": params["embed"]["embedding"]}

    def norm(tree, name):
        out[f"{name}.weight"] = tree["scale"] - np.float32(family.norm_offset)

    norm(decoder["final_norm"], "model.norm")
    mixtral = config.get("moe") and config.moe.num_experts and llama_kind(config) == "Mixtral"
    for i in range(config.num_layers):
        layer, p = decoder[f"layers_{i}"], f"model.layers.{i}."
        attn = layer["self_attention"]
        for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v")):
            out[f"{p}self_attn.{theirs}_proj.weight"] = flat_heads(attn[ours]).T
            if f"{ours}_bias" in attn:
                out[f"{p}self_attn.{theirs}_proj.bias"] = attn[f"{ours}_bias"].reshape(-1)
            if f"{ours}_norm" in attn:  # qk-norm scales: [H] per head, [heads, H] projection
                out[f"{p}self_attn.{theirs}_norm.weight"] = attn[f"{ours}_norm"]["scale"] \
                    .reshape(-1) - np.float32(family.qk_norm_offset)
        out[p + "self_attn.o_proj.weight"] = attn["out"].reshape(-1, config.d_model).T
        for ours, theirs in (("out_bias", "o_proj.bias"), ("sinks", "sinks")):
            if ours in attn:
                out[f"{p}self_attn.{theirs}"] = attn[ours]
        for ours, theirs in family.norms:
            norm(layer[ours], p + theirs)
        if "moe" in layer and "router_bias" in layer["moe"]:  # gpt-oss
            out.update(_gpt_oss_experts(layer["moe"], p + "mlp."))
            continue
        if "moe" in layer:
            out.update(_moe_state(layer["moe"], p + ("block_sparse_moe." if mixtral else "mlp.")))
            continue
        out.update(mlp_state(layer["mlp"], p + "mlp."))
    if not config.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    return out


def mlp_state(mlp: dict, prefix: str) -> dict[str, np.ndarray]:
    """HF's `gate_proj` / `up_proj` / `down_proj` of a dense SwiGLU feed-forward (the inverse
    of `convert_llama.mlp_params`)."""
    return {prefix + "gate_proj.weight": mlp["wi_gate"].T,
            prefix + "up_proj.weight": mlp["wi_up"].T, prefix + "down_proj.weight": mlp["wo"].T}


def _moe_state(moe: dict, prefix: str, shared: str = "shared_expert.") -> dict[str, np.ndarray]:
    """HF's tensors of one MoE layer as save_pretrained writes them, one per expert (Mixtral's
    block_sparse_moe.experts.j.w1 / w3 / w2, Qwen's mlp.experts.j.gate_proj / up_proj /
    down_proj), which the hub's tools read; the inverse of `convert_llama._moe_params`."""
    mixtral = "block_sparse_moe" in prefix
    out = {prefix + "gate.weight": moe["router"].T}
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for ours, theirs in zip(("wi_gate", "wi_up", "wo"), names, strict=True):
        for j, kernel in enumerate(moe[ours]):
            out[f"{prefix}experts.{j}.{theirs}.weight"] = kernel.T
    for ours, theirs in (("shared_wi", f"{shared}gate_proj.weight"),
                         ("shared_wi_up", f"{shared}up_proj.weight"),
                         ("shared_wo", f"{shared}down_proj.weight"),
                         ("shared_gate", "shared_expert_gate.weight")):
        if ours in moe:
            out[prefix + theirs] = moe[ours].T
    return out


def _gpt_oss_experts(moe: dict, prefix: str) -> dict[str, np.ndarray]:
    """gpt-oss's MoE tensors (the inverse of `convert_gpt_oss`): the router with its bias,
    gate_up_proj [E, D, 2F] with the gate and up columns interleaved, and their biases."""
    def interleave(gate, up):
        both = np.stack([gate, up], axis=-1)
        return both.reshape(*gate.shape[:-1], 2 * gate.shape[-1])

    e = prefix + "experts."
    return {prefix + "router.weight": moe["router"].T, prefix + "router.bias": moe["router_bias"],
            e + "gate_up_proj": interleave(moe["wi_gate"], moe["wi_up"]),
            e + "gate_up_proj_bias": interleave(moe["wi_gate_bias"], moe["wi_up_bias"]),
            e + "down_proj": moe["wo"], e + "down_proj_bias": moe["wo_bias"]}
