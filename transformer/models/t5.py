"""Encoder-decoder model (T5): encoder stack, decoder stack with causal self-attention and
cross-attention to the encoder output, one token embedding shared by both and the output head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.models.family import Family, transformer_config
from transformer.models.gpt import decode_mask
from transformer.nn import masks
from transformer.nn.blocks import TransformerStack
from transformer.nn.config import TransformerConfig
from transformer.nn.layers import OutputHead, TokenEmbedding

Array = jax.Array


def shift_right(targets_BT: Array, bos_id: int, segment_ids_BT: Array | None = None) -> Array:
    """Teacher forcing: the decoder input is the target shifted right by one, starting at BOS.

    With packed rows (`segment_ids`), every document restarts at BOS.

    >>> shift_right(jnp.array([[5, 6, 7, 8]]), bos_id=0).tolist()
    [[0, 5, 6, 7]]
    >>> shift_right(jnp.array([[5, 6, 7, 8]]), 0, jnp.array([[1, 1, 2, 2]])).tolist()
    [[0, 5, 0, 7]]
    """
    shifted = jnp.pad(targets_BT, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
    if segment_ids_BT is not None:
        starts = segment_ids_BT != jnp.pad(segment_ids_BT, ((0, 0), (1, 0)))[:, :-1]
        shifted = jnp.where(starts, bos_id, shifted)
    return shifted


def unpadded_ids(tokens_BT: Array) -> Array:
    """Segment ids of right-padded decoder inputs (`tasks.decoder_features` pads with id 0): 1
    up to each row's last nonzero token and on its first (<bos> may be id 0), 0 after.

    >>> unpadded_ids(jnp.array([[0, 7, 0, 9, 0, 0]])).tolist()
    [[1, 1, 1, 1, 0, 0]]
    """
    real_BT = (jnp.asarray(tokens_BT) != 0).at[:, 0].set(True)
    last_B = tokens_BT.shape[1] - 1 - jnp.argmax(real_BT[:, ::-1], axis=1)
    return (jnp.arange(tokens_BT.shape[1]) <= last_B[:, None]).astype(jnp.int32)


class EncoderDecoder(nn.Module):
    """T5. Each stack owns its relative position bias (shared by that stack's layers): encoder
    buckets are bidirectional, decoder buckets causal. `scale_output` multiplies the decoder
    output by d_model^-0.5 before the output projection (original T5, with tied embeddings;
    T5 v1.1 unties and does not scale)."""

    encoder_config: TransformerConfig
    decoder_config: TransformerConfig
    vocab_size: int
    tie_embeddings: bool = True
    scale_output: bool = True

    def setup(self):
        cfg = self.decoder_config
        if self.encoder_config.d_model != cfg.d_model:
            raise ValueError(f"encoder d_model={self.encoder_config.d_model} != decoder d_model="
                             f"{cfg.d_model}: the stacks share one embedding")
        self.embed = TokenEmbedding(self.vocab_size, cfg.d_model, init_std=cfg.init_std or 1.0,
                                    dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.encoder = TransformerStack(self.encoder_config, bidirectional=True)
        self.decoder = TransformerStack(cfg, cross_attention=True, bidirectional=False)
        if not self.tie_embeddings:
            self.lm_head = OutputHead(self.vocab_size, init_std=cfg.init_std, dtype=cfg.dtype,
                                      param_dtype=cfg.param_dtype)

    def encode(self, tokens_BS, *, segment_ids=None, positions=None, deterministic=True):
        """Encoder tokens [B, S] -> encoded [B, S, D]; `segment_ids` 0 marks padding."""
        mask = masks.Full() if segment_ids is None else masks.Segment(segment_ids)
        return self.encoder(self.embed(tokens_BS), mask, positions, deterministic=deterministic,
                            segment_ids=segment_ids)  # (an MoE layer routes no padding)

    def decode(self, encoded_BSD, decoder_tokens_BT, *, encoder_segment_ids=None,
               decoder_segment_ids=None, decoder_positions=None, deterministic=True,
               decode=False, cache_length=None):
        """Decoder inputs [B, T] (BOS-shifted targets) over encoded [B, S, D] -> logits.

        `decode=True` runs on the KV cache like `DecoderLM` (slots = `decoder_positions`); the
        call given `encoded_BSD` caches the cross-attention keys/values, later calls pass None.
        """
        kv_positions = None
        if decode:
            if decoder_positions is None or decoder_segment_ids is not None:
                raise ValueError("decode=True needs decoder_positions [B, T] (the cache slots) "
                                 "and no decoder_segment_ids")
            self_mask, kv_positions = decode_mask(
                decoder_positions, cache_length or decoder_tokens_BT.shape[1])
        else:
            self_mask = masks.Causal()
            if decoder_segment_ids is not None:
                self_mask = self_mask & masks.Segment(decoder_segment_ids)
        # Routing only (the masks stay as they are): a capacity-routed MoE layer gives padding
        # no expert slot, so the padding cannot push out a real token's choice.
        routing_ids = (unpadded_ids(decoder_tokens_BT)
                       if decoder_segment_ids is None and not decode else decoder_segment_ids)
        cross_mask = None
        if encoder_segment_ids is not None:
            dec_ids = (jnp.ones_like(decoder_tokens_BT) if decoder_segment_ids is None
                       else decoder_segment_ids)
            cross_mask = masks.Segment(dec_ids, encoder_segment_ids)
        x_BTD = self.decoder(self.embed(decoder_tokens_BT), self_mask, decoder_positions,
                             encoded=encoded_BSD, cross_mask=cross_mask,
                             deterministic=deterministic, decode=decode,
                             kv_positions=kv_positions, segment_ids=routing_ids)
        if self.scale_output:
            x_BTD = x_BTD * self.decoder_config.d_model**-0.5
        return self.embed.attend(x_BTD) if self.tie_embeddings else self.lm_head(x_BTD)

    def __call__(self, encoder_tokens_BS, decoder_tokens_BT, *, encoder_segment_ids=None,
                 decoder_segment_ids=None, encoder_positions=None, decoder_positions=None,
                 deterministic=True) -> Array:
        """Teacher-forced logits [B, T, V]; decoder_tokens = shift_right(targets, bos)."""
        encoded = self.encode(encoder_tokens_BS, segment_ids=encoder_segment_ids,
                              positions=encoder_positions, deterministic=deterministic)
        return self.decode(encoded, decoder_tokens_BT, encoder_segment_ids=encoder_segment_ids,
                           decoder_segment_ids=decoder_segment_ids,
                           decoder_positions=decoder_positions, deterministic=deterministic)


def _build(model_config) -> EncoderDecoder:
    encoder = transformer_config(model_config)
    decoder_layers = model_config.get("num_decoder_layers") or encoder.num_layers
    return EncoderDecoder(encoder, transformer_config(model_config, num_layers=decoder_layers),
                          model_config.vocab_size, model_config.tie_embeddings,
                          model_config.scale_decoder_output)


# Padded rows (fine-tuning) mark their encoder padding with segment ids.
T5 = Family("t5", _build, inputs=("encoder_inputs", "decoder_inputs"),
            optional_features=("encoder_segment_ids",), objectives=("span_corruption", "text2text"),
            decoding="encoder_decoder", attention_maps=True,
            stacks=("num_layers", "num_decoder_layers"))
