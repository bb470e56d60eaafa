"""Import Hugging Face checkpoints (GPT-2, BERT, T5 families) into this project's models.

`from_hf(hf_config, state_dict)` returns (model config group, params). The state dict may hold
torch tensors or NumPy arrays (torch itself is not needed here). Any parameter the model needs
that the checkpoint lacks, and any checkpoint tensor left unused, is an error naming it.

    import transformers
    hf = transformers.GPT2LMHeadModel.from_pretrained("gpt2")
    model_config, params = from_hf(hf.config, hf.state_dict())
    logits = build_model(model_config).apply({"params": params}, tokens)
"""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np

from transformer.layers import stack_layers
from transformer.models import default_model_config

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "gated-gelu": "geglu", "gated-silu": "swiglu"}


class _Checkpoint:
    """A state dict that remembers which tensors were read, to report what is missing or left."""

    def __init__(self, state_dict: dict[str, Any], ignored: tuple[str, ...] = (),
                 dtype=np.float32):
        self._tensors = dict(state_dict)
        self._dtype = dtype
        self._used: set[str] = set()
        self._ignored = set(ignored)  # tied copies read under another name, unused heads

    def __call__(self, name: str, transpose: bool = False) -> np.ndarray:
        if name not in self._tensors:
            raise KeyError(f"checkpoint is missing parameter {name!r} "
                           f"({len(self._tensors)} tensors present)")
        self._used.add(name)
        tensor = self._tensors[name]
        if hasattr(tensor, "detach"):  # torch.Tensor
            tensor = tensor.detach().cpu().double().numpy()
        array = np.asarray(tensor, self._dtype)
        return array.T if transpose else array

    def has(self, name: str) -> bool:
        return name in self._tensors

    def check_all_used(self) -> None:
        unused = sorted(set(self._tensors) - self._used - self._ignored)
        if unused:
            raise ValueError(f"checkpoint has unexpected parameters {unused}: the converted "
                             "model has no place for them")


def _heads(kernel_DX: np.ndarray, num_heads: int) -> np.ndarray:
    """[D, N * H] -> [D, N, H] (HF splits the projection's output dim head by head)."""
    return kernel_DX.reshape(kernel_DX.shape[0], num_heads, -1)


def _norm(ckpt, prefix, bias=True, weight="weight", bias_name="bias"):
    params = {"scale": ckpt(f"{prefix}.{weight}")}
    if bias:
        params["bias"] = ckpt(f"{prefix}.{bias_name}")
    return params


def _model_config(**overrides) -> ml_collections.ConfigDict:
    config = default_model_config()
    config.update(overrides)
    return config


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r}: expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def gpt2(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """GPT2LMHeadModel / GPT2Model -> (config for `DecoderLM`, params)."""
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or getattr(
            hf_config, "reorder_and_upcast_attn", False):
        raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx or "
                         "reorder_and_upcast_attn are not supported")
    d, n = hf_config.n_embd, hf_config.n_head
    tie = getattr(hf_config, "tie_word_embeddings", True)
    config = _model_config(
        family="gpt", vocab_size=hf_config.vocab_size, tie_embeddings=tie,
        num_layers=hf_config.n_layer, d_model=d, num_heads=n, d_ff=hf_config.n_inner or 4 * d,
        activation=_activation(hf_config.activation_function), norm="layernorm",
        norm_placement="pre", norm_epsilon=hf_config.layer_norm_epsilon, position="learned",
        max_len=hf_config.n_positions, use_bias=True, init_std=hf_config.initializer_range,
        dropout_rate=hf_config.resid_pdrop, attention_dropout_rate=hf_config.attn_pdrop)
    root = "transformer." if any(k.startswith("transformer.") for k in state_dict) else ""
    ckpt = _Checkpoint(state_dict, ("lm_head.weight",) if tie else (), dtype)
    decoder = {"position_embedding": {"embedding": ckpt(f"{root}wpe.weight")},
               "final_norm": _norm(ckpt, f"{root}ln_f")}
    for i in range(hf_config.n_layer):
        p = f"{root}h.{i}."
        q, k, v = np.split(ckpt(p + "attn.c_attn.weight"), 3, axis=1)  # Conv1D: [in, out]
        qb, kb, vb = np.split(ckpt(p + "attn.c_attn.bias"), 3)
        decoder[f"layers_{i}"] = {
            "self_attention_norm": _norm(ckpt, p + "ln_1"),
            "self_attention": {
                "query": _heads(q, n), "key": _heads(k, n), "value": _heads(v, n),
                "query_bias": qb.reshape(n, -1), "key_bias": kb.reshape(n, -1),
                "value_bias": vb.reshape(n, -1),
                "out": ckpt(p + "attn.c_proj.weight").reshape(n, -1, d),
                "out_bias": ckpt(p + "attn.c_proj.bias"),
            },
            "mlp_norm": _norm(ckpt, p + "ln_2"),
            "mlp": {"wi": ckpt(p + "mlp.c_fc.weight"), "wi_bias": ckpt(p + "mlp.c_fc.bias"),
                    "wo": ckpt(p + "mlp.c_proj.weight"), "wo_bias": ckpt(p + "mlp.c_proj.bias")},
        }
    params = {"embed": {"embedding": ckpt(f"{root}wte.weight")}, "decoder": decoder}
    if not tie:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, _maybe_scan(config, params, "decoder")


