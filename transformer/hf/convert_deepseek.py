"""Import Hugging Face's DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3, R1, Kimi K2 and their
small relatives) into `DecoderLM`: multi-head latent attention (`model.attention_kind="mla"`,
transformer.nn.mixers.mla), YaRN RoPE on the decoupled key, and DeepSeek's experts (sigmoid
scores in groups, the balance bias, shared experts, the first dense layers;
transformer.nn.routing). `convert.from_hf` dispatches here."""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np

from transformer.hf.common import Checkpoint, maybe_scan
from transformer.hf.convert_llama import _llama_like_config, _moe_params, mlp_params


def yarn_settings(hf_config, family: str = "deepseek_v3") -> dict[str, Any]:
    """RoPE settings of a family that scales by YaRN (rope_type "yarn": DeepSeek-V3, gpt-oss);
    "default" is plain RoPE, "linear" position interpolation, any other type is refused."""
    rope = {**(getattr(hf_config, "rope_scaling", None) or {}),
            **(getattr(hf_config, "rope_parameters", None) or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    settings = {"rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": "linear",
                "rope_scale": 1.0}
    if kind == "yarn" and rope.get("attention_factor") is not None:
        raise ValueError(f"{family} rope attention_factor={rope['attention_factor']}: expected "
                         "it unset (YaRN's scale from factor, mscale and mscale_all_dim)")
    if kind == "yarn":
        settings.update(
            rope_scaling="yarn", rope_scale=float(rope["factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
            rope_yarn_beta_fast=float(rope.get("beta_fast", 32.0)),
            rope_yarn_beta_slow=float(rope.get("beta_slow", 1.0)),
            rope_yarn_mscale=float(rope.get("mscale", 1.0)),
            rope_yarn_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            rope_yarn_truncate=bool(rope.get("truncate", True)))
    elif kind == "linear":  # position interpolation: the positions divided by factor
        settings["rope_scale"] = float(rope["factor"])
    elif kind != "default":
        raise ValueError(f"{family} rope_type={kind!r}: expected 'default', 'linear' or 'yarn'")
    return settings


def _experts(hf_config) -> dict[str, Any]:
    """model.moe: dropless (as HF), sigmoid scores, n_group / topk_group, the gates
    renormalised (norm_topk_prob) and times routed_scaling_factor, n_shared_experts always on,
    the first first_k_dense_replace layers dense, the score-correction bias fixed (its update
    is training's: set moe.bias_update_rate to move it). HF has no auxiliary loss here."""
    top_k, normalize = hf_config.num_experts_per_tok, bool(hf_config.norm_topk_prob)
    if top_k == 1 and normalize:
        raise ValueError("deepseek_v3 num_experts_per_tok=1 with norm_topk_prob=True: expected "
                         ">= 2 or norm_topk_prob=False (our top-1 gate is its score)")
    dense, layers = hf_config.first_k_dense_replace, hf_config.num_hidden_layers
    if dense >= layers:
        raise ValueError(f"deepseek_v3 first_k_dense_replace={dense} with num_hidden_layers="
                         f"{layers}: expected fewer (at least one mixture-of-experts layer)")
    if getattr(hf_config, "topk_method", "noaux_tc") not in ("noaux_tc",):
        raise ValueError(f"deepseek_v3 topk_method={hf_config.topk_method!r}: expected "
                         "'noaux_tc' (grouped top-k of the biased sigmoid scores)")
    return dict(num_experts=hf_config.n_routed_experts, top_k=top_k, capacity_factor=0.0,
                d_ff=hf_config.moe_intermediate_size, num_shared=hf_config.n_shared_experts or 0,
                normalize_gates=normalize, score="sigmoid", n_group=hf_config.n_group or 1,
                topk_group=hf_config.topk_group or 1,
                routed_scaling_factor=float(hf_config.routed_scaling_factor),
                first_dense_layers=dense, balance_bias=True,
                load_balance_loss=0.0, router_z_loss=0.0)


def deepseek_v3(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict,
                                                                   dict]:
    """DeepseekV3ForCausalLM / DeepseekV3Model -> (config for `DecoderLM`, params). Settings
    this model cannot represent are refused, naming them."""
    heads, kv = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None)
    if kv not in (None, heads):  # MLA's keys and values come per head from the latent
        raise ValueError(f"DeepseekV3 num_key_value_heads={kv}: expected num_attention_heads="
                         f"{heads} (transformers' attention takes no other)")
    if hf_config.rms_norm_eps != 1e-6:  # ours: one epsilon for every norm
        raise ValueError(f"DeepseekV3 rms_norm_eps={hf_config.rms_norm_eps}: expected 1e-06 "
                         "(transformers' q_a and kv_a latent norms keep 1e-6 whatever it says)")
    mla = dict(q_lora_rank=hf_config.q_lora_rank or 0, kv_lora_rank=hf_config.kv_lora_rank,
               qk_nope_head_dim=hf_config.qk_nope_head_dim,
               qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim)
    config = _llama_like_config("DeepseekV3", hf_config, state_dict, rope=yarn_settings(hf_config),
                                attention_kind="mla", mla=mla, moe=_experts(hf_config))
    config.update(head_dim=None, num_kv_heads=None,
                  rope_layout="interleaved" if getattr(hf_config, "rope_interleave", True)
                  else "half")
    root = "model." if any(k.startswith("model.") for k in state_dict) else ""
    ckpt = Checkpoint(state_dict, ("lm_head.weight",) if config.tie_embeddings else (), dtype)
    decoder = {"final_norm": {"scale": ckpt(f"{root}norm.weight")}}
    layer = lambda p, dense: {
        "self_attention_norm": {"scale": ckpt(p + "input_layernorm.weight")},
        "mlp_norm": {"scale": ckpt(p + "post_attention_layernorm.weight")},
        "self_attention": mla_params(ckpt, p + "self_attn.", config),
        **({"mlp": mlp_params(ckpt, p + "mlp.")} if dense else
           {"moe": _moe_params(ckpt, p + "mlp.", config.moe)})}
    for i in range(config.num_layers):
        decoder[f"layers_{i}"] = layer(f"{root}layers.{i}.", i < config.moe.first_dense_layers)
    params = {"embed": {"embedding": ckpt(f"{root}embed_tokens.weight")}, "decoder": decoder}
    if config.head != "none" and not config.tie_embeddings:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    # The multi-token prediction layers (num_nextn_predict_layers) after the stack, where the
    # checkpoint carries them (transformers drops them on load; the hub's files keep them).
    depth = 0
    while f"{root}layers.{config.num_layers + depth}.eh_proj.weight" in state_dict:
        depth += 1
    config.mtp.depth = depth
    for j in range(depth):
        p = f"{root}layers.{config.num_layers + j}."
        _check_shared(ckpt, p, params, config)
        params[f"mtp_{j}"] = {
            "embedding_norm": {"scale": ckpt(p + "enorm.weight")},
            "hidden_norm": {"scale": ckpt(p + "hnorm.weight")},
            "projection": ckpt(p + "eh_proj.weight", transpose=True),
            "final_norm": {"scale": ckpt(p + "shared_head.norm.weight")},
            "layers_0": layer(p, config.num_layers - 1 < config.moe.first_dense_layers)}
    ckpt.check_all_used()
    return config, maybe_scan(config, params, "decoder")


def _check_shared(ckpt: Checkpoint, prefix: str, params, config) -> None:
    """An MTP layer's copies of the embedding and the output head: our modules share the LM's,
    so they must be equal to them (as in DeepSeek-V3's files), or the import is refused."""
    head = (params["embed"]["embedding"] if config.tie_embeddings
            else params["lm_head"]["kernel"].T)
    for name, want in (("embed_tokens.weight", params["embed"]["embedding"]),
                       ("shared_head.head.weight", head)):
        if ckpt.has(prefix + name) and not np.array_equal(ckpt(prefix + name), want):
            raise ValueError(f"deepseek_v3 {prefix}{name}: expected a copy of the model's own "
                             "(our multi-token prediction modules share its embedding and head)")


def mla_params(ckpt: Checkpoint, prefix: str, config) -> dict[str, np.ndarray]:
    """`MultiHeadLatentAttention`'s params from DeepseekV3Attention's tensors: q_a / q_b (or
    one q_proj), kv_a_proj_with_mqa, the two RMSNorms, kv_b_proj split per head into W_uk
    (`k_b`, [C, N, P]) and W_uv (`v_b`, [C, N, V]), and o_proj as [N, V, D]."""
    m, n, d = config.mla, config.num_heads, config.d_model
    nope, k = m.qk_nope_head_dim, m.qk_nope_head_dim + m.qk_rope_head_dim
    kv_b = ckpt(prefix + "kv_b_proj.weight").reshape(n, nope + m.v_head_dim, m.kv_lora_rank)
    params = {"kv_a": ckpt(prefix + "kv_a_proj_with_mqa.weight", True),
              "kv_a_norm": {"scale": ckpt(prefix + "kv_a_layernorm.weight")},
              "k_b": kv_b[:, :nope].transpose(2, 0, 1), "v_b": kv_b[:, nope:].transpose(2, 0, 1),
              "out": ckpt(prefix + "o_proj.weight", True).reshape(n, m.v_head_dim, d)}
    if m.q_lora_rank:
        params.update(q_a=ckpt(prefix + "q_a_proj.weight", True),
                      q_a_norm={"scale": ckpt(prefix + "q_a_layernorm.weight")},
                      q_b=ckpt(prefix + "q_b_proj.weight", True).reshape(m.q_lora_rank, n, k))
    else:
        params["query"] = ckpt(prefix + "q_proj.weight", True).reshape(d, n, k)
    return params


def exporter():
    """DeepSeek-V3's allowlist (`allowlist.check`): a RoPE GPT with multi-head latent
    attention, DeepSeek's routing with the balance bias, SwiGLU, pre-RMSNorm, no biases."""
    from transformer.hf.allowlist import ANY, SHAPES, Exporter

    moe = ("num_experts", "top_k", "capacity_factor", "d_ff", "num_shared", "normalize_gates",
           "n_group", "topk_group", "routed_scaling_factor", "first_dense_layers")
    return Exporter("deepseek_v3", "DeepSeek-V3", {
        "family": ("gpt",), "head": ("mlm",), "position": ("rope",), "norm": ("rmsnorm",),
        "norm_placement": ("pre",), "activation": ("swiglu",), "use_bias": (False,),
        "attention_kind": ("mla",), **{f"mla.{k}": ANY for k in (
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")},
        "rope_theta": ANY, "rope_layout": ANY, "rope_scaling": ("linear", "yarn"),
        "rope_scale": ANY, "rope_original_max_len": ANY, **{f"rope_yarn_{k}": ANY for k in (
            "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")},
        "moe.score": ("sigmoid",), "moe.balance_bias": (True,), "moe.every_n_layers": (1,),
        "mtp.depth": ANY,
        **{f"moe.{k}": ANY for k in moe}, **SHAPES, "tie_embeddings": ANY,
        # transformers' q_a / kv_a latent norms keep 1e-6 whatever rms_norm_eps says, ours
        # take norm_epsilon: only 1e-6 gives the same function (and imports back)
        "norm_epsilon": (1e-6,)})


def to_hf(config, params, transformers):
    """(DeepseekV3Config, state dict) of an MLA GPT with DeepSeek's experts: the inverse of
    `deepseek_v3` above, the experts one tensor each as the hub's files hold them."""
    from transformer.hf.export_llama import _moe_state, mlp_state

    m, moe = config.mla, config.moe
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(config.rope_scale),
                    original_max_position_embeddings=int(config.rope_original_max_len),
                    beta_fast=float(config.rope_yarn_beta_fast),
                    beta_slow=float(config.rope_yarn_beta_slow),
                    mscale=float(config.rope_yarn_mscale),
                    mscale_all_dim=float(config.rope_yarn_mscale_all_dim),
                    truncate=bool(config.rope_yarn_truncate))
    elif config.rope_scale != 1:  # linear position interpolation
        rope.update(rope_type="linear", factor=float(config.rope_scale))
    hf_config = transformers.DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        moe_intermediate_size=moe.d_ff or config.d_ff, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
        n_shared_experts=moe.num_shared, n_routed_experts=moe.num_experts,
        routed_scaling_factor=float(moe.routed_scaling_factor), kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank or None, qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim, qk_nope_head_dim=m.qk_nope_head_dim, n_group=moe.n_group,
        topk_group=moe.topk_group, num_experts_per_tok=moe.top_k,
        first_k_dense_replace=moe.first_dense_layers,
        norm_topk_prob=moe.normalize_gates and moe.top_k > 1,  # our top-1 gate: its score
        max_position_embeddings=config.max_len, rms_norm_eps=config.norm_epsilon,
        tie_word_embeddings=config.tie_embeddings, rope_parameters=rope,
        rope_interleave=config.rope_layout == "interleaved", attention_bias=False,
        initializer_range=config.init_std or 0.02, architectures=["DeepseekV3ForCausalLM"],
        num_nextn_predict_layers=config.mtp.depth)
    decoder = params["decoder"]
    embedding = params["embed"]["embedding"]
    head = embedding if config.tie_embeddings else params["lm_head"]["kernel"].T
    out = {"model.embed_tokens.weight": embedding,
           "model.norm.weight": decoder["final_norm"]["scale"]}

    def layer_state(layer, p):
        out[p + "input_layernorm.weight"] = layer["self_attention_norm"]["scale"]
        out[p + "post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"]
        out.update(_mla_state(layer["self_attention"], p + "self_attn.", config))
        if "moe" in layer:
            out.update(_moe_state(layer["moe"], p + "mlp.", shared="shared_experts."))
            out[p + "mlp.gate.e_score_correction_bias"] = layer["moe"]["balance_bias"]
        else:
            out.update(mlp_state(layer["mlp"], p + "mlp."))

    for i in range(config.num_layers):
        layer_state(decoder[f"layers_{i}"], f"model.layers.{i}.")
    for j in range(config.mtp.depth):  # as DeepSeek-V3's files hold them, with their copies
        module, p = params[f"mtp_{j}"], f"model.layers.{config.num_layers + j}."
        layer_state(module["layers_0"], p)
        out.update({p + "enorm.weight": module["embedding_norm"]["scale"],
                    p + "hnorm.weight": module["hidden_norm"]["scale"],
                    p + "eh_proj.weight": module["projection"].T,
                    p + "shared_head.norm.weight": module["final_norm"]["scale"],
                    p + "embed_tokens.weight": embedding, p + "shared_head.head.weight": head})
    if not config.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    return hf_config, out


def _mla_state(attention: dict, prefix: str, config) -> dict[str, np.ndarray]:
    """DeepseekV3Attention's tensors (the inverse of `mla_params`)."""
    m, d = config.mla, config.d_model
    kv_b = np.concatenate([attention["k_b"].transpose(1, 2, 0),
                           attention["v_b"].transpose(1, 2, 0)], axis=1)  # [N, P + V, C]
    out = {prefix + "kv_a_proj_with_mqa.weight": attention["kv_a"].T,
           prefix + "kv_a_layernorm.weight": attention["kv_a_norm"]["scale"],
           prefix + "kv_b_proj.weight": kv_b.reshape(-1, m.kv_lora_rank),
           prefix + "o_proj.weight": attention["out"].reshape(-1, d).T}
    if m.q_lora_rank:
        out.update({prefix + "q_a_proj.weight": attention["q_a"].T,
                    prefix + "q_a_layernorm.weight": attention["q_a_norm"]["scale"],
                    prefix + "q_b_proj.weight": attention["q_b"].reshape(m.q_lora_rank, -1).T})
    else:
        out[prefix + "q_proj.weight"] = attention["query"].reshape(d, -1).T
    return out
