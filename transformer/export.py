"""Export a trained model as a Hugging Face `save_pretrained` directory (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json), with the user's umask:

    python -m transformer.export --workdir=runs/gpt --output=hf/gpt [--step=N]

A LoRA run (model.lora.rank > 0) exports its adapters as a peft adapter directory
(adapter_config.json + adapter_model.safetensors, `peft.PeftModel.from_pretrained` loads it onto
the Hugging Face base), or with --merge_lora the merged model W + (alpha / rank) A B as above.

`to_hf(model_config, params)` is the inverse of `transformer.hf.convert.from_hf`: a GPT becomes
GPT-2 (learned positions, LayerNorm, biases) or Llama (RoPE, RMSNorm, SwiGLU, no biases; with
q/k/v biases Qwen2, with a sliding window Mistral, with per-head qk-norm Qwen3, with sandwich
norms Gemma 2, with post-sublayer norms OLMo 2; with MoE layers Mixtral, with shared experts
Qwen2-MoE, with per-head qk-norm Qwen3-MoE), and a BERT BertForMaskedLM (or
BertForSequenceClassification for a [CLS] classifier), and a T5 T5ForConditionalGeneration
(tied head, v1.0 or v1.1 feed-forward). An architecture no Hugging Face class represents (ALiBi
or T5-bias positions in a GPT, post-LN GPT, ...) is refused with a one-line reason naming the
setting, before anything is written.

Needs `transformers` (pip install transformers); torch is not needed.
"""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from transformer.hf import convert
from transformer.nn import lora
from transformer.nn.layers import unstack_layers
from transformer.parallel import sharding
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import finetune
from transformer.training import state as state_lib
from transformer.utils import fileio

_GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _require(config, target: str, **expected) -> None:
    """A one-line refusal naming the first model setting `target` cannot represent."""
    for key, allowed in expected.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if config.get(key) not in allowed:
            want = " or ".join(map(repr, allowed))
            raise ValueError(f"model.{key}={config.get(key)!r}: the {target} export needs "
                             f"{want} (no Hugging Face class represents this architecture)")


def _numpy(params) -> dict:
    return traverse_util.unflatten_dict({k: np.asarray(v, np.float32) for k, v in
                                         traverse_util.flatten_dict(dict(params)).items()})


def _unscanned(config, params, *stacks) -> dict:
    params = dict(params)
    if config.scan_layers:
        for name in stacks:
            layers = config.num_decoder_layers if name == "decoder" and \
                config.num_decoder_layers else config.num_layers
            params[name] = unstack_layers(params[name], layers)
    return params


def _flat_heads(kernel_DNH: np.ndarray) -> np.ndarray:
    """[D, N, H] -> [D, N * H], HF's head-by-head output layout."""
    return kernel_DNH.reshape(kernel_DNH.shape[0], -1)


def _ln(norm: dict, prefix: str, out: dict, weight="weight", bias="bias") -> None:
    out[f"{prefix}.{weight}"] = norm["scale"]
    if "bias" in norm:
        out[f"{prefix}.{bias}"] = norm["bias"]


