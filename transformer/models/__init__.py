"""Model families: the one table of them (`FAMILIES`), and `build_model` to make one from an
ml_collections `model` config group.

A family is declared once, beside its model, as a `family.Family` (how a batch feeds it, its
loss and objectives, whether and how it decodes); code outside transformer/models looks the
family up here instead of branching on its name.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from transformer.models import bert, gpt, lstm, t5, vision
from transformer.models.bert import EncoderModel
from transformer.models.family import Family, transformer_config
from transformer.models.gpt import DecoderLM
from transformer.models.lstm import LSTMLM
from transformer.models.t5 import EncoderDecoder, shift_right
from transformer.models.vision import CLIP, Captioner, ViTClassifier
from transformer.nn import quantization
from transformer.nn.config import TransformerConfig, parse_layer_types
from transformer.nn.mixers import RECURRENT
from transformer.utils.keys import BOOL, Key, described, int_, one_of, optional

FAMILIES: dict[str, Family] = {family.name: family for family in (
    gpt.GPT, gpt.PREFIX_LM, bert.BERT, t5.T5, lstm.LSTM, vision.VIT, vision.CLIP_FAMILY,
    vision.CAPTIONER)}
_OPTIONAL_FIELDS = {"num_kv_heads": int, "head_dim": int, "init_std": float,
                    "attention_scale": float, "qkv_bias": bool, "sliding_window": int,
                    "num_decoder_layers": int, "rope_local_theta": float}


def family_of(config: ml_collections.ConfigDict) -> Family:
    """The `Family` of a run config (or of its `model` group), or a one-line error."""
    name = getattr(config, "model", config).family
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r}: expected one of {tuple(FAMILIES)}")
    return FAMILIES[name]


# The model group's keys outside TransformerConfig (whose fields declare their own), each
# declared once: default, check, meaning, and whether a resume must keep it (structural).
MODEL_KEYS: dict[str, Key] = {
    "family": Key("gpt", "The model family (`transformer.models.FAMILIES`).",
                  one_of(tuple(FAMILIES))),
    "vocab_size": Key(256, "Vocabulary size.", int_(gt=0)),
    "tie_embeddings": Key(True, "The output head shares the token embedding (always in bert "
                                "and captioner).", BOOL),
    # (TransformerConfig's fields come here, in default_model_config)
    "num_decoder_layers": Key(None, "Encoder-decoder: decoder depth; None: = num_layers.",
                              optional(int_(gt=0), "None or an int > 0")),
    "scale_decoder_output": Key(True, "Encoder-decoder: scale the decoder output by "
                                "d_model^-0.5 before the head (T5 v1.0).", BOOL),
    "type_vocab_size": Key(2, "BERT: the sentence A/B vocabulary.", int_(gt=0)),
    "head": Key("mlm", "BERT and GPT: `mlm` (the LM head), `classify` (a sequence classifier) "
                "or `none` (the last layer's vectors, an imported base model's outputs).",
                one_of(bert.HEADS)),
    "num_classes": Key(0, "Classifier classes.", int_(ge=0, note="0: the task's")),
    "image_size": Key(8, "Images (vit, clip): square images of this side.",
                      described(int_(gt=0), "an int > 0, a multiple of patch_size")),
    "patch_size": Key(2, "Images: side of the square patches.", int_(gt=0)),
    "channels": Key(1, "Images: channels.", int_(gt=0)),
    "pooling": Key("cls", "Images: the pooled vector, [CLS] or the mean; none: every patch's "
                   "vector (the captioner's cross-attention).", one_of(vision.POOLINGS)),
    "patch_position": Key("sinusoidal_2d", "Images: patch positions (the image tower then "
                          "adds no `position` of its own; none: `position` is its only one).",
                          one_of(vision.PATCH_POSITIONS)),
    "projection_dim": Key(64, "CLIP: the shared embedding width of the two towers.",
                          int_(gt=0)),
    # Compute settings (params stay float): a resume may change them (and says so).
    "quantization": Key("", "Quantized training through Qwix: '' (none), 'int8' or 'fp8' for "
                        "the attention projections and MLPs (params stay float; it may change "
                        "on resume). See docs/performance.md.",
                        one_of(("",) + tuple(quantization.SCHEMES)), structural=False,
                        export_neutral=True),
    "quantize_head": Key(False, "With model.quantization: quantize the output head too (the "
                         "tied embedding's logits or lm_head).", BOOL, structural=False,
                         export_neutral=True,
                         needs=(lambda config: bool(config.model.quantization),
                                "model.quantization 'int8' or 'fp8'")),
}


def default_model_config() -> ml_collections.ConfigDict:
    """Every model key with its default: the `model` group of an experiment config
    (`MODEL_KEYS`, with `TransformerConfig`'s fields after `tie_embeddings`)."""
    stack = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    stack["dtype"] = stack["param_dtype"] = "float32"
    # The config groups: moe (num_experts 0 keeps dense layers), lora (rank 0 trains the whole
    # model), and the token mixers' (mamba2, ...; read by layers of their type).
    for name, value in stack.items():
        if dataclasses.is_dataclass(value):
            stack[name] = ml_collections.ConfigDict(dataclasses.asdict(value))
    group = {}
    for name, declared in MODEL_KEYS.items():
        group[name] = declared.default
        if name == "tie_embeddings":
            group.update(stack)
    for name, kind in _OPTIONAL_FIELDS.items():  # None defaults keep their type for overrides
        group[name] = ml_collections.FieldReference(group[name], field_type=kind)
    return ml_collections.ConfigDict(group)


def build_model(model_config: ml_collections.ConfigDict) -> nn.Module:
    """The Linen module for `model_config.family`, configured from the group's keys."""
    unknown = sorted(set(model_config.keys()) - set(default_model_config().keys()))
    if unknown:
        raise ValueError(f"unknown model config keys {unknown}: expected keys of "
                         "transformer.models.default_model_config()")
    if model_config.get("sliding_window") is not None and model_config.family != "gpt":
        raise ValueError(f"sliding_window={model_config.sliding_window} with family="
                         f"{model_config.family!r}: expected family 'gpt' (a causal decoder LM)")
    if model_config.get("parametrization", "standard") != "standard" and \
            model_config.family not in ("gpt", "prefix_lm"):
        raise ValueError(f"parametrization={model_config.parametrization!r} with family="
                         f"{model_config.family!r}: expected family 'gpt' or 'prefix_lm' (muP's "
                         "output multiplier is a decoder LM's)")
    if model_config.get("final_logit_softcap") and model_config.family not in ("gpt",
                                                                                "prefix_lm"):
        raise ValueError(f"final_logit_softcap={model_config.final_logit_softcap} with family="
                         f"{model_config.family!r}: expected family 'gpt' or 'prefix_lm' (the "
                         "decoder LMs whose logits it caps)")
    moe = model_config.get("moe")
    if moe and moe.get("num_experts") and not family_of(model_config).attention:
        raise ValueError(f"moe.num_experts={moe.num_experts} with family="
                         f"{model_config.family!r}: expected a transformer family (its "
                         "feed-forward layers become experts)")
    _check_mtp(model_config)
    _check_quantization(model_config)
    return quantization.quantize(family_of(model_config).build(model_config), model_config)


def _check_quantization(model_config) -> None:
    """`model.quantization` quantizes the blocks' softmax attention and feed-forward matmuls
    (and the head under quantize_head): a model with none of them would train as float."""
    quantization.check(model_config)
    scheme = model_config.get("quantization")
    if not scheme:
        return
    if not family_of(model_config).attention:
        raise ValueError(f"model.quantization={scheme!r} with family={model_config.family!r}: "
                         "expected a transformer family (it quantizes the blocks' attention "
                         "and MLP matmuls: an LSTM has none)")
    spec = model_config.get("layer_types", "")
    softmax = not spec or any(t not in RECURRENT for t in parse_layer_types(spec))
    moe = model_config.get("moe") or ml_collections.ConfigDict()
    every_ff_routed = moe.get("num_experts") and moe.get("every_n_layers", 1) == 1 and \
        not moe.get("first_dense_layers")  # (the experts' einsums stay in model.dtype)
    dense = model_config.get("d_ff") and not every_ff_routed
    if not (softmax or dense or model_config.get("quantize_head")):
        raise ValueError(f"model.quantization={scheme!r} with layer_types={spec!r}, no dense "
                         "feed-forward: expected a softmax attention layer or a dense "
                         "feed-forward (it quantizes their matmuls; the linear mixers' and "
                         "the experts' own stay in model.dtype)")


def takes_mtp(model_config) -> bool:
    """Whether the model can have multi-token prediction modules: a decoder LM's next-token
    head (a fine-tune into another head or family drops them, as it drops the LM head)."""
    return model_config.family == "gpt" and model_config.head == "mlm"


def _check_mtp(model_config) -> None:
    """Multi-token prediction needs a decoder LM's next-token head, and the stack's own
    positions inside its blocks (no ALiBi or T5 bias: only the stack computes those)."""
    depth = model_config.get("mtp", {}).get("depth", 0)
    if not depth:
        return
    if not takes_mtp(model_config):
        raise ValueError(f"mtp.depth={depth} with family={model_config.family!r}, head="
                         f"{model_config.head!r}: expected family 'gpt' with head 'mlm' (a "
                         "decoder LM predicting tokens)")
    if model_config.position in ("alibi", "t5"):
        raise ValueError(f"mtp.depth={depth} with position={model_config.position!r}: expected "
                         "rope, learned, sinusoidal or none (the modules' blocks take no "
                         "position bias)")


def init_cache(model: nn.Module, batch_size: int, cache_length: int,
               encoder_length: int | None = None):
    """A zero KV cache (the 'cache' collection) for decoding `batch_size` rows of up to
    `cache_length` tokens with a `DecoderLM`, or an `EncoderDecoder` over encoder inputs of
    `encoder_length` tokens."""
    tokens = jnp.zeros((batch_size, cache_length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(cache_length, dtype=jnp.int32), tokens.shape)
    rng = jax.random.key(0)
    if isinstance(model, EncoderDecoder):
        if encoder_length is None:
            raise ValueError("init_cache of an EncoderDecoder: expected encoder_length")
        cfg = model.decoder_config
        encoded = jnp.zeros((batch_size, encoder_length, cfg.d_model), cfg.dtype)
        init = lambda: model.init(rng, encoded, tokens, decoder_positions=positions, decode=True,
                                  cache_length=cache_length, method=model.decode)
    elif isinstance(model, DecoderLM):
        init = lambda: model.init(rng, tokens, positions=positions, decode=True,
                                  cache_length=cache_length)
    else:
        raise ValueError(f"{type(model).__name__}: expected a DecoderLM or EncoderDecoder (the "
                         "models with a KV cache)")
    shapes = jax.eval_shape(init)["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


__all__ = ["FAMILIES", "Family", "family_of", "CLIP", "Captioner", "ViTClassifier", "DecoderLM",
           "EncoderModel", "EncoderDecoder", "LSTMLM", "shift_right", "build_model",
           "default_model_config", "transformer_config", "init_cache", "takes_mtp"]
