"""Decoder-only language model (GPT), also the prefix LM: tokens -> embeddings -> causal blocks
-> final norm -> logits over the vocabulary."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.models.family import Family, transformer_config
from transformer.nn import masks, sequence_parallel
from transformer.nn import mtp as mtp_lib
from transformer.nn import positions as positions_lib
from transformer.nn.blocks import TransformerBlock, TransformerStack
from transformer.nn.config import REMAT_POLICIES, TransformerConfig
from transformer.nn.layers import OutputHead, TokenEmbedding, norm_layer
from transformer.parallel import sharding

Array = jax.Array
HEADS = ("mlm", "classify", "none")  # model.head: the LM head, a classifier, or none


def decode_mask(positions_BT: Array, cache_length: int, prefix_lengths_B: Array | None = None,
                window: int | None = None) -> tuple[Array, Array]:
    """(mask [B, 1, T, L], slot positions [1, L]) of queries at `positions` over a KV cache of
    L slots, slot j holding the token at position j: j <= the query's position, or j in the
    prefix; with `window`, only the last `window` positions (j > position - window). Queries
    at positions 3 and 4 over 6 slots, prefix 2:

    >>> mask, _ = decode_mask(jnp.array([[3, 4]]), 6, jnp.array([2]))
    >>> mask[0, 0].astype(int).tolist()
    [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    >>> decode_mask(jnp.array([[4]]), 6, window=2)[0][0, 0].astype(int).tolist()
    [[0, 0, 0, 1, 1, 0]]
    """
    slots_L = jnp.arange(cache_length, dtype=jnp.int32)
    allowed_BTL = slots_L[None, None, :] <= positions_BT[:, :, None]
    if prefix_lengths_B is not None:
        allowed_BTL |= slots_L[None, None, :] < prefix_lengths_B[:, None, None]
    if window is not None:
        allowed_BTL &= slots_L[None, None, :] > positions_BT[:, :, None] - window
    return allowed_BTL[:, None], slots_L[None]


class DecoderLM(nn.Module):
    """GPT-style causal LM. With `prefix_lengths` it is a prefix LM: bidirectional attention over
    each example's first `prefix_lengths[b]` tokens, causal after (the loss weights restrict the
    loss to the continuation, see `objectives.prefix_lm_split`).

    Packed rows pass `segment_ids` (1, 2, ... per document, 0 for padding) and per-document
    `positions`; attention then stays within each document.

    `num_classes > 0` makes it a sequence classifier: logits [B, num_classes] from the last
    token's final vector (the last position with segment_ids > 0, or T - 1), through a new
    `classifier` head. `hidden_states=True` (model.head "none": an imported base model such as
    LlamaModel) returns the final norm's vectors [B, T, D] and has no output head.

    `decode=True` runs on the KV cache (`init_cache`; apply with `mutable=["cache"]`): each
    token is written into cache slot `positions[b, t]` and attends to slots <= its position
    (and to the prefix, slots < `prefix_lengths[b]`), out of `cache_length` slots. A prefill of
    right-padded prompts passes `segment_ids` (1 for a prompt token, 0 for padding): recurrent
    layers (`config.layer_types`) then keep their state as it was after each row's last token.

    `mtp_tokens` [B, T] (the next-token targets: token t + 1 at position t) run the
    multi-token prediction modules (`config.mtp.depth` of them, `transformer.nn.mtp`) after
    the stack; their logits [D, B, T, V] are sown as `mtp/logits` (apply with
    `mutable=["mtp"]`). `draft` runs one module on the KV cache (speculative decoding).

    `config.sliding_window` = W limits every token to the last W positions, itself included
    (Mistral), in training and in decoding; the cache still holds every position. With
    `config.sliding_window_pattern` = P, every P-th layer attends to all earlier positions
    (Gemma 2). `config.final_logit_softcap` = c > 0 caps the LM logits at c * tanh(x / c).
    """

    config: TransformerConfig
    vocab_size: int
    tie_embeddings: bool = True
    num_classes: int = 0
    hidden_states: bool = False

    def setup(self):
        cfg = self.config
        self.embed = TokenEmbedding(self.vocab_size, cfg.d_model, init_std=cfg.init_std or 0.02,
                                    dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.decoder = TransformerStack(cfg, bidirectional=False)
        if not self.tie_embeddings and not self.hidden_states:
            self.lm_head = OutputHead(self.vocab_size, init_std=cfg.init_std, dtype=cfg.dtype,
                                      param_dtype=cfg.param_dtype)
        if self.num_classes:
            self.classifier = OutputHead(self.num_classes, use_bias=True, init_std=cfg.init_std,
                                         names=("embed", "classes"), dtype=cfg.dtype,
                                         param_dtype=cfg.param_dtype)
        self.mtp = [mtp_lib.MTPModule(cfg, norm_layer) for _ in range(cfg.mtp.depth)]

    def __call__(
        self,
        tokens_BT: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        prefix_lengths: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        cache_length: int | None = None,
        mtp_tokens: Array | None = None,
        with_hidden: bool = False,
    ) -> Array | tuple[Array, Array]:
        """int tokens [B, T] -> logits [B, T, V] in the compute dtype (position t predicts token
        t + 1), or [B, num_classes] for a classifier; `with_hidden`: (logits, the final norm's
        vectors [B, T, D])."""
        kv_positions = None
        window = self.config.sliding_window
        if window is not None and prefix_lengths is not None:
            raise ValueError(f"sliding_window={window} with prefix_lengths: expected one of them "
                             "(a window would cut into the bidirectional prefix)")
        if decode:  # segment_ids: a prefill's prompt tokens (1) and right padding (0)
            if positions is None:
                raise ValueError("decode=True needs positions [B, T] (the cache slots)")
            length = cache_length or tokens_BT.shape[1]
            mask, kv_positions = decode_mask(positions, length, prefix_lengths)
            local_mask = mask if window is None else decode_mask(positions, length, None,
                                                                 window)[0]
        else:
            mask = masks.Causal() if prefix_lengths is None else masks.PrefixLM(prefix_lengths)
            if segment_ids is not None:
                mask = mask & masks.Segment(segment_ids)
            local_mask = mask if window is None else mask & masks.SlidingWindow(left=window - 1)
        split = sequence_parallel.shards()
        balance = split > 1 and self.config.sequence_load_balance and not decode
        if balance:  # lay the sequence out zig-zag; the mask still sees original positions
            length = tokens_BT.shape[1]
            if positions is None:
                positions_lib.check_learned_length(self.config, length)
                positions = jnp.arange(length, dtype=jnp.int32)[None]
            tokens_BT = sequence_parallel.to_zigzag(tokens_BT, split)
            positions = sequence_parallel.to_zigzag(positions, split)
            if segment_ids is not None:
                segment_ids = sequence_parallel.to_zigzag(segment_ids, split)
            order = jnp.asarray(sequence_parallel.zigzag(length, split))
            mask, local_mask = (masks.Permuted(m, order, zigzag_shards=split)
                                for m in (mask, local_mask))
        x_BTD = self.embed(tokens_BT)
        x_BTD = self.decoder(x_BTD, mask, positions, deterministic=deterministic, decode=decode,
                             kv_positions=kv_positions, local_mask=local_mask,
                             segment_ids=segment_ids)
        if balance:
            x_BTD = sharding.constrain(sequence_parallel.from_zigzag(x_BTD, split),
                                       sharding.ACTIVATIONS)
        if self.hidden_states:
            return x_BTD
        if self.num_classes:
            last_B = (jnp.full(tokens_BT.shape[:1], tokens_BT.shape[1] - 1) if segment_ids is None
                      else jnp.sum(segment_ids > 0, axis=1) - 1)
            return self.classifier(x_BTD[jnp.arange(x_BTD.shape[0]), jnp.maximum(last_B, 0)])
        if self.mtp and self.is_initializing() and mtp_tokens is None:
            mtp_tokens = tokens_BT  # the modules' params exist whether or not a batch feeds them
        if mtp_tokens is not None and self.mtp:
            if balance:
                raise ValueError("model.mtp.depth with a `sequence` mesh axis: expected "
                                 "sequence_load_balance=False (the modules shift the sequence)")
            if positions is None:
                positions = jnp.arange(tokens_BT.shape[1], dtype=jnp.int32)[None]
            args = (mask, None, positions, None, None, local_mask, segment_ids)
            hidden_BTD, logits = x_BTD, []
            for k in range(1, len(self.mtp) + 1):
                ahead_BT = mtp_lib.shift_left(mtp_tokens, k - 1)  # t_{i+k} at position i
                hidden_BTD, ahead_logits = self._ahead(k, hidden_BTD, ahead_BT, args,
                                                       deterministic, decode)
                logits.append(ahead_logits)
            self.sow("mtp", "logits", jnp.stack(logits))
        logits_BTV = self.head(x_BTD)
        return (logits_BTV, x_BTD) if with_hidden else logits_BTV

    def head(self, x_BTD: Array) -> Array:
        """The output head on final-norm vectors: logits [..., V]."""
        logits_BTV = self.embed.attend(x_BTD) if self.tie_embeddings else self.lm_head(x_BTD)
        if (m := self.config.mup_width_multiplier) != 1.0:  # muP's output multiplier
            logits_BTV = logits_BTV * jnp.asarray(1 / m, logits_BTV.dtype)
        return softcap(logits_BTV, self.config.final_logit_softcap)

    def _ahead(self, k: int, hidden_BTD, tokens_BT, block_args, deterministic, decode):
        """Multi-token prediction module k (from 1) on h^{k-1} and the tokens t_{i+k}:
        (h^k [B, T, D], logits [B, T, V] predicting t_{i+k+1})."""
        cfg, last = self.config, self.config.num_layers - 1
        kind = TransformerBlock if cfg.remat_policy == "none" else nn.remat(
            TransformerBlock, policy=REMAT_POLICIES[cfg.remat_policy])
        block = lambda name: kind(
            cfg, deterministic=deterministic, decode=decode, moe_layer=cfg.moe.is_moe_layer(last),
            layer_type=cfg.layer_type(last), name=name)
        hidden_BTD, normed_BTD = self.mtp[k - 1](hidden_BTD, self.embed(tokens_BT), block,
                                                 block_args)
        return hidden_BTD, self.head(normed_BTD)

    def draft(self, k: int, hidden_BTD: Array, tokens_BT: Array, positions: Array,
              cache_length: int) -> tuple[Array, Array]:
        """Module k on the KV cache (its block's own), as `__call__(decode=True)` runs the
        stack: h^{k-1} and tokens t_{i+k} at `positions` [B, T] -> (h^k, logits [B, T, V])."""
        mask, _ = decode_mask(positions, cache_length)
        window = self.config.sliding_window
        local = mask if window is None else decode_mask(positions, cache_length, None, window)[0]
        return self._ahead(k, hidden_BTD, tokens_BT, (mask, None, positions, None, None, local,
                                                      None), True, True)


def softcap(x: Array, cap: float) -> Array:
    """cap * tanh(x / cap), computed in float32 at least (0: x as it is).

    >>> softcap(jnp.array([0.5, 100.0]), 30.0).round(2).tolist()  # 30 tanh(10 / 3) = 29.92
    [0.5, 29.920000076293945]
    """
    if not cap:
        return x
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (cap * jnp.tanh(wide / cap)).astype(x.dtype)


def _build(model_config) -> DecoderLM:
    if model_config.head not in HEADS:
        raise ValueError(f"head={model_config.head!r}: expected one of {HEADS}")
    classes = model_config.num_classes if model_config.head == "classify" else 0
    if model_config.head == "classify" and classes < 1:
        raise ValueError(f"model.num_classes={classes}: the classify head needs >= 1")
    return DecoderLM(transformer_config(model_config), model_config.vocab_size,
                     model_config.tie_embeddings, classes, model_config.head == "none")


_classifies = lambda model_config: model_config.head == "classify"
GPT = Family("gpt", _build, inputs=("inputs",), features=("segment_ids", "positions"),
             objectives=("next_token", "classification", "sft"), decoding="causal",
             attention_maps=True, classifier=_classifies)
# A prefix LM reads its prefix bidirectionally: the batch says how long each row's prefix is.
PREFIX_LM = Family("prefix_lm", _build, inputs=("inputs",),
                   features=("segment_ids", "positions", "prefix_lengths"),
                   objectives=("prefix_lm", "classification"), decoding="prefix",
                   attention_maps=True, classifier=_classifies)