def _gpt2(config, params, transformers):
    _require(config, "GPT-2", norm="layernorm", norm_placement="pre", use_bias=True,
             qkv_bias=(None, True), activation=tuple(_GPT2_ACTIVATIONS), num_kv_heads=None,
             attention_scale=(None, 1.0), scale_embeddings=False, embedding_norm=False,
             sliding_window=None, **_PLAIN)
    if config.head_dim not in (None, config.d_model // config.num_heads):
        raise ValueError(f"model.head_dim={config.head_dim}: the GPT-2 export needs d_model / "
                         "num_heads")
    hf_config = transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_len, n_embd=config.d_model,
        n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.d_ff,
        activation_function=_GPT2_ACTIVATIONS[config.activation],
        layer_norm_epsilon=config.norm_epsilon, tie_word_embeddings=config.tie_embeddings,
        resid_pdrop=config.dropout_rate, embd_pdrop=config.dropout_rate,
        attn_pdrop=config.attention_dropout_rate, initializer_range=config.init_std or 0.02,
        scale_attn_weights=config.attention_scale is None, architectures=["GPT2LMHeadModel"],
        bos_token_id=None, eos_token_id=None)  # not GPT-2's 50256: the tokenizer's, if any
    decoder, out = params["decoder"], {}
    out["transformer.wte.weight"] = params["embed"]["embedding"]
    out["transformer.wpe.weight"] = decoder["position_embedding"]["embedding"]
    _ln(decoder["final_norm"], "transformer.ln_f", out)
    for i in range(config.num_layers):
        layer, p = decoder[f"layers_{i}"], f"transformer.h.{i}."
        attn = layer["self_attention"]
        out[p + "attn.c_attn.weight"] = np.concatenate(
            [_flat_heads(attn[k]) for k in ("query", "key", "value")], axis=1)
        out[p + "attn.c_attn.bias"] = np.concatenate(
            [attn[f"{k}_bias"].reshape(-1) for k in ("query", "key", "value")])
        out[p + "attn.c_proj.weight"] = attn["out"].reshape(-1, config.d_model)
        out[p + "attn.c_proj.bias"] = attn["out_bias"]
        _ln(layer["self_attention_norm"], p + "ln_1", out)
        _ln(layer["mlp_norm"], p + "ln_2", out)
        mlp = layer["mlp"]
        out.update({p + "mlp.c_fc.weight": mlp["wi"], p + "mlp.c_fc.bias": mlp["wi_bias"],
                    p + "mlp.c_proj.weight": mlp["wo"], p + "mlp.c_proj.bias": mlp["wo_bias"]})
    if not config.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    return hf_config, out


# Settings of the newer knobs that only some Hugging Face classes have.
_NO_CAPS = dict(attention_softcap=0.0, final_logit_softcap=0.0, parallel_block=False)
_PLAIN = dict(_NO_CAPS, qk_norm=False)
_LLAMA = dict(_PLAIN, sliding_window_pattern=0, attention_scale=None, scale_embeddings=False)
# Beyond Llama's RMSNorm, RoPE and no biases, what each Llama-like class fixes (its norm
# placement and activation come from convert.LLAMA_LIKE).
_LLAMA_LIKE_NEEDS = {
    "Llama": _LLAMA, "Mistral": _LLAMA, "Qwen2": _LLAMA,
    "Qwen3": dict(_NO_CAPS, qk_norm=True, qk_norm_scope="head", qkv_bias=(None, False),
                  attention_scale=None, scale_embeddings=False),
    "Gemma2": dict(qk_norm=False, parallel_block=False, qkv_bias=(None, False),
                   scale_embeddings=True),
    "Olmo2": dict(_NO_CAPS, qk_norm=True, qk_norm_scope="projection", sliding_window=None,
                  qkv_bias=(None, False), attention_scale=None, scale_embeddings=False),
    "Mixtral": dict(_LLAMA, qkv_bias=(None, False)),
    "Qwen2Moe": dict(_LLAMA, sliding_window=None),
}
_LLAMA_LIKE_NEEDS["Qwen3Moe"] = dict(_LLAMA_LIKE_NEEDS["Qwen3"], sliding_window_pattern=0)


def _llama_kind(config) -> str:
    """The Llama-like class a RoPE GPT exports as: the norm placement, then qk-norm, biases
    and the window pick it, and with MoE layers qk-norm and shared experts or biases (the
    class's other requirements are checked after)."""
    if config.get("moe") and config.moe.num_experts and config.norm_placement == "pre":
        shared = config.moe.num_shared or config.qkv_bias
        return "Qwen3Moe" if config.qk_norm else "Qwen2Moe" if shared else "Mixtral"
    if config.norm_placement in ("sandwich", "post_sublayer"):
        return "Gemma2" if config.norm_placement == "sandwich" else "Olmo2"
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
    if kind == "Gemma2":
        scalar = head_dim
        if config.attention_scale is not None:
            scalar = round(config.attention_scale ** -2)
            if not np.isclose(scalar ** -0.5, config.attention_scale, rtol=1e-9, atol=0):
                raise ValueError(f"model.attention_scale={config.attention_scale}: the Gemma2 "
                                 "export needs 1 / sqrt(an integer) (query_pre_attn_scalar)")
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
    """The HF config keys of a Mixtral, Qwen2-MoE or Qwen3-MoE (see `convert._moe`), after
    refusing what the class cannot hold: HF routes dropless whatever model.moe.capacity_factor,
    Mixtral renormalises the top-k gates of every layer's experts d_ff wide, Qwen2-MoE has a
    gated shared expert, Qwen3-MoE none."""
    moe, d_ff = config.moe, config.moe.d_ff or config.d_ff
    needs = {"Mixtral": dict(num_shared=0, shared_gate=False, normalize_gates=True,
                             every_n_layers=1, d_ff=(0, config.d_ff)),
             "Qwen2Moe": dict(shared_gate=True), "Qwen3Moe": dict(num_shared=0,
                                                                  shared_gate=False)}[kind]
    for key, allowed in needs.items():
        if moe[key] not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise ValueError(f"model.moe.{key}={moe[key]!r}: the {kind} export needs {allowed!r}")
    if kind == "Mixtral" and moe.top_k == 1:
        raise ValueError("model.moe.top_k=1: the Mixtral export needs >= 2 (its top-1 gate is "
                         "1, ours the router probability)")
    if kind == "Qwen2Moe" and not moe.num_shared:
        raise ValueError("model.moe.num_shared=0: the Qwen2Moe export needs >= 1")
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


