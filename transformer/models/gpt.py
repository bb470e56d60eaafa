"""Decoder-only language model (GPT), also the prefix LM: tokens -> embeddings -> causal blocks
-> final norm -> logits over the vocabulary."""

from __future__ import annotations

import flax.linen as nn
import jax

from transformer import masks
from transformer.layers import OutputHead, TokenEmbedding, TransformerConfig, TransformerStack

Array = jax.Array


class DecoderLM(nn.Module):
    """GPT-style causal LM. With `prefix_lengths` it is a prefix LM: bidirectional attention over
    each example's first `prefix_lengths[b]` tokens, causal after (the loss weights restrict the
    loss to the continuation, see `objectives.prefix_lm_split`).

    Packed rows pass `segment_ids` (1, 2, ... per document, 0 for padding) and per-document
    `positions`; attention then stays within each document.
    """

    config: TransformerConfig
    vocab_size: int
    tie_embeddings: bool = True

    def setup(self):
        cfg = self.config
        self.embed = TokenEmbedding(self.vocab_size, cfg.d_model, init_std=cfg.init_std or 0.02,
                                    dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.decoder = TransformerStack(cfg, bidirectional=False)
        if not self.tie_embeddings:
            self.lm_head = OutputHead(self.vocab_size, init_std=cfg.init_std, dtype=cfg.dtype,
                                      param_dtype=cfg.param_dtype)

    def __call__(
        self,
        tokens_BT: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        prefix_lengths: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """int tokens [B, T] -> float32 logits [B, T, V] (position t predicts token t + 1)."""
        mask = masks.Causal() if prefix_lengths is None else masks.PrefixLM(prefix_lengths)
        if segment_ids is not None:
            mask = mask & masks.Segment(segment_ids)
        x_BTD = self.embed(tokens_BT)
        x_BTD = self.decoder(x_BTD, mask, positions, deterministic=deterministic)
        return self.embed.attend(x_BTD) if self.tie_embeddings else self.lm_head(x_BTD)
