"""`TransformerConfig`: every architectural choice of one stack of blocks, checked when made.
Models build one from their `model` config group and pass it down to the layers."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from transformer.nn import kernels, sequence_parallel
from transformer.nn.activations import ACTIVATIONS
from transformer.nn.attention import ATTENTION_GATES
from transformer.nn.lora import LoraConfig
from transformer.nn.mixers import ATTENTION_KINDS, MIXERS
from transformer.nn.mixers.gated_deltanet import GatedDeltaNetConfig
from transformer.nn.mixers.mamba2 import Mamba2Config
from transformer.nn.mixers.mla import MLAConfig
from transformer.nn.moe import MoEConfig
from transformer.nn.mtp import MTPConfig
from transformer.utils.keys import (
    BOOL,
    POSITIVE_INT,
    check_fields,
    choice,
    declarations,
    described,
    int_,
    is_number,
    key,
    number,
    one_of,
    optional,
)

POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi", "t5")
NORMS = ("layernorm", "rmsnorm")
# pre: x + f(N(x)); post: N(x + f(x)); sandwich: x + N'(f(N(x))) (Gemma 2); post_sublayer:
# x + N'(f(x)) (OLMo 2)
NORM_PLACEMENTS = ("pre", "post", "sandwich", "post_sublayer")
QK_NORM_SCOPES = ("head", "projection")
PARAMETRIZATIONS = ("standard", "mup")


def parse_layer_types(spec: str) -> tuple[str, ...]:
    """`model.layer_types` as a tuple of layer types: comma-separated names, each optionally
    `*n` (n times in a row). An unknown name or a bad count raises one line.

    >>> parse_layer_types("linear_attention*3, full_attention")
    ('linear_attention', 'linear_attention', 'linear_attention', 'full_attention')
    """
    names = []
    for entry in (e.strip() for e in spec.split(",")):
        name, _, count = entry.partition("*")
        name = name.strip()
        if name not in MIXERS:
            raise ValueError(f"layer_types={spec!r}: {name!r} is not a layer type; expected "
                             f"comma-separated names from {tuple(MIXERS)} (each optionally *n)")
        if count and not (count.strip().isdigit() and int(count) > 0):
            raise ValueError(f"layer_types={spec!r}: {entry!r} expected a count n > 0 after '*'")
        names += [name] * (int(count) if count else 1)
    return tuple(names)


# The float dtypes the models compute in and keep params in (float64 needs jax_enable_x64).
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


# `needs` of keys that act only with another one (`utils.keys.Key`): the start warns of them
_QK_NORM = (lambda cfg: cfg.qk_norm, "model.qk_norm=True")
# num_kv_heads and head_dim size multi-head attention's heads (head_dim Gated DeltaNet's too,
# where its own is 0); not MLA's (mla.*_head_dim), Mamba 2's or a conv's. An encoder-decoder's
# cross-attention is multi-head whatever attention_kind (config_keys.idle_settings: CROSS_KEYS).
_mha = lambda cfg: cfg.attention_kind == "mha" and bool(
    cfg.used_layer_types & {"full_attention", "sliding_attention"})
_MHA = (_mha, "a multi-head attention layer (attention_kind='mha')")
_HEAD_DIM = (lambda cfg: _mha(cfg) or (
    "linear_attention" in cfg.used_layer_types and not cfg.linear_attention.key_head_dim),
    "a multi-head attention layer (attention_kind='mha') or a linear_attention layer whose "
    "linear_attention.key_head_dim is 0")
CROSS_KEYS = ("num_kv_heads", "head_dim")  # what a cross-attention reads of the keys with needs


_ROPE = (lambda cfg: cfg.position == "rope", "model.position='rope'")
_T5 = (lambda cfg: cfg.position == "t5", "model.position='t5'")


def _scaling(*kinds: str):
    """`needs` of a key only these rope_scaling kinds read (with RoPE)."""
    return (lambda cfg: cfg.position == "rope" and cfg.rope_scaling in kinds,
            f"model.rope_scaling={kinds[0]!r}" if len(kinds) == 1 else
            f"model.rope_scaling in {kinds}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of one stack of blocks (and of the layers inside it). Each field declares
    its default, allowed values and meaning once (`utils.keys.key`): the `model.*` keys of a run
    config, checked here one by one, then by the rules joining several of them."""

    num_layers: int = key(2, "Blocks in the stack (the encoder's, for T5).", POSITIVE_INT)
    d_model: int = key(64, "Width of the residual stream.", POSITIVE_INT)
    num_heads: int = key(4, "Query heads.", POSITIVE_INT)
    num_kv_heads: int | None = key(
        None, "Key/value heads: None = num_heads (MHA); 1: MQA; otherwise GQA.",
        optional(POSITIVE_INT, "None, or an int > 0 dividing num_heads"), needs=_MHA)
    head_dim: int | None = key(None, "Width of a head; None: d_model // num_heads.",
                               optional(POSITIVE_INT, "None, or an int > 0 (even with RoPE)"),
                               needs=_HEAD_DIM)
    d_ff: int = key(256, "Hidden units of the feed-forward layer (and of each expert); 0: "
                    "no feed-forward sublayer (Mamba 2's blocks: the mixer alone).",
                    int_(ge=0, note="0: none"))
    activation: str = key("gelu", "The feed-forward nonlinearity: gelu is erf's, gelu_tanh "
                          "GPT-2's; swiglu and geglu (T5 v1.1) are gated.",
                          choice(tuple(ACTIVATIONS)))
    norm: str = key("layernorm", "The norm.", choice(NORMS))
    norm_placement: str = key(
        "pre", "pre x + f(N(x)); post N(x + f(x)); sandwich x + N'(f(N(x))) (Gemma 2); "
        "post_sublayer x + N'(f(x)) (OLMo 2).", choice(NORM_PLACEMENTS))
    norm_epsilon: float = key(1e-5, "The norms' epsilon.", number(gt=0))
    qk_norm: bool = key(False, "RMSNorm with a learned scale on q and k, before RoPE (Qwen3, "
                        "Gemma 3, OLMo 2).", BOOL, attention_only=True)
    qk_norm_scope: str = key("head", "qk_norm over each head (`head`) or the whole projection "
                             "(`projection`).", choice(QK_NORM_SCOPES), attention_only=True,
                             needs=_QK_NORM)
    layer_types: str = key(
        "", "The token mixer of each layer, comma-separated, by its name in the registry "
        "(`nn.mixers.MIXERS`, Hugging Face's layer_types names; the allowed values list them), "
        "e.g. full_attention, sliding_attention (through sliding_window) or linear_attention "
        "(Gated DeltaNet, model.linear_attention); what each mixer is and its keys: "
        "docs/experiments.md, Token mixers. `name*n` repeats a name. Fewer names than "
        "num_layers repeat as a pattern: 'linear_attention*3,full_attention' is three linear "
        "layers, then one full, over and over. \"\": every layer full, or sliding as "
        "sliding_window and sliding_window_pattern say.",
        # a string here; its names are checked with the other layer settings (one line each)
        (lambda value: isinstance(value, str), "a string of comma-separated names from "
         + ", ".join(MIXERS) + " (each optionally *n)"))
    attention_kind: str = key(
        "mha", "The attention of full and sliding layers: `mha` (multi-head; GQA/MQA by "
        "num_kv_heads) or `mla` (DeepSeek's multi-head latent attention, model.mla). "
        "Self-attention only: an encoder-decoder's cross-attention stays multi-head.",
        choice(tuple(ATTENTION_KINDS)), attention_only=True)
    attention_gate: str = key(
        "", "Gated attention (Qwen3-Next): sigmoid(x W_gate) of the attention's input multiplies "
        "its output before W_o, one gate per head (`head`) or per head_dim element (`element`); "
        "\"\": off.", choice(ATTENTION_GATES), attention_only=True)
    attention_softcap: float = key(
        0.0, "Caps the scaled attention logits: cap * tanh(logits / cap) (Gemma 2: 50); 0: off.",
        number(ge=0, note="0: off"), attention_only=True)
    attention_sinks: bool = key(False, "A learned logit per head that joins each softmax's "
                                "denominator with no value (gpt-oss, StreamingLLM).", BOOL,
                                attention_only=True)
    final_logit_softcap: float = key(
        0.0, "The same cap on a decoder LM's output logits (Gemma 2: 30); 0: off.",
        described(number(ge=0, note="0: off"), "a number >= 0 (0: off; gpt and prefix_lm)"))
    parallel_block: bool = key(False, "x + attn(N(x)) + mlp(N(x)) with one norm (GPT-J, PaLM); "
                               "pre-norm blocks without cross-attention.",
                               described(BOOL, "a bool (with norm_placement 'pre')"))
    scale_residual_init: bool = key(
        False, "Kernels writing into the residual stream (attention W_o, the MLP's output, the "
        "experts' too) start with their std / sqrt(2 num_layers) (GPT-2).", BOOL,
        export_neutral=True)
    # muP (Tensor Programs V): a model m = d_model / mup_base_width times as wide as the base
    # behaves as the base does (`mup_width_multiplier`).
    parametrization: str = key(
        "standard", "`mup`: muP, a model wider than `mup_base_width` trains like the base (GPT "
        "and prefix LM).", choice(PARAMETRIZATIONS))
    mup_base_width: int = key(0, "muP: the width the hyperparameters were tuned at; 0: d_model.",
                              int_(ge=0, note="0: d_model"),
                              needs=(lambda cfg: cfg.parametrization == "mup",
                                     "model.parametrization='mup'"))
    position: str = key("rope", "Positional encoding (`t5`: relative buckets).",
                        choice(POSITIONS))
    max_len: int = key(512, "Positions of a learned position table.", POSITIVE_INT)
    # RoPE's keys and T5's buckets act in softmax attention alone (the other mixers ignore
    # positions): attention_only
    rope_theta: float = key(10000.0, "RoPE's base.", number(gt=0), attention_only=True, needs=_ROPE)
    rope_layout: str = key("half", "RoPE pairs the two halves (`half`) or neighbours "
                           "(`interleaved`).", choice(("half", "interleaved")),
                           attention_only=True, needs=_ROPE)
    rope_scale: float = key(1.0, "> 1: positions stretched by this factor, as `rope_scaling` "
                            "says.", number(gt=0, note="1: no scaling"), attention_only=True,
                            needs=_ROPE)
    rope_scaling: str = key("linear", "`linear` (position interpolation), `llama3` (Llama "
                            "3.1) or `yarn` (YaRN: DeepSeek-V2/V3, gpt-oss, Qwen).",
                            choice(("linear", "llama3", "yarn")), attention_only=True, needs=_ROPE)
    rope_low_freq_factor: float = key(1.0, "llama3 scaling's low-frequency factor "
                                      "(positions.rope_frequencies).",
                                      (is_number, "a number, 0 < low < high"),
                                      attention_only=True, needs=_scaling("llama3"))
    rope_high_freq_factor: float = key(4.0, "llama3 scaling's high-frequency factor.",
                                       (is_number, "a number > rope_low_freq_factor"),
                                       attention_only=True, needs=_scaling("llama3"))
    rope_original_max_len: int = key(8192, "llama3 and yarn scaling: the context length "
                                     "trained at before rope_scale stretched it.", int_(gt=0),
                                     attention_only=True, needs=_scaling("llama3", "yarn"))
    # YaRN (rope_scaling "yarn", positions.yarn_frequencies): rope_scale is its factor,
    # rope_original_max_len its original_max_position_embeddings
    rope_yarn_beta_fast: float = key(32.0, "yarn: pairs turning more often than this over "
                                     "rope_original_max_len keep their frequency.",
                                     number(gt=0), attention_only=True, needs=_scaling("yarn"))
    rope_yarn_beta_slow: float = key(1.0, "yarn: pairs turning less often are interpolated "
                                     "by rope_scale.", number(gt=0), attention_only=True,
                                     needs=_scaling("yarn"))
    rope_yarn_mscale: float = key(
        1.0, "yarn: RoPE's rotated q and k are multiplied by mscale(rope_scale, this) / "
        "mscale(rope_scale, rope_yarn_mscale_all_dim) where both are > 0, else by "
        "mscale(rope_scale, 1) (HF's attention_factor; positions.rope_attention_factor).",
        number(ge=0), attention_only=True, needs=_scaling("yarn"))
    rope_yarn_mscale_all_dim: float = key(
        0.0, "yarn: > 0 also multiplies MLA's logit scale by mscale(rope_scale, this)^2 "
        "(DeepSeek).", number(ge=0), attention_only=True, needs=_scaling("yarn"))
    rope_yarn_truncate: bool = key(True, "yarn: round the ramp's ends to whole pairs (HF's "
                                   "default; gpt-oss: False).", BOOL, attention_only=True,
                                   needs=_scaling("yarn"))
    rope_fraction: float = key(1.0, "The fraction of each head's dims RoPE rotates (the first "
                               "ones; Qwen3-Next's partial_rotary_factor: 0.25).",
                               number(gt=0, le=1), attention_only=True, needs=_ROPE)
    rope_local_theta: float | None = key(
        None, "The sliding layers' RoPE base, unscaled (Gemma 3: 10,000; the full layers keep "
        "rope_theta and its scaling); None: one RoPE for every layer.",
        optional(number(gt=0), "None or a number > 0"), attention_only=True)
    t5_num_buckets: int = key(32, "T5 relative-position buckets.", int_(gt=0),
                              attention_only=True, needs=_T5)
    t5_max_distance: int = key(128, "T5 relative positions: the distance the largest bucket "
                               "starts at.", int_(gt=0), attention_only=True, needs=_T5)
    use_bias: bool = key(True, "Biases on the projections and the feed-forward layer.", BOOL)
    qkv_bias: bool | None = key(None, "Biases on q/k/v only; None: = use_bias (Qwen2: True).",
                                optional(BOOL, "None or a bool"), attention_only=True)
    sliding_window: int | None = key(
        None, "Decoder LMs: each token sees the last W positions, itself included (Mistral); "
        "None: no limit.", optional(POSITIVE_INT, "None, or an int > 0 (family gpt)"))
    # With scan_layers, P (with moe.every_n_layers) must divide num_layers.
    sliding_window_pattern: int = key(
        0, "With sliding_window: layers P-1, 2P-1, ... attend to every earlier position (Gemma "
        "2: 2, Gemma 3: 6); 0: every layer windowed.", int_(ge=0))
    attention_scale: float | None = key(
        None, "Attention logit scale; None: 1/sqrt(head_dim) (T5: 1.0).",
        optional(number(), "None or a number"), attention_only=True)
    embedding_norm: bool = key(False, "A norm after adding absolute positions (BERT).", BOOL)
    scale_embeddings: bool = key(False, "Inputs times sqrt(d_model) before positions (Vaswani "
                                 "et al.).", BOOL)
    dropout_rate: float = key(0.0, "Dropout on the residual branches and embeddings.",
                              number(ge=0, lt=1), structural=False, export_neutral=True)
    attention_dropout_rate: float = key(
        0.0, "Dropout on the attention weights (runs the dense kernel).", number(ge=0, lt=1),
        structural=False, export_neutral=True, attention_only=True)
    init_std: float | None = key(
        None, "Normal init std of the kernels; None: fan-in scaling (GPT-2: 0.02).",
        optional(number(gt=0), "None or a number > 0"), export_neutral=True)
    # Checked as the config's names; the dataclass takes any dtype (float64 included).
    dtype: Any = key(jnp.float32, "Compute dtype (softmax and loss stay float32).",
                     one_of(DTYPES), structural=False, export_neutral=True)
    param_dtype: Any = key(jnp.float32, "Dtype the params are kept in.", one_of(DTYPES),
                           export_neutral=True)
    scan_layers: bool = key(False, "Run the stack as one `nn.scan` over layers (faster "
                            "compiles; the same params give the same results, but a fresh "
                            "init draws other values, so curves from scratch differ).", BOOL,
                            export_neutral=True)
    remat_policy: str = key("none", "What the backward pass recomputes: none, everything "
                            "(`full`) or all but the matmuls.", choice(tuple(REMAT_POLICIES)),
                            structural=False, export_neutral=True)
    # The devices the step is compiled for choose `auto`'s kernel.
    attention_impl: str = key(
        "auto", "The attention kernel; `auto`: splash on TPU (per device under a `sequence` "
        "axis too), cuDNN on GPU, chunked for long sequences, else dense; `reference`: the "
        "plain float32 formula by autodiff, for prototyping (`kernels.KERNELS` says which "
        "features each kernel takes).",
        choice(kernels.IMPLS), structural=False, export_neutral=True)
    # transformer.nn.sequence_parallel
    sequence_parallel: str = key(
        "all_gather", "Under a `sequence` mesh axis: how attention reaches the other devices' "
        "keys.", choice(sequence_parallel.STRATEGIES), structural=False, export_neutral=True)
    sequence_load_balance: bool = key(
        True, "Under a `sequence` mesh axis: lay decoder LMs' sequences out zig-zag so every "
        "device does the same causal work.", BOOL, structural=False, export_neutral=True)
    moe: MoEConfig = MoEConfig()  # mixture-of-experts feed-forward layers (transformer.nn.moe)
    lora: LoraConfig = LoraConfig()  # low-rank adapters on a frozen base (transformer.nn.lora)
    # the token mixers' own keys (transformer.nn.mixers), read by layers of their type
    mla: MLAConfig = MLAConfig()  # under attention_kind="mla"
    linear_attention: GatedDeltaNetConfig = GatedDeltaNetConfig()
    mamba2: Mamba2Config = Mamba2Config()
    mtp: MTPConfig = MTPConfig()  # multi-token prediction (decoder LMs, transformer.nn.mtp)

    def __post_init__(self):
        check_fields(self, skip=("dtype", "param_dtype"))  # any jnp dtype
        if self.parallel_block and self.norm_placement != "pre":
            raise ValueError(f"parallel_block=True with norm_placement={self.norm_placement!r}: "
                             "expected 'pre' (one norm feeds both branches)")
        if self.rope_scaling == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError(f"rope_low_freq_factor={self.rope_low_freq_factor}, "
                             f"rope_high_freq_factor={self.rope_high_freq_factor}: expected "
                             "0 < low < high")
        self._build_groups()
        if self.moe.num_experts and self.num_layers % self.moe.every_n_layers:
            raise ValueError(f"moe.every_n_layers={self.moe.every_n_layers}: expected a divisor "
                             f"of num_layers={self.num_layers}")
        if not self.d_ff and (self.parallel_block or (self.moe.num_experts
                                                       and not self.moe.d_ff)):
            raise ValueError("d_ff=0: expected > 0 with " + (
                "parallel_block" if self.parallel_block else "experts as wide as model.d_ff "
                "(moe.d_ff=0)"))
        if self.moe.num_experts and self.moe.swiglu_limit and self.activation != "swiglu":
            raise ValueError(f"moe.swiglu_limit={self.moe.swiglu_limit}: expected activation="
                             f"'swiglu' (it clamps SwiGLU's halves), not {self.activation!r}")
        dense = self.moe.first_dense_layers if self.moe.num_experts else 0
        if dense and not any(self.moe.is_moe_layer(i) for i in range(self.num_layers)):
            raise ValueError(f"moe.first_dense_layers={dense}: expected fewer than the layers "
                             f"(num_layers={self.num_layers}), or no MoE layer is left")
        if dense and self.scan_layers and dense % self.layer_period:
            raise ValueError(f"moe.first_dense_layers={dense}: with scan_layers, expected a "
                             f"multiple of the layer period ({self.layer_period}; the dense "
                             "layers and the rest scan apart)")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads}: expected a divisor of "
                             f"num_heads={self.num_heads}")
        # (MLA sizes its heads by model.mla's keys, which check themselves: head_dim is idle)
        mha = self.attention_kind != "mla"
        if mha and self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model}: expected a multiple of num_heads={self.num_heads} "
                "(or set head_dim)"
            )
        if mha and self.position == "rope" and self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim}: RoPE needs an even head dim")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model={self.d_model}: sinusoidal positions need an even width")
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, jnp.dtype(getattr(self, name)))
        self._check_window_pattern()
        self._check_mixers()
        self._check_rope_keys()
        # (attention_kind 'mla' refuses it in _check_mixers: MLA's RoPE dims rotate whole)
        if self.rope_fraction < 1 and self.position != "rope":
            raise ValueError(f"rope_fraction={self.rope_fraction}: expected position='rope'")
        if self.rope_local_theta is not None and (
                self.position != "rope" or "sliding_attention" not in self.layer_pattern):
            raise ValueError(f"rope_local_theta={self.rope_local_theta}: expected position="
                             "'rope' and sliding_attention layers (it is their RoPE base)")

    def _check_rope_keys(self) -> None:
        """RoPE's keys set (not their defaults) without position 'rope' would do nothing:
        refused. rope_fraction and rope_local_theta say so in their own checks."""
        if self.position == "rope":
            return
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith("rope_") and field.name not in (
                    "rope_fraction", "rope_local_theta") and value != field.default:
                raise ValueError(f"{field.name}={value!r}: expected position='rope' (RoPE's "
                                 f"keys do nothing with position={self.position!r})")

    def _build_groups(self) -> None:
        """Each config group (`moe`, `lora`, a mixer's) given as a dict (the `model.<group>` of a
        run config) becomes its dataclass, unknown keys refused in one line."""
        for field in dataclasses.fields(self):
            group, value = type(field.default), getattr(self, field.name)
            if not dataclasses.is_dataclass(field.default) or isinstance(value, group):
                continue
            values = dict(value)
            unknown = sorted(set(values) - {f.name for f in dataclasses.fields(group)})
            if unknown:
                raise ValueError(f"{field.name}: unknown keys {unknown}: expected keys of "
                                 f"{group.__module__}.{group.__qualname__}")
            object.__setattr__(self, field.name, group(**values))

    def _check_mixers(self) -> None:
        """The config group of each mixer the layers use checks itself against the model
        (`check(config)`): e.g. mamba2's head_dim must divide expand x d_model. Without a full
        or sliding attention layer, a key declared `attention_only` is refused off its default
        (it would do nothing)."""
        used = self.used_layer_types
        records = [MIXERS[name] for name in used]
        if used & {"full_attention", "sliding_attention"}:
            records.append(ATTENTION_KINDS[self.attention_kind])
        else:
            for field in dataclasses.fields(self):
                declared, value = field.metadata.get("key"), getattr(self, field.name)
                if declared and declared.attention_only and value != field.default:
                    raise ValueError(f"{field.name}={value!r} with layer_types="
                                     f"{self.layer_types!r}: expected a full_attention or "
                                     "sliding_attention layer (it sets softmax attention, which "
                                     "no layer has)")
        groups = tuple(m.config for m in records if m.config is not None)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, groups) and hasattr(value, "check"):
                value.check(self)

    def _check_window_pattern(self) -> None:
        pattern, types = self.sliding_window_pattern, self.layer_pattern
        if pattern and self.sliding_window is None:
            raise ValueError(f"sliding_window_pattern={pattern}: expected a sliding_window")
        if self.layer_types:
            if pattern:
                raise ValueError(f"sliding_window_pattern={pattern} with layer_types="
                                 f"{self.layer_types!r}: expected one of them (name the "
                                 "sliding_attention layers in layer_types)")
            given = len(parse_layer_types(self.layer_types))
            if self.num_layers % given:
                raise ValueError(f"layer_types={self.layer_types!r}: {given} layers, "
                                 f"expected num_layers={self.num_layers} or a pattern whose "
                                 "length divides it")
            sliding = "sliding_attention" in types
            if sliding != (self.sliding_window is not None):
                raise ValueError(f"sliding_window={self.sliding_window} with layer_types="
                                 f"{self.layer_types!r}: expected a sliding_window exactly when "
                                 "a layer is sliding_attention")
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
    def layer_pattern(self) -> tuple[str, ...]:
        """The layer types that repeat down the stack: `layer_types` as given, else one layer
        (full, or sliding under a sliding_window) or the sliding_window_pattern's P layers.
        The shortest period is kept ("full_attention*4" is one full layer, repeated), so the
        scanned params are laid out the same however the pattern is written."""
        if self.layer_types:
            names = parse_layer_types(self.layer_types)
            return next(names[:p] for p in range(1, len(names) + 1)
                        if len(names) % p == 0 and names == names[:p] * (len(names) // p))
        if self.sliding_window is None:
            return ("full_attention",)
        period = self.sliding_window_pattern or 1
        return ("sliding_attention",) * (period - 1) + (
            "sliding_attention" if period == 1 else "full_attention",)

    @property
    def layer_period(self) -> int:
        """How many consecutive layers repeat: MoE layers every n, the layer types' pattern."""
        moe = self.moe.every_n_layers if self.moe.num_experts else 1
        return math.lcm(moe, len(self.layer_pattern))

    def layer_type(self, layer: int) -> str:
        """The token mixer of layer `layer` (from 0), a name in `mixers.MIXERS`.

        >>> cfg = TransformerConfig(num_layers=4, layer_types="sliding_attention*3,full_attention",
        ...                         sliding_window=8)
        >>> [cfg.layer_type(i)[:4] for i in range(4)]
        ['slid', 'slid', 'slid', 'full']
        """
        pattern = self.layer_pattern
        return pattern[layer % len(pattern)]

    def idle_keys(self, cross_attention: bool = False,
                  set_only: bool = True) -> dict[str, tuple[Any, str]]:
        """{dotted key: (value, what it needs)} of the keys set off their defaults (`set_only`;
        else at any value) that act only with another setting this stack leaves off
        (`Key.needs`; a group class's `NEEDS`). `cross_attention`: an encoder-decoder's stack,
        whose multi-head cross-attention reads `CROSS_KEYS` whatever attention_kind.

        >>> TransformerConfig(num_kv_heads=2, attention_kind="mla", mla=dict(kv_lora_rank=16),
        ...                   d_model=64).idle_keys()
        {'num_kv_heads': (2, "a multi-head attention layer (attention_kind='mha')")}
        """
        idle = {}
        for name, declared in declarations(type(self)):
            value = functools.reduce(getattr, name.split("."), self)
            read = not declared.needs or declared.needs[0](self) or (
                cross_attention and name in CROSS_KEYS)
            if not read and (value != declared.default or not set_only):
                idle[name] = (value, declared.needs[1])
        return idle

    @property
    def used_layer_types(self) -> set[str]:
        """The token mixers the stack's layers use (`layer_type` of each)."""
        return {self.layer_type(i) for i in range(self.num_layers)}

    def mixer(self, layer: int):
        """The `mixers.base.Mixer` record of layer `layer`."""
        return MIXERS[self.layer_type(layer)]

    def is_local_layer(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) attends through the sliding window.

        >>> cfg = TransformerConfig(sliding_window=4, sliding_window_pattern=3, num_layers=6)
        >>> [cfg.is_local_layer(i) for i in range(6)]
        [True, True, False, True, True, False]
        """
        return self.mixer(layer).local


def residual_init_scale(config: TransformerConfig) -> float:
    """The init std multiplier of the kernels writing into the residual stream: 1 / sqrt(2 L)
    under `scale_residual_init` (two such kernels per layer), else 1."""
    return (2 * config.num_layers) ** -0.5 if config.scale_residual_init else 1.0
