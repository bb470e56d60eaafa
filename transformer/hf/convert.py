"""Import Hugging Face checkpoints (GPT-2, BERT, T5, Llama, Mistral, Qwen2, Qwen3, Gemma 2,
OLMo 2, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE) into this project's models.

`from_hf(hf_config, state_dict)` returns (model config group, params). The state dict may hold
torch tensors or NumPy arrays (torch itself is not needed here). Any parameter the model needs
that the checkpoint lacks, and any checkpoint tensor left unused, is an error naming it. A base
model without its head (BertModel, LlamaModel, T5EncoderModel, ...) gives `head="none"`: the
model then returns its last layer's vectors, as the base model's `last_hidden_state`.

    import transformers
    hf = transformers.GPT2LMHeadModel.from_pretrained("gpt2")
    model_config, params = from_hf(hf.config, hf.state_dict())
    logits = build_model(model_config).apply({"params": params}, tokens)

This module holds the GPT-2, BERT and T5 converters; `convert_llama` the Llama-like ones and
`common` what they share.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from transformer.hf import (
    convert_deepseek,
    convert_gpt_oss,
    convert_llama,
    convert_mamba2,
    convert_qwen3_next,
)
from transformer.hf.common import (
    Checkpoint,
    head_tied,
    maybe_scan,
    model_config,
    norm_params,
    split_heads,
)

# GPT-2's activation_function and BERT's hidden_act (T5's feed-forward: _t5_activation).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu"}


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r}: expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def gpt2(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """GPT2LMHeadModel / GPT2Model -> (config for `DecoderLM`, params). Tied embeddings are the
    LM head; an untied GPT2Model without lm_head.weight gives head "none"."""
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                 "add_cross_attention"):
        if getattr(hf_config, name, False):
            raise ValueError(f"GPT-2 {name}=True: expected False (this model does not "
                             "represent it)")
    if getattr(hf_config, "embd_pdrop", hf_config.resid_pdrop) != hf_config.resid_pdrop:
        raise ValueError(f"GPT-2 embd_pdrop={hf_config.embd_pdrop} with resid_pdrop="
                         f"{hf_config.resid_pdrop}: expected them equal (one model.dropout_rate)")
    d, n = hf_config.n_embd, hf_config.n_head
    root = "transformer." if any(k.startswith("transformer.") for k in state_dict) else ""
    tie = head_tied(getattr(hf_config, "tie_word_embeddings", True), state_dict,
                    f"{root}wte.weight")
    headless = not tie and "lm_head.weight" not in state_dict
    config = model_config(
        family="gpt", vocab_size=hf_config.vocab_size, tie_embeddings=tie,
        head="none" if headless else "mlm",
        num_layers=hf_config.n_layer, d_model=d, num_heads=n, d_ff=hf_config.n_inner or 4 * d,
        activation=_activation(hf_config.activation_function), norm="layernorm",
        norm_placement="pre", norm_epsilon=hf_config.layer_norm_epsilon, position="learned",
        max_len=hf_config.n_positions, use_bias=True, init_std=hf_config.initializer_range,
        # scale_attn_weights=False: logits q.k unscaled
        attention_scale=None if getattr(hf_config, "scale_attn_weights", True) else 1.0,
        dropout_rate=hf_config.resid_pdrop, attention_dropout_rate=hf_config.attn_pdrop)
    buffers = tuple(k for k in state_dict if k.endswith((".attn.bias", ".attn.masked_bias")))
    ckpt = Checkpoint(state_dict, buffers + (("lm_head.weight",) if tie else ()), dtype)
    decoder = {"position_embedding": {"embedding": ckpt(f"{root}wpe.weight")},
               "final_norm": norm_params(ckpt, f"{root}ln_f")}
    for i in range(hf_config.n_layer):
        p = f"{root}h.{i}."
        q, k, v = np.split(ckpt(p + "attn.c_attn.weight"), 3, axis=1)  # Conv1D: [in, out]
        qb, kb, vb = np.split(ckpt(p + "attn.c_attn.bias"), 3)
        decoder[f"layers_{i}"] = {
            "self_attention_norm": norm_params(ckpt, p + "ln_1"),
            "self_attention": {
                "query": split_heads(q, n), "key": split_heads(k, n), "value": split_heads(v, n),
                "query_bias": qb.reshape(n, -1), "key_bias": kb.reshape(n, -1),
                "value_bias": vb.reshape(n, -1),
                "out": ckpt(p + "attn.c_proj.weight").reshape(n, -1, d),
                "out_bias": ckpt(p + "attn.c_proj.bias"),
            },
            "mlp_norm": norm_params(ckpt, p + "ln_2"),
            "mlp": {"wi": ckpt(p + "mlp.c_fc.weight"), "wi_bias": ckpt(p + "mlp.c_fc.bias"),
                    "wo": ckpt(p + "mlp.c_proj.weight"), "wo_bias": ckpt(p + "mlp.c_proj.bias")},
        }
    params = {"embed": {"embedding": ckpt(f"{root}wte.weight")}, "decoder": decoder}
    if not tie and not headless:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, maybe_scan(config, params, "decoder")


def _check_bert(hf_config, classify: bool, num_classes: int) -> None:
    """Refuses, in one line, a BERT setting or head the bert family does not represent."""
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BERT position_embedding_type={hf_config.position_embedding_type!r}: "
                         "expected 'absolute'")
    for name, supported in (("is_decoder", False), ("add_cross_attention", False),
                            ("tie_word_embeddings", True)):
        if getattr(hf_config, name, supported) != supported:
            raise ValueError(f"BERT {name}={getattr(hf_config, name)!r}: expected {supported!r} "
                             "(this model does not represent it)")
    dropout = getattr(hf_config, "classifier_dropout", None)
    if dropout is not None and dropout != hf_config.hidden_dropout_prob:
        raise ValueError(f"BERT classifier_dropout={dropout} with hidden_dropout_prob="
                         f"{hf_config.hidden_dropout_prob}: expected None or equal (one "
                         "model.dropout_rate)")
    kind = (getattr(hf_config, "architectures", None) or [None])[0]
    if classify and kind not in (None, "BertForSequenceClassification"):
        raise ValueError(f"BERT architectures={[kind]}: its classifier is not a [CLS] sequence "
                         "classifier (expected BertForSequenceClassification, BertForMaskedLM, "
                         "BertForPreTraining or BertModel)")
    problem = getattr(hf_config, "problem_type", None)  # None: regression if one label
    if classify and (problem or ("regression" if num_classes == 1 else None)) not in (
            None, "single_label_classification"):
        raise ValueError(f"BERT problem_type={problem!r} with {num_classes} label(s): expected "
                         "single-label classification (num_labels >= 2); regression and "
                         "multi-label heads are not represented")


def bert(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """BertForMaskedLM / BertForPreTraining (MLM part) / BertForSequenceClassification, or a
    BertModel (keys with or without "bert."; every sentence-transformers checkpoint): head
    "none", the encoder's params, and its pooler's if it has one (unused by head "none"; a
    classifier's `init_from` loads it; `init_from` starts any other head fresh)."""
    d, n = hf_config.hidden_size, hf_config.num_attention_heads
    root = "bert." if any(k.startswith("bert.") for k in state_dict) else ""
    classify = any(k.startswith("classifier.") for k in state_dict)
    mlm = any(k.startswith("cls.predictions.") for k in state_dict)
    num_classes = int(np.shape(state_dict["classifier.weight"])[0]) if classify else 0
    _check_bert(hf_config, classify, num_classes)
    config = model_config(
        family="bert", vocab_size=hf_config.vocab_size, num_layers=hf_config.num_hidden_layers,
        d_model=d, num_heads=n, d_ff=hf_config.intermediate_size,
        activation=_activation(hf_config.hidden_act), norm="layernorm", norm_placement="post",
        norm_epsilon=hf_config.layer_norm_eps, position="learned",
        max_len=hf_config.max_position_embeddings, use_bias=True, embedding_norm=True,
        init_std=hf_config.initializer_range, dropout_rate=hf_config.hidden_dropout_prob,
        attention_dropout_rate=hf_config.attention_probs_dropout_prob,
        type_vocab_size=hf_config.type_vocab_size,
        head="classify" if classify else "mlm" if mlm else "none",
        num_classes=num_classes)
    ignored = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
               "cls.seq_relationship.weight", "cls.seq_relationship.bias",
               f"{root}embeddings.position_ids")  # a buffer older versions saved
    if mlm:  # the MLM checkpoints' pooler is unused by the MLM head
        ignored += (f"{root}pooler.dense.weight", f"{root}pooler.dense.bias")
    ckpt = Checkpoint(state_dict, ignored, dtype)
    e = f"{root}embeddings."
    encoder = {"position_embedding": {"embedding": ckpt(e + "position_embeddings.weight")},
               "embedding_norm": norm_params(ckpt, e + "LayerNorm")}
    for i in range(hf_config.num_hidden_layers):
        p = f"{root}encoder.layer.{i}."
        attn = {}
        for ours, theirs in (("query", "query"), ("key", "key"), ("value", "value")):
            attn[ours] = split_heads(ckpt(f"{p}attention.self.{theirs}.weight", True), n)
            attn[f"{ours}_bias"] = ckpt(f"{p}attention.self.{theirs}.bias").reshape(n, -1)
        attn["out"] = ckpt(p + "attention.output.dense.weight", True).reshape(n, -1, d)
        attn["out_bias"] = ckpt(p + "attention.output.dense.bias")
        encoder[f"layers_{i}"] = {
            "self_attention": attn,
            "self_attention_norm": norm_params(ckpt, p + "attention.output.LayerNorm"),
            "mlp": {"wi": ckpt(p + "intermediate.dense.weight", True),
                    "wi_bias": ckpt(p + "intermediate.dense.bias"),
                    "wo": ckpt(p + "output.dense.weight", True),
                    "wo_bias": ckpt(p + "output.dense.bias")},
            "mlp_norm": norm_params(ckpt, p + "output.LayerNorm"),
        }
    params = {"embed": {"embedding": ckpt(e + "word_embeddings.weight")},
              "type_embed": {"embedding": ckpt(e + "token_type_embeddings.weight")},
              "encoder": encoder}
    if not mlm and ckpt.has(f"{root}pooler.dense.weight"):
        params["pooler"] = {"kernel": ckpt(f"{root}pooler.dense.weight", True),
                            "bias": ckpt(f"{root}pooler.dense.bias")}
    if classify:
        params["classifier"] = {"kernel": ckpt("classifier.weight", True),
                                "bias": ckpt("classifier.bias")}
    elif mlm:
        t = "cls.predictions."
        params["mlm_dense"] = {"kernel": ckpt(t + "transform.dense.weight", True),
                               "bias": ckpt(t + "transform.dense.bias")}
        params["mlm_norm"] = norm_params(ckpt, t + "transform.LayerNorm")
        params["mlm_bias"] = ckpt(t + "bias")
    ckpt.check_all_used()
    return config, maybe_scan(config, params, "encoder")