def _llama(config, params, transformers):
    """Llama, Mistral, Qwen2, Qwen3, Gemma2 or Olmo2 (`_llama_kind`)."""
    kind = _llama_kind(config)
    family = convert.LLAMA_LIKE[kind]
    activation = family.activations[0]  # (HF's name, ours)
    _require(config, kind, norm="rmsnorm", norm_placement=family.placement,
             activation=activation[1], use_bias=False, rope_layout="half", embedding_norm=False,
             **_LLAMA_LIKE_NEEDS[kind])
    head_dim = config.head_dim or config.d_model // config.num_heads
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=float(config.rope_scale),
                    low_freq_factor=float(config.rope_low_freq_factor),
                    high_freq_factor=float(config.rope_high_freq_factor),
                    original_max_position_embeddings=int(config.rope_original_max_len))
    elif config.rope_scale != 1.0:
        rope.update(rope_type="linear", factor=float(config.rope_scale))
    hf_config = getattr(transformers, f"{kind}Config")(
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


def _llama_like_state(config, params, family) -> dict[str, np.ndarray]:
    """The state dict of a Llama-like class; Gemma's norm weights are our scales - 1."""
    decoder, out = params["decoder"], {"model.embed_tokens.weight": params["embed"]["embedding"]}

    def norm(tree, name):
        out[f"{name}.weight"] = tree["scale"] - np.float32(family.norm_offset)

    norm(decoder["final_norm"], "model.norm")
    mixtral = config.get("moe") and config.moe.num_experts and _llama_kind(config) == "Mixtral"
    for i in range(config.num_layers):
        layer, p = decoder[f"layers_{i}"], f"model.layers.{i}."
        attn = layer["self_attention"]
        for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v")):
            out[f"{p}self_attn.{theirs}_proj.weight"] = _flat_heads(attn[ours]).T
            if f"{ours}_bias" in attn:
                out[f"{p}self_attn.{theirs}_proj.bias"] = attn[f"{ours}_bias"].reshape(-1)
            if f"{ours}_norm" in attn:  # qk-norm scales: [H] per head, [heads, H] projection
                out[f"{p}self_attn.{theirs}_norm.weight"] = attn[f"{ours}_norm"]["scale"] \
                    .reshape(-1)
        out[p + "self_attn.o_proj.weight"] = attn["out"].reshape(-1, config.d_model).T
        for ours, theirs in family.norms:
            norm(layer[ours], p + theirs)
        if "moe" in layer:
            out.update(_moe_state(layer["moe"], p + ("block_sparse_moe." if mixtral else "mlp.")))
            continue
        mlp = layer["mlp"]
        out.update({p + "mlp.gate_proj.weight": mlp["wi_gate"].T,
                    p + "mlp.up_proj.weight": mlp["wi_up"].T,
                    p + "mlp.down_proj.weight": mlp["wo"].T})
    if not config.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]["kernel"].T
    return out


