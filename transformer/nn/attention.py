"""`attend` (picks a kernel from `kernels.KERNELS` and runs it), `AttentionSettings` (one
attention layer's settings, read off the config in one place) and the Linen multi-head attention
layer. The dense math itself is in `dense_attention`.

Shapes: B batch, T query length, S key length, N query heads, K key/value heads (N % K == 0:
K == N is multi-head, 1 < K < N grouped-query, K == 1 multi-query), G = N // K, H head dim,
D model width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn import cudnn_attention, dense_attention, kernels, quantization
from transformer.nn import lora as lora_lib
from transformer.nn import positions as positions_lib
from transformer.nn import sequence_parallel as sequence_parallel_lib
from transformer.nn.chunked_attention import chunked_attention
from transformer.nn.masks import Mask

Array = jax.Array
ATTENTION_GATES = ("", "head", "element")  # off, a gate per head, or per head_dim element
FLAT_MATMUL_PLATFORMS = ("cpu",)  # where `matmul` runs projections as 2-D GEMMs

def attend(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Mask | Array | None = None,
    bias: Array | Callable | None = None,
    impl: str = "dense",
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    sequence_parallel: str = "all_gather",
    softcap: float = 0.0,
    sinks: Array | None = None,
):
    """Attention through the kernel `impl` names: what `dense_attention.dot_product_attention`
    computes.

    Args:
      query: [B, T, N, H]; key, value: [B, S, K, H] with N divisible by K.
      mask: a `masks.Mask`, a boolean array broadcastable to [B, N, T, S], or None.
      bias: a float array broadcastable to [B, N, T, S], or a function `bias(q_idx, kv_idx)` of
        query and key indices (see `chunked_attention`): the chunked kernel evaluates it per
        tile, the others materialise it.
      impl: one of `kernels.IMPLS`, resolved by `kernels.select`: "dense"
        (`dot_product_attention`, [B, N, T, S] logits; on CPU in query blocks), "chunked"
        (`chunked_attention`, O(T + S) memory), "splash" (the Pallas TPU kernel; Pallas
        interpret mode elsewhere), "cudnn" (cuDNN flash attention on GPU), "reference" (the
        plain formula by autodiff, `reference_attention`) or "auto" (by platform and length;
        see `kernels`). What each kernel takes is declared in `kernels.KERNELS`.
      scale: logit scale, default 1 / sqrt(H).
      dropout_rate, dropout_rng: dropout on the attention weights (training only).
      return_weights: also return the weights [B, N, T, S].
      sequence_parallel: "all_gather" or "ring": the strategy when the mesh in context splits
        the length over its `sequence` axis (see `sequence_parallel`); each device then runs
        splash where `impl` is "splash" (or "auto" on TPU) and splash can, else chunked.
      softcap: > 0 soft-caps the scaled logits (see `dot_product_attention`); not in cuDNN.
      sinks: [N] sink logits, one per query head, with no value (`dot_product_attention`).

    Dropout and `return_weights` run a kernel that declares them: dense (also under a `sequence`
    axis, where XLA then partitions it), or reference when named. Returns out [B, T, N, H], or
    (out, weights) with `return_weights`.

    >>> from transformer.nn import masks
    >>> q, kv = jnp.ones((2, 4, 8, 16)), jnp.ones((2, 6, 2, 16))
    >>> attend(q, kv, kv, mask=masks.Causal(), impl="chunked").shape
    (2, 4, 8, 16)
    >>> attend(q, kv, kv, impl="chunked", return_weights=True)[1].shape  # ran dense
    (2, 8, 4, 6)
    """
    platform, split = kernels.target_platform(), sequence_parallel_lib.shards()
    mesh_set = not jax.sharding.get_abstract_mesh().empty
    call = kernels.Call(platform, mask, bias, dropout_rate, query.shape[1], key.shape[1],
                        query.shape[-1], interpret=impl == "splash" and platform != "tpu",
                        dtype=query.dtype, devices=1 if mesh_set else jax.device_count(),
                        softcap=softcap, weights=return_weights, sinks=sinks is not None,
                        gqa=query.shape[2] != key.shape[2], split=split)
    if split > 1 and kernels.refusal("chunked per device", call) is None:
        return _attend_split(query, key, value, mask, bias, call, impl=impl, scale=scale,
                             strategy=sequence_parallel, sinks=sinks)
    impl = kernels.select(impl, fall_back=True, **{
        f.name: getattr(call, f.name) for f in dataclasses.fields(call)})
    if callable(bias) and impl != "chunked":
        bias = bias(jnp.arange(query.shape[1]), jnp.arange(key.shape[1]))
    fused = dict(scale=scale, softcap=softcap, sinks=sinks)  # what chunked and splash take
    if impl == "chunked":
        return chunked_attention(query, key, value, mask, bias, **fused)
    if impl == "splash":
        return kernels.splash_attention(query, key, value, mask, interpret=platform != "tpu",
                                        **fused)
    if impl == "cudnn":
        return cudnn_attention.cudnn_attention(query, key, value, mask, scale=scale)
    dense = dict(scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                 return_weights=return_weights, softcap=softcap, sinks=sinks)
    if impl == "reference":
        return dense_attention.reference_attention(query, key, value, mask, bias, **dense)
    return dense_attention.dot_product_attention(
        query, key, value, mask, bias, **dense_attention.cpu_layout(query.shape[1], platform),
        **dense)


def _attend_split(query, key, value, mask, bias, call, *, impl, scale, strategy, sinks=None):
    """Attention under a `sequence` axis of `call.split` devices: splash per device where `impl`
    asks for it ("splash", or "auto" on TPU) and it can run, else the chunked kernel; the kernel
    line says which, and why splash could not."""
    note, split, platform = "", call.split, call.platform
    if impl == "splash" or (impl == "auto" and platform == "tpu"):
        interpret = platform != "tpu"
        reason = sequence_parallel_lib.splash_reason(
            mask, bias, strategy=strategy, q_len=call.q_len, kv_len=call.kv_len,
            num_shards=split, platform=platform, interpret=interpret) or kernels.refusal(
                "splash per device", call)
        if reason is None:
            kernels.record(f"splash per device, {strategy} over sequence={split}")
            return sequence_parallel_lib.splash_attention(
                query, key, value, mask, scale=scale, softcap=call.softcap, interpret=interpret)
        note = f" (splash {reason})"
    kernels.record(f"chunked per device, {strategy} over sequence={split}{note}")
    return sequence_parallel_lib.attention(query, key, value, mask, bias, strategy=strategy,
                                           scale=scale, softcap=call.softcap, sinks=sinks)


def matmul(x: Array, kernel: Array, contract: int = 1, dtype=None,
           preferred_element_type=None, quantized: bool = True) -> Array:
    """x [..., *kernel.shape[:contract]] times kernel -> [..., *kernel.shape[contract:]].

    On CPU computed as one 2-D [tokens, in] x [in, out] matmul (in `dtype`, if given): with 3-D
    operands XLA CPU lays the backward pass's activation gradients out transposed, which made
    fwd+bwd of a GPT-2-sized MLP 2x slower. Elsewhere one dot over the kernel's own axes, so a
    projection to heads gives [B, T, N, H] directly: on TPU reshaping a flat [tokens, N * H]
    result to heads is a relayout, a copy the backward pass keeps (0.30 GiB a chip of the 1.71B
    on v6e-8, docs/performance.md). `quantized=False`: a product a quantized run leaves in
    float (`quantization.dot`, not the intercepted `projection_dot`).

    >>> matmul(jnp.ones((2, 3, 4)), jnp.ones((4, 5, 6))).shape
    (2, 3, 5, 6)
    """
    in_shape, out_shape = kernel.shape[:contract], kernel.shape[contract:]
    lead = x.shape[:x.ndim - contract]
    if x.shape[x.ndim - contract:] != in_shape:
        raise ValueError(f"matmul: x shape {x.shape} does not end in the kernel's input dims "
                         f"{in_shape}")
    if dtype is not None:
        x, kernel = x.astype(dtype), kernel.astype(dtype)
    # Qwix quantizes projection_dot, where a quantized run asks it to
    dot = quantization.projection_dot if quantized else quantization.dot
    if kernels.target_platform() not in FLAT_MATMUL_PLATFORMS:
        return dot(x, kernel, preferred_element_type, contract)
    size = math.prod(in_shape)
    y = dot(x.reshape(-1, size), kernel.reshape(size, -1), preferred_element_type)
    return y.reshape(*lead, *out_shape)


def projection_init(std: float | None, in_axis, out_axis,
                    multiplier: float = 1.0) -> nn.initializers.Initializer:
    """Normal(std) if std is given, else fan-in variance scaling over the given kernel axes;
    either with its standard deviation times `multiplier` (GPT-2's 1 / sqrt(2 L) on the
    projections into the residual stream, `TransformerConfig.scale_residual_init`)."""
    if std is not None:
        return nn.initializers.normal(stddev=std * multiplier)
    return nn.initializers.variance_scaling(
        multiplier**2, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )


@dataclasses.dataclass(frozen=True)
class AttentionSettings:
    """Everything one attention layer is built from: its shapes, projections, positions, norms,
    init and kernel. `from_config` reads them off a `TransformerConfig` in one place; a new
    attention knob is one field here, its key in the config, and its use in the kernels."""

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    use_bias: bool = False
    qkv_bias: bool | None = None  # biases on the q/k/v projections; None: = use_bias
    scale: float | None = None  # logit scale; None: 1/sqrt(head_dim)
    rope_theta: float | None = None
    rope_layout: str = "half"
    rope_scale: float = 1.0
    rope_scaling: str = "linear"  # how rope_scale stretches positions: linear | llama3 | yarn
    rope_low_freq_factor: float = 1.0  # llama3 only (positions.rope_frequencies)
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_yarn_beta_fast: float = 32.0  # yarn only (positions.yarn_frequencies)
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0  # positions.rope_attention_factor
    rope_yarn_mscale_all_dim: float = 0.0
    rope_yarn_truncate: bool = True
    rope_fraction: float = 1.0
    dropout_rate: float = 0.0
    init_std: float | None = None
    init_scale: float = 1.0  # W_q, W_k, W_v's init std multiplier (projection_init)
    out_init_scale: float = 1.0  # W_o's
    # RMSNorm with a learned scale on q and k after the projections, before RoPE: "head" over
    # each head's H values (Qwen3, Gemma 3), "projection" over all N x H (OLMo 2); "": none
    qk_norm: str = ""
    norm_epsilon: float = 1e-6  # the q/k norms'
    # gated attention (Qwen3-Next): sigmoid(x W_gate) scales the heads' output before W_o, one
    # gate per "head" or per "element" of each head; "": none (MultiHeadAttention._gated)
    gate: str = ""
    softcap: float = 0.0  # > 0: logit soft-cap, softcap * tanh(logits / softcap) (Gemma 2)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    cross: bool = False  # cross-attention: under decode, K/V are cached once and reused
    # kernels.IMPLS: "auto", "dense", "chunked" (O(T) memory), "splash", "cudnn" or "reference";
    # dropout on the weights and requests for the weights use dense
    impl: str = "auto"
    sequence_parallel: str = "all_gather"  # under a `sequence` mesh axis: all_gather | ring
    lora: Any = None  # transformer.nn.lora.LoraConfig: adapters on the projections it targets
    sinks: bool = False  # a learned sink logit per query head, param `sinks` [N] (gpt-oss)

    @classmethod
    def from_config(cls, cfg, *, cross: bool = False) -> AttentionSettings:
        """The settings of a `TransformerConfig`'s self-attention (or, `cross`, its
        cross-attention, which has no RoPE)."""
        return cls(
            num_heads=cfg.num_heads, head_dim=cfg.resolved_head_dim,
            num_kv_heads=cfg.num_kv_heads, use_bias=cfg.use_bias, qkv_bias=cfg.qkv_bias,
            scale=cfg.resolved_attention_scale,
            # every RoPE key as the config has it (positions.ROPE_KEYS), but no RoPE at all
            # without position "rope" or in a cross-attention (rope_theta None)
            **{name: getattr(cfg, name) for name in positions_lib.ROPE_KEYS.values()} | (
                {} if not cross and cfg.position == "rope" else {"rope_theta": None}),
            dropout_rate=cfg.attention_dropout_rate, init_std=cfg.init_std,
            init_scale=cfg.init_scale(), out_init_scale=cfg.init_scale(residual=True),
            qk_norm=cfg.qk_norm_scope if cfg.qk_norm else "", norm_epsilon=cfg.norm_epsilon,
            gate=cfg.attention_gate,
            softcap=cfg.attention_softcap, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            cross=cross, impl=cfg.attention_impl, sequence_parallel=cfg.sequence_parallel,
            lora=cfg.lora if cfg.lora.rank else None, sinks=cfg.attention_sinks)

    def kernel_args(self, deterministic: bool) -> dict[str, Any]:
        """The keyword arguments of `attend` these settings give (no dropout when
        `deterministic`)."""
        return dict(impl=self.impl, scale=self.scale, sequence_parallel=self.sequence_parallel,
                    softcap=self.softcap, dropout_rate=0.0 if deterministic else self.dropout_rate)


class MultiHeadAttention(nn.Module):
    """Multi-head attention: per-head W_q, W_k, W_v, attention per head, concat, W_o.

    Self-attention when `inputs_kv` is None, cross-attention otherwise. Grouped-query and
    multi-query attention via `num_kv_heads`. `qk_norm` normalises q and k, then RoPE (if
    `rope_theta` is set) rotates them at `q_positions` / `kv_positions`; the cache holds the
    normalised, rotated keys. Params carry logical axis names: query [embed, heads, kv],
    key/value [embed, kv_heads, kv], out [heads, kv, embed].

    The attention weights are sown into the 'intermediates' collection as `attention_weights`
    when that collection is mutable (for attention-map pictures), and returned as a second
    output when `return_weights=True`.

    `decode=True` uses the 'cache' collection (apply with `mutable=["cache"]`). Self-attention
    writes the new (rotated) keys and values into slots `q_positions` of its [B, L, K, H]
    buffers and attends over the whole buffer, so the caller's mask must hide the slots not
    written yet (slot j > the query's position). A `cross=True` layer caches the keys and values
    of `inputs_kv` when given them and reuses them when `inputs_kv` is None. The decode call
    inside `init` only creates the buffers, shaped like its inputs (L = the input length).

    The attention itself is `attend` with the settings' kernel: `mask` and `bias` (an array or a
    function of query and key indices) are passed to it as given. All settings are one field,
    `settings` (`AttentionSettings`).
    """

    settings: AttentionSettings


    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        *,
        mask: Mask | Array | None = None,
        bias: Array | Callable | None = None,
        q_positions: Array | None = None,
        kv_positions: Array | None = None,
        deterministic: bool = True,
        return_weights: bool = False,
        decode: bool = False,
        segment_ids: Array | None = None,  # the token-mixer call's; documents are in `mask`
    ):
        num_kv_heads = self._num_kv_heads()
        # a cross-attention decode step reuses the cached keys and values
        reuse_kv = decode and self.settings.cross and inputs_kv is None
        self_attention = inputs_kv is None and not self.settings.cross
        inputs_kv = inputs_q if self_attention else inputs_kv
        query_BTNH = self._normed("query", self._project("query", inputs_q, self.settings.num_heads,
                                                         "heads", deterministic), "heads")
        if reuse_kv:
            key_BSKH, value_BSKH = self._cached("cross_key"), self._cached("cross_value")
        else:
            key_BSKH = self._normed("key", self._project("key", inputs_kv, num_kv_heads,
                                                         "kv_heads", deterministic), "kv_heads")
            value_BSKH = self._project("value", inputs_kv, num_kv_heads, "kv_heads",
                                       deterministic)
        if self.settings.rope_theta is not None:
            q_positions = _default_positions(q_positions, inputs_q.shape[1])
            query_BTNH = self._rotate(query_BTNH, q_positions)
            if not reuse_kv:  # cached keys were rotated before they were written
                kv_positions = q_positions if self_attention and kv_positions is None else (
                    _default_positions(kv_positions, inputs_kv.shape[1]))
                key_BSKH = self._rotate(key_BSKH, kv_positions)
        if decode and not reuse_kv:
            key_BSKH, value_BSKH = self._update_cache(key_BSKH, value_BSKH, q_positions)
        out_BTNH, weights_BNTS = self._attend(query_BTNH, key_BSKH, value_BSKH, mask, bias,
                                              deterministic, return_weights)
        out_BTNH = self._gated(inputs_q, out_BTNH, deterministic)
        out_BTD = self._output(out_BTNH, inputs_q.shape[-1], deterministic)
        return (out_BTD, weights_BNTS) if return_weights else out_BTD

    def _num_kv_heads(self) -> int:
        num_heads = self.settings.num_heads
        num_kv_heads = self.settings.num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads}: expected a multiple of num_kv_heads={num_kv_heads}"
            )
        return num_kv_heads

    def _project(self, name: str, x_BTD: Array, heads: int, heads_axis: str,
                 deterministic: bool = True) -> Array:
        """x [B, T, D] -> [B, T, heads, H] through param `name` (and `name`_bias)."""
        names = ("embed", heads_axis, "kv")
        kernel = self.param(
            name,
            nn.with_logical_partitioning(projection_init(self.settings.init_std, 0, (1, 2),
                                                         self.settings.init_scale), names),
            (x_BTD.shape[-1], heads, self.settings.head_dim),
            self.settings.param_dtype,
        )
        y_BTNH = self._matmul(name, x_BTD, kernel, names, 1, deterministic)
        if self.settings.use_bias if self.settings.qkv_bias is None else self.settings.qkv_bias:
            b = self.param(
                f"{name}_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
                (heads, self.settings.head_dim),
                self.settings.param_dtype,
            )
            y_BTNH = y_BTNH + b.astype(self.settings.dtype)
        return y_BTNH

    def _normed(self, name: str, x_BTNH: Array, heads_axis: str) -> Array:
        """`qk_norm`: RMSNorm of the projection `name` over each head's H values, or over all
        its heads' (param `name`_norm/scale [H] or [heads, H]); `x` itself without it."""
        s = self.settings
        if s.qk_norm not in ("", "head", "projection"):
            raise ValueError(f"qk_norm={s.qk_norm!r}: expected '', 'head' or 'projection'")
        if not s.qk_norm:
            return x_BTNH
        axes = (-2, -1) if s.qk_norm == "projection" else -1
        names = (heads_axis, "kv") if s.qk_norm == "projection" else ("kv",)
        return nn.RMSNorm(epsilon=s.norm_epsilon, dtype=s.dtype,
                          param_dtype=s.param_dtype, reduction_axes=axes, feature_axes=axes,
                          scale_init=nn.with_logical_partitioning(nn.initializers.ones, names),
                          name=f"{name}_norm")(x_BTNH)

    def _rotate(self, x_BTNH: Array, positions: Array) -> Array:
        """RoPE at `positions` [B or 1, T]."""
        return positions_lib.apply_rope(x_BTNH, positions,
                                        **positions_lib.rope_args(self.settings))

    def _update_cache(self, key_BSKH: Array, value_BSKH: Array,
                      q_positions: Array | None) -> tuple[Array, Array]:
        """Decode: writes the new keys and values into the cache (cross-attention: replaces
        them; self-attention: at slots `q_positions`) and returns what to attend over."""
        if self.settings.cross:
            return (self._cache("cross_key", key_BSKH, None),
                    self._cache("cross_value", value_BSKH, None))
        if q_positions is None:
            raise ValueError("decode=True needs q_positions: the cache slots to write")
        return (self._cache("key", key_BSKH, q_positions),
                self._cache("value", value_BSKH, q_positions))

    def _attend(self, query_BTNH, key_BSKH, value_BSKH, mask, bias, deterministic,
                return_weights) -> tuple[Array, Array | None]:
        """`attend` with this layer's settings (`AttentionSettings.kernel_args`); sows the
        weights into 'intermediates' when mutable (`attend_and_sow`). Returns (out [B, T, N, H],
        weights or None)."""
        args = self.settings.kernel_args(deterministic)
        dropout_rng = self.make_rng("dropout") if args["dropout_rate"] > 0.0 else None
        return attend_and_sow(self, query_BTNH, key_BSKH, value_BSKH, mask=mask, bias=bias,
                              dropout_rng=dropout_rng, return_weights=return_weights,
                              sinks=self._sinks(), **args)

    def _gated(self, x_BTD: Array, out_BTNH: Array, deterministic: bool) -> Array:
        """Gated attention ("Gated Attention for Large Language Models", Qiu et al. 2025):
        `out` times sigmoid(x W_gate + b_gate), x the layer's query-side input (a cross-attention
        layer's gate reads the decoder, not the memory), so a decode step's gate is its own
        token's. Param `gate` [embed, heads, kv] ("element", Qwen3-Next's) or [embed, heads]
        ("head", one scalar per head and token), plus `gate_bias` where the query has a bias.

        A kernel of its own rather than Hugging Face's layout, whose q_proj fuses it into the
        query (weight [N * 2H, D], each head's H query rows then its H gate rows): the gate is
        then named (LoRA targets it as `attention/gate`; the default targets leave it), shards
        over `heads` as the query does, and maps to HF at import as
        W.reshape(N, 2, H, D)[:, 1].transpose(2, 0, 1) (the query: [:, 0])."""
        s = self.settings
        if s.gate not in ATTENTION_GATES:
            raise ValueError(f"gate={s.gate!r}: expected '', 'head' or 'element'")
        if not s.gate:
            return out_BTNH
        names = ("embed", "heads", "kv") if s.gate == "element" else ("embed", "heads")
        shape = (x_BTD.shape[-1], s.num_heads, s.head_dim)[:len(names)]
        kernel = self.param("gate", nn.with_logical_partitioning(projection_init(
            s.init_std, 0, tuple(range(1, len(names))), s.init_scale), names), shape,
            s.param_dtype)
        gate = self._matmul("gate", x_BTD, kernel, names, 1, deterministic)
        if s.use_bias if s.qkv_bias is None else s.qkv_bias:
            gate = gate + self.param("gate_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, names[1:]), shape[1:], s.param_dtype).astype(s.dtype)
        gate = jax.nn.sigmoid(gate).astype(out_BTNH.dtype)
        return out_BTNH * (gate if s.gate == "element" else gate[..., None])

    def _sinks(self) -> Array | None:
        """`sinks`: param [N] under logical axis `heads`, initialised as Hugging Face's gpt-oss
        does (normal, std `init_std` or 0.02); float32 in the kernels' softmax."""
        if not self.settings.sinks:
            return None
        init = nn.initializers.normal(stddev=self.settings.init_std or 0.02)
        return self.param("sinks", nn.with_logical_partitioning(init, ("heads",)),
                          (self.settings.num_heads,), self.settings.param_dtype)

    def _matmul(self, name, x, kernel, names, contract, deterministic) -> Array:
        if self.settings.lora is None:
            return matmul(x, kernel, contract, dtype=self.settings.dtype)
        s = self.settings
        return lora_lib.project(self, name, x, kernel, names, contract, s.lora, s.dtype,
                                s.param_dtype, deterministic, matmul)

    def _output(self, out_BTNH: Array, d_model: int, deterministic: bool = True) -> Array:
        """W_o: [B, T, N, H] -> [B, T, D] (plus the output bias)."""
        out_init = projection_init(self.settings.init_std, (0, 1), 2, self.settings.out_init_scale)
        w_out = self.param(
            "out",
            nn.with_logical_partitioning(out_init, ("heads", "kv", "embed")),
            (self.settings.num_heads, self.settings.head_dim, d_model),
            self.settings.param_dtype,
        )
        out_BTD = self._matmul("out", out_BTNH, w_out, ("heads", "kv", "embed"), 2,
                               deterministic)
        if self.settings.use_bias:
            b_out = self.param(
                "out_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                (d_model,),
                self.settings.param_dtype,
            )
            out_BTD = out_BTD + b_out.astype(self.settings.dtype)
        return out_BTD

    def _cache(self, name: str, new_BTKH: Array, slots_BT: Array | None) -> Array:
        """Cache buffer `name` with `new` [B, T, K, H] written at slots `slots_BT` [B, T] (or
        replacing it, when None), returned as [B, L, K, H]. Inside `init` the buffer is only
        created, shaped like `new`. Buffers are stored [B, K, L, H], the layout the attention
        dots read without a transpose per step."""
        initialized = self.has_variable("cache", name)
        new_BKTH = new_BTKH.transpose(0, 2, 1, 3)
        buffer = self.variable("cache", name, jnp.zeros, new_BKTH.shape, new_BKTH.dtype)
        if not initialized:
            return new_BTKH
        new_BKTH = new_BKTH.astype(buffer.value.dtype)
        buffer.value = new_BKTH if slots_BT is None else write_slots(buffer.value, new_BKTH,
                                                                      slots_BT)
        return buffer.value.transpose(0, 2, 1, 3)

    def _cached(self, name: str) -> Array:
        """A cache buffer as [B, L, K, H], for decode steps that only read it."""
        return self.variable("cache", name).value.transpose(0, 2, 1, 3)


def attend_and_sow(module: nn.Module, query: Array, key: Array, value: Array, *,
                   return_weights: bool = False, **kwargs) -> tuple[Array, Array | None]:
    """`attend(query, key, value, **kwargs)` inside an attention layer `module`: when its
    'intermediates' collection is mutable, also sows the weights [B, N, T, S] there as
    `attention_weights` (what `transformer.visualize` draws; this forces a kernel that returns
    them, the dense one). Returns (out, weights, or None unless returned or sown)."""
    sow = module.is_mutable_collection("intermediates")
    want_weights = return_weights or sow
    result = attend(query, key, value, return_weights=want_weights, **kwargs)
    out, weights_BNTS = result if want_weights else (result, None)
    if sow:
        module.sow("intermediates", "attention_weights", weights_BNTS)
    return out, weights_BNTS


def write_slots(buffer: Array, new: Array, slots_BT: Array) -> Array:
    """`buffer` [B, ..., L, X] with `new` [B, ..., T, X] written at slots `slots_BT` [B, T] of
    its axis -2, the axes between written whole: a decode step's cache write.

    >>> write_slots(jnp.zeros((1, 5, 2)), jnp.ones((1, 1, 2)), jnp.array([[3]]))[0, :, 0]
    Array([0., 0., 0., 1., 0.], dtype=float32)
    """
    batch, *between, steps, _ = new.shape
    if slots_BT.size == 1 and math.prod(between) == 1 and kernels.target_platform() == "cpu":
        # XLA rewrites a one-index scatter (batch 1, one KV head or MLA's latent, one token) as
        # a dynamic-update-slice, which XLA:CPU then copies into each reader of the buffer: 4
        # copies of the whole cache a layer a step. The same write twice stays a scatter, in
        # place (MLA at 32k, batch 1: 20 -> 58 tokens/s on a 2-core EPYC).
        new, slots_BT = jnp.concatenate([new, new], -2), jnp.concatenate([slots_BT] * 2, 1)
        steps = 2
    ones = (1,) * len(between)
    index = (jnp.arange(batch).reshape(batch, *ones, 1),
             *(jnp.arange(n).reshape((1,) * (1 + i) + (n,) + ones[i + 1:] + (1,))
               for i, n in enumerate(between)),
             slots_BT.reshape(batch, *ones, steps))
    return buffer.at[index].set(new.astype(buffer.dtype))


def _default_positions(positions: Array | None, length: int) -> Array:
    return jnp.arange(length, dtype=jnp.int32)[None] if positions is None else positions
