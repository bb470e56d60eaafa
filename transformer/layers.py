"""Transformer layers: norms, feed-forward, blocks (pre/post-LN) and (scanned) stacks of blocks.

`TransformerConfig` holds every architectural choice; models build one and pass it down.
Shapes: B batch, T length, D model width, F feed-forward width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import kernels, pipeline_parallel, sequence_parallel, sharding
from transformer import lora as lora_lib
from transformer import positions as positions_lib
from transformer.attention import MultiHeadAttention, matmul, projection_init
from transformer.lora import LoraConfig
from transformer.masks import Mask
from transformer.moe import MoEConfig, MoEFeedForward

Array = jax.Array

POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi", "t5")
NORMS = ("layernorm", "rmsnorm")
# pre: x + f(N(x)); post: N(x + f(x)); sandwich: x + N'(f(N(x))) (Gemma 2); post_sublayer:
# x + N'(f(x)) (OLMo 2)
NORM_PLACEMENTS = ("pre", "post", "sandwich", "post_sublayer")
QK_NORM_SCOPES = ("head", "projection")
PARAMETRIZATIONS = ("standard", "mup")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, choices))}")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive int")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of one stack of blocks (and of the layers inside it)."""

    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: = num_heads (MHA); 1: MQA; otherwise GQA
    head_dim: int | None = None  # None: d_model // num_heads
    d_ff: int = 256
    activation: str = "gelu"  # relu | gelu (erf) | gelu_tanh (GPT-2) | swiglu | geglu (T5 v1.1)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_placement: str = "pre"  # NORM_PLACEMENTS
    norm_epsilon: float = 1e-5
    # RMSNorm with a learned scale on q and k, before RoPE, over each head (qk_norm_scope
    # "head": Qwen3, Gemma 3) or over the whole projection ("projection": OLMo 2).
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    # > 0: logits -> cap * tanh(logits / cap) (Gemma 2); 0: off. attention_softcap caps the
    # scaled attention logits; final_logit_softcap a decoder LM's output logits.
    attention_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # x + attn(N(x)) + mlp(N(x)) with one norm (GPT-J, PaLM); pre-norm blocks without
    # cross-attention only.
    parallel_block: bool = False
    # GPT-2: the kernels that write into the residual stream (attention W_o, the MLP's output,
    # experts' too) start with their init std divided by sqrt(2 num_layers).
    scale_residual_init: bool = False
    # muP (Tensor Programs V): "mup" makes a model m = d_model / mup_base_width times as wide as
    # the base behave as the base does (`mup_width_multiplier`); "standard": none.
    parametrization: str = "standard"
    mup_base_width: int = 0  # the width the hyperparameters were tuned at; 0: d_model (m = 1)
    position: str = "rope"  # none | sinusoidal | learned | rope | alibi | t5
    max_len: int = 512  # learned positions only
    rope_theta: float = 10000.0
    rope_layout: str = "half"  # half | interleaved
    rope_scale: float = 1.0  # > 1: positions stretched by this factor, as rope_scaling says
    rope_scaling: str = "linear"  # linear (position interpolation) | llama3 (Llama 3.1)
    rope_low_freq_factor: float = 1.0  # llama3 only (positions.rope_frequencies)
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_len: int = 8192  # llama3 only: the context length trained at
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    use_bias: bool = True
    qkv_bias: bool | None = None  # biases on the q/k/v projections; None: = use_bias (Qwen2: True)
    # Decoder LMs: each token attends to the last `sliding_window` positions, itself included
    # (Mistral); None: no limit.
    sliding_window: int | None = None
    # With sliding_window: every sliding_window_pattern-th layer (layers P-1, 2P-1, ...) attends
    # to every earlier position, the others to the window (Gemma 2: 2, Gemma 3: 6); 0: every
    # layer is windowed. With scan_layers, P (with moe.every_n_layers) must divide num_layers.
    sliding_window_pattern: int = 0
    attention_scale: float | None = None  # logit scale; None: 1/sqrt(head_dim); T5 uses 1.0
    embedding_norm: bool = False  # norm after adding absolute positions (BERT)
    scale_embeddings: bool = False  # inputs x sqrt(d_model) before positions (Vaswani et al.)
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    init_std: float | None = None  # None: fan-in scaling; GPT-2 uses 0.02
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    scan_layers: bool = False
    remat_policy: str = "none"  # none | full | dots | dots_no_batch
    # auto (splash on TPU, cuDNN on GPU, chunked for long sequences, else dense; chosen for the
    # devices the step is compiled for) | dense | chunked (O(T) memory) | splash | cudnn
    attention_impl: str = "auto"
    # Under a `sequence` mesh axis (transformer.sequence_parallel): how attention crosses the
    # split (all_gather | ring), and whether decoder LMs lay the sequence out zig-zag so every
    # device gets the same share of the causal mask.
    sequence_parallel: str = "all_gather"
    sequence_load_balance: bool = True
    moe: MoEConfig = MoEConfig()  # mixture-of-experts feed-forward layers (transformer.moe)
    lora: LoraConfig = LoraConfig()  # low-rank adapters on a frozen base (transformer.lora)

    def __post_init__(self):
        for name in ("num_layers", "d_model", "num_heads", "d_ff", "max_len"):
            _check_positive(name, getattr(self, name))
        _check_choice("activation", self.activation, tuple(ACTIVATIONS))
        _check_choice("norm", self.norm, NORMS)
        _check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _check_choice("qk_norm_scope", self.qk_norm_scope, QK_NORM_SCOPES)
        _check_choice("parametrization", self.parametrization, PARAMETRIZATIONS)
        if not isinstance(self.mup_base_width, int) or self.mup_base_width < 0:
            raise ValueError(f"mup_base_width={self.mup_base_width!r}: expected an int >= 0 "
                             "(0: d_model)")
        for name in ("attention_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r}: expected a number >= 0 (0: off)")
        if self.parallel_block and self.norm_placement != "pre":
            raise ValueError(f"parallel_block=True with norm_placement={self.norm_placement!r}: "
                             "expected 'pre' (one norm feeds both branches)")
        _check_choice("position", self.position, POSITIONS)
        _check_choice("rope_layout", self.rope_layout, ("half", "interleaved"))
        _check_choice("rope_scaling", self.rope_scaling, ("linear", "llama3"))
        if self.rope_scaling == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError(f"rope_low_freq_factor={self.rope_low_freq_factor}, "
                             f"rope_high_freq_factor={self.rope_high_freq_factor}: expected "
                             "0 < low < high")
        _check_choice("remat_policy", self.remat_policy, tuple(REMAT_POLICIES))
        _check_choice("attention_impl", self.attention_impl, kernels.IMPLS)
        _check_choice("sequence_parallel", self.sequence_parallel,
                      sequence_parallel.STRATEGIES)
        if self.sliding_window is not None:
            _check_positive("sliding_window", self.sliding_window)
        if not isinstance(self.lora, LoraConfig):  # the `model.lora` config group
            object.__setattr__(self, "lora", LoraConfig(**dict(self.lora)))
        if not isinstance(self.moe, MoEConfig):  # e.g. the `model.moe` config group
            values = dict(self.moe)
            unknown = sorted(set(values) - {f.name for f in dataclasses.fields(MoEConfig)})
            if unknown:
                raise ValueError(f"moe: unknown keys {unknown}: expected keys of "
                                 "transformer.moe.MoEConfig")
            object.__setattr__(self, "moe", MoEConfig(**values))
        if self.moe.num_experts and self.num_layers % self.moe.every_n_layers:
            raise ValueError(f"moe.every_n_layers={self.moe.every_n_layers}: expected a divisor "
                             f"of num_layers={self.num_layers}")
        if self.num_kv_heads is not None:
            _check_positive("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_kv_heads={self.num_kv_heads}: expected a divisor of "
                    f"num_heads={self.num_heads}"
                )
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model}: expected a multiple of num_heads={self.num_heads} "
                "(or set head_dim)"
            )
        if self.head_dim is not None:
            _check_positive("head_dim", self.head_dim)
        if self.position == "rope" and self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim}: RoPE needs an even head dim")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model={self.d_model}: sinusoidal positions need an even width")
        for name in ("dropout_rate", "attention_dropout_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected 0 <= rate < 1")
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, jnp.dtype(getattr(self, name)))
        self._check_window_pattern()

    def _check_window_pattern(self) -> None:
        pattern = self.sliding_window_pattern
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
            raise ValueError(f"sliding_window_pattern={pattern!r}: expected an int >= 0")
        if pattern and self.sliding_window is None:
            raise ValueError(f"sliding_window_pattern={pattern}: expected a sliding_window")
        if self.scan_layers and self.num_layers % self.layer_period:
            raise ValueError(f"sliding_window_pattern={pattern}: with scan_layers, expected a "
                             f"period ({self.layer_period}, with moe.every_n_layers) dividing "
                             f"num_layers={self.num_layers}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def mup_width_multiplier(self) -> float:
        """muP's m = d_model / mup_base_width (1 under "standard"). It divides the hidden
        matrices' init std by sqrt(m) (when init_std is given: fan-in init already scales so),
        the attention logits by sqrt(m) more (1 / head_dim instead of 1 / sqrt(head_dim) as
        head_dim grows with the width), a decoder LM's output logits by m, and (optim.make_
        optimizer) the hidden matrices' learning rates by m."""
        if self.parametrization != "mup" or not self.mup_base_width:
            return 1.0
        return self.d_model / self.mup_base_width

    @property
    def resolved_attention_scale(self) -> float | None:
        """The attention logits' scale: `attention_scale` (None: 1 / sqrt(head_dim)), over
        sqrt(m) under muP."""
        m = self.mup_width_multiplier
        if m == 1.0:
            return self.attention_scale
        return (self.attention_scale or self.resolved_head_dim**-0.5) * m**-0.5

    def init_scale(self, residual: bool = False) -> float:
        """The init std multiplier of a hidden matrix: muP's 1 / sqrt(m) when init_std is given,
        times `residual_init_scale` for those writing into the residual stream."""
        m = self.mup_width_multiplier if self.init_std is not None else 1.0
        return m**-0.5 * (residual_init_scale(self) if residual else 1.0)

    @property
    def layer_period(self) -> int:
        """How many consecutive layers repeat: MoE layers every n, global layers every P."""
        moe = self.moe.every_n_layers if self.moe.num_experts else 1
        return math.lcm(moe, self.sliding_window_pattern or 1)

    def is_local_layer(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) attends through the sliding window.

        >>> cfg = TransformerConfig(sliding_window=4, sliding_window_pattern=3, num_layers=6)
        >>> [cfg.is_local_layer(i) for i in range(6)]
        [True, True, False, True, True, False]
        """
        if self.sliding_window is None:
            return False
        return not self.sliding_window_pattern or (layer + 1) % self.sliding_window_pattern > 0


def residual_init_scale(config: TransformerConfig) -> float:
    """The init std multiplier of the kernels writing into the residual stream: 1 / sqrt(2 L)
    under `scale_residual_init` (two such kernels per layer), else 1."""
    return (2 * config.num_layers) ** -0.5 if config.scale_residual_init else 1.0


def norm_layer(config: TransformerConfig, name: str) -> nn.Module:
    """LayerNorm or RMSNorm over the model width, with logical names on its params."""
    scale_init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    common = dict(epsilon=config.norm_epsilon, dtype=config.dtype,
                  param_dtype=config.param_dtype, scale_init=scale_init, name=name)
    if config.norm == "rmsnorm":
        return nn.RMSNorm(**common)
    bias_init = nn.with_logical_partitioning(nn.initializers.zeros, ("embed",))
    return nn.LayerNorm(use_bias=config.use_bias, bias_init=bias_init, **common)


# GELUs with hand-written JVPs. Differentiating the formulas as written (jax.nn.gelu) gives
# XLA several elementwise passes over the [tokens, d_ff] activations (the exact one through
# erfc, divides and exps); these compute the derivative in one pass. They equal jax.nn.gelu to
# float32 rounding (tests/test_layers.py) and cut about 10% off a GPT train step on CPU
# (benchmarks/train_throughput.py). The derivative evaluates erf / tanh at -u (both are odd),
# not at the value's u: the same numbers, but not the same expression, so XLA cannot merge the
# two and keep erf(u) / tanh(u) from the forward pass alive until the backward pass beside the
# pre-activation x (one more [tokens, d_ff] tensor per layer). The backward pass recomputes the
# derivative from x alone. With the softmax's (attention.softmax_values) this keeps a GPT
# 4/4/128 train step (batch 12 x 64) inside a 32 MiB L3 cache: 48 -> 34 ms on 2 cores.
_SQRT_HALF, _INV_SQRT_2PI, _SQRT_2_OVER_PI = math.sqrt(0.5), 1 / math.sqrt(2 * math.pi), \
    math.sqrt(2 / math.pi)


@jax.custom_jvp
def gelu(x: Array) -> Array:
    """Exact GELU, x Phi(x) (`jax.nn.gelu(x, approximate=False)`); derivative Phi + x phi.

    >>> float(gelu(jnp.float32(1.0)))  # doctest: +ELLIPSIS
    0.8413...
    """
    return x * (0.5 + 0.5 * jax.lax.erf(x * _SQRT_HALF))


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    cdf = 0.5 - 0.5 * jax.lax.erf(-x * _SQRT_HALF)  # Phi(x), at -u (see above)
    pdf = jnp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return gelu(x), t * (cdf + x * pdf)


@jax.custom_jvp
def gelu_tanh(x: Array) -> Array:
    """GPT-2's tanh GELU, x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2 (`jax.nn.gelu`)."""
    return 0.5 * x * (1 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


@gelu_tanh.defjvp
def _gelu_tanh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    th = -jnp.tanh(-_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))  # tanh(u), at -u (see above)
    slope = 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * _SQRT_2_OVER_PI * (1 + 0.134145 * x * x)
    return gelu_tanh(x), t * slope


ACTIVATIONS = {  # name -> nonlinearity (for gated variants: of the gate)
    "relu": nn.relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "swiglu": nn.silu,
    "geglu": gelu_tanh,
}
GATED = ("swiglu", "geglu")


class MLP(nn.Module):
    """Position-wise feed-forward: act(x W_i + b_i) W_o + b_o.

    Gated variants (SwiGLU, GeGLU): (act(x W_gate) * x W_up) W_o.
    """

    config: TransformerConfig
    deterministic: bool = True  # LoRA's dropout

    @nn.compact
    def __call__(self, x_BTD: Array) -> Array:
        cfg = self.config
        d_model = x_BTD.shape[-1]
        x_BTD = x_BTD.astype(cfg.dtype)

        def dense(name, x, features, names):
            scale = cfg.init_scale(residual=name == "wo")
            kernel = self.param(
                name,
                nn.with_logical_partitioning(projection_init(cfg.init_std, 0, 1, scale), names),
                (x.shape[-1], features),
                cfg.param_dtype,
            )
            y = lora_lib.project(self, name, x, kernel, names, 1, cfg.lora, cfg.dtype,
                                 cfg.param_dtype, self.deterministic, matmul)
            if cfg.use_bias:
                b = self.param(f"{name}_bias",
                               nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
                               (features,), cfg.param_dtype)
                y = y + b.astype(cfg.dtype)
            return y

        act = ACTIVATIONS[cfg.activation]
        if cfg.activation in GATED:
            gate_BTF = dense("wi_gate", x_BTD, cfg.d_ff, ("embed", "mlp"))
            up_BTF = dense("wi_up", x_BTD, cfg.d_ff, ("embed", "mlp"))
            hidden_BTF = act(gate_BTF) * up_BTF
        else:
            hidden_BTF = act(dense("wi", x_BTD, cfg.d_ff, ("embed", "mlp")))
        return dense("wo", hidden_BTF, d_model, ("mlp", "embed"))


class TransformerBlock(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; each a residual sublayer.

    `config.norm_placement`: pre-LN x + Dropout(f(LN(x))); post-LN (the original Transformer)
    LN(x + Dropout(f(x))); sandwich x + LN'(Dropout(f(LN(x)))); post_sublayer x + LN'(f(x)).
    `config.parallel_block`: x + attn(LN(x)) + mlp(LN(x)), one norm for both.
    An encoder block is self-attention (with a Full/Padding mask) + FFN; a decoder block uses a
    Causal mask and, with `cross_attention=True`, attends to `encoded` in between.
    `local=True`: self-attention under `local_mask` (the sliding window) instead of `mask`.
    `moe_layer=True` makes the feed-forward a mixture of experts (`config.moe`), which sows
    its auxiliary quantities into the 'losses' collection (`moe_aux`).
    `scanned=True` makes it return (x, None), the carry/output pair `nn.scan` expects.
    """

    config: TransformerConfig
    cross_attention: bool = False
    deterministic: bool = True
    scanned: bool = False
    decode: bool = False  # KV-cache decoding (see MultiHeadAttention)
    moe_layer: bool = False
    local: bool = False

    @nn.compact
    def __call__(self, x_BTD, mask, bias, positions, encoded=None, cross_mask=None,
                 local_mask=None):
        cfg = self.config
        if self.cross_attention and encoded is None and not self.decode:
            raise ValueError("a block with cross_attention=True needs `encoded` inputs")
        self_mask = local_mask if self.local else mask
        attend = lambda h: self._attention("self_attention", True)(
            h, mask=self_mask, bias=bias, q_positions=positions,
            deterministic=self.deterministic, decode=self.decode)
        mlp = self._moe if self.moe_layer else MLP(cfg, self.deterministic, name="mlp")
        dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
        if cfg.parallel_block:
            if self.cross_attention:
                raise ValueError("parallel_block=True: expected a stack without cross-attention")
            h_BTD = norm_layer(cfg, "self_attention_norm")(x_BTD)
            x_BTD = x_BTD + dropout(attend(h_BTD)) + dropout(mlp(h_BTD))
        else:
            x_BTD = self._residual(x_BTD, "self_attention", attend)
            if self.cross_attention:  # decode steps reuse the cached K/V (encoded is None)
                x_BTD = self._residual(x_BTD, "cross_attention", lambda h: self._attention(
                    "cross_attention", False)(h, encoded, mask=cross_mask,
                                              deterministic=self.deterministic,
                                              decode=self.decode))
            x_BTD = self._residual(x_BTD, "mlp", mlp)
        x_BTD = sharding.constrain(x_BTD, sharding.ACTIVATIONS)
        return (x_BTD, None) if self.scanned else x_BTD

    def _residual(self, x_BTD: Array, name: str, sublayer) -> Array:
        """x plus the sublayer's dropped-out output, normed where `norm_placement` says: params
        `name`_norm (on its input; post: on the sum) and `name`_output_norm (on its output)."""
        cfg, placement = self.config, self.config.norm_placement
        y_BTD = sublayer(norm_layer(cfg, f"{name}_norm")(x_BTD)
                         if placement in ("pre", "sandwich") else x_BTD)
        if placement in ("sandwich", "post_sublayer"):
            y_BTD = norm_layer(cfg, f"{name}_output_norm")(y_BTD)
        x_BTD = x_BTD + nn.Dropout(cfg.dropout_rate)(y_BTD, deterministic=self.deterministic)
        return norm_layer(cfg, f"{name}_norm")(x_BTD) if placement == "post" else x_BTD

    def _attention(self, name: str, is_self: bool) -> MultiHeadAttention:
        cfg = self.config
        return MultiHeadAttention(
            num_heads=cfg.num_heads,
            head_dim=cfg.resolved_head_dim,
            num_kv_heads=cfg.num_kv_heads,
            use_bias=cfg.use_bias,
            qkv_bias=cfg.qkv_bias,
            scale=cfg.resolved_attention_scale,
            rope_theta=cfg.rope_theta if is_self and cfg.position == "rope" else None,
            rope_layout=cfg.rope_layout,
            rope_scale=cfg.rope_scale,
            rope_scaling=cfg.rope_scaling,
            rope_low_freq_factor=cfg.rope_low_freq_factor,
            rope_high_freq_factor=cfg.rope_high_freq_factor,
            rope_original_max_len=cfg.rope_original_max_len,
            dropout_rate=cfg.attention_dropout_rate,
            init_std=cfg.init_std,
            init_scale=cfg.init_scale(),
            out_init_scale=cfg.init_scale(residual=True),
            qk_norm=cfg.qk_norm_scope if cfg.qk_norm else "",
            norm_epsilon=cfg.norm_epsilon,
            softcap=cfg.attention_softcap,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            cross=not is_self,
            impl=cfg.attention_impl,
            sequence_parallel=cfg.sequence_parallel,
            lora=cfg.lora if cfg.lora.rank else None,
            name=name,
        )

    def _moe(self, x_BTD: Array) -> Array:
        cfg = self.config
        y_BTD, routing = MoEFeedForward(
            num_experts=cfg.moe.num_experts, d_ff=cfg.moe.d_ff or cfg.d_ff, top_k=cfg.moe.top_k,
            capacity_factor=cfg.moe.capacity_factor, num_shared=cfg.moe.num_shared,
            normalize_gates=cfg.moe.normalize_gates, shared_gate=cfg.moe.shared_gate,
            activation=ACTIVATIONS[cfg.activation], gated=cfg.activation in GATED,
            init_std=cfg.init_std, init_scale=cfg.init_scale(),
            out_init_scale=cfg.init_scale(residual=True), dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, name="moe")(x_BTD)
        for name in MOE_AUX:
            self.sow("losses", f"moe_{name}", getattr(routing, name))
        return y_BTD


class _BlockGroup(nn.Module):
    """`config.layer_period` consecutive blocks: what one step of the scan runs when layers are
    not all alike (MoE every n layers, a global layer every sliding_window_pattern), each block
    the kind its index in the period gives (params `layers/block_0..n-1`)."""

    config: TransformerConfig
    block: Any  # the block class (possibly rematerialised)
    cross_attention: bool = False
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x_BTD, *args):
        cfg = self.config
        for i in range(cfg.layer_period):
            x_BTD = self.block(cfg, cross_attention=self.cross_attention,
                               deterministic=self.deterministic, decode=self.decode,
                               moe_layer=cfg.moe.is_moe_layer(i), local=cfg.is_local_layer(i),
                               name=f"block_{i}")(x_BTD, *args)
        return x_BTD, None


def _scanned(cfg: TransformerConfig, block, length: int, kwargs: dict, **module_kwargs):
    """`length` scanned block groups (or blocks, when all layers are alike): the `layers` unit
    whose params have a leading axis of that length, named `layers` by the logical rules."""
    grouped = cfg.layer_period > 1
    scanned = nn.scan(
        _BlockGroup if grouped else block,
        variable_axes={"params": 0, "intermediates": 0, "cache": 0, "losses": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * 6,
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    if grouped:
        return scanned(cfg, block, **kwargs, **module_kwargs)
    return scanned(cfg, scanned=True, moe_layer=cfg.moe.num_experts > 0,
                   local=cfg.is_local_layer(0), **kwargs, **module_kwargs)


MOE_AUX = ("load_balance", "router_z", "dropped")  # sown per MoE layer as losses/moe_<name>


def moe_aux(losses) -> dict[str, Array]:
    """{"load_balance", "router_z", "dropped"}: each the mean over the MoE layers of what they
    sowed into the 'losses' collection (`{}` for a model without MoE layers)."""
    leaves = {name: [] for name in MOE_AUX}
    flat = jax.tree_util.tree_flatten_with_path(losses)[0]
    for path, value in flat:
        keys = [getattr(k, "key", None) for k in path]
        for name in MOE_AUX:
            if f"moe_{name}" in keys:
                leaves[name].append(jnp.ravel(value))
    return {name: jnp.mean(jnp.concatenate(values)) for name, values in leaves.items() if values}


class TransformerStack(nn.Module):
    """N blocks plus what a stack owns: absolute positions, shared position biases, final norm.

    Adds sinusoidal/learned positions to the input (then the embedding norm, if configured, and
    dropout), computes the ALiBi or T5 bias once (the T5
    bias table is shared by all layers of the stack; `bidirectional=False` uses causal buckets),
    runs the blocks (unrolled as `layers_0..N-1`, or one `nn.scan` over `layers` with a leading
    layer axis so compile time does not grow with depth), then the final norm for pre-LN.
    """

    config: TransformerConfig
    cross_attention: bool = False
    bidirectional: bool = True

    @nn.compact
    def __call__(
        self,
        x_BTD: Array,
        mask: Mask | Array | None = None,
        positions: Array | None = None,
        encoded: Array | None = None,
        cross_mask: Mask | Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        kv_positions: Array | None = None,
        local_mask: Mask | Array | None = None,
    ) -> Array:
        """`decode=True` runs the blocks' attention on the KV cache (see MultiHeadAttention);
        `kv_positions` [1 or B, L] are then the positions of the cache slots, for the ALiBi and
        T5 biases (default: `positions`). `local_mask`: the self-attention mask of the layers
        `config.is_local_layer` names (the sliding window's; default `mask`)."""
        cfg = self.config
        length = x_BTD.shape[1]
        if positions is None:
            positions = jnp.arange(length, dtype=jnp.int32)[None]
        x_BTD = x_BTD.astype(cfg.dtype)
        if cfg.scale_embeddings:
            x_BTD = x_BTD * jnp.asarray(cfg.d_model**0.5, cfg.dtype)
        if cfg.position == "sinusoidal":
            x_BTD = x_BTD + positions_lib.sinusoidal_positions(positions, cfg.d_model).astype(
                cfg.dtype)
        elif cfg.position == "learned":
            x_BTD = x_BTD + positions_lib.LearnedPositionEmbedding(
                cfg.max_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                name="position_embedding")(positions)
        bias = None
        kv_positions = positions if kv_positions is None else kv_positions
        # With chunked attention (or "auto", which may pick it) the biases are functions of
        # (query, key) indices, evaluated per tile: never a [B, N, T, S] array.
        as_function = (cfg.attention_impl in ("chunked", "auto")
                       or sequence_parallel.shards() > 1)
        if cfg.position == "alibi":
            bias = (positions_lib.alibi_bias_fn if as_function else positions_lib.alibi_bias)(
                positions, kv_positions, cfg.num_heads)
        elif cfg.position == "t5":
            bias = positions_lib.T5RelativePositionBias(
                cfg.num_heads, bidirectional=self.bidirectional, num_buckets=cfg.t5_num_buckets,
                max_distance=cfg.t5_max_distance, param_dtype=cfg.param_dtype,
                dtype=jnp.promote_types(cfg.dtype, jnp.float32),
                name="relative_position_bias")(positions, kv_positions, as_function=as_function)
        if cfg.embedding_norm:
            x_BTD = norm_layer(cfg, "embedding_norm")(x_BTD)
        x_BTD = nn.Dropout(cfg.dropout_rate)(x_BTD, deterministic=deterministic)
        x_BTD = sharding.constrain(x_BTD, sharding.ACTIVATIONS)

        block = TransformerBlock
        if cfg.remat_policy != "none":
            block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy],
                             prevent_cse=not cfg.scan_layers)
        args = (mask, bias, positions, encoded, cross_mask,
                mask if local_mask is None else local_mask)
        kwargs = dict(cross_attention=self.cross_attention, deterministic=deterministic,
                      decode=decode)
        moe = cfg.moe
        if cfg.scan_layers:
            groups = cfg.num_layers // cfg.layer_period
            if self._pipelined(decode):
                x_BTD = self._pipeline(block, kwargs, x_BTD, args, deterministic)
            else:
                x_BTD, _ = _scanned(cfg, block, groups, kwargs, name="layers")(x_BTD, *args)
        else:
            for i in range(cfg.num_layers):
                x_BTD = block(cfg, name=f"layers_{i}", moe_layer=moe.is_moe_layer(i),
                              local=cfg.is_local_layer(i), **kwargs)(x_BTD, *args)
        if cfg.norm_placement != "post":
            x_BTD = norm_layer(cfg, "final_norm")(x_BTD)
        return x_BTD

    def _pipelined(self, decode: bool) -> bool:
        """Whether the scanned blocks run as a pipeline: under a mesh with `stage` > 1, when
        applied (init lays the params out as the plain scan does), not decoding, and for a
        stack without cross-attention (the families `configs.validate_config` accepts)."""
        return (pipeline_parallel.stages_in_mesh() > 1 and not self.is_initializing() and not decode
                and not self.cross_attention)

    def _pipeline(self, block, kwargs, x_BTD, args, deterministic):
        """The scanned blocks over the `stage` axis (`pipeline_parallel.run`), on the params the
        plain scan declares (`layers`, leading axis the layer groups). MoE layers' auxiliary
        losses come back averaged over microbatches and sown once per quantity."""
        cfg = self.config
        if cfg.position in ("alibi", "t5"):
            raise ValueError(f"position={cfg.position!r}: the pipeline (mesh.stage > 1) "
                             "expected positions without an attention bias (not alibi or t5)")
        microbatches, repeats = pipeline_parallel.current_schedule()
        stages = pipeline_parallel.stages_in_mesh()
        groups = cfg.num_layers // cfg.layer_period
        unit = _scanned(cfg, block, groups // (stages * repeats), kwargs, parent=None)

        def stage_fn(params, x_bTD, stage_args, key):
            (y_bTD, _), state = unit.apply({"params": params}, x_bTD, *stage_args,
                                           rngs={} if key is None else {"dropout": key},
                                           mutable=["losses"])
            return y_bTD, moe_aux(state.get("losses", {}))

        rng = None if deterministic or not (cfg.dropout_rate or cfg.attention_dropout_rate) \
            else self.make_rng("dropout")
        x_BTD, aux = pipeline_parallel.run(
            stage_fn, self.variables["params"]["layers"], x_BTD, args, stages=stages,
            microbatches=microbatches, repeats=repeats, rng=rng,
            remat_policy=REMAT_POLICIES[cfg.remat_policy])
        for name, value in aux.items():
            self.sow("losses", f"moe_{name}", value)
        return x_BTD


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled stack params {layers_0: p0, ...} -> scanned {layers: stacked along axis 0}."""
    params = dict(params)
    layers = [params.pop(f"layers_{i}") for i in range(num_layers)]
    params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return params


def unstack_layers(params: dict, num_layers: int) -> dict:
    """Scanned stack params {layers: stacked} -> unrolled {layers_0: p0, ...}."""
    params = dict(params)
    stacked = params.pop("layers")
    for i in range(num_layers):
        params[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params


class TokenEmbedding(nn.Module):
    """Token id -> vector lookup, and its transpose (`attend`) for a tied output head."""

    vocab_size: int
    features: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        init = nn.with_logical_partitioning(nn.initializers.normal(self.init_std),
                                            ("vocab", "embed"))
        self.embedding = self.param("embedding", init, (self.vocab_size, self.features),
                                    self.param_dtype)

    def __call__(self, tokens_BT: Array) -> Array:
        return jnp.take(self.embedding, tokens_BT, axis=0).astype(self.dtype)

    def attend(self, x_BTD: Array) -> Array:
        """Logits x E^T in the compute dtype: [B, T, D] -> [B, T, V].

        Bfloat16 logits, as MaxText and t5x keep them: the loss upcasts inside its fused
        reduction (`objectives.cross_entropy`), so [B, T, V] never exists whole in float32.
        """
        logits_BTV = matmul(x_BTD, self.embedding.T, dtype=self.dtype)
        return sharding.constrain(logits_BTV, sharding.LOGITS)


class OutputHead(nn.Module):
    """An untied projection to the vocabulary (or to classes), logits in the compute dtype."""

    features: int
    use_bias: bool = False
    init_std: float | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    names: tuple[str, str] = ("embed", "vocab")

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = self.param("kernel", nn.with_logical_partitioning(
            projection_init(self.init_std, 0, 1), self.names), (x.shape[-1], self.features),
            self.param_dtype)
        y = matmul(x, kernel, dtype=self.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.with_logical_partitioning(
                nn.initializers.zeros, self.names[1:]), (self.features,), self.param_dtype)
        return sharding.constrain(y, sharding.LOGITS) if y.ndim == 3 else y