def _t5_activation(hf_config) -> str:
    """T5's feed-forward as the model builds it: `is_gated_act` and `dense_act_fn` (which
    T5Config derives from feed_forward_proj, and which a config may also set directly)."""
    gated = bool(getattr(hf_config, "is_gated_act", False))
    act = getattr(hf_config, "dense_act_fn", "relu")
    table = {"gelu_new": "geglu", "gelu_pytorch_tanh": "geglu", "silu": "swiglu"} if gated \
        else {"relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
              "gelu": "gelu"}
    if act not in table:
        raise ValueError(f"T5 dense_act_fn={act!r} with is_gated_act={gated}: expected one of "
                         f"{sorted(table)}")
    return table[act]


def t5(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """T5ForConditionalGeneration / T5Model (T5 v1.0 and v1.1 / gated-GELU) -> (config,
    params). A T5EncoderModel (no decoder.* weights) becomes the encoder-only family "bert"
    with T5's settings (RMSNorm, relative position buckets, no token types) and head "none"."""
    if getattr(hf_config, "is_decoder", False):
        raise ValueError("T5 is_decoder=True: expected False (an encoder-decoder checkpoint)")
    d, n = hf_config.d_model, hf_config.num_heads
    # transformers 5 always ties T5's head and records the original choice as
    # `scale_decoder_outputs`; older configs say `tie_word_embeddings`. Trust the tensors.
    tie = head_tied(True, state_dict, "shared.weight")
    scale = getattr(hf_config, "scale_decoder_outputs", getattr(
        hf_config, "tie_word_embeddings", True))
    encoder_only = not any(k.startswith("decoder.") for k in state_dict)  # T5EncoderModel
    config = model_config(
        family="bert" if encoder_only else "t5", vocab_size=hf_config.vocab_size,
        tie_embeddings=tie, scale_decoder_output=bool(scale), num_layers=hf_config.num_layers,
        num_decoder_layers=None if encoder_only else hf_config.num_decoder_layers,
        **(dict(type_vocab_size=0, head="none") if encoder_only else {}),
        d_model=d, num_heads=n, head_dim=hf_config.d_kv, d_ff=hf_config.d_ff,
        activation=_t5_activation(hf_config), norm="rmsnorm",
        norm_placement="pre", norm_epsilon=hf_config.layer_norm_epsilon, position="t5",
        t5_num_buckets=hf_config.relative_attention_num_buckets,
        t5_max_distance=hf_config.relative_attention_max_distance, use_bias=False,
        attention_scale=1.0, dropout_rate=hf_config.dropout_rate,
        attention_dropout_rate=hf_config.dropout_rate, init_std=None)
    duplicates = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    ckpt = Checkpoint(state_dict, duplicates + (("lm_head.weight",) if tie else ()), dtype)
    gated = config.activation in ("geglu", "swiglu")

    def attention(prefix):
        return {"query": split_heads(ckpt(prefix + "q.weight", True), n),
                "key": split_heads(ckpt(prefix + "k.weight", True), n),
                "value": split_heads(ckpt(prefix + "v.weight", True), n),
                "out": ckpt(prefix + "o.weight", True).reshape(n, -1, d)}

    def mlp(prefix):
        if gated:
            return {"wi_gate": ckpt(prefix + "wi_0.weight", True),
                    "wi_up": ckpt(prefix + "wi_1.weight", True),
                    "wo": ckpt(prefix + "wo.weight", True)}
        return {"wi": ckpt(prefix + "wi.weight", True), "wo": ckpt(prefix + "wo.weight", True)}

    def stack(name, num_layers, cross):
        first = f"{name}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        params = {"relative_position_bias": {"rel_embedding": ckpt(first)},
                  "final_norm": norm_params(ckpt, f"{name}.final_layer_norm", bias=False)}
        for i in range(num_layers):
            p = f"{name}.block.{i}.layer."
            layer = {"self_attention": attention(p + "0.SelfAttention."),
                     "self_attention_norm": norm_params(ckpt, p + "0.layer_norm", bias=False)}
            if cross:
                layer["cross_attention"] = attention(p + "1.EncDecAttention.")
                layer["cross_attention_norm"] = norm_params(ckpt, p + "1.layer_norm", bias=False)
            ff = 2 if cross else 1
            layer["mlp"] = mlp(f"{p}{ff}.DenseReluDense.")
            layer["mlp_norm"] = norm_params(ckpt, f"{p}{ff}.layer_norm", bias=False)
            params[f"layers_{i}"] = layer
        return params

    params = {"embed": {"embedding": ckpt("shared.weight")},
              "encoder": stack("encoder", hf_config.num_layers, False)}
    if not encoder_only:
        params["decoder"] = stack("decoder", hf_config.num_decoder_layers, True)
    if not tie:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, maybe_scan(config, params, *(k for k in ("encoder", "decoder") if k in params))


