"""`TransformerConfig`: every architectural choice of one stack of blocks, checked when made.
Models build one from their `model` config group and pass it down to the layers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from transformer.nn import kernels, sequence_parallel
from transformer.nn.activations import ACTIVATIONS
from transformer.nn.lora import LoraConfig
from transformer.nn.moe import MoEConfig

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
    # Under a `sequence` mesh axis (transformer.nn.sequence_parallel): how attention crosses the
    # split (all_gather | ring), and whether decoder LMs lay the sequence out zig-zag so every
    # device gets the same share of the causal mask.
    sequence_parallel: str = "all_gather"
    sequence_load_balance: bool = True
    moe: MoEConfig = MoEConfig()  # mixture-of-experts feed-forward layers (transformer.nn.moe)
    lora: LoraConfig = LoraConfig()  # low-rank adapters on a frozen base (transformer.nn.lora)

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
                                 "transformer.nn.moe.MoEConfig")
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