def bert(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """BertForMaskedLM / BertForPreTraining (MLM part) / BertForSequenceClassification."""
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BERT position_embedding_type={hf_config.position_embedding_type!r}: "
                         "expected 'absolute'")
    d, n = hf_config.hidden_size, hf_config.num_attention_heads
    classify = any(k.startswith("classifier.") for k in state_dict)
    num_classes = int(np.shape(state_dict["classifier.weight"])[0]) if classify else 0
    config = _model_config(
        family="bert", vocab_size=hf_config.vocab_size, num_layers=hf_config.num_hidden_layers,
        d_model=d, num_heads=n, d_ff=hf_config.intermediate_size,
        activation=_activation(hf_config.hidden_act), norm="layernorm", norm_placement="post",
        norm_epsilon=hf_config.layer_norm_eps, position="learned",
        max_len=hf_config.max_position_embeddings, use_bias=True, embedding_norm=True,
        init_std=hf_config.initializer_range, dropout_rate=hf_config.hidden_dropout_prob,
        attention_dropout_rate=hf_config.attention_probs_dropout_prob,
        type_vocab_size=hf_config.type_vocab_size, head="classify" if classify else "mlm",
        num_classes=num_classes)
    ignored = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
               "cls.seq_relationship.weight", "cls.seq_relationship.bias")
    if not classify:  # the MLM checkpoints' pooler is unused by the MLM head
        ignored += ("bert.pooler.dense.weight", "bert.pooler.dense.bias")
    ckpt = _Checkpoint(state_dict, ignored, dtype)
    e = "bert.embeddings."
    encoder = {"position_embedding": {"embedding": ckpt(e + "position_embeddings.weight")},
               "embedding_norm": _norm(ckpt, e + "LayerNorm")}
    for i in range(hf_config.num_hidden_layers):
        p = f"bert.encoder.layer.{i}."
        attn = {}
        for ours, theirs in (("query", "query"), ("key", "key"), ("value", "value")):
            attn[ours] = _heads(ckpt(f"{p}attention.self.{theirs}.weight", True), n)
            attn[f"{ours}_bias"] = ckpt(f"{p}attention.self.{theirs}.bias").reshape(n, -1)
        attn["out"] = ckpt(p + "attention.output.dense.weight", True).reshape(n, -1, d)
        attn["out_bias"] = ckpt(p + "attention.output.dense.bias")
        encoder[f"layers_{i}"] = {
            "self_attention": attn,
            "self_attention_norm": _norm(ckpt, p + "attention.output.LayerNorm"),
            "mlp": {"wi": ckpt(p + "intermediate.dense.weight", True),
                    "wi_bias": ckpt(p + "intermediate.dense.bias"),
                    "wo": ckpt(p + "output.dense.weight", True),
                    "wo_bias": ckpt(p + "output.dense.bias")},
            "mlp_norm": _norm(ckpt, p + "output.LayerNorm"),
        }
    params = {"embed": {"embedding": ckpt(e + "word_embeddings.weight")},
              "type_embed": {"embedding": ckpt(e + "token_type_embeddings.weight")},
              "encoder": encoder}
    if classify:
        params["pooler"] = {"kernel": ckpt("bert.pooler.dense.weight", True),
                            "bias": ckpt("bert.pooler.dense.bias")}
        params["classifier"] = {"kernel": ckpt("classifier.weight", True),
                                "bias": ckpt("classifier.bias")}
    else:
        t = "cls.predictions."
        params["mlm_dense"] = {"kernel": ckpt(t + "transform.dense.weight", True),
                               "bias": ckpt(t + "transform.dense.bias")}
        params["mlm_norm"] = _norm(ckpt, t + "transform.LayerNorm")
        params["mlm_bias"] = ckpt(t + "bias")
    ckpt.check_all_used()
    return config, _maybe_scan(config, params, "encoder")


