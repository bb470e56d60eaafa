"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, section 2.1, and V3),
parametrised as Hugging Face's `DeepseekV3Attention`, so that an HF checkpoint imports by
reshaping each weight (`MultiHeadLatentAttention` lists the reshapes).

Per token x [D], with N heads, C = kv_lora_rank, P = qk_nope_head_dim, R = qk_rope_head_dim,
V = v_head_dim:

    q = RMSNorm(x W_qa) W_qb   (q_lora_rank > 0; else q = x W_q)   per head [q_nope P, q_rope R]
    [c, k_r] = x W_kva;  c = RMSNorm(c)    the latent c [C] the keys and values come from
    k_nope_h = c W_uk_h [P],  v_h = c W_uv_h [V]
    q_rope_h, k_r rotated by RoPE at the token's position (k_r [R]: one key, shared by the heads)
    logit_h(t, s) = scale (q_nope_h(t) . k_nope_h(s) + q_rope_h(t) . k_r(s))
    y = sum_h (sum_s softmax_s(logit_h) v_h(s)) W_o_h

Training materialises every head's key [k_nope_h, k_r] and value v_h and runs
`attention.attend` with the layer's kernel. The kernels take a key and value of one width, so
the narrower of the two sides is padded with zeros (v from V to P + R, by default) and the
output cut back to V.

Decode caches only [c, k_r] per token (the "latent cache", [B, L, C + R]) and absorbs W_uk into
the query: q_nope_h . (c W_uk_h) = (q_nope_h W_uk_h^T) . c. Attention is then multi-query over
the cache: the query [q_nope_h W_uk_h^T, q_rope_h] of each head, one key [c, k_r] of width
C + R, and as value that same key, of whose output only the first C values (sum_s p_s c(s))
are kept; W_uv_h and W_o take them to the output. No per-head key or value is ever formed.