def _moe_state(moe: dict, prefix: str) -> dict[str, np.ndarray]:
    """HF's tensors of one MoE layer as save_pretrained writes them, one per expert (Mixtral's
    block_sparse_moe.experts.j.w1 / w3 / w2, Qwen's mlp.experts.j.gate_proj / up_proj /
    down_proj), which the hub's tools read; the inverse of `convert._moe_params`."""
    mixtral = "block_sparse_moe" in prefix
    out = {prefix + "gate.weight": moe["router"].T}
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for ours, theirs in zip(("wi_gate", "wi_up", "wo"), names, strict=True):
        for j, kernel in enumerate(moe[ours]):
            out[f"{prefix}experts.{j}.{theirs}.weight"] = kernel.T
    for ours, theirs in (("shared_wi", "shared_expert.gate_proj.weight"),
                         ("shared_wi_up", "shared_expert.up_proj.weight"),
                         ("shared_wo", "shared_expert.down_proj.weight"),
                         ("shared_gate", "shared_expert_gate.weight")):
        if ours in moe:
            out[prefix + theirs] = moe[ours].T
    return out


def _bert(config, params, transformers):
    _require(config, "BERT", position="learned", norm="layernorm", norm_placement="post",
             use_bias=True, qkv_bias=(None, True), embedding_norm=True, scale_embeddings=False,
             activation=tuple(_BERT_ACTIVATIONS), num_kv_heads=None, attention_scale=None,
             head=("mlm", "classify"), **_PLAIN)
    classify = config.head == "classify"
    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        intermediate_size=config.d_ff, hidden_act=_BERT_ACTIVATIONS[config.activation],
        max_position_embeddings=config.max_len, type_vocab_size=config.type_vocab_size,
        layer_norm_eps=config.norm_epsilon, hidden_dropout_prob=config.dropout_rate,
        attention_probs_dropout_prob=config.attention_dropout_rate,
        initializer_range=config.init_std or 0.02,
        num_labels=config.num_classes if classify else 2,
        architectures=["BertForSequenceClassification" if classify else "BertForMaskedLM"])
    if not config.type_vocab_size:
        raise ValueError("model.type_vocab_size=0: the BERT export needs token type embeddings "
                         "(>= 1)")
    encoder, e = params["encoder"], "bert.embeddings."
    out = {e + "word_embeddings.weight": params["embed"]["embedding"],
           e + "position_embeddings.weight": encoder["position_embedding"]["embedding"],
           e + "token_type_embeddings.weight": params["type_embed"]["embedding"]}
    _ln(encoder["embedding_norm"], e + "LayerNorm", out)
    for i in range(config.num_layers):
        layer, p = encoder[f"layers_{i}"], f"bert.encoder.layer.{i}."
        attn = layer["self_attention"]
        for name in ("query", "key", "value"):
            out[f"{p}attention.self.{name}.weight"] = _flat_heads(attn[name]).T
            out[f"{p}attention.self.{name}.bias"] = attn[f"{name}_bias"].reshape(-1)
        out[p + "attention.output.dense.weight"] = attn["out"].reshape(-1, config.d_model).T
        out[p + "attention.output.dense.bias"] = attn["out_bias"]
        _ln(layer["self_attention_norm"], p + "attention.output.LayerNorm", out)
        mlp = layer["mlp"]
        out.update({p + "intermediate.dense.weight": mlp["wi"].T,
                    p + "intermediate.dense.bias": mlp["wi_bias"],
                    p + "output.dense.weight": mlp["wo"].T,
                    p + "output.dense.bias": mlp["wo_bias"]})
        _ln(layer["mlp_norm"], p + "output.LayerNorm", out)
    if classify:
        out["bert.pooler.dense.weight"] = params["pooler"]["kernel"].T
        out["bert.pooler.dense.bias"] = params["pooler"]["bias"]
        out["classifier.weight"] = params["classifier"]["kernel"].T
        out["classifier.bias"] = params["classifier"]["bias"]
    else:
        t = "cls.predictions."
        out[t + "transform.dense.weight"] = params["mlm_dense"]["kernel"].T
        out[t + "transform.dense.bias"] = params["mlm_dense"]["bias"]
        _ln(params["mlm_norm"], t + "transform.LayerNorm", out)
        out[t + "bias"] = params["mlm_bias"]
    return hf_config, out


_T5_ACTIVATIONS = {"relu": "relu", "geglu": "gated-gelu", "swiglu": "gated-silu"}