def t5(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """T5ForConditionalGeneration (T5 v1.0 and v1.1 / gated-GELU) -> (config, params)."""
    d, n = hf_config.d_model, hf_config.num_heads
    # transformers 5 always ties T5's head and records the original choice as
    # `scale_decoder_outputs`; older configs say `tie_word_embeddings`. Trust the tensors.
    tie = "lm_head.weight" not in state_dict or np.array_equal(
        _Checkpoint(state_dict)("lm_head.weight"), _Checkpoint(state_dict)("shared.weight"))
    scale = getattr(hf_config, "scale_decoder_outputs", getattr(
        hf_config, "tie_word_embeddings", True))
    config = _model_config(
        family="t5", vocab_size=hf_config.vocab_size, tie_embeddings=tie,
        scale_decoder_output=bool(scale),
        num_layers=hf_config.num_layers, num_decoder_layers=hf_config.num_decoder_layers,
        d_model=d, num_heads=n, head_dim=hf_config.d_kv, d_ff=hf_config.d_ff,
        activation=_activation(hf_config.feed_forward_proj), norm="rmsnorm",
        norm_placement="pre", norm_epsilon=hf_config.layer_norm_epsilon, position="t5",
        t5_num_buckets=hf_config.relative_attention_num_buckets,
        t5_max_distance=hf_config.relative_attention_max_distance, use_bias=False,
        attention_scale=1.0, dropout_rate=hf_config.dropout_rate,
        attention_dropout_rate=hf_config.dropout_rate, init_std=None)
    duplicates = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    ckpt = _Checkpoint(state_dict, duplicates + (("lm_head.weight",) if tie else ()), dtype)
    gated = config.activation in ("geglu", "swiglu")

    def attention(prefix):
        return {"query": _heads(ckpt(prefix + "q.weight", True), n),
                "key": _heads(ckpt(prefix + "k.weight", True), n),
                "value": _heads(ckpt(prefix + "v.weight", True), n),
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
                  "final_norm": _norm(ckpt, f"{name}.final_layer_norm", bias=False)}
        for i in range(num_layers):
            p = f"{name}.block.{i}.layer."
            layer = {"self_attention": attention(p + "0.SelfAttention."),
                     "self_attention_norm": _norm(ckpt, p + "0.layer_norm", bias=False)}
            if cross:
                layer["cross_attention"] = attention(p + "1.EncDecAttention.")
                layer["cross_attention_norm"] = _norm(ckpt, p + "1.layer_norm", bias=False)
            ff = 2 if cross else 1
            layer["mlp"] = mlp(f"{p}{ff}.DenseReluDense.")
            layer["mlp_norm"] = _norm(ckpt, f"{p}{ff}.layer_norm", bias=False)
            params[f"layers_{i}"] = layer
        return params

    params = {"embed": {"embedding": ckpt("shared.weight")},
              "encoder": stack("encoder", hf_config.num_layers, False),
              "decoder": stack("decoder", hf_config.num_decoder_layers, True)}
    if not tie:
        params["lm_head"] = {"kernel": ckpt("lm_head.weight", transpose=True)}
    ckpt.check_all_used()
    return config, _maybe_scan(config, params, "encoder", "decoder")


def from_hf(hf_config, state_dict, dtype=np.float32) -> tuple[ml_collections.ConfigDict, dict]:
    """Dispatches on `hf_config.model_type` (gpt2, bert, t5); params as `dtype` arrays."""
    converters = {"gpt2": gpt2, "bert": bert, "t5": t5}
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in converters:
        raise ValueError(f"model_type={model_type!r}: expected one of {sorted(converters)}")
    return converters[model_type](hf_config, state_dict, dtype)


def _maybe_scan(config, params, *stacks):
    """Stack per-layer params along a leading axis when the config scans layers."""
    if not config.scan_layers:
        return params
    params = dict(params)
    for name in stacks:
        layers = config.num_decoder_layers if name == "decoder" and config.num_decoder_layers \
            else config.num_layers
        params[name] = stack_layers(params[name], layers)
    return params