Logit scale (DeepSeek's): 1 / sqrt(P + R) (or `attention_scale`; under muP over sqrt(m) as
attention's), times mscale(rope_scale, rope_yarn_mscale_all_dim)^2 under YaRN with a non-zero
rope_yarn_mscale_all_dim (`positions.yarn_mscale`).

Shapes: B batch, T tokens, L cache slots, D model width, N heads, Q q_lora_rank, and C, P, R,
V as above; W = C + R.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn import kernels
from transformer.nn import lora as lora_lib
from transformer.nn import positions as positions_lib
from transformer.nn.attention import attend_and_sow, matmul, projection_init, write_slots
from transformer.nn.mixers.base import Mixer
from transformer.utils.keys import check_fields, int_, is_int, key

Array = jax.Array

# The model keys declared `attention_only` that this layer honours, and how (as `kernels.FEATURES`
# lists what a kernel takes). `MLAConfig.check` refuses every other attention-only key set off
# its default: a knob added for `MultiHeadAttention` is refused here until it is wired into
# `MLASettings` and named in this table.
HONOURED = {
    "attention_kind": "selects this layer",
    "attention_softcap": "the kernel's logit soft-cap",
    "attention_sinks": "a learned sink logit per head (param `sinks`)",
    "attention_scale": "the logit scale, before YaRN's mscale (`MLASettings.softmax_scale`)",
    "attention_dropout_rate": "dropout on the softmax weights",
    "qkv_bias": "biases on W_qa and W_kva",
    # apply_rope's arguments, on q_rope and k_r; not rope_fraction: MLA's RoPE dims rotate whole
    **{name: "RoPE of q_rope and k_r" for name in positions_lib.ROPE_KEYS.values()
       if name != "rope_fraction"},
    "rope_local_theta": "the sliding layers' RoPE base (`softmax_attention._local`)",
}


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention's settings (`model.mla.*`), HF `DeepseekV3Config`'s names
    (its q_lora_rank None is 0 here); the defaults are DeepSeek-V2/V3's head shapes. The layer
    has `model.num_heads` heads; `num_kv_heads` and `head_dim` do not apply to it (a warning at
    the start, where no other attention reads them: `Key.needs`)."""

    q_lora_rank: int = key(0, "Rank of the query's low-rank projection, with an RMSNorm in "
                           "between (DeepSeek-V3: 1536); 0: one full-rank W_q.",
                           int_(ge=0, note="0: full rank"))
    kv_lora_rank: int = key(512, "Width of the latent the keys and values are projected up "
                            "from: what decoding caches, with the RoPE key.", int_(ge=1))
    qk_nope_head_dim: int = key(128, "Each head's query and key dims without RoPE.", int_(ge=1))
    qk_rope_head_dim: int = key(64, "Each head's query dims with RoPE, and the width of the one "
                                "RoPE key the heads share.",
                                (lambda v: is_int(v) and v >= 2 and v % 2 == 0,
                                 "an even int >= 2"))
    v_head_dim: int = key(128, "Each head's value width.", int_(ge=1))

    # what its keys act only with (`utils.keys.Key.needs`), given the stack's config
    NEEDS = (lambda cfg: cfg.attention_kind == "mla", "model.attention_kind='mla'")

    def __post_init__(self):
        check_fields(self, prefix="mla.")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check(self, cfg) -> None:
        """The rules across these keys and the model's (`cfg`, a `TransformerConfig`); an
        attention-only key outside `HONOURED` is refused off its default.

        >>> from types import SimpleNamespace
        >>> MLAConfig(kv_lora_rank=96).check(SimpleNamespace(d_model=64, position="rope"))
        Traceback (most recent call last):
        ValueError: mla.kv_lora_rank=96: expected a low rank, <= d_model=64
        """
        for name in ("q_lora_rank", "kv_lora_rank"):
            if getattr(self, name) > cfg.d_model:
                raise ValueError(f"mla.{name}={getattr(self, name)}: expected a low rank, <= "
                                 f"d_model={cfg.d_model}")
        if cfg.position != "rope":
            raise ValueError(f"position={cfg.position!r}: expected 'rope' with multi-head "
                             "latent attention (its decoupled RoPE key)")
        # (e.g. attention_gate, qk_norm: DeepSeek's layer has no output gate or q/k norm)
        for field in dataclasses.fields(cfg):
            declared, value = field.metadata.get("key"), getattr(cfg, field.name)
            if (declared and declared.attention_only and field.name not in HONOURED
                    and value != field.default):
                raise ValueError(f"{field.name}={value!r} with attention_kind='mla': expected it "
                                 f"off ({field.default!r}): multi-head latent attention does not "
                                 "read it (mla.HONOURED lists the attention keys it does)")


@dataclasses.dataclass(frozen=True)
class MLASettings:
    """Everything one MLA layer is built from; `from_config` reads it off a `TransformerConfig`
    (the rope_* fields as `positions.rope_args` names them)."""

    num_heads: int
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    scale: float | None = None  # the logit scale before YaRN's; None: 1 / sqrt(P + R)
    rope_theta: float = 10000.0
    rope_layout: str = "half"  # HF's rope_interleave=True (DeepSeek's default): "interleaved"
    rope_scale: float = 1.0
    rope_scaling: str = "linear"
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 0.0
    rope_yarn_truncate: bool = True
    rope_fraction: float = 1.0  # (1: the config refuses partial RoPE with MLA)
    norm_epsilon: float = 1e-6  # the q_a and kv_a RMSNorms'
    qkv_bias: bool = False  # biases on W_qa (or W_q's none, as HF) and W_kva
    use_bias: bool = False  # a bias on W_o
    init_std: float | None = None
    init_scale: float = 1.0
    out_init_scale: float = 1.0
    softcap: float = 0.0
    sinks: bool = False
    impl: str = "auto"
    sequence_parallel: str = "all_gather"
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora: Any = None  # transformer.nn.lora.LoraConfig, as attention's

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The logits' scale: `scale` (or 1 / sqrt(P + R)) times YaRN's mscale^2."""
        base = self.qk_head_dim**-0.5 if self.scale is None else self.scale
        if self.rope_scaling == "yarn" and self.rope_yarn_mscale_all_dim:
            base *= positions_lib.yarn_mscale(self.rope_scale, self.rope_yarn_mscale_all_dim)**2
        return base

    @classmethod
    def from_config(cls, cfg) -> MLASettings:
        m = cfg.mla
        mup = cfg.mup_width_multiplier  # cfg.resolved_attention_scale, with MLA's head dim
        scale = cfg.attention_scale if mup == 1.0 else (
            (cfg.attention_scale or m.qk_head_dim**-0.5) * mup**-0.5)
        rope = {name: getattr(cfg, name) for name in positions_lib.ROPE_KEYS.values()}
        return cls(
            num_heads=cfg.num_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim, scale=scale, **rope, norm_epsilon=cfg.norm_epsilon,
            qkv_bias=cfg.use_bias if cfg.qkv_bias is None else cfg.qkv_bias,
            use_bias=cfg.use_bias, init_std=cfg.init_std, init_scale=cfg.init_scale(),
            out_init_scale=cfg.init_scale(residual=True), softcap=cfg.attention_softcap,
            sinks=cfg.attention_sinks, impl=cfg.attention_impl,
            sequence_parallel=cfg.sequence_parallel, dropout_rate=cfg.attention_dropout_rate,
            dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            lora=cfg.lora if cfg.lora.rank else None)

    def kernel_args(self, deterministic: bool) -> dict[str, Any]:
        """`attend`'s keyword arguments (no dropout when `deterministic`)."""
        return dict(impl=self.impl, scale=self.softmax_scale, softcap=self.softcap,
                    sequence_parallel=self.sequence_parallel,
                    dropout_rate=0.0 if deterministic else self.dropout_rate)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (the module docstring), called as every mixer is (`base`).

    Params, with logical axes, and the HF `DeepseekV3Attention` weight each one is (HF's
    Linear weights are [out, in]; Q = q_lora_rank, W = C + R):

      q_a [embed, latent] (D, Q)               q_a_proj.weight.T  (+ q_a_bias: .bias)
      q_a_norm/scale [latent] (Q,)             q_a_layernorm.weight
      q_b [latent_in, heads, kv] (Q, N, P+R)   q_b_proj.weight.T.reshape(Q, N, P + R)
      query [embed, heads, kv] (D, N, P+R)     q_proj.weight.T.reshape(D, N, P + R)  (Q = 0)
      kv_a [embed, latent] (D, W)              kv_a_proj_with_mqa.weight.T  (+ kv_a_bias)
      kv_a_norm/scale [latent] (C,)            kv_a_layernorm.weight
      k_b [latent_in, heads, kv] (C, N, P)     w[:, :P].transpose(2, 0, 1)   (w: kv_b_proj
      v_b [latent_in, heads, kv] (C, N, V)     w[:, P:].transpose(2, 0, 1)   .weight.reshape(
                                                                              N, P + V, C))
      out [heads, kv, embed] (N, V, D)         o_proj.weight.T.reshape(N, V, D)  (+ out_bias)
      sinks [heads] (N,)                       with attention_sinks (HF's has none)

    and rope_layout "interleaved" where HF's rope_interleave is True, "half" where False.

    `latent` (the down-projections' output) stays whole, `latent_in` (the up-projections'
    input) splits over fsdp as `embed` does (parallel/sharding.py): q_b, k_b and v_b are most
    of MLA's params.

    `decode=True`: the 'cache' collection holds `latent` [B, L, C + R], each slot the
    normalised latent c then the rotated RoPE key k_r of the token at that position, written
    at slots `q_positions` (the caller's [B, 1, T, L] mask hides the slots not written yet). The
    decode call inside `init` only creates the buffer, shaped like its input.

    The softmax weights are sown into 'intermediates' as `attention_weights` when that
    collection is mutable, as attention's are (`attention.attend_and_sow`).
    """

    settings: MLASettings

    @nn.compact
    def __call__(self, x_BTD: Array, *, mask=None, bias=None, q_positions: Array | None = None,
                 segment_ids: Array | None = None, deterministic: bool = True,
                 decode: bool = False) -> Array:
        del segment_ids  # the mask keeps attention within a document
        if decode and q_positions is None:
            raise ValueError("decode=True needs q_positions: the cache slots to write")
        if q_positions is None:
            q_positions = jnp.arange(x_BTD.shape[1], dtype=jnp.int32)[None]
        q_nope_BTNP, q_rope_BTNR = self._query(x_BTD, q_positions, deterministic)
        latent_BTW = self._latent(x_BTD, q_positions, deterministic)
        if decode:
            out_BTNV = self._absorbed(q_nope_BTNP, q_rope_BTNR, latent_BTW, q_positions, mask,
                                      bias, deterministic)
        else:
            out_BTNV = self._materialised(q_nope_BTNP, q_rope_BTNR, latent_BTW, mask, bias,
                                          deterministic)
        return self._output(out_BTNV, x_BTD.shape[-1], deterministic)

    def _kernel(self, name: str, shape: tuple, names: tuple, in_axis, out_axis,
                scale: float | None = None) -> Array:
        s = self.settings
        init = projection_init(s.init_std, in_axis, out_axis,
                               s.init_scale if scale is None else scale)
        return self.param(name, nn.with_logical_partitioning(init, names), shape,
                          s.param_dtype)

    def _dense(self, name: str, x: Array, shape: tuple, names: tuple, deterministic: bool,
               bias: bool = False) -> Array:
        """x times a new kernel `name` of `shape` whose first dim it contracts (+ `name`_bias)."""
        s = self.settings
        kernel = self._kernel(name, shape, names, 0, tuple(range(1, len(shape))))
        if s.lora is None:
            y = matmul(x, kernel, 1, dtype=s.dtype)
        else:
            y = lora_lib.project(self, name, x, kernel, names, 1, s.lora, s.dtype,
                                 s.param_dtype, deterministic, matmul)
        if bias:
            y = y + self.param(f"{name}_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, names[1:]), shape[1:], s.param_dtype).astype(s.dtype)
        return y

    def _norm(self, name: str, x: Array) -> Array:
        s = self.settings
        return nn.RMSNorm(epsilon=s.norm_epsilon, dtype=s.dtype, param_dtype=s.param_dtype,
                          scale_init=nn.with_logical_partitioning(nn.initializers.ones,
                                                                  ("latent",)), name=name)(x)

    def _rotate(self, x_BTNR: Array, positions: Array) -> Array:
        return positions_lib.apply_rope(x_BTNR, positions,
                                        **positions_lib.rope_args(self.settings))

    def _query(self, x_BTD: Array, positions: Array, deterministic: bool) -> tuple[Array, Array]:
        """(q_nope [B, T, N, P], rotated q_rope [B, T, N, R])."""
        s = self.settings
        heads = (s.num_heads, s.qk_head_dim)
        if s.q_lora_rank:
            c_BTQ = self._dense("q_a", x_BTD, (x_BTD.shape[-1], s.q_lora_rank),
                                ("embed", "latent"), deterministic, bias=s.qkv_bias)
            q_BTNK = self._dense("q_b", self._norm("q_a_norm", c_BTQ), (s.q_lora_rank, *heads),
                                 ("latent_in", "heads", "kv"), deterministic)
        else:
            q_BTNK = self._dense("query", x_BTD, (x_BTD.shape[-1], *heads),
                                 ("embed", "heads", "kv"), deterministic)
        nope = s.qk_nope_head_dim
        return q_BTNK[..., :nope], self._rotate(q_BTNK[..., nope:], positions)

    def _latent(self, x_BTD: Array, positions: Array, deterministic: bool) -> Array:
        """[normalised c, rotated k_r] [B, T, C + R]: what the cache holds per token."""
        s = self.settings
        c = s.kv_lora_rank
        kv_BTW = self._dense("kv_a", x_BTD, (x_BTD.shape[-1], c + s.qk_rope_head_dim),
                             ("embed", "latent"), deterministic, bias=s.qkv_bias)
        c_BTC = self._norm("kv_a_norm", kv_BTW[..., :c])
        k_rope_BTR = self._rotate(kv_BTW[:, :, None, c:], positions)[:, :, 0]
        return jnp.concatenate([c_BTC, k_rope_BTR.astype(c_BTC.dtype)], axis=-1)

    def _up(self, name: str, width: int) -> Array:
        """W_uk (`k_b`, width P) or W_uv (`v_b`, width V): [C, N, width]."""
        s = self.settings
        return self._kernel(name, (s.kv_lora_rank, s.num_heads, width),
                            ("latent_in", "heads", "kv"), 0, (1, 2))

    def _materialised(self, q_nope_BTNP, q_rope_BTNR, latent_BSW, mask, bias,
                      deterministic) -> Array:
        """Training: every head's key and value from the latent, then `attend`."""
        s = self.settings
        c = s.kv_lora_rank
        c_BSC, k_rope_BSR = latent_BSW[..., :c], latent_BSW[..., c:]
        # W_uk and W_uv stay float under model.quantization, as decoding's absorbed form (plain
        # einsums) has them: training, evaluation and generation run the same model.
        k_nope_BSNP = matmul(c_BSC, self._up("k_b", s.qk_nope_head_dim), 1, dtype=s.dtype,
                             quantized=False)
        v_BSNV = matmul(c_BSC, self._up("v_b", s.v_head_dim), 1, dtype=s.dtype,
                        quantized=False)
        k_rope_BSNR = jnp.broadcast_to(k_rope_BSR[:, :, None], (*k_nope_BSNP.shape[:3],
                                                               s.qk_rope_head_dim))
        query = jnp.concatenate([q_nope_BTNP, q_rope_BTNR.astype(q_nope_BTNP.dtype)], -1)
        key_ = jnp.concatenate([k_nope_BSNP, k_rope_BSNR.astype(k_nope_BSNP.dtype)], -1)
        width = max(s.qk_head_dim, s.v_head_dim)  # zero dims add nothing to logits or output
        query, key_, value = (_pad_last(a, width) for a in (query, key_, v_BSNV))
        out = self._attend(query, key_, value, mask, bias, deterministic)
        return out[..., :s.v_head_dim]

    def _absorbed(self, q_nope_BTNP, q_rope_BTNR, latent_BTW, slots_BT, mask, bias,
                  deterministic) -> Array:
        """Decode: write the latents into the cache, then MQA over it with W_uk in the query
        and W_uv after the weighted sum (the module docstring)."""
        s = self.settings
        latent_BLW = self._cache(latent_BTW, slots_BT)
        w_uk_CNP, w_uv_CNV = self._up("k_b", s.qk_nope_head_dim), self._up("v_b", s.v_head_dim)
        q_latent_BTNC = jnp.einsum("btnp,cnp->btnc", q_nope_BTNP.astype(s.dtype),
                                   w_uk_CNP.astype(s.dtype))
        query_BTNW = jnp.concatenate([q_latent_BTNC, q_rope_BTNR.astype(s.dtype)], -1)
        key_BL1W = latent_BLW[:, :, None].astype(s.dtype)
        out_BTNW = self._attend(query_BTNW, key_BL1W, key_BL1W, mask, bias, deterministic)
        return jnp.einsum("btnc,cnv->btnv", out_BTNW[..., :s.kv_lora_rank],
                          w_uv_CNV.astype(s.dtype))

    def _attend(self, query, key_, value, mask, bias, deterministic) -> Array:
        s = self.settings
        args = s.kernel_args(deterministic)
        rng = self.make_rng("dropout") if args["dropout_rate"] > 0.0 else None
        sinks = None
        if s.sinks:  # as attention's: param [N], HF gpt-oss's init
            init = nn.initializers.normal(stddev=s.init_std or 0.02)
            sinks = self.param("sinks", nn.with_logical_partitioning(init, ("heads",)),
                               (s.num_heads,), s.param_dtype)
        # Sows the softmax weights [B, N, T, S] when 'intermediates' is mutable, as attention's.
        return attend_and_sow(self, query, key_, value, mask=mask, bias=bias, dropout_rng=rng,
                              sinks=sinks, **args)[0]

    def _cache(self, new_BTW: Array, slots_BT: Array) -> Array:
        """The `latent` buffer [B, L, W] with `new` written at slots `slots_BT`; inside `init`
        only created (shaped like `new`, which is returned)."""
        initialized = self.has_variable("cache", "latent")
        buffer = self.variable("cache", "latent", jnp.zeros, new_BTW.shape, new_BTW.dtype)
        if not initialized:
            return new_BTW
        buffer.value = write_slots(buffer.value, new_BTW, slots_BT)
        return buffer.value

    def _output(self, out_BTNV: Array, d_model: int, deterministic: bool) -> Array:
        """W_o: [B, T, N, V] -> [B, T, D] (plus the output bias)."""
        s = self.settings
        names = ("heads", "kv", "embed")
        w_out = self._kernel("out", (s.num_heads, s.v_head_dim, d_model), names, (0, 1), 2,
                             s.out_init_scale)
        if s.lora is None:
            y_BTD = matmul(out_BTNV, w_out, 2, dtype=s.dtype)
        else:
            y_BTD = lora_lib.project(self, "out", out_BTNV, w_out, names, 2, s.lora, s.dtype,
                                     s.param_dtype, deterministic, matmul)
        if s.use_bias:
            y_BTD = y_BTD + self.param("out_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, ("embed",)), (d_model,), s.param_dtype).astype(s.dtype)
        return y_BTD


def _pad_last(x: Array, width: int) -> Array:
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def flops_per_token(cfg, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one layer beyond 6 x its matmul params: the
    scores (2 (P + R) per head and key, forward) and the weighted values (2 V), times 3 for the
    backward pass, over `seq_len` keys: 6 N (P + R + V) T. With P + R = V = head_dim this is
    attention's 12 x width x T (`training.metrics.flops_per_token`); causal masking is not
    halved, and neither the kernels' zero padding of v nor decode's absorbed form is counted.

    >>> from types import SimpleNamespace
    >>> flops_per_token(SimpleNamespace(num_heads=2, mla=MLAConfig()), 10)
    38400
    """
    m = cfg.mla
    return 6 * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * seq_len


def cache_bytes_per_token(cfg) -> int:
    """The latent cache's bytes per token and layer: (C + R) values in the compute dtype."""
    return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * jnp.dtype(cfg.dtype).itemsize


def gqa_cache_bytes_per_token(cfg) -> int:
    """What `MultiHeadAttention` of the same config caches per token and layer, to compare:
    a key and a value of head_dim for each of its num_kv_heads (default num_heads) heads."""
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    return 2 * kv_heads * cfg.resolved_head_dim * jnp.dtype(cfg.dtype).itemsize


def refuses(cfg, mesh: dict) -> str | None:
    """cuDNN, when named, where it cannot take MLA's heads: training's of width
    max(P + R, V), decode's of C + R (one key head), by `kernels.KERNELS`. A `sequence` axis
    needs nothing more: training's keys and values are per-head attention's, and decode reads
    the whole cache as attention's does."""
    if cfg.attention_impl != "cudnn":
        return None
    m = cfg.mla
    for what, width, gqa in (("training", max(m.qk_head_dim, m.v_head_dim), False),
                             ("decode", m.kv_lora_rank + m.qk_rope_head_dim, True)):
        call = kernels.Call("gpu", head_dim=width, dtype=cfg.dtype, gqa=gqa,
                            softcap=cfg.attention_softcap, sinks=cfg.attention_sinks)
        reason = kernels.refusal("cudnn", call)
        if reason is not None:
            return (f"attention_impl='cudnn' {reason} in MLA's {what} attention (head width "
                    f"{width}); use 'auto' or 'chunked'")
    return None


MIXER = Mixer(layer=lambda cfg, name: MultiHeadLatentAttention(MLASettings.from_config(cfg),
                                                               name=name),
              param_name="self_attention", flops_per_token=flops_per_token,
              decode_state="latent cache", cache_bytes_per_token=cache_bytes_per_token,
              refuses=refuses, config=MLAConfig)