def _t5(config, params, transformers):
    _require(config, "T5", position="t5", norm="rmsnorm", norm_placement="pre", use_bias=False,
             qkv_bias=(None, False), attention_scale=1.0, activation=tuple(_T5_ACTIVATIONS),
             num_kv_heads=None, embedding_norm=False, scale_embeddings=False,
             sliding_window=None, **_PLAIN)
    if not config.tie_embeddings:  # transformers 5 always ties T5's head to `shared`
        raise ValueError("model.tie_embeddings=False: the T5 export needs a tied head "
                         "(transformers 5's T5ForConditionalGeneration always ties it)")
    head_dim = config.head_dim or config.d_model // config.num_heads
    decoder_layers = config.num_decoder_layers or config.num_layers
    hf_config = transformers.T5Config(
        vocab_size=config.vocab_size, d_model=config.d_model, d_kv=head_dim, d_ff=config.d_ff,
        num_layers=config.num_layers, num_decoder_layers=decoder_layers,
        num_heads=config.num_heads, relative_attention_num_buckets=config.t5_num_buckets,
        relative_attention_max_distance=config.t5_max_distance,
        dropout_rate=config.dropout_rate, layer_norm_epsilon=config.norm_epsilon,
        feed_forward_proj=_T5_ACTIVATIONS[config.activation], tie_word_embeddings=True,
        architectures=["T5ForConditionalGeneration"])
    hf_config.scale_decoder_outputs = bool(config.scale_decoder_output)
    shared = params["embed"]["embedding"]
    out = {"shared.weight": shared, "encoder.embed_tokens.weight": shared,
           "decoder.embed_tokens.weight": shared, "lm_head.weight": shared}

    def attention(attn, prefix):
        for name, theirs in (("query", "q"), ("key", "k"), ("value", "v")):
            out[f"{prefix}{theirs}.weight"] = _flat_heads(attn[name]).T
        out[f"{prefix}o.weight"] = attn["out"].reshape(-1, config.d_model).T

    def stack(name, num_layers, cross):
        tree = params[name]
        out[f"{name}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = \
            tree["relative_position_bias"]["rel_embedding"]
        _ln(tree["final_norm"], f"{name}.final_layer_norm", out)
        for i in range(num_layers):
            layer, p = tree[f"layers_{i}"], f"{name}.block.{i}.layer."
            attention(layer["self_attention"], p + "0.SelfAttention.")
            _ln(layer["self_attention_norm"], p + "0.layer_norm", out)
            if cross:
                attention(layer["cross_attention"], p + "1.EncDecAttention.")
                _ln(layer["cross_attention_norm"], p + "1.layer_norm", out)
            ff = f"{p}{2 if cross else 1}."
            mlp = layer["mlp"]
            if "wi_gate" in mlp:
                out[ff + "DenseReluDense.wi_0.weight"] = mlp["wi_gate"].T
                out[ff + "DenseReluDense.wi_1.weight"] = mlp["wi_up"].T
            else:
                out[ff + "DenseReluDense.wi.weight"] = mlp["wi"].T
            out[ff + "DenseReluDense.wo.weight"] = mlp["wo"].T
            _ln(layer["mlp_norm"], ff + "layer_norm", out)

    stack("encoder", config.num_layers, False)
    stack("decoder", decoder_layers, True)
    return hf_config, out


def to_hf(model_config, params) -> tuple[Any, dict[str, np.ndarray]]:
    """(transformers config, state dict of float32 NumPy arrays) of a model of this project:
    the checkpoint `convert.from_hf` reads back into the same params. Refuses, with a one-line
    ValueError naming the setting, what no Hugging Face class represents."""
    import transformers

    family = model_config.family
    moe = model_config.get("moe")
    if moe and moe.num_experts and (family, model_config.get("position")) != ("gpt", "rope"):
        raise ValueError(f"model.moe.num_experts={moe.num_experts} with family={family!r}, "
                         f"position={model_config.get('position')!r}: a mixture of experts is "
                         "not exported but as a RoPE GPT (Mixtral, Qwen2-MoE, Qwen3-MoE)")
    if family == "gpt":
        if model_config.head != "mlm":
            raise ValueError(f"model.head={model_config.head!r}: the GPT export writes a causal "
                             "LM (head 'mlm'); a GPT classifier is not exported")
        exporter = {"learned": _gpt2, "rope": _llama}.get(model_config.position)
        if exporter is None:
            raise ValueError(f"model.position={model_config.position!r}: the GPT export needs "
                             "'learned' (GPT-2) or 'rope' (Llama); no Hugging Face causal LM "
                             "has these positions with this architecture")
        params = _unscanned(model_config, _numpy(params), "decoder")
    elif family == "bert":
        exporter, params = _bert, _unscanned(model_config, _numpy(params), "encoder")
    elif family == "t5":
        exporter = _t5
        params = _unscanned(model_config, _numpy(params), "encoder", "decoder")
    else:
        raise ValueError(f"model.family={family!r}: expected 'gpt', 'bert' or 't5' (the "
                         "families with a Hugging Face counterpart)")
    hf_config, state = exporter(model_config, params, transformers)
    return hf_config, {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


def _tokenizer_files(tokenizer, directory: str) -> None:
    """tokenizer.json and tokenizer_config.json, so `AutoTokenizer` gives the run's ids."""
    import json

    tokenizer_json, config = tokenizer.hugging_face()
    fileio.path(directory).joinpath("tokenizer.json").write_text(tokenizer_json,
                                                                  encoding="utf-8")
    fileio.path(directory).joinpath("tokenizer_config.json").write_text(
        json.dumps(config, indent=1) + "\n", encoding="utf-8")


def _new_directory(parent: str) -> str:
    """A new hidden directory in `parent`, made with the user's umask (mkdtemp's is 0700)."""
    while True:
        path = os.path.join(parent, f".export-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def export_workdir(workdir: str, output: str, step: int | None = None,
                   merge_lora: bool = False) -> dict:
    """Writes checkpoint `step` (default: the latest) of `workdir` as a `save_pretrained`
    directory `output`, which must not exist yet, with the user's umask (a LoRA run's: its peft
    adapter, or with `merge_lora` the merged model). Returns what was written: the step, the
    output, the architecture and `files`, [(path, bytes)]."""
    from safetensors.numpy import save_file

    from transformer.data import inputs
    from transformer.data import tokenizers as tokenizers_lib

    if fileio.path(output).exists():
        raise FileExistsError(f"output={output!r} exists: expected a new directory (nothing is "
                              "overwritten)")
    newest = step is None
    step, config = checkpoint_lib.saved_run(workdir, step)
    adapters = lora.enabled(config)
    if merge_lora and not adapters:
        raise ValueError(f"--merge_lora: {workdir}'s run has no LoRA adapters (model.lora.rank "
                         "is 0): expected a LoRA run, or no --merge_lora")
    tokenizer = tokenizers_lib.load_tokenizer(fileio.join(workdir, inputs.TOKENIZER_DIR))
    tokenizer.hugging_face()  # refused, if it is, before anything is read or written
    # Read onto one local device, whatever mesh the run trained on (Orbax reshards).
    one_device = sharding.make_mesh({axis: 1 for axis in sharding.MESH_AXES},
                                    devices=jax.local_devices()[:1])
    # A training beside it may delete the newest step meanwhile: then the next one is read.
    step, _, params = finetune.restore_params(workdir, step, one_device, or_newer=newest)
    if adapters and not merge_lora:
        return _write(output, lambda staging: _peft_files(config, params, staging),
                      {"step": step, "architecture": "a peft LoRA adapter"})
    if adapters:
        params = lora.merged_params(params, state_lib.model_lora(config))
    hf_config, state = to_hf(config.model, params)
    for role in ("bos", "eos", "pad"):
        value = getattr(tokenizer, f"{role}_id", None)
        if value is not None:
            setattr(hf_config, f"{role}_token_id", int(value))
    if config.model.family == "t5":
        hf_config.decoder_start_token_id = int(tokenizer.decoder_start_id)

    def write(staging):
        hf_config.save_pretrained(staging)
        save_file(state, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        _tokenizer_files(tokenizer, staging)

    return _write(output, write, {"step": step, "architecture": hf_config.architectures[0]})


def _write(output: str, write, result: dict) -> dict:
    """`write(staging)` into a new directory renamed to `output` when complete (the files with
    the user's umask); `result` with the output and `files`, [(path, bytes)]."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = _new_directory(parent)  # complete, then renamed
    try:
        write(staging)
        file_mode = os.stat(staging).st_mode & 0o666  # the umask's (safetensors' is 0600)
        files = []
        for name in sorted(os.listdir(staging)):
            os.chmod(os.path.join(staging, name), file_mode)
            files.append((os.path.join(output, name), os.path.getsize(os.path.join(staging, name))))
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {**result, "output": output, "files": files}


# Our kernel names -> the Llama-like modules peft names (PEFT_PREFIX + layer + module).
PEFT_MODULES = {"query": "self_attn.q_proj", "key": "self_attn.k_proj",
                "value": "self_attn.v_proj", "out": "self_attn.o_proj",
                "wi_gate": "mlp.gate_proj", "wi_up": "mlp.up_proj", "wo": "mlp.down_proj"}
PEFT_PREFIX = "base_model.model.model.layers."


def peft_state(config, params) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json's dict, adapter_model.safetensors' tensors) of a LoRA run's params:
    a Llama-like GPT's adapters as peft names and lays them out, lora_A [rank, in] = A^T and
    lora_B [out, rank] = B^T, with A and B flattened to matrices (HF's weights are [out, in])."""
    model = config.model
    if (model.family, model.get("position")) != ("gpt", "rope") or \
            (model.get("moe") and model.moe.num_experts):
        raise ValueError(f"model.family={model.family!r}, position={model.get('position')!r}: "
                         "the peft adapter export writes a Llama-like GPT's (position 'rope', "
                         "dense); export with --merge_lora instead")
    to_hf(model, lora.merged_params(params, state_lib.model_lora(config)))  # refuses the rest
    layers = _unscanned(model, _numpy(params), "decoder")["decoder"]
    state, modules = {}, set()
    for i in range(model.num_layers):
        for group in ("self_attention", "mlp"):
            for ours, theirs in PEFT_MODULES.items():
                tree = layers[f"layers_{i}"].get(group, {})
                if f"{ours}_lora_a" not in tree:
                    continue
                a, b = tree[f"{ours}_lora_a"], tree[f"{ours}_lora_b"]
                rank = a.shape[-1]
                name = f"{PEFT_PREFIX}{i}.{theirs}"
                state[f"{name}.lora_A.weight"] = a.reshape(-1, rank).T
                state[f"{name}.lora_B.weight"] = b.reshape(rank, -1).T
                modules.add(name.rsplit(".", 1)[1])
    lora_config = model.lora
    init_from = config.get("init_from", "")
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_config.rank,
        "lora_alpha": lora_config.alpha, "lora_dropout": lora_config.dropout,
        "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": init_from[3:] if init_from.startswith("hf:") else init_from}
    return adapter_config, {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


def _peft_files(config, params, directory: str) -> None:
    import json

    from safetensors.numpy import save_file

    adapter_config, state = peft_state(config, params)
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)
    save_file(state, os.path.join(directory, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def _size(num_bytes: int) -> str:
    """'812 bytes', '1.4 kB', '25.0 MB'."""
    if num_bytes < 1000:
        return f"{num_bytes} bytes"
    return f"{num_bytes / 1e3:.1f} kB" if num_bytes < 1e6 else f"{num_bytes / 1e6:.1f} MB"


def _main(argv):
    from absl import app, flags, logging

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}: expected only flags")
    logging.set_verbosity(logging.WARNING)  # one line per file, not Orbax's INFO logs
    f = flags.FLAGS
    written = export_workdir(f.workdir, f.output, f.step, f.merge_lora)
    for path, num_bytes in written["files"]:
        print(f"wrote {path} ({_size(num_bytes)})")
    print(f"step {written['step']} of {f.workdir} -> {written['output']} as "
          f"{written['architecture']}" + ("" if "peft" in written["architecture"] else
                                          ", with its tokenizer"))


def _define_flags():
    from absl import flags

    flags.DEFINE_string("workdir", None, "Training workdir to export.", required=True)
    flags.DEFINE_string("output", None, "New directory for the save_pretrained files.",
                        required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_bool("merge_lora", False, "A LoRA run: write the merged model (W + alpha/rank "
                      "A B) instead of a peft adapter directory.")


if __name__ == "__main__":
    from transformer.utils import cli

    cli.run(_main, _define_flags)
