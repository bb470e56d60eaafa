"""Encoder-only model (BERT): bidirectional encoder over [CLS] A [SEP] (B [SEP]) with a masked-LM
head for pretraining and a sequence-classification head on [CLS] for fine-tuning, or no head (an
imported base model: its encoder's vectors)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.models.family import Family, transformer_config
from transformer.nn import masks
from transformer.nn.activations import ACTIVATIONS
from transformer.nn.blocks import TransformerStack
from transformer.nn.config import TransformerConfig
from transformer.nn.layers import OutputHead, TokenEmbedding, norm_layer

Array = jax.Array
HEADS = ("mlm", "classify", "none")


class EncoderModel(nn.Module):
    """BERT. `head="mlm"`: logits [B, T, V] over the vocabulary at every position (the MLM
    transform dense -> act -> norm, then the tied embedding plus a bias). `head="classify"`:
    logits [B, num_classes] from the pooled [CLS] vector (dense + tanh) at position 0.
    `head="none"`: the encoder's vectors [B, T, D] (Hugging Face's `last_hidden_state` of a
    BertModel), with no head params.

    `segment_ids` [B, T] (1 for real tokens, 0 for padding; 1, 2, ... for packed rows) is the
    padding mask; `token_types` [B, T] are BERT's sentence A/B ids.
    """

    config: TransformerConfig
    vocab_size: int
    type_vocab_size: int = 2
    head: str = "mlm"
    num_classes: int = 0

    def setup(self):
        cfg = self.config
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r}: expected one of {HEADS}")
        if self.head == "classify" and self.num_classes < 1:
            raise ValueError(f"num_classes={self.num_classes}: the classify head needs >= 1")
        common = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.embed = TokenEmbedding(self.vocab_size, cfg.d_model, cfg.init_std or 0.02, **common)
        if self.type_vocab_size:
            self.type_embed = TokenEmbedding(self.type_vocab_size, cfg.d_model,
                                             cfg.init_std or 0.02, **common)
        self.encoder = TransformerStack(cfg, bidirectional=True)
        if self.head == "mlm":
            self.mlm_dense = OutputHead(cfg.d_model, use_bias=True, init_std=cfg.init_std,
                                        names=("embed", "mlp"), **common)
            self.mlm_norm = norm_layer(cfg, "mlm_norm")
            self.mlm_bias = self.param("mlm_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, ("vocab",)), (self.vocab_size,), cfg.param_dtype)
        elif self.head == "classify":
            self.pooler = OutputHead(cfg.d_model, use_bias=True, init_std=cfg.init_std,
                                     names=("embed", "mlp"), **common)
            self.classifier = OutputHead(self.num_classes, use_bias=True, init_std=cfg.init_std,
                                         names=("embed", "classes"), **common)
        self.head_dropout = nn.Dropout(cfg.dropout_rate)

    def encode(self, tokens_BT, *, token_types=None, segment_ids=None, positions=None,
               deterministic=True) -> Array:
        """Contextual vectors [B, T, D]."""
        x_BTD = self.embed(tokens_BT)
        if self.type_vocab_size:
            types = jnp.zeros_like(tokens_BT) if token_types is None else token_types
            x_BTD = x_BTD + self.type_embed(types)
        mask = masks.Full() if segment_ids is None else masks.Segment(segment_ids)
        return self.encoder(x_BTD, mask, positions, deterministic=deterministic,
                            segment_ids=segment_ids)  # (an MoE layer routes no padding)

    def __call__(self, tokens_BT, *, token_types=None, segment_ids=None, positions=None,
                 deterministic=True) -> Array:
        x_BTD = self.encode(tokens_BT, token_types=token_types, segment_ids=segment_ids,
                            positions=positions, deterministic=deterministic)
        if self.head == "none":
            return x_BTD
        if self.head == "mlm":  # the transform uses the blocks' nonlinearity
            h_BTD = self.mlm_norm(ACTIVATIONS[self.config.activation](self.mlm_dense(x_BTD)))
            logits_BTV = self.embed.attend(h_BTD)
            return logits_BTV + self.mlm_bias.astype(logits_BTV.dtype)
        pooled_BD = jnp.tanh(self.pooler(x_BTD[:, 0]))
        pooled_BD = self.head_dropout(pooled_BD, deterministic=deterministic)
        return self.classifier(pooled_BD)


def _build(model_config) -> EncoderModel:
    return EncoderModel(transformer_config(model_config), model_config.vocab_size,
                        model_config.type_vocab_size, model_config.head,
                        model_config.num_classes)


BERT = Family("bert", _build, inputs=("inputs",), features=("segment_ids", "positions"),
              objectives=("mlm", "classification"), attention_maps=True, cls_token=True,
              classifier=lambda model_config: model_config.head == "classify")
