"""Import the Llama-like Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Gemma 2, OLMo 2,
and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE): each family's converter, and
`LLAMA_LIKE`, what each lays out differently from Llama (which the export reads too).
`convert.from_hf` dispatches here."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections
import numpy as np

from transformer.hf.common import Checkpoint, head_tied, maybe_scan, model_config, split_heads
from transformer.nn.positions import rope_attention_factor


def _rope(hf_config, parameters: dict | None = None) -> dict[str, Any]:
    """The model's RoPE settings of a Llama-family config: transformers 5 keeps them in
    `rope_parameters` ({"rope_type", "rope_theta", "factor", ...}), older configs in
    `rope_theta` / `rope_scaling`; `parameters`: these instead of the config's. Types other than
    default, linear, llama3 and yarn (`_yarn`) are refused."""
    rope = dict(parameters or getattr(hf_config, "rope_parameters", None) or {})
    # transformers 5 may key them by layer type (OLMo 3, Gemma 3), beside stale flat keys
    types = set(getattr(hf_config, "layer_types", None) or ())
    per_type = {kind: value for kind, value in rope.items() if isinstance(value, dict)
                and (kind in types or not types)}
    if per_type:
        if len({repr(sorted(value.items())) for value in per_type.values()}) > 1:
            raise ValueError(f"rope_parameters {per_type}: expected the same RoPE for every "
                             "layer type (one RoPE for all layers)")
        rope = dict(next(iter(per_type.values())))
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    rope = {**legacy, **rope}
    settings = {"rope_theta": float(rope.get("rope_theta", getattr(hf_config, "rope_theta",
                                                                      10000.0)))}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "linear":
        settings["rope_scale"] = float(rope["factor"])
    elif kind == "llama3":
        settings.update(rope_scale=float(rope["factor"]), rope_scaling="llama3",
                        rope_low_freq_factor=float(rope["low_freq_factor"]),
                        rope_high_freq_factor=float(rope["high_freq_factor"]),
                        rope_original_max_len=int(rope["original_max_position_embeddings"]))
    elif kind == "yarn":
        settings.update(_yarn(rope, hf_config))
    elif kind != "default":
        raise ValueError(f"rope scaling type {kind!r}: expected 'default', 'linear', 'llama3' "
                         "or 'yarn' (dynamic NTK and longrope scaling are not implemented)")
    return settings


def _yarn(rope: dict, hf_config) -> dict[str, Any]:
    """The settings of rope_type "yarn" as transformers' `_compute_yarn_parameters` reads it for
    the Llama-like classes: `factor` (None: max_position_embeddings over the original),
    `beta_fast` / `beta_slow` (unset or 0: 32 and 1), `truncate`, and cos and sin times
    `attention_factor`, by default mscale(factor, mscale) / mscale(factor, mscale_all_dim) where
    both are non-zero, else mscale(factor) (`positions.rope_attention_factor`: unlike
    DeepSeek's, mscale alone changes nothing). An explicit attention_factor other than that is
    refused, as is a factor <= 0."""
    original = int(rope.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings)
    factor = rope.get("factor")
    factor = float(hf_config.max_position_embeddings / original if factor is None else factor)
    if not factor > 0:
        raise ValueError(f"rope factor={factor} (rope_type 'yarn'): expected > 0")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)  # HF takes the ratio only when both are non-zero
    settings = dict(
        rope_scaling="yarn", rope_scale=factor, rope_original_max_len=original,
        rope_yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        rope_yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_yarn_mscale=float(mscale) if both else 1.0,
        rope_yarn_mscale_all_dim=float(mscale_all_dim) if both else 0.0,
        rope_yarn_truncate=_nested(hf_config) or bool(rope.get("truncate", True)))
    derived = rope_attention_factor("yarn", factor, settings["rope_yarn_mscale"],
                                    settings["rope_yarn_mscale_all_dim"])
    given = rope.get("attention_factor")
    if given is not None and not math.isclose(float(given), derived, rel_tol=1e-6):
        raise ValueError(f"rope attention_factor={given} (rope_type 'yarn'): expected unset or "
                         f"{derived} (derived from factor, mscale and mscale_all_dim; RoPE here "
                         "scales cos and sin by no other)")
    return settings


def _nested(hf_config) -> bool:
    """Whether `rope_parameters` is keyed by layer type: transformers then reads YaRN's
    `truncate` off the top level, where there is none, so truncates whatever a type says."""
    return any(isinstance(value, dict) for value in
               (getattr(hf_config, "rope_parameters", None) or {}).values())


@dataclasses.dataclass(frozen=True)
class LlamaLike:
    """What a Llama-like Hugging Face family lays out differently from Llama: the block's norm
    placement (model.norm_placement) with each norm's HF name (ours, theirs), the q/k norm
    scope ("": none), what its RMSNorm adds to the weight, and its activation key and values."""

    placement: str = "pre"
    norms: tuple[tuple[str, str], ...] = (("self_attention_norm", "input_layernorm"),
                                          ("mlp_norm", "post_attention_layernorm"))
    qk_norm: str = ""  # "head" (Qwen3) | "projection" (OLMo 2)
    norm_offset: float = 0.0  # Gemma: RMSNorm(x) * (1 + weight), so our scale is weight + 1
    qk_norm_offset: float = 0.0  # the same for the q / k norms (Gemma 3's)
    activation_key: str = "hidden_act"
    activations: tuple[tuple[str, str], ...] = (("silu", "swiglu"),)  # (HF's, ours)


LLAMA_LIKE = {
    "Llama": LlamaLike(), "Mistral": LlamaLike(), "Qwen2": LlamaLike(),
    "Qwen3": LlamaLike(qk_norm="head"),
    "Gemma2": LlamaLike(
        "sandwich", (("self_attention_norm", "input_layernorm"),
                     ("self_attention_output_norm", "post_attention_layernorm"),
                     ("mlp_norm", "pre_feedforward_layernorm"),
                     ("mlp_output_norm", "post_feedforward_layernorm")),
        norm_offset=1.0, activation_key="hidden_activation",
        activations=(("gelu_pytorch_tanh", "geglu"), ("gelu_new", "geglu"))),
    "Gemma3": LlamaLike(
        "sandwich", (("self_attention_norm", "input_layernorm"),
                     ("self_attention_output_norm", "post_attention_layernorm"),
                     ("mlp_norm", "pre_feedforward_layernorm"),
                     ("mlp_output_norm", "post_feedforward_layernorm")),
        qk_norm="head", norm_offset=1.0, qk_norm_offset=1.0, activation_key="hidden_activation",
        activations=(("gelu_pytorch_tanh", "geglu"),)),
    "Mixtral": LlamaLike(), "Qwen2Moe": LlamaLike(), "Qwen3Moe": LlamaLike(qk_norm="head"),
    "Olmo3": LlamaLike("post_sublayer", (("self_attention_output_norm", "post_attention_layernorm"),
                                         ("mlp_output_norm", "post_feedforward_layernorm")),
                       qk_norm="projection"),
    "Qwen3Next": LlamaLike(qk_norm="head", norm_offset=1.0, qk_norm_offset=1.0),
    "DeepseekV3": LlamaLike(), "GptOss": LlamaLike(),  # convert_deepseek, convert_gpt_oss
    "Olmo2": LlamaLike("post_sublayer", (("self_attention_output_norm", "post_attention_layernorm"),
                                         ("mlp_output_norm", "post_feedforward_layernorm")),
                       qk_norm="projection"),
}


def llama(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """LlamaForCausalLM / LlamaModel -> (config for `DecoderLM`: RMSNorm, SwiGLU, RoPE, GQA, no
    biases; params). A LlamaModel (config.json's architectures; in memory, one with untied
    embeddings and no lm_head.weight) gives head "none".
    Settings this model cannot represent are refused, naming them."""
    return _llama_like("Llama", hf_config, state_dict, dtype)


def mistral(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """MistralForCausalLM / MistralModel: Llama with sliding-window attention (each token sees
    the last `sliding_window` positions: model.sliding_window)."""
    return _llama_like("Mistral", hf_config, state_dict, dtype,
                       sliding_window=getattr(hf_config, "sliding_window", None))


def qwen2(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Qwen2ForCausalLM / Qwen2Model: Llama with biases on the q/k/v projections
    (model.qkv_bias). Per-layer sliding windows (use_sliding_window) are refused."""
    _full_attention_only("Qwen2", hf_config)
    return _llama_like("Qwen2", hf_config, state_dict, dtype, qkv_bias=True)


def _full_attention_only(name, hf_config) -> None:
    kinds = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{name} layer_types {sorted(kinds)} (use_sliding_window="
                         f"{getattr(hf_config, 'use_sliding_window', False)}): expected only "
                         "'full_attention' (one attention pattern for every layer)")


def qwen3(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Qwen3ForCausalLM / Qwen3Model: Llama with an RMSNorm over each head's q and k before
    RoPE (model.qk_norm, scope "head"). Sliding windows on every layer, or on all but every
    P-th, are kept; other per-layer mixes (max_window_layers) are refused."""
    return _llama_like("Qwen3", hf_config, state_dict, dtype, **_windows("Qwen3", hf_config))


def gemma2(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Gemma2ForCausalLM / Gemma2Model: sandwich norms x + N'(f(N(x))), GeGLU through the tanh
    GELU, embeddings times sqrt(d_model), logit scale query_pre_attn_scalar^-0.5, attention and
    final-logit soft-caps, and sliding-window layers between global ones (layer_types)."""
    if getattr(hf_config, "use_bidirectional_attention", None):
        raise ValueError("Gemma2 use_bidirectional_attention=True: expected False or None (a "
                         "causal decoder LM)")
    scalar = hf_config.query_pre_attn_scalar
    head_dim = getattr(hf_config, "head_dim", None) or \
        hf_config.hidden_size // hf_config.num_attention_heads
    return _llama_like(
        "Gemma2", hf_config, state_dict, dtype, scale_embeddings=True,
        attention_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        attention_softcap=float(hf_config.attn_logit_softcapping or 0.0),
        final_logit_softcap=float(hf_config.final_logit_softcapping or 0.0),
        **_windows("Gemma2", hf_config))


def gemma3(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Gemma3ForCausalLM / Gemma3TextModel (`gemma3_text`): Gemma 2 without soft-caps, with
    per-head q / k RMSNorms (1 + weight, as its other norms), and its local layers' own RoPE:
    `rope_parameters` by layer type, the full layers' possibly scaled (`_gemma3_local_theta`)."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    local, full = rope.get("sliding_attention"), rope.get("full_attention")
    if not (isinstance(local, dict) and isinstance(full, dict)):
        raise ValueError(f"Gemma3 rope_parameters={rope}: expected one per layer type "
                         "(sliding_attention, full_attention), as transformers 5 writes them")
    if getattr(hf_config, "use_bidirectional_attention", None):
        raise ValueError("Gemma3 use_bidirectional_attention=True: expected False or None (a "
                         "causal decoder LM)")
    scalar = hf_config.query_pre_attn_scalar
    head_dim = getattr(hf_config, "head_dim", None) or \
        hf_config.hidden_size // hf_config.num_attention_heads
    windows = _windows("Gemma3", hf_config)
    return _llama_like(
        "Gemma3", hf_config, state_dict, dtype, scale_embeddings=True,
        rope=_rope(hf_config, full),
        rope_local_theta=_gemma3_local_theta(hf_config, local, full) if windows["sliding_window"]
        else None,
        attention_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        # no attention_softcap: HF's Gemma 3 keeps attn_logit_softcapping but never applies it
        final_logit_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
        **windows)


def _gemma3_local_theta(hf_config, local: dict, full: dict) -> float | None:
    """rope_local_theta of Gemma 3's sliding layers' `rope_parameters`: plain RoPE -> its base;
    the full layers' own RoPE, scaled alike -> None (one RoPE for every layer: what the export
    writes for a model without rope_local_theta, and what transformers then applies to both).
    A sliding scaling of its own is refused: only the full layers' RoPE is scaled here."""
    if local.get("rope_type", "default") == "default":
        return float(local["rope_theta"])
    if _rope(hf_config, local) != _rope(hf_config, full):
        raise ValueError(f"Gemma3 sliding_attention rope_parameters={local}: expected rope_type "
                         f"'default' or the full_attention layers' own RoPE ({full}); a scaling "
                         "of the sliding layers' own is not implemented")
    return None


def olmo2(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Olmo2ForCausalLM / Olmo2Model: norms on the sublayers' outputs, x + N'(f(x))
    (model.norm_placement "post_sublayer"), and an RMSNorm over the whole q and k projections
    (all heads together) before RoPE (model.qk_norm, scope "projection")."""
    return _llama_like("Olmo2", hf_config, state_dict, dtype)


def olmo3(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Olmo3ForCausalLM / Olmo3Model: OLMo 2 with sliding-window layers (three in four, the
    fourth full: `sliding_window` with `sliding_window_pattern=4`, from `layer_types`), one
    RoPE for both kinds of layer."""
    return _llama_like("Olmo3", hf_config, state_dict, dtype, **_windows("Olmo3", hf_config))


def mixtral(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """MixtralForCausalLM / MixtralModel: Mistral with a mixture of experts in every layer (see
    `_moe`); transformers 5's fused expert tensors (experts.gate_up_proj, experts.down_proj)."""
    return _llama_like("Mixtral", hf_config, state_dict, dtype,
                       sliding_window=getattr(hf_config, "sliding_window", None),
                       moe=_moe("Mixtral", hf_config))


def qwen2_moe(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Qwen2MoeForCausalLM / Qwen2MoeModel: Qwen2 (q/k/v biases if `qkv_bias`) whose MoE layers
    add a shared expert, its output times a per-token sigmoid gate (model.moe.shared_gate).
    Per-layer sliding windows (use_sliding_window) are refused."""
    _full_attention_only("Qwen2Moe", hf_config)
    return _llama_like("Qwen2Moe", hf_config, state_dict, dtype,
                       qkv_bias=getattr(hf_config, "qkv_bias", True),
                       moe=_moe("Qwen2Moe", hf_config))


def qwen3_moe(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Qwen3MoeForCausalLM / Qwen3MoeModel: Qwen3 (per-head qk-norm) with MoE layers; its
    `sliding_window` (set when use_sliding_window) windows every layer, as Mistral's."""
    return _llama_like("Qwen3Moe", hf_config, state_dict, dtype,
                       sliding_window=getattr(hf_config, "sliding_window", None),
                       moe=_moe("Qwen3Moe", hf_config))


def _moe(name, hf_config) -> dict[str, Any]:
    """model.moe of an HF mixture of experts. Routing is dropless (capacity_factor 0: HF drops
    no token); the router's softmax is float32 in both; top-k gates renormalised to sum 1
    (Mixtral always, Qwen with norm_topk_prob=True) or the router probabilities (Qwen's
    norm_topk_prob=False: normalize_gates False); layer i is MoE when (i + 1) %
    decoder_sparse_step == 0 (every_n_layers); experts are moe_intermediate_size wide (moe.d_ff)
    and Qwen2-MoE's shared expert num_shared of them. HF's aux loss is training-only:
    router_aux_loss_coef * top_k is load_balance_loss (HF's expert fractions sum to k, ours to
    1) when output_router_logits, else 0; there is no z-loss."""
    experts = getattr(hf_config, "num_local_experts", None) or hf_config.num_experts
    top_k, d_ff = hf_config.num_experts_per_tok, getattr(hf_config, "moe_intermediate_size", 0)
    normalize = bool(getattr(hf_config, "norm_topk_prob", True))  # Mixtral's always are
    dense_layers = list(getattr(hf_config, "mlp_only_layers", None) or [])
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) \
        if name in ("Qwen2Moe", "Qwen3Next") else 0
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError(f"{name} router_jitter_noise={hf_config.router_jitter_noise}: expected "
                         "0.0 (no router jitter in training here)")
    if dense_layers:
        raise ValueError(f"{name} mlp_only_layers={dense_layers}: expected [] (dense layers "
                         "only by decoder_sparse_step)")
    step, layers = getattr(hf_config, "decoder_sparse_step", 1), hf_config.num_hidden_layers
    # our stack repeats one period of step layers, the last one MoE
    if step < 1 or layers % step:
        raise ValueError(f"{name} decoder_sparse_step={step} with num_hidden_layers={layers}: "
                         "expected a divisor of num_hidden_layers")
    if top_k == 1 and normalize:
        raise ValueError(f"{name} num_experts_per_tok=1 with renormalised gates: expected >= 2 "
                         "or norm_topk_prob=False (our top-1 gate is the router probability)")
    if name in ("Qwen2Moe", "Qwen3Next") and (not shared or shared % d_ff):
        raise ValueError(f"{name} shared_expert_intermediate_size={shared}: expected a positive "
                         f"multiple of moe_intermediate_size={d_ff}")
    aux = getattr(hf_config, "router_aux_loss_coef", 0.0) * top_k \
        if getattr(hf_config, "output_router_logits", False) else 0.0
    return dict(num_experts=experts, top_k=top_k, capacity_factor=0.0, d_ff=d_ff,
                every_n_layers=step,
                num_shared=shared // d_ff if shared else 0, shared_gate=bool(shared),
                normalize_gates=normalize, load_balance_loss=float(aux), router_z_loss=0.0)


def _moe_params(ckpt, prefix, moe) -> dict[str, np.ndarray]:
    """Our MoE layer's params from HF's `mlp.` tensors: router [D, E] is gate.weight.T; the
    experts' wi_gate, wi_up [E, D, F] and wo [E, F, D] from transformers 5's fused [E, 2F, D]
    gate_up_proj (gate first) and [E, D, F] down_proj, or from the per-expert tensors that
    save_pretrained and the hub's files hold (Mixtral's block_sparse_moe.experts.j.w1 / w3 /
    w2, Qwen's mlp.experts.j.gate_proj / up_proj / down_proj); Qwen2-MoE's shared expert and
    its gate [1, D]."""
    hub_mixtral = prefix.replace(".mlp.", ".block_sparse_moe.")
    prefix = hub_mixtral if ckpt.has(hub_mixtral + "gate.weight") else prefix
    if ckpt.has(prefix + "experts.gate_up_proj"):
        gate_up = ckpt(prefix + "experts.gate_up_proj").transpose(0, 2, 1)
        wi_gate, wi_up = np.split(gate_up, 2, axis=2)
        wo = ckpt(prefix + "experts.down_proj").transpose(0, 2, 1)
    else:
        names = ("w1", "w3", "w2") if prefix == hub_mixtral else ("gate_proj", "up_proj",
                                                                   "down_proj")
        wi_gate, wi_up, wo = (np.stack([ckpt(f"{prefix}experts.{j}.{name}.weight", True)
                                        for j in range(moe.num_experts)]) for name in names)
    params = {"router": ckpt(prefix + "gate.weight", True), "wi_gate": wi_gate,
              "wi_up": wi_up, "wo": wo}
    if moe.balance_bias:  # DeepSeek-V3's score-correction bias (a buffer in HF's model)
        params["balance_bias"] = ckpt(prefix + "gate.e_score_correction_bias")
    if moe.num_shared:  # Qwen2-MoE's shared_expert, DeepSeek's shared_experts
        s = prefix + ("shared_experts." if ckpt.has(prefix + "shared_experts.gate_proj.weight")
                      else "shared_expert.")
        params.update(shared_wi=ckpt(s + "gate_proj.weight", True),
                      shared_wi_up=ckpt(s + "up_proj.weight", True),
                      shared_wo=ckpt(s + "down_proj.weight", True))
    if moe.shared_gate:
        params["shared_gate"] = ckpt(prefix + "shared_expert_gate.weight", True)
    return params


def mlp_params(ckpt, prefix) -> dict[str, np.ndarray]:
    """A dense SwiGLU feed-forward's params from HF's `gate_proj` / `up_proj` / `down_proj`
    under `prefix` (e.g. "model.layers.0.mlp.")."""
    return {"wi_gate": ckpt(prefix + "gate_proj.weight", True),
            "wi_up": ckpt(prefix + "up_proj.weight", True),
            "wo": ckpt(prefix + "down_proj.weight", True)}


def _windows(name, hf_config) -> dict[str, Any]:
    """model.sliding_window and sliding_window_pattern of HF's per-layer `layer_types`: all
    full (no window), all sliding (pattern 0), or full exactly at layers P-1, 2P-1, ...
    (pattern P). HF's window W lets query i see keys j > i - W, as model.sliding_window does."""
    layers = hf_config.num_hidden_layers
    kinds = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * layers)
    if set(kinds) == {"full_attention"}:
        return {"sliding_window": None, "sliding_window_pattern": 0}
    window = getattr(hf_config, "sliding_window", None)
    period = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
    periodic = ["full_attention" if period and (i + 1) % period == 0 else "sliding_attention"
                for i in range(layers)]
    if kinds != periodic or window is None:
        raise ValueError(f"{name} layer_types={kinds} with sliding_window={window}: expected "
                         "a window and 'full_attention' exactly at layers P-1, 2P-1, ... (or "
                         "nowhere), 'sliding_attention' elsewhere")
    return {"sliding_window": int(window), "sliding_window_pattern": period}


def _base_model(hf_config, state_dict, tie: bool) -> bool:
    """Whether a Llama-like checkpoint is a base model without an LM head (LlamaModel,
    Qwen3Model, ...: head "none"). config.json's `architectures` says so: a tied
    `*ForCausalLM` saves no lm_head.weight either. Without it (an in-memory config), an
    untied checkpoint without lm_head.weight is one."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and architectures[0].endswith(("Model", "ForCausalLM")):
        return architectures[0].endswith("Model")
    return not tie and "lm_head.weight" not in state_dict


def _llama_like_config(name, hf_config, state_dict, rope=None, mapped=(),
                       **knobs) -> ml_collections.ConfigDict:
    """The model config of a Llama-like HF config; `rope`: its RoPE settings where `_rope`
    does not read them; `mapped`: HF keys Llama refuses that the family maps itself (in
    `knobs`: family settings beyond Llama's)."""
    family = LLAMA_LIKE[name]
    refused = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    for key, supported in refused.items():
        if key in mapped:
            continue
        if getattr(hf_config, key, supported) != supported:
            raise ValueError(f"{name} {key}={getattr(hf_config, key)!r}: expected "
                             f"{supported!r} (the only value this model represents)")
    activations = dict(family.activations)
    act = getattr(hf_config, family.activation_key, family.activations[0][0])
    if act not in activations:
        raise ValueError(f"{name} {family.activation_key}={act!r}: expected "
                         f"{' or '.join(map(repr, activations))} (the only value this model "
                         "represents)")
    d, n = hf_config.hidden_size, hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or n
    head_dim = getattr(hf_config, "head_dim", None) or d // n
    root = "model." if any(k.startswith("model.") for k in state_dict) else ""
    tie = head_tied(bool(getattr(hf_config, "tie_word_embeddings", False)), state_dict,
                    f"{root}embed_tokens.weight")
    return model_config(
        family="gpt", vocab_size=hf_config.vocab_size, tie_embeddings=tie,
        head="none" if _base_model(hf_config, state_dict, tie) else "mlm",
        num_layers=hf_config.num_hidden_layers, d_model=d, num_heads=n,
        num_kv_heads=None if kv == n else kv, head_dim=None if head_dim * n == d else head_dim,
        d_ff=hf_config.intermediate_size, activation=activations[act], norm="rmsnorm",
        norm_placement=family.placement, qk_norm=bool(family.qk_norm),
        qk_norm_scope=family.qk_norm or "head", norm_epsilon=hf_config.rms_norm_eps,
        position="rope", rope_layout="half", **(_rope(hf_config) if rope is None else rope),
        max_len=hf_config.max_position_embeddings, use_bias=False,
        init_std=hf_config.initializer_range, dropout_rate=0.0,
        attention_dropout_rate=getattr(hf_config, "attention_dropout", 0.0), **knobs)


def _llama_like(name, hf_config, state_dict, dtype, *, qkv_bias=False, **knobs):
    """(config, params) of a Llama-like family (LLAMA_LIKE[name]); `knobs`: model settings."""
    family = LLAMA_LIKE[name]
    config = _llama_like_config(name, hf_config, state_dict,
                                qkv_bias=True if qkv_bias else None, **knobs)
    n, d = config.num_heads, config.d_model
    kv, head_dim = config.num_kv_heads or n, config.head_dim or d // n
    root = "model." if any(k.startswith("model.") for k in state_dict) else ""
    ignored = tuple(k for k in state_dict if k.endswith("rotary_emb.inv_freq"))  # old buffers
    ckpt = Checkpoint(state_dict, ignored + (("lm_head.weight",) if config.tie_embeddings
                                              else ()), dtype)
    norm = lambda prefix: {"scale": ckpt(f"{prefix}.weight") + family.norm_offset}
    qk_shape = lambda heads: (heads, head_dim) if family.qk_norm == "projection" else (head_dim,)
    decoder = {"final_norm": norm(f"{root}norm")}
    for i in range(config.num_layers):
        p = f"{root}layers.{i}."
        attention = {
            "query": split_heads(ckpt(p + "self_attn.q_proj.weight", True), n),
            "key": split_heads(ckpt(p + "self_attn.k_proj.weight", True), kv),
            "value": split_heads(ckpt(p + "self_attn.v_proj.weight", True), kv),
            "out": ckpt(p + "self_attn.o_proj.weight", True).reshape(n, head_dim, d)}
        for ours, theirs, heads in (("query", "q", n), ("key", "k", kv), ("value", "v", kv)):
            if qkv_bias:
                attention[f"{ours}_bias"] = ckpt(f"{p}self_attn.{theirs}_proj.bias").reshape(
                    heads, head_dim)
            if family.qk_norm and ours != "value":
                attention[f"{ours}_norm"] = {"scale": ckpt(
                    f"{p}self_attn.{theirs}_norm.weight").reshape(qk_shape(heads))
                    + family.qk_norm_offset}
        moe = config.moe.num_experts and (i + 1) % config.moe.every_n_layers == 0
        decoder[f"layers_{i}"] = {
            **{ours: norm(p + theirs) for ours, theirs in family.norms},
            "self_attention": attention,
            **({"moe": _moe_params(ckpt, p + "mlp.", config.moe)} if moe else
               {"mlp": mlp_params(ckpt, p + "mlp.")})}
    params = {"embed": {"embedding": ckpt(f"{root}embed_tokens.weight")}, "decoder": decoder}
    if config.head != "none" and not config.tie_embeddings:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, maybe_scan(config, params, "decoder")