def from_hf(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Dispatches on `hf_config.model_type` (gpt2, bert, t5, llama, mistral, qwen2, qwen3,
    gemma2, gemma3_text, olmo2, olmo3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3, gpt_oss,
    mamba2, qwen3_next);
    params as `dtype` arrays."""
    llama = convert_llama
    converters = {"gpt2": gpt2, "bert": bert, "t5": t5, "llama": llama.llama,
                  "mistral": llama.mistral, "qwen2": llama.qwen2, "qwen3": llama.qwen3,
                  "gemma2": llama.gemma2, "gemma3_text": llama.gemma3, "olmo2": llama.olmo2,
                  "olmo3": llama.olmo3, "mixtral": llama.mixtral, "qwen2_moe": llama.qwen2_moe,
                  "qwen3_moe": llama.qwen3_moe, "deepseek_v3": convert_deepseek.deepseek_v3,
                  "gpt_oss": convert_gpt_oss.gpt_oss, "mamba2": convert_mamba2.mamba2,
                  "qwen3_next": convert_qwen3_next.qwen3_next}
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in converters:
        raise ValueError(f"model_type={model_type!r}: expected one of {sorted(converters)}")
    return converters[model_type](hf_config, state_dict, dtype)


def scan_params(config, params) -> dict:
    """Unrolled `params` (as `from_hf` gives them) with each layer stack (encoder, decoder)
    stacked along a leading axis: the layout of the same model with scan_layers=True."""
    config = ml_collections.ConfigDict(config.to_dict())
    config.scan_layers = True
    return maybe_scan(config, params, *(k for k in ("encoder", "decoder") if k in params))

