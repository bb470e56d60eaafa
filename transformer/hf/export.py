"""Our params and model config as a Hugging Face model: `to_hf(model_config, params)` is the
inverse of `transformer.hf.convert.from_hf` for models with a head (an imported BertModel or
T5EncoderModel, head "none", is refused: no task class holds it). A GPT becomes GPT-2 (learned
positions, LayerNorm, biases) or one of the Llama-like classes (RoPE: `export_llama`), a BERT
BertForMaskedLM (or BertForSequenceClassification for a [CLS] classifier), and a T5
T5ForConditionalGeneration (tied head, v1.0 or v1.1 feed-forward). `peft_state` gives a LoRA
run's adapters as a peft adapter.

Each exporter lists the model keys it maps (`allowlist.Exporter`); any other model key set away
from its default, or a listed key at a value the class cannot hold, is refused with a one-line
ValueError naming the key, its value and the exporter, before anything is written. An
architecture no Hugging Face class represents at all (ALiBi or T5-bias positions in a GPT, a
GPT classifier, ...) is refused the same way.

Needs `transformers` (pip install transformers); torch is not needed.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from flax import traverse_util

from transformer.hf import (
    allowlist,
    convert_deepseek,
    convert_mamba2,
    convert_qwen3_next,
    export_llama,
)
from transformer.hf.allowlist import ANY, SHAPES, Exporter
from transformer.hf.common import flat_heads
from transformer.models import default_model_config
from transformer.nn import lora
from transformer.nn.config import parse_layer_types
from transformer.nn.layers import unstack_layers
from transformer.nn.mixers import MIXERS

_GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
_T5_ACTIVATIONS = {"relu": "relu", "geglu": "gated-gelu", "swiglu": "gated-silu"}

GPT2 = Exporter("gpt2", "GPT-2", dict(
    family=("gpt",), head=("mlm",), position=("learned",), norm=("layernorm",),
    norm_placement=("pre",), use_bias=(True,), qkv_bias=(None, True),
    activation=tuple(_GPT2_ACTIVATIONS), num_kv_heads=(None,), attention_scale=(None, 1.0),
    **SHAPES, tie_embeddings=ANY, head_dim=ANY))  # head_dim: checked in _gpt2
BERT = Exporter("bert", "BERT", dict(
    family=("bert",), position=("learned",), norm=("layernorm",), norm_placement=("post",),
    use_bias=(True,), qkv_bias=(None, True), embedding_norm=(True,),
    activation=tuple(_BERT_ACTIVATIONS), num_kv_heads=(None,), attention_scale=(None,),
    head=("mlm", "classify"), **SHAPES, num_classes=ANY, type_vocab_size=ANY,
    tie_embeddings=ANY))  # our BERT's MLM head always ties: tie_embeddings unused
T5 = Exporter("t5", "T5", dict(
    family=("t5",), head=("mlm",), position=("t5",), norm=("rmsnorm",), norm_placement=("pre",),
    use_bias=(False,), qkv_bias=(None, False), attention_scale=(1.0,),
    activation=tuple(_T5_ACTIVATIONS), num_kv_heads=(None,), **SHAPES, tie_embeddings=ANY,
    head_dim=ANY, num_decoder_layers=ANY, t5_num_buckets=ANY, t5_max_distance=ANY,
    scale_decoder_output=ANY))  # tie_embeddings: checked in _t5
# The LoRA settings a peft adapter maps (the base model is checked by its own exporter).
PEFT = Exporter("peft", "peft LoRA", {"lora.rank": ANY, "lora.alpha": ANY, "lora.dropout": ANY,
                                      "lora.targets": ANY, "lora.base_quantization": ANY})


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


def _ln(norm: dict, prefix: str, out: dict, weight="weight", bias="bias") -> None:
    out[f"{prefix}.{weight}"] = norm["scale"]
    if "bias" in norm:
        out[f"{prefix}.{bias}"] = norm["bias"]


def _gpt2(config, params, transformers):
    allowlist.check(GPT2, config)
    if config.head_dim not in (None, config.d_model // config.num_heads):
        raise allowlist.refusal(GPT2, "head_dim", config.head_dim, "None or d_model / "
                                "num_heads")
    hf_config = transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_len, n_embd=config.d_model,
        n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.d_ff,
        activation_function=_GPT2_ACTIVATIONS[config.activation],
        layer_norm_epsilon=config.norm_epsilon, tie_word_embeddings=config.tie_embeddings,
        resid_pdrop=config.dropout_rate, embd_pdrop=config.dropout_rate,
        attn_pdrop=config.attention_dropout_rate, initializer_range=config.init_std or 0.02,
        scale_attn_weights=config.attention_scale is None, architectures=["GPT2LMHeadModel"],
        bos_token_id=None, eos_token_id=None)  # (GPT-2's 50256 warns past a smaller vocabulary)
    decoder, out = params["decoder"], {}
    out["transformer.wte.weight"] = params["embed"]["embedding"]
    out["transformer.wpe.weight"] = decoder["position_embedding"]["embedding"]
    _ln(decoder["final_norm"], "transformer.ln_f", out)
    for i in range(config.num_layers):
        layer, p = decoder[f"layers_{i}"], f"transformer.h.{i}."
        attn = layer["self_attention"]
        out[p + "attn.c_attn.weight"] = np.concatenate(
            [flat_heads(attn[k]) for k in ("query", "key", "value")], axis=1)
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


def _bert(config, params, transformers):
    allowlist.check(BERT, config)
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
        raise allowlist.refusal(BERT, "type_vocab_size", 0, ">= 1: token type embeddings")
    encoder, e = params["encoder"], "bert.embeddings."
    out = {e + "word_embeddings.weight": params["embed"]["embedding"],
           e + "position_embeddings.weight": encoder["position_embedding"]["embedding"],
           e + "token_type_embeddings.weight": params["type_embed"]["embedding"]}
    _ln(encoder["embedding_norm"], e + "LayerNorm", out)
    for i in range(config.num_layers):
        layer, p = encoder[f"layers_{i}"], f"bert.encoder.layer.{i}."
        attn = layer["self_attention"]
        for name in ("query", "key", "value"):
            out[f"{p}attention.self.{name}.weight"] = flat_heads(attn[name]).T
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


def _t5(config, params, transformers):
    allowlist.check(T5, config)
    if not config.tie_embeddings:  # transformers 5 always ties T5's head to `shared`
        raise allowlist.refusal(T5, "tie_embeddings", False, "True: transformers 5's "
                                "T5ForConditionalGeneration always ties its head")
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
            out[f"{prefix}{theirs}.weight"] = flat_heads(attn[name]).T
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


def task_labels(config, saved_stream: dict | None = None) -> list[str] | None:
    """The class names of a run config's labeled task, in class order, for a classifier's
    exported id2label (None: the model has no class head): the ones `saved_stream` (the
    checkpoint's, `checkpoint.saved_stream`) records (`tasks.LABELS`), with no data read.
    A checkpoint saved before they were recorded: the task's data is read, as training did;
    where it is not there (an export on another machine), or where its content fingerprints
    differ from `saved_stream`'s (the names would be the new data's, not the trained
    classes'), a warning says the names stay transformers' LABEL_i, and None."""
    import sys

    from transformer.data import inputs, tasks
    from transformer.models import family_of

    if not family_of(config).classifier(config.model):
        return None
    if saved_stream is not None and saved_stream.get(tasks.LABELS) is not None:
        return list(saved_stream[tasks.LABELS])
    fallback = "id2label stays LABEL_0, LABEL_1, ..."
    try:
        task = inputs.labeled_task(config)
    except FileNotFoundError as error:
        print(f"warning: data.path={config.data.path!r}: the classifier's label names come from "
              f"its task's data ({error}): {fallback}", file=sys.stderr)
        return None
    if task is not None and saved_stream is not None:
        changed = [key for key, value in inputs.data_stream(config).items()
                   if key.endswith("fingerprint") and saved_stream.get(key) != value]
        if changed:
            print(f"warning: data.path={config.data.path!r}: the data changed since the "
                  f"checkpoint was saved (a different {', '.join(changed)}), so its class names "
                  f"may not be the trained ones: {fallback}", file=sys.stderr)
            return None
    return None if task is None else list(task.labels)


# The classes with experts in every layer (DeepSeek-V3's after its first_k_dense_replace dense
# ones): a model without experts has no such class, whatever its (then unused) moe.* keys say.
_NEEDS_EXPERTS = {"deepseek_v3": "DeepSeek-V3's layers after first_k_dense_replace route to "
                                 "experts", "qwen3_next": "Qwen3-Next's layers route to experts"}


def _check(exporter: Exporter, model_config) -> None:
    """`allowlist.check`, after refusing a model without experts for a class that has them (its
    routing keys at their defaults would be named instead, or pass and write a broken model)."""
    experts = model_config.moe.num_experts if model_config.get("moe") else 0
    if exporter.name in _NEEDS_EXPERTS and not experts:
        raise allowlist.refusal(exporter, "moe.num_experts", experts,
                                f">= 1: {_NEEDS_EXPERTS[exporter.name]}")
    allowlist.check(exporter, model_config)


def _without_token_ids(hf_config) -> None:
    """No bos / eos / pad ids: a transformers config class's defaults (GPT-2's 50256, Llama's 1
    and 2, Mamba 2's 0, 2 and 1) are its tokenizer's, not ours; `transformer.export` writes the
    run's tokenizer's (or its import's) ids."""
    for role in ("bos", "eos", "pad"):
        setattr(hf_config, f"{role}_token_id", None)


def to_hf(model_config, params, labels=None) -> tuple[Any, dict[str, np.ndarray]]:
    """(transformers config, state dict of float32 NumPy arrays) of a model of this project:
    the checkpoint `convert.from_hf` reads back into the same params. Refuses, with a one-line
    ValueError naming the setting, what no Hugging Face class represents (a LoRA model's
    adapters included: merge them first, with `base_model_config`). `labels`: a classifier's
    class names (`task_labels`), its id2label; None leaves transformers' LABEL_i. A causal
    LM's config names no token ids (`_without_token_ids`): the caller sets its tokenizer's."""
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
        exporter = {"learned": _gpt2, "rope": export_llama.export}.get(model_config.position)
        if model_config.get("layer_types") == "mamba2":  # no positions, no feed-forward
            _check(convert_mamba2.exporter(), model_config)
            exporter = convert_mamba2.to_hf
        if "linear_attention" in (model_config.get("layer_types") or ""):
            _check(convert_qwen3_next.exporter(), model_config)
            exporter = convert_qwen3_next.to_hf
        if model_config.get("attention_kind") == "mla":
            _check(convert_deepseek.exporter(), model_config)
            exporter = convert_deepseek.to_hf
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
    if family == "gpt":
        _without_token_ids(hf_config)
    if labels is not None and model_config.get("head") == "classify":
        hf_config.id2label = dict(enumerate(labels))  # one name per class (training checked)
        hf_config.label2id = {name: i for i, name in enumerate(labels)}
    return hf_config, {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


# Our kernel names -> the Llama-like modules peft names (PEFT_PREFIX + layer + module).
PEFT_MODULES = {"query": "self_attn.q_proj", "key": "self_attn.k_proj",
                "value": "self_attn.v_proj", "out": "self_attn.o_proj",
                "wi_gate": "mlp.gate_proj", "wi_up": "mlp.up_proj", "wo": "mlp.down_proj"}
PEFT_PREFIX = "base_model.model.model.layers."


def peft_state(config, params) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json's dict, adapter_model.safetensors' tensors) of a LoRA run's params:
    a Llama-like GPT's adapters as peft names and lays them out, lora_A [rank, in] = A^T and
    lora_B [out, rank] = B^T, with A and B flattened to matrices (HF's weights are [out, in]).
    peft attaches adapters to exactly the adapted modules (`_peft_targets`)."""
    model = config.model
    if (refused := _peft_refusal(model)) is not None:
        raise ValueError(f"{refused}: the peft adapter export writes a dense Llama-like GPT's "
                         "(family 'gpt', position 'rope', softmax attention layers); export "
                         "with --merge_lora instead")
    allowlist.check(PEFT, model, prefix="lora.")
    layers = _unscanned(model, _numpy(params), "decoder")["decoder"]
    # an adapter on a kernel peft has no module for (attention's gate, ...) is refused, not
    # dropped
    kernels = {k[:-1] + (k[-1][:-len("_lora_a")],) for k in traverse_util.flatten_dict(layers)
               if k[-1].endswith("_lora_a")}
    if left := sorted(k for k in kernels if k[-2] not in ("self_attention", "mlp")
                      or k[-1] not in PEFT_MODULES):
        raise ValueError(f"model.lora.targets={model.lora.targets!r} adapts decoder/"
                         f"{'/'.join(left[0])}, which the peft adapter export has no module "
                         f"for (it writes {', '.join(PEFT_MODULES)}); export with --merge_lora "
                         "instead")
    merged = lora.merged_params(params, lora.LoraConfig(**model.lora.to_dict()))
    to_hf(base_model_config(model), merged)  # refuses the rest
    state, adapted = {}, set()
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
                adapted.add((i, theirs))
    lora_config = model.lora
    init_from = config.get("init_from", "")
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_config.rank,
        "lora_alpha": lora_config.alpha, "lora_dropout": lora_config.dropout,
        **_peft_targets(adapted, model.num_layers), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": init_from[3:] if init_from.startswith("hf:") else init_from}
    return adapter_config, {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


def _peft_refusal(model) -> str | None:
    """The first model setting the peft export cannot write adapters for, as `KEY=VALUE`
    (None: a Llama-like GPT's, whose adapted kernels are all in `PEFT_MODULES`)."""
    layer_types = model.get("layer_types") or ""
    other = [t for t in parse_layer_types(layer_types)
             if MIXERS[t].param_name != "self_attention"] if layer_types else []
    moe = model.get("moe")
    for name, value, ok in (
            ("family", model.family, model.family == "gpt"),
            ("position", model.get("position"), model.get("position") == "rope"),
            ("moe.num_experts", moe and moe.num_experts, not (moe and moe.num_experts)),
            ("attention_kind", model.get("attention_kind", "mha"),
             model.get("attention_kind", "mha") == "mha"),  # MLA: q_a, q_b, kv_a, ...
            ("layer_types", layer_types, not other)):  # a Gated DeltaNet's or Mamba 2's
        if not ok:
            return f"model.{name}={value!r}"
    return None


def _peft_targets(adapted: set[tuple[int, str]], num_layers: int) -> dict:
    """adapter_config.json's keys that make peft attach adapters to exactly the `adapted`
    (layer, module) pairs: target_modules, with layers_to_transform when only some layers
    have them; a regex of the exact modules where the pairs are no layers x modules grid."""
    layers = sorted({i for i, _ in adapted})
    modules = sorted({m.rsplit(".", 1)[1] for _, m in adapted})
    if adapted == {(i, m) for i in layers for m in {m for _, m in adapted}}:
        some = len(layers) < num_layers
        return {"target_modules": modules, "layers_to_transform": layers if some else None,
                "layers_pattern": "layers" if some else None}
    names = "|".join(re.escape(f"{i}.{m}") for i, m in sorted(adapted))
    return {"target_modules": rf"model\.layers\.(?:{names})", "layers_to_transform": None,
            "layers_pattern": None}


def base_model_config(model_config):
    """The model config of a LoRA model's merged weights (or of its base): lora.* at their
    defaults, the rest as `model_config`'s."""
    config = model_config.copy_and_resolve_references()
    if "lora" in config:
        config.lora = default_model_config().lora
    return config
