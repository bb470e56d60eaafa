"""Beyond text on the same attention library: patch tokenization (ViT) and a CLIP-style
contrastive dual encoder. An image becomes a sequence of patch embeddings that the unchanged
bidirectional `TransformerStack` reads; CLIP pairs that image tower with a text tower.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.models.family import Family, transformer_config
from transformer.models.t5 import unpadded_ids
from transformer.nn import masks, objectives, positions
from transformer.nn.blocks import TransformerStack
from transformer.nn.config import TransformerConfig
from transformer.nn.layers import OutputHead, TokenEmbedding

Array = jax.Array
POOLINGS = ("cls", "mean", "none")  # none: every patch's vector [B, N, D] (cross-attention)
PATCH_POSITIONS = ("sinusoidal_2d", "learned", "none")
MAX_LOGIT_SCALE = 100.0  # CLIP clips its learned temperature so logits stay <= 100 x cosine


def patchify(images_BHWC: Array, patch_size: int) -> Array:
    """Images [B, H, W, C] -> non-overlapping patches [B, (H/p)(W/p), p*p*C], row-major over
    the patch grid, each patch flattened row-major (rows, then columns, then channels).

    A 4 x 4 one-channel image in 2 x 2 patches:

    >>> image = jnp.arange(16).reshape(1, 4, 4, 1)
    >>> patchify(image, 2)[0].tolist()
    [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    """
    B, H, W, C = images_BHWC.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"image of {H} x {W}: expected sides divisible by patch_size={p}")
    x = images_BHWC.reshape(B, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (H // p) * (W // p), p * p * C)


def unpatchify(patches_BNP: Array, patch_size: int, height: int, width: int) -> Array:
    """The inverse of `patchify`: patches [B, N, p*p*C] -> images [B, height, width, C].

    >>> image = jnp.arange(48).reshape(1, 4, 4, 3)
    >>> bool((unpatchify(patchify(image, 2), 2, 4, 4) == image).all())
    True
    """
    B, N, P = patches_BNP.shape
    p = patch_size
    gh, gw = height // p, width // p
    if gh * gw != N or P % (p * p):
        raise ValueError(f"{N} patches of {P} values: expected {gh * gw} patches of p*p*C values "
                         f"for a {height} x {width} image with patch_size={p}")
    C = P // (p * p)
    x = patches_BNP.reshape(B, gh, gw, p, p, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, height, width, C)


def sinusoidal_2d(grid_height: int, grid_width: int, dim: int) -> Array:
    """Fixed 2-D positions [grid_height * grid_width, dim]: the first half of the features is
    the 1-D sinusoidal code of the patch's row, the second half that of its column.

    >>> table = sinusoidal_2d(2, 3, 8)
    >>> same_row = bool((table[1, :4] == table[2, :4]).all())
    >>> same_col = bool((table[0, 4:] == table[3, 4:]).all())
    >>> table.shape, same_row, same_col
    ((6, 8), True, True)
    """
    if dim % 4:
        raise ValueError(f"dim={dim}: 2-D sinusoidal positions need a multiple of 4")
    rows, cols = np.divmod(np.arange(grid_height * grid_width), grid_width)
    return jnp.concatenate([positions.sinusoidal_positions(jnp.asarray(rows), dim // 2),
                            positions.sinusoidal_positions(jnp.asarray(cols), dim // 2)], -1)


def without_positions(cfg: TransformerConfig) -> TransformerConfig:
    """The stack config with no positions of its own (position "none"; RoPE's keys, which
    refuse any other position, back at their defaults)."""
    rope = {f.name: f.default for f in dataclasses.fields(cfg) if f.name.startswith("rope_")}
    return dataclasses.replace(cfg, position="none", **rope)


class ImageEncoder(nn.Module):
    """Patch embedding -> (+ [CLS]) -> 2-D or learned positions -> bidirectional stack -> pooled
    vector [B, D] ([CLS]'s final vector, or the mean over patches), or with pooling "none" the
    patch vectors [B, N, D].

    With patch positions (patch_position not "none") the stack adds none of its own, whatever
    `config.position` (which CLIP's text tower and the captioner's decoder read): a 1-D table
    would number [CLS] and the patches in reading order on top of their 2-D places. With
    patch_position "none", `config.position` is the image tower's only position.
    """

    config: TransformerConfig
    image_size: int
    patch_size: int
    channels: int = 1
    pooling: str = "cls"
    patch_position: str = "sinusoidal_2d"

    def setup(self):
        cfg = self.config
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r}: expected one of {POOLINGS}")
        if self.patch_position not in PATCH_POSITIONS:
            raise ValueError(f"patch_position={self.patch_position!r}: expected one of "
                             f"{PATCH_POSITIONS}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size}: expected a multiple of "
                             f"patch_size={self.patch_size}")
        common = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        # Fan-in init (not the 0.02 of token tables): pixels in [0, 1] must make O(1) vectors.
        self.patch_embed = OutputHead(cfg.d_model, use_bias=True, init_std=None,
                                      names=("patch", "embed"), **common)
        if self.pooling == "cls":
            self.cls = self.param("cls", nn.with_logical_partitioning(
                nn.initializers.normal(0.02), ("embed",)), (cfg.d_model,), cfg.param_dtype)
        if self.patch_position == "learned":
            self.position_embedding = self.param(
                "position_embedding", nn.with_logical_partitioning(
                    nn.initializers.normal(0.02), ("length", "embed")),
                (self.grid ** 2, cfg.d_model), cfg.param_dtype)
        self.encoder = TransformerStack(
            cfg if self.patch_position == "none" else without_positions(cfg), bidirectional=True)

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    def patch_positions(self) -> Array | None:
        if self.patch_position == "sinusoidal_2d":
            return sinusoidal_2d(self.grid, self.grid, self.config.d_model)
        if self.patch_position == "learned":
            return self.position_embedding
        return None

    def __call__(self, images_BHWC, *, deterministic=True) -> Array:
        size, channels = self.image_size, self.channels
        if images_BHWC.shape[1:] != (size, size, channels):
            raise ValueError(f"images of shape {images_BHWC.shape}: expected [B, {size}, {size}, "
                             f"{channels}]")
        x_BND = self.patch_embed(patchify(images_BHWC.astype(self.config.dtype),
                                          self.patch_size))
        table = self.patch_positions()
        if table is not None:
            x_BND = x_BND + table.astype(x_BND.dtype)
        if self.pooling == "cls":  # [CLS] carries no position: it is not a place in the image
            cls = jnp.broadcast_to(self.cls.astype(x_BND.dtype), (x_BND.shape[0], 1,
                                                                 x_BND.shape[-1]))
            x_BND = jnp.concatenate([cls, x_BND], axis=1)
        x_BND = self.encoder(x_BND, masks.Full(), None, deterministic=deterministic)
        if self.pooling == "none":
            return x_BND
        return x_BND[:, 0] if self.pooling == "cls" else x_BND.mean(axis=1)


class ViTClassifier(nn.Module):
    """ViT: images [B, H, W, C] -> class logits [B, num_classes] from the pooled vector."""

    config: TransformerConfig
    num_classes: int
    image_size: int
    patch_size: int
    channels: int = 1
    pooling: str = "cls"
    patch_position: str = "sinusoidal_2d"

    def setup(self):
        if self.num_classes < 1:
            raise ValueError(f"num_classes={self.num_classes}: expected >= 1")
        self.image_encoder = ImageEncoder(self.config, self.image_size, self.patch_size,
                                          self.channels, self.pooling, self.patch_position)
        self.classifier = OutputHead(self.num_classes, use_bias=True,
                                     init_std=self.config.init_std, names=("embed", "classes"),
                                     dtype=self.config.dtype, param_dtype=self.config.param_dtype)

    def __call__(self, images_BHWC, *, deterministic=True) -> Array:
        return self.classifier(self.image_encoder(images_BHWC, deterministic=deterministic))


class TextEncoder(nn.Module):
    """CLIP's text tower: causal stack over tokens, the last real token's final vector [B, D]
    (the token before padding: segment_ids 1 on tokens, 0 on padding)."""

    config: TransformerConfig
    vocab_size: int

    @nn.compact
    def __call__(self, tokens_BT, segment_ids_BT, *, deterministic=True) -> Array:
        cfg = self.config
        x_BTD = TokenEmbedding(self.vocab_size, cfg.d_model, cfg.init_std or 0.02,
                               dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                               name="embed")(tokens_BT)
        mask = masks.Causal() & masks.Segment(segment_ids_BT)
        x_BTD = TransformerStack(cfg, bidirectional=False, name="encoder")(
            x_BTD, mask, None, deterministic=deterministic,
            segment_ids=segment_ids_BT)  # (an MoE layer routes no padding)
        last_B = jnp.maximum(jnp.sum(segment_ids_BT > 0, axis=1) - 1, 0)
        return x_BTD[jnp.arange(x_BTD.shape[0]), last_B]


class Captioner(nn.Module):
    """Image captioning by cross-attention from text to image patches: the ViT encoder's patch
    vectors [B, N, D] are the memory of a causal text decoder (T5's decoder stack: self-attention,
    then cross-attention to the patches, then the MLP), with a tied output embedding.

    `encode` / `decode` mirror `EncoderDecoder`'s, so the text-to-text scoring (teacher-forced
    exact match, rank classification over captions) applies unchanged.
    """

    config: TransformerConfig
    vocab_size: int
    image_size: int
    patch_size: int
    channels: int = 1
    patch_position: str = "sinusoidal_2d"

    def setup(self):
        cfg = self.config
        self.image_encoder = ImageEncoder(cfg, self.image_size, self.patch_size, self.channels,
                                          "none", self.patch_position)
        self.embed = TokenEmbedding(self.vocab_size, cfg.d_model, cfg.init_std or 0.02,
                                    dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.decoder = TransformerStack(cfg, cross_attention=True, bidirectional=False)

    def encode(self, images_BHWC, *, segment_ids=None, deterministic=True) -> Array:
        del segment_ids  # every patch is real
        return self.image_encoder(images_BHWC, deterministic=deterministic)

    def decode(self, encoded_BND, decoder_tokens_BT, *, encoder_segment_ids=None,
               deterministic=True) -> Array:
        del encoder_segment_ids
        x_BTD = self.decoder(self.embed(decoder_tokens_BT), masks.Causal(), None,
                             encoded=encoded_BND, deterministic=deterministic,
                             segment_ids=unpadded_ids(decoder_tokens_BT))  # as T5's decoder
        return self.embed.attend(x_BTD)

    def __call__(self, images_BHWC, decoder_tokens_BT, *, deterministic=True) -> Array:
        """Teacher-forced logits [B, T, V] of the caption given the image."""
        return self.decode(self.encode(images_BHWC, deterministic=deterministic),
                           decoder_tokens_BT, deterministic=deterministic)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


class CLIP(nn.Module):
    """Dual encoder: a ViT image tower and a text tower, each projected to `projection_dim` and
    L2-normalised; logits [B_images, B_texts] = exp(logit_scale) * cosine similarity, with the
    learned log-temperature initialised to log(1/0.07) and clipped to log(100).

    `embed_images` / `embed_texts` give the normalised embeddings (zero-shot classification
    compares an image's with those of each class's text).
    """

    config: TransformerConfig  # shared by both towers
    vocab_size: int
    projection_dim: int
    image_size: int
    patch_size: int
    channels: int = 1
    pooling: str = "cls"
    patch_position: str = "sinusoidal_2d"

    def setup(self):
        cfg = self.config
        common = dict(init_std=cfg.init_std, names=("embed", "projection"), dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype)
        self.image_encoder = ImageEncoder(cfg, self.image_size, self.patch_size, self.channels,
                                          self.pooling, self.patch_position)
        self.text_encoder = TextEncoder(cfg, self.vocab_size)
        self.image_projection = OutputHead(self.projection_dim, **common)
        self.text_projection = OutputHead(self.projection_dim, **common)
        self.logit_scale = self.param("logit_scale", nn.initializers.constant(
            math.log(1 / 0.07)), (), jnp.float32)

    def embed_images(self, images_BHWC, *, deterministic=True) -> Array:
        return l2_normalize(self.image_projection(
            self.image_encoder(images_BHWC, deterministic=deterministic)))

    def embed_texts(self, tokens_BT, segment_ids_BT, *, deterministic=True) -> Array:
        return l2_normalize(self.text_projection(
            self.text_encoder(tokens_BT, segment_ids_BT, deterministic=deterministic)))

    def scale(self) -> Array:
        return jnp.exp(jnp.minimum(self.logit_scale, math.log(MAX_LOGIT_SCALE)))

    def __call__(self, images_BHWC, tokens_BT, segment_ids_BT, *, deterministic=True) -> Array:
        images = self.embed_images(images_BHWC, deterministic=deterministic)
        texts = self.embed_texts(tokens_BT, segment_ids_BT, deterministic=deterministic)
        return self.scale() * images @ texts.T


def contrastive_loss(logits_IT: Array, weights_B: Array | None = None, **kwargs):
    """CLIP's symmetric loss over a batch of B (image, text) pairs: the mean of the
    cross-entropy of each image's row (its own text is the target) and of each text's column.
    `weights` [B] drop padded pairs (as targets and as negatives); `kwargs` go to
    `objectives.cross_entropy`. Returns (loss, metrics); metrics["accuracy"] is the share of
    images and texts whose own partner scores highest.

    >>> loss, metrics = contrastive_loss(jnp.zeros((4, 4)))
    >>> round(float(loss), 4) == round(math.log(4), 4), float(metrics["num_tokens"])
    (True, 8.0)
    """
    n = logits_IT.shape[0]
    weights_B = jnp.ones(n, jnp.float32) if weights_B is None else weights_B
    real = weights_B > 0
    logits_IT = jnp.where(real[:, None] & real[None, :], logits_IT.astype(jnp.float32), -1e9)
    both_2BB = jnp.stack([logits_IT, logits_IT.T])  # rows: images over texts, texts over images
    targets_2B = jnp.broadcast_to(jnp.arange(n), (2, n))
    return objectives.cross_entropy(both_2BB, targets_2B,
                                    jnp.broadcast_to(weights_B, (2, n)), **kwargs)


def image_tokens(model_config) -> int:
    """The tokens the image encoder reads an image: its patches, and [CLS] if it pools by it.

    >>> image_tokens({"image_size": 8, "patch_size": 2, "pooling": "cls"})
    17
    """
    size, patch = model_config["image_size"], model_config["patch_size"]
    if size % patch:  # (before anything counts its tokens)
        raise ValueError(f"image_size={size}: expected a multiple of patch_size={patch}")
    grid = size // patch
    return grid * grid + (model_config["pooling"] == "cls")


def _image_settings(model_config, pooled: bool = False) -> dict:
    """The image tower's keys; `pooled`: its head reads one vector an image (ViT's classifier,
    CLIP's projection), so pooling "none" is refused (validate_config builds the model)."""
    if pooled and model_config.pooling == "none":
        raise ValueError(f"pooling='none' with family {model_config.family!r}: expected one of "
                         f"{POOLINGS[:-1]} (its head reads one pooled vector an image; 'none' is "
                         "the captioner's every patch)")
    # patch_position "none": the stack's own table numbers the tokens (the captioner's: patches)
    tokens = image_tokens(model_config if pooled else {**model_config, "pooling": "none"})
    if model_config.patch_position == "none" and model_config.position == "learned" and \
            tokens > model_config.max_len:
        raise ValueError(f"patch_position='none' with position='learned': the image tower "
                         f"reads {tokens} tokens (image_size={model_config.image_size}, "
                         f"patch_size={model_config.patch_size}), past model.max_len="
                         f"{model_config.max_len}: expected max_len >= {tokens}, or patch "
                         "positions of their own (patch_position 'sinusoidal_2d' or 'learned')")
    return {k: model_config[k] for k in ("image_size", "patch_size", "channels", "pooling",
                                         "patch_position")}


def _build_vit(model_config) -> ViTClassifier:
    return ViTClassifier(transformer_config(model_config), model_config.num_classes,
                         **_image_settings(model_config, pooled=True))


def _build_clip(model_config) -> CLIP:
    return CLIP(transformer_config(model_config), model_config.vocab_size,
                model_config.projection_dim, **_image_settings(model_config, pooled=True))


def _build_captioner(model_config) -> Captioner:
    image = _image_settings(model_config)
    del image["pooling"]  # the decoder attends to every patch
    return Captioner(transformer_config(model_config), model_config.vocab_size, **image)


def _contrastive_loss(logits, batch, **kwargs):
    return contrastive_loss(logits, batch["weights"], **kwargs)


VIT = Family("vit", _build_vit, inputs=("images",), objectives=("image_classification",),
             classifier=lambda model_config: True)
CLIP_FAMILY = Family("clip", _build_clip, inputs=("images", "texts", "text_segment_ids"),
                     objectives=("contrastive",), loss=_contrastive_loss, rows_interact=True)
CAPTIONER = Family("captioner", _build_captioner, inputs=("images", "decoder_inputs"),
                   objectives=("captioning",))
