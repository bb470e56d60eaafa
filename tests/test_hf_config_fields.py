"""Every field of every supported Hugging Face config class is honoured, refused or inert.

For each config class the converter reads (GPT-2, BERT, T5, Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3, OLMo 2, OLMo 3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss, Qwen3-Next, Mamba 2),
every key of `config.to_dict()` is in exactly one table below:
- HONOURED: changing it changes our logits exactly as it changes HF's (both compared to 1e-4);
- REFUSED: `convert.from_hf` raises a ValueError naming it;
- INERT: it does not change HF's logits at all (checked: the same weights under the changed
  config give the same HF logits), so there is nothing to honour; or METADATA (names, output
  flags, label maps), which no forward pass reads. (REORDERING: inert fields that only reorder
  HF's float arithmetic, whose HF logits are compared to 1e-5.)
A field a new transformers version adds fails the coverage test until it is decided here; one
that fits none of the three (UNDECIDED, with the evidence) waits for the converter to decide.
"""

import copy
import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from test_hf_equivalence import VOCAB, randomized, relative_difference, tokens  # noqa: E402

from transformer.hf import convert  # noqa: E402
from transformer.models import build_model  # noqa: E402

LLAMA_BASE = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48, vocab_size=VOCAB,
                  max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
QWEN_MOE_BASE = dict(LLAMA_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     decoder_sparse_step=2)
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 8.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 8}
MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
        eos_token_id=0)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=48,
        vocab_size=VOCAB, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_BASE),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA_BASE, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA_BASE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA_BASE, head_dim=8)),
    # layers sliding, full with a window of 4 < 12 tokens
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        LLAMA_BASE, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", LLAMA_BASE),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        LLAMA_BASE, num_local_experts=4, num_experts_per_tok=2)),
    # layer 0 dense (intermediate_size 48), layer 1 MoE (experts 16 wide)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(QWEN_MOE_BASE,
                                                                shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(QWEN_MOE_BASE, head_dim=8)),
    # sliding (window 4 < 12 tokens), full; the local layers' RoPE base apart from the full ones'
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        LLAMA_BASE, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, sliding_window_pattern=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # both layers sliding (window 4): OLMo 3's fourth layer is its first full one
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(LLAMA_BASE, sliding_window=4)),
    # MLA with a low-rank query; layer 0 dense, layer 1 8 experts in 2 groups and a shared one
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        LLAMA_BASE, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # sliding (window 4), full; 4 experts top-2 with the clamped SwiGLU; YaRN
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        LLAMA_BASE, intermediate_size=16, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, swiglu_limit=1.5, rope_parameters=GPT_OSS_YARN)),
    # Gated DeltaNet x 3, then gated full attention with half the head rotated; layers 0 and 2
    # dense (intermediate_size 48), 1 and 3 experts (16 wide) with a 16-wide shared expert
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        QWEN_MOE_BASE, num_hidden_layers=4, head_dim=8, shared_expert_intermediate_size=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                  "partial_rotary_factor": 0.5})),
    # 8 heads of 8 in 2 groups, a time-step limit that clips
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8,
        num_heads=8, n_groups=2, expand=2, conv_kernel=4, chunk_size=4,
        time_step_limit=(0.0, 0.6), bos_token_id=1, eos_token_id=2, pad_token_id=0)),
}
METADATA = {"_name_or_path", "architectures", "model_type", "transformers_version",
            "return_dict", "output_attentions", "output_hidden_states", "problem_type",
            "id2label", "label2id", "dtype", "is_encoder_decoder", "use_cache"}
ROPE_LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 16}
# dynamic NTK scaling: the Llama-like converters take default, linear, llama3 and yarn only
ROPE_DYNAMIC = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
LLAMA_HONOURED = {
    "num_hidden_layers": {"num_hidden_layers": 3}, "hidden_size": {"hidden_size": 48},
    "num_attention_heads": {"num_attention_heads": 8}, "intermediate_size":
    {"intermediate_size": 40}, "num_key_value_heads": {"num_key_value_heads": 1},
    "head_dim": {"head_dim": 16}, "rms_norm_eps": {"rms_norm_eps": 0.5},
    "rope_parameters": {"rope_parameters": ROPE_LINEAR}, "vocab_size": {"vocab_size": 77},
    "tie_word_embeddings": {"tie_word_embeddings": True},
}
LLAMA_INERT = {"attention_dropout": {"attention_dropout": 0.5}, "initializer_range":
               {"initializer_range": 0.5}, "bos_token_id": {"bos_token_id": 3},
               "eos_token_id": {"eos_token_id": 3}, "pad_token_id": {"pad_token_id": 3},
               "chunk_size_feed_forward": {"chunk_size_feed_forward": 2},
               # RoPE positions have no table: the length bound changes no logit
               "max_position_embeddings": {"max_position_embeddings": 32}}
# 4 layers, not 3: decoder_sparse_step 2 (model.moe.every_n_layers) must divide the depth
QWEN_MOE_HONOURED = {
    "num_hidden_layers": {"num_hidden_layers": 4},
    "num_experts_per_tok": {"num_experts_per_tok": 3},
    "moe_intermediate_size": {"moe_intermediate_size": 8}, "norm_topk_prob":
    {"norm_topk_prob": True}, "decoder_sparse_step": {"decoder_sparse_step": 1}}
MOE_REFUSED = {"hidden_act": {"hidden_act": "gelu"},
               "rope_parameters": {"rope_parameters": ROPE_DYNAMIC},
               "mlp_only_layers": {"mlp_only_layers": [1]}}
MOE_INERT = {**LLAMA_INERT, "output_router_logits": {"output_router_logits": True},
             "router_aux_loss_coef": {"router_aux_loss_coef": 0.5}}
# the full layers' RoPE scaled, as Gemma 3's 4B-27B checkpoints (linear, factor 8)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
               "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}}
# YaRN with the keys DeepSeek-V3's checkpoints set: the attention scale from mscale and
# mscale_all_dim, no attention_factor
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                 "original_max_position_embeddings": 8, "beta_fast": 8.0, "beta_slow": 1.0,
                 "mscale": 0.9, "mscale_all_dim": 0.7}
# an explicit attention_factor (HF scales cos / sin by it): our YaRN has no setting for it
YARN_ATTENTION_FACTOR = dict(DEEPSEEK_YARN, attention_factor=1.5)
MAMBA2_HEADS = {"hidden_size": {"hidden_size": 48, "num_heads": 12},
                "num_heads": {"num_heads": 16, "head_dim": 4},
                "head_dim": {"head_dim": 16, "num_heads": 4},
                "expand": {"expand": 1, "num_heads": 4}}
HONOURED = {
    "gpt2": {"n_layer": {"n_layer": 3}, "n_embd": {"n_embd": 48}, "n_head": {"n_head": 8},
             "n_inner": {"n_inner": 40}, "activation_function": {"activation_function": "relu"},
             "layer_norm_epsilon": {"layer_norm_epsilon": 0.5}, "n_positions":
             {"n_positions": 32}, "vocab_size": {"vocab_size": 77}, "scale_attn_weights":
             {"scale_attn_weights": False}, "tie_word_embeddings": {"tie_word_embeddings": False}},
    "bert": {"num_hidden_layers": {"num_hidden_layers": 3}, "hidden_size": {"hidden_size": 48},
             "num_attention_heads": {"num_attention_heads": 8}, "intermediate_size":
             {"intermediate_size": 40}, "hidden_act": {"hidden_act": "relu"}, "layer_norm_eps":
             {"layer_norm_eps": 0.5}, "max_position_embeddings": {"max_position_embeddings": 32},
             "type_vocab_size": {"type_vocab_size": 3}, "vocab_size": {"vocab_size": 77}},
    "t5": {"num_layers": {"num_layers": 3}, "num_decoder_layers": {"num_decoder_layers": 3},
           "d_model": {"d_model": 48}, "d_kv": {"d_kv": 4}, "num_heads": {"num_heads": 8},
           "d_ff": {"d_ff": 40}, "feed_forward_proj": {"feed_forward_proj": "gated-gelu"},
           "layer_norm_epsilon": {"layer_norm_epsilon": 0.5}, "relative_attention_num_buckets":
           {"relative_attention_num_buckets": 16}, "relative_attention_max_distance":
           {"relative_attention_max_distance": 8}, "vocab_size": {"vocab_size": 77},
           "scale_decoder_outputs": {"scale_decoder_outputs": False},
           # what the model is built from (T5Config derives them from feed_forward_proj)
           "is_gated_act": {"is_gated_act": True, "dense_act_fn": "gelu_new"},
           "dense_act_fn": {"dense_act_fn": "gelu_new"},
           "tie_word_embeddings": {"tie_word_embeddings": False}},
    "llama": LLAMA_HONOURED,
    "mistral": {**LLAMA_HONOURED, "sliding_window": {"sliding_window": 3}},
    "qwen2": {k: v for k, v in LLAMA_HONOURED.items() if k != "head_dim"},
    "qwen3": {**LLAMA_HONOURED, "use_sliding_window": {
        "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}},
    "gemma2": {**LLAMA_HONOURED, "tie_word_embeddings": {"tie_word_embeddings": False},
               "query_pre_attn_scalar": {"query_pre_attn_scalar": 3},
               "sliding_window": {"sliding_window": 2},
               "layer_types": {"layer_types": ["full_attention", "full_attention"]},
               "final_logit_softcapping": {"final_logit_softcapping": 1.0},
               "attn_logit_softcapping": {"attn_logit_softcapping": 0.5}},
    "olmo2": {k: v for k, v in LLAMA_HONOURED.items() if k != "head_dim"},
    "mixtral": {**LLAMA_HONOURED, "sliding_window": {"sliding_window": 3},
                "num_local_experts": {"num_local_experts": 3},
                "num_experts_per_tok": {"num_experts_per_tok": 3}},
    "qwen2_moe": {**{k: v for k, v in LLAMA_HONOURED.items() if k != "head_dim"},
                  **QWEN_MOE_HONOURED, "num_experts": {"num_experts": 3},
                  "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 48},
                  "qkv_bias": {"qkv_bias": False}},
    "qwen3_moe": {**LLAMA_HONOURED, **QWEN_MOE_HONOURED, "num_local_experts": {"num_experts": 3},
                  "use_sliding_window":
                  {"use_sliding_window": True, "sliding_window": 3}},
    "gemma3": {**LLAMA_HONOURED, "tie_word_embeddings": {"tie_word_embeddings": False},
               "rope_parameters": {"rope_parameters": GEMMA3_ROPE},
               "query_pre_attn_scalar": {"query_pre_attn_scalar": 3},
               "sliding_window": {"sliding_window": 2},
               "layer_types": {"layer_types": ["full_attention", "full_attention"]},
               # what layer_types is derived from when a config gives none (3: all sliding);
               # Gemma3TextConfig keeps it as _sliding_window_pattern too
               "sliding_window_pattern": {"sliding_window_pattern": 3},
               "_sliding_window_pattern": {"sliding_window_pattern": 1},
               "final_logit_softcapping": {"final_logit_softcapping": 1.0}},
    "olmo3": {**{k: v for k, v in LLAMA_HONOURED.items() if k != "head_dim"},
              "rope_parameters": {"rope_parameters": {kind: ROPE_LINEAR for kind in (
                  "sliding_attention", "full_attention")}},
              "sliding_window": {"sliding_window": 3},
              "layer_types": {"layer_types": ["sliding_attention", "full_attention"]}},
    "deepseek_v3": {
        **{k: LLAMA_HONOURED[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                          "tie_word_embeddings")},
        "num_hidden_layers": {"num_hidden_layers": 3},
        "num_attention_heads": {"num_attention_heads": 8, "num_key_value_heads": 8},
        "rope_parameters": {"rope_parameters": DEEPSEEK_YARN},
        "rope_interleave": {"rope_interleave": False},
        "q_lora_rank": {"q_lora_rank": None}, "kv_lora_rank": {"kv_lora_rank": 8},
        "qk_nope_head_dim": {"qk_nope_head_dim": 4}, "qk_rope_head_dim": {"qk_rope_head_dim": 8},
        "v_head_dim": {"v_head_dim": 8},
        # DeepseekV3Config derives them (head_dim: the RoPE part; qk_head_dim: the sum)
        "head_dim": {"qk_rope_head_dim": 2}, "qk_head_dim": {"qk_nope_head_dim": 6},
        "moe_intermediate_size": {"moe_intermediate_size": 8},
        "n_routed_experts": {"n_routed_experts": 6}, "n_shared_experts": {"n_shared_experts": 2},
        "num_experts_per_tok": {"num_experts_per_tok": 3}, "n_group": {"n_group": 4},
        "topk_group": {"topk_group": 2}, "norm_topk_prob": {"norm_topk_prob": False},
        "routed_scaling_factor": {"routed_scaling_factor": 1.0},
        "first_k_dense_replace": {"first_k_dense_replace": 0}},
    "gpt_oss": {
        **{k: v for k, v in LLAMA_HONOURED.items() if k != "rope_parameters"},
        "intermediate_size": {"intermediate_size": 8},
        "rope_parameters": {"rope_parameters": dict(GPT_OSS_YARN, factor=2.0, beta_fast=4.0)},
        "sliding_window": {"sliding_window": 3},
        "layer_types": {"layer_types": ["full_attention", "full_attention"]},
        "num_local_experts": {"num_local_experts": 3},
        "num_experts_per_tok": {"num_experts_per_tok": 3},
        "swiglu_limit": {"swiglu_limit": 0.5}},
    "qwen3_next": {
        **LLAMA_HONOURED, **QWEN_MOE_HONOURED,
        # two layers keep one full-attention layer (HF's model needs one)
        "num_hidden_layers": {"num_hidden_layers": 2,
                              "layer_types": ["linear_attention", "full_attention"]},
        "rope_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.25}},
        "num_experts": {"num_experts": 3}, "norm_topk_prob": {"norm_topk_prob": False},
        "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 32},
        "layer_types": {"layer_types": ["linear_attention", "full_attention"] * 2},
        "linear_conv_kernel_dim": {"linear_conv_kernel_dim": 3},
        "linear_key_head_dim": {"linear_key_head_dim": 4},
        "linear_value_head_dim": {"linear_value_head_dim": 4},
        "linear_num_key_heads": {"linear_num_key_heads": 4},
        "linear_num_value_heads": {"linear_num_value_heads": 8}},
    "mamba2": {
        **MAMBA2_HEADS, "num_hidden_layers": {"num_hidden_layers": 3},
        "state_size": {"state_size": 4}, "n_groups": {"n_groups": 1},
        "conv_kernel": {"conv_kernel": 3}, "use_conv_bias": {"use_conv_bias": False},
        "layer_norm_epsilon": {"layer_norm_epsilon": 0.5},
        "time_step_limit": {"time_step_limit": (0.0, float("inf"))},
        "vocab_size": {"vocab_size": 77}, "tie_word_embeddings": {"tie_word_embeddings": True}},
}
REFUSED = {
    "gpt2": {"add_cross_attention": {"add_cross_attention": True}, "reorder_and_upcast_attn":
             {"reorder_and_upcast_attn": True}, "scale_attn_by_inverse_layer_idx":
             {"scale_attn_by_inverse_layer_idx": True}, "embd_pdrop": {"embd_pdrop": 0.0}},
    "bert": {"is_decoder": {"is_decoder": True}, "add_cross_attention":
             {"add_cross_attention": True}, "tie_word_embeddings": {"tie_word_embeddings": False},
             "classifier_dropout": {"classifier_dropout": 0.5}},
    "t5": {"is_decoder": {"is_decoder": True}, "dense_act_fn": {"dense_act_fn": "tanh"}},
    "llama": {"attention_bias": {"attention_bias": True}, "mlp_bias": {"mlp_bias": True},
              "pretraining_tp": {"pretraining_tp": 2}, "hidden_act": {"hidden_act": "gelu"},
              "rope_parameters": {"rope_parameters": ROPE_DYNAMIC}},
    "mistral": {"hidden_act": {"hidden_act": "gelu"}, "rope_parameters":
                {"rope_parameters": ROPE_DYNAMIC}},
    "qwen2": {"hidden_act": {"hidden_act": "gelu"},
              "rope_parameters": {"rope_parameters": ROPE_DYNAMIC},
              "use_sliding_window": {"use_sliding_window": True, "sliding_window": 4,
                                     "max_window_layers": 1},
              "layer_types": {"layer_types": ["sliding_attention", "full_attention"]}},
    "qwen3": {"attention_bias": {"attention_bias": True}, "hidden_act": {"hidden_act": "gelu"},
              "rope_parameters": {"rope_parameters": ROPE_DYNAMIC},
              "layer_types": {"layer_types": ["full_attention", "sliding_attention"],
                              "use_sliding_window": True, "sliding_window": 3}},
    "gemma2": {"attention_bias": {"attention_bias": True}, "hidden_activation":
               {"hidden_activation": "silu"},
               "rope_parameters": {"rope_parameters": ROPE_DYNAMIC},
               "use_bidirectional_attention": {"use_bidirectional_attention": True}},
    "olmo2": {"attention_bias": {"attention_bias": True}, "hidden_act": {"hidden_act": "gelu"},
              "rope_parameters": {"rope_parameters": ROPE_DYNAMIC}},
    # top-1 with renormalised gates (HF's gate 1); training-time router noise
    "mixtral": {"hidden_act": {"hidden_act": "gelu"},
                "rope_parameters": {"rope_parameters": ROPE_DYNAMIC},
                "num_experts_per_tok": {"num_experts_per_tok": 1},
                "router_jitter_noise": {"router_jitter_noise": 0.1}},
    "qwen2_moe": {**MOE_REFUSED, "use_sliding_window": {
        "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        "layer_types": {"layer_types": ["sliding_attention", "full_attention"]},
        "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 24}},
    "qwen3_moe": {**MOE_REFUSED, "attention_bias": {"attention_bias": True}},
    # a sliding layers' scaling unlike the full layers' (one alike is one RoPE for all layers)
    "gemma3": {"attention_bias": {"attention_bias": True}, "hidden_activation":
               {"hidden_activation": "silu"}, "rope_parameters": {"rope_parameters": {
                   "sliding_attention": ROPE_LINEAR, "full_attention": YARN}},
               "use_bidirectional_attention": {"use_bidirectional_attention": True},
               "layer_types": {"layer_types": ["full_attention", "sliding_attention"]}},
    # YaRN on the full layers alone (where transformers 5 puts a legacy rope_scaling)
    "olmo3": {"attention_bias": {"attention_bias": True}, "hidden_act": {"hidden_act": "gelu"},
              "rope_parameters": {"layer_types": ["sliding_attention", "full_attention"],
                                  "rope_parameters": {"sliding_attention": {
                                      "rope_type": "default", "rope_theta": 1e4},
                                      "full_attention": YARN}},
              "layer_types": {"layer_types": ["full_attention", "sliding_attention"]}},
    # pretraining_tp: HF's model does not read it, the converter refuses any but 1
    # num_key_value_heads: HF's MLA takes no other than the heads (a shape error); rms_norm_eps:
    # HF's q_a / kv_a latent norms keep 1e-6 whatever it says
    "deepseek_v3": {"attention_bias": {"attention_bias": True}, "hidden_act":
                    {"hidden_act": "gelu"}, "pretraining_tp": {"pretraining_tp": 2},
                    "rope_parameters": {"rope_parameters": YARN_ATTENTION_FACTOR},
                    "num_experts_per_tok": {"num_experts_per_tok": 1},
                    "num_key_value_heads": {"num_key_value_heads": 2},
                    "rms_norm_eps": {"rms_norm_eps": 1e-5}},
    # hidden_act: HF's clamped SwiGLU does not read it, the converter refuses any but silu
    "gpt_oss": {"attention_bias": {"attention_bias": False}, "hidden_act": {"hidden_act": "gelu"},
                "swiglu_alpha": {"swiglu_alpha": 1.0},
                "num_experts_per_tok": {"num_experts_per_tok": 1},
                "rope_parameters": {"rope_parameters": dict(GPT_OSS_YARN, attention_factor=1.5)},
                "layer_types": {"layer_types": ["full_attention", "sliding_attention"]}},
    "qwen3_next": {**MOE_REFUSED, "attention_bias": {"attention_bias": True},
                   "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 24},
                   "num_experts_per_tok": {"num_experts_per_tok": 1},
                   "layer_types": {"layer_types": ["linear_attention", "sliding_attention"] * 2}},
    "mamba2": {"use_bias": {"use_bias": True}, "hidden_act": {"hidden_act": "gelu"}},
}
# Fields whose change moves HF's logits (or breaks HF's model) while the converter neither
# honours nor refuses it: the coverage test skips them until the converter decides.
UNDECIDED: dict[str, dict[str, str]] = {}  # {family: {field: the evidence}}
# Inert fields that only reorder HF's float arithmetic: its logits compared to 1e-5, not exactly.
REORDERING = {"mamba2": {"chunk_size"}}  # the scan's block length: 3e-7 relative at 4 -> 8
INERT = {
    "gpt2": {"attn_pdrop": {"attn_pdrop": 0.5}, "resid_pdrop": {"resid_pdrop": 0.5,
                                                                "embd_pdrop": 0.5},
             "initializer_range": {"initializer_range": 0.5}, "bos_token_id": {"bos_token_id": 3},
             "eos_token_id": {"eos_token_id": 3}, "pad_token_id": {"pad_token_id": 3},
             # the summary head of GPT2DoubleHeadsModel, which the LM does not have
             "summary_activation": {"summary_activation": "tanh"}, "summary_first_dropout":
             {"summary_first_dropout": 0.5}, "summary_proj_to_labels":
             {"summary_proj_to_labels": False}, "summary_type": {"summary_type": "last"},
             "summary_use_proj": {"summary_use_proj": False},
             "chunk_size_feed_forward": {"chunk_size_feed_forward": 2}},
    "bert": {"attention_probs_dropout_prob": {"attention_probs_dropout_prob": 0.5},
             "hidden_dropout_prob": {"hidden_dropout_prob": 0.5}, "initializer_range":
             {"initializer_range": 0.5}, "bos_token_id": {"bos_token_id": 3}, "eos_token_id":
             {"eos_token_id": 3}, "pad_token_id": {"pad_token_id": 3},
             "chunk_size_feed_forward": {"chunk_size_feed_forward": 2}},
    "t5": {"dropout_rate": {"dropout_rate": 0.5}, "initializer_factor":
           {"initializer_factor": 0.5}, "classifier_dropout": {"classifier_dropout": 0.5},
           "eos_token_id": {"eos_token_id": 3}, "pad_token_id": {"pad_token_id": 3},
           "decoder_start_token_id": {"decoder_start_token_id": 3},  # generation only
           "chunk_size_feed_forward": {"chunk_size_feed_forward": 2}},
    "llama": LLAMA_INERT,
    "mistral": LLAMA_INERT,
    # without use_sliding_window (and sliding layer_types, refused) Qwen2 reads neither
    "qwen2": {**LLAMA_INERT, "sliding_window": {"sliding_window": 3}, "max_window_layers":
              {"max_window_layers": 1}},
    # without use_sliding_window Qwen3 reads neither (with it, a mixed max_window_layers gives
    # layer_types that are refused)
    "qwen3": {**LLAMA_INERT, "sliding_window": {"sliding_window": 3}, "max_window_layers":
              {"max_window_layers": 1}},
    "gemma2": LLAMA_INERT,
    "olmo2": LLAMA_INERT,
    "mixtral": MOE_INERT,
    # without use_sliding_window Qwen2-MoE reads neither, nor Qwen3-MoE its sliding_window
    "qwen2_moe": {**MOE_INERT, "sliding_window": {"sliding_window": 3}, "max_window_layers":
                  {"max_window_layers": 1}},
    "qwen3_moe": {**MOE_INERT, "sliding_window": {"sliding_window": 3}},
    # HF's Gemma 3 keeps attn_logit_softcapping but never applies it
    "gemma3": {**LLAMA_INERT, "attn_logit_softcapping": {"attn_logit_softcapping": 0.5}},
    "olmo3": LLAMA_INERT,
    # transformers drops the multi-token prediction layers (num_nextn_predict_layers)
    "deepseek_v3": {**MOE_INERT, "num_nextn_predict_layers": {"num_nextn_predict_layers": 2}},
    "gpt_oss": MOE_INERT,
    "qwen3_next": MOE_INERT,
    # init-only (time_step_*, rescale_prenorm_residual); float32 already (residual_in_fp32); the
    # gated norm's order, which HF's Mamba 2 does not read (Codestral's config.json sets it)
    "mamba2": {**{k: LLAMA_INERT[k] for k in ("initializer_range", "bos_token_id", "eos_token_id",
                                               "pad_token_id", "chunk_size_feed_forward")},
               "time_step_min": {"time_step_min": 0.01}, "time_step_max": {"time_step_max": 0.2},
               "time_step_floor": {"time_step_floor": 0.01},
               "time_step_rank": {"time_step_rank": 4},
               "rescale_prenorm_residual": {"rescale_prenorm_residual": True},
               "residual_in_fp32": {"residual_in_fp32": False},
               "norm_before_gate": {"norm_before_gate": True}, "chunk_size": {"chunk_size": 8}},
}


def hf_config(name: str, **changes):
    config_class, _, base = MODELS[name]
    # a copy: the config classes fill in (and so change) the nested rope_parameters they get
    return getattr(transformers, config_class)(**copy.deepcopy({**base, **changes}))


def hf_model(name: str, config, seed=0):
    torch.manual_seed(seed)
    return randomized(getattr(transformers, MODELS[name][1])(config))


def inputs(name: str, vocab: int):
    ids = tokens(11, (2, 12)) % vocab
    if name == "t5":
        dec = tokens(12, (2, 6)) % vocab
        return dict(input_ids=ids, decoder_input_ids=dec), (ids, dec)
    return dict(input_ids=ids), (ids,)


def hf_logits(model, hf_inputs):
    with torch.no_grad():
        return model(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).logits.numpy()


@functools.cache
def default_model(name: str):
    """The family's model at its default config (seeded weights), built once: the cases below
    compare with it and copy its weights, never change it."""
    return hf_model(name, hf_config(name))


@functools.cache
def default_logits(name: str) -> np.ndarray:
    logits = hf_logits(default_model(name), inputs(name, VOCAB)[0])
    logits.setflags(write=False)
    return logits


def our_logits(model, args):
    config, params = convert.from_hf(model.config, model.state_dict())
    return np.asarray(build_model(config).apply({"params": params}, *map(jnp.asarray, args)))


def cases(table):
    return [(name, field, change) for name, fields in table.items()
            for field, change in fields.items()]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_config_field_is_decided(name):
    keys = set(hf_config(name).to_dict())
    decided = set(HONOURED[name]) | set(REFUSED[name]) | set(INERT[name]) | METADATA | set(
        UNDECIDED.get(name, ()))
    assert not keys - decided, f"{name}: decide these fields: {sorted(keys - decided)}"
    assert not (set(HONOURED[name]) & set(INERT[name])) and not (
        set(REFUSED[name]) & set(INERT[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name,field,change", cases(HONOURED))
def test_honoured_fields_change_our_logits_as_they_change_hfs(name, field, change):
    config = hf_config(name, **change)
    model = hf_model(name, config)
    hf_inputs, args = inputs(name, config.vocab_size)
    expected = hf_logits(model, hf_inputs)
    assert relative_difference(our_logits(model, args), expected) <= 1e-4
    # ... and it does change them: the same field at its default differs (shapes or values).
    before = default_logits(name)
    assert before.shape != expected.shape or not np.allclose(before, expected)


@pytest.mark.parametrize("name,field,change", cases(REFUSED))
def test_refused_fields_raise_naming_the_field(name, field, change):
    config = hf_config(name, **change)
    state = default_model(name).state_dict()
    with pytest.raises(ValueError, match=field.split("_")[0] if field == "rope_parameters"
                       else field) as error:
        convert.from_hf(config, state)
    assert "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("name,field,change", cases(INERT))
def test_inert_fields_do_not_change_hf_logits(name, field, change):
    changed_config = hf_config(name, **change)
    changed = getattr(transformers, MODELS[name][1])(changed_config).eval()
    changed.load_state_dict(default_model(name).state_dict())
    hf_inputs, args = inputs(name, VOCAB)
    want = default_logits(name)
    if field in REORDERING.get(name, ()):
        assert relative_difference(hf_logits(changed, hf_inputs), want) <= 1e-5
    else:
        np.testing.assert_array_equal(hf_logits(changed, hf_inputs), want)
    assert relative_difference(our_logits(changed, args), want) <= 1e-4


# YaRN on a Llama-like model (the long-context setting Qwen's model cards give): 4 x an original
# context of 16. Heads of 16 with theta 100 put pairs on both sides of YaRN's ramp and one in it,
# so beta_fast, beta_slow and truncate move it.
LLAMA_YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
              "original_max_position_embeddings": 16}
# name: (family, changes to LLAMA_YARN, whether they move HF's logits from LLAMA_YARN's)
YARN_CASES = {
    "qwen3": ("qwen3", {}, True),  # ... from plain RoPE's
    "llama": ("llama", {}, True),
    "qwen3_betas": ("qwen3", {"beta_fast": 2.0, "beta_slow": 0.25}, True),
    "qwen3_untruncated": ("qwen3", {"truncate": False}, True),
    "qwen3_mscales": ("qwen3", {"mscale": 0.9, "mscale_all_dim": 0.7}, True),
    # the Llama-like classes take the mscale ratio only with both set (unlike DeepSeek's)
    "qwen3_mscale_alone": ("qwen3", {"mscale": 0.9}, False),
    "qwen3_attention_factor_as_derived": ("qwen3", {"attention_factor": 1 + 0.1 * math.log(4)},
                                          False),
    "qwen3_factor_from_lengths": ("qwen3", {"factor": None}, False),  # 64 / 16
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_llama_like_yarn_logits_equal_hfs_past_the_original_context(case):
    """50 tokens, past the original 16 (max_position_embeddings 64): every field transformers'
    `_compute_yarn_parameters` reads for these classes, with its defaults, is honoured."""
    family, changes, moves = YARN_CASES[case]
    model = hf_model(family, hf_config(family, head_dim=16,
                                       rope_parameters={**LLAMA_YARN, **changes}))
    ids = tokens(13, (2, 50))
    expected = hf_logits(model, dict(input_ids=ids))
    assert relative_difference(our_logits(model, (ids,)), expected) <= 1e-5
    # ... and the case changes HF's logits or not, as said: from plain YaRN's (plain RoPE's)
    plain = LLAMA_YARN if changes else {"rope_type": "default", "rope_theta": 100.0}
    reference = getattr(transformers, MODELS[family][1])(
        hf_config(family, head_dim=16, rope_parameters=plain))
    reference.load_state_dict(model.state_dict())
    assert np.allclose(hf_logits(reference.eval(), dict(input_ids=ids)), expected) != moves


@pytest.mark.parametrize("rope,match", [
    (ROPE_DYNAMIC, r"^rope scaling type 'dynamic': expected 'default', 'linear', 'llama3' or "
     r"'yarn' \(dynamic NTK and longrope scaling are not implemented\)$"),
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
      "long_factor": [2.0] * 4, "original_max_position_embeddings": 16},
     r"^rope scaling type 'longrope': expected 'default', 'linear', 'llama3' or 'yarn'"),
    (dict(YARN, attention_factor=1.5), r"^rope attention_factor=1.5 \(rope_type 'yarn'\): "
     r"expected unset or 1.1386"),
    (dict(YARN, factor=0.0), r"^rope factor=0.0 \(rope_type 'yarn'\): expected > 0$"),
])
def test_llama_like_rope_we_cannot_honour_is_refused_in_one_line(rope, match):
    with pytest.raises(ValueError, match=match) as error:
        convert.from_hf(hf_config("qwen3", rope_parameters=rope), {})
    assert "\n" not in str(error.value)


# Our Gemma 3 without rope_local_theta: one RoPE, scaled, for every layer (the export writes it
# for both layer types, and transformers scales the sliding layers' too); heads of 16 at base
# 100 over 50 tokens, past YaRN's original 16, with a window of 4.
GEMMA3_ONE_ROPE = dict(
    num_layers=2, d_model=32, num_heads=2, head_dim=16, d_ff=64, vocab_size=VOCAB, max_len=64,
    position="rope", norm="rmsnorm", activation="geglu", use_bias=False,
    norm_placement="sandwich", scale_embeddings=True, qk_norm=True, sliding_window=4,
    sliding_window_pattern=2, rope_theta=100.0)
GEMMA3_SCALINGS = {
    "yarn": dict(rope_scaling="yarn", rope_scale=4.0, rope_original_max_len=16),
    "linear": dict(rope_scale=4.0),
    "llama3": dict(rope_scaling="llama3", rope_scale=4.0, rope_original_max_len=16),
}


@pytest.mark.parametrize("scaling", list(GEMMA3_SCALINGS))
def test_a_gemma3_export_with_one_scaled_rope_imports_back_with_hfs_logits(scaling, tmp_path):
    from test_export import export_perturbed

    from transformer.models import default_model_config

    config = default_model_config()
    config.update(**GEMMA3_ONE_ROPE, **GEMMA3_SCALINGS[scaling])
    ids = tokens(13, (2, 50))
    model, params, _ = export_perturbed(config, ids, tmp_path)
    hf = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path).eval()
    expected = hf_logits(hf, dict(input_ids=ids))
    again, _ = convert.from_hf(hf.config, hf.state_dict())
    keys = [k for k in config if k.startswith(("rope", "sliding_window"))]
    assert {k: again[k] for k in keys} == {k: config[k] for k in keys}
    assert again.rope_local_theta is None
    assert relative_difference(our_logits(hf, (ids,)), expected) <= 1e-5


def test_a_gemma3_sliding_scaling_of_its_own_is_refused_in_one_line():
    config = hf_config("gemma3", rope_parameters={"sliding_attention": YARN,
                                                  "full_attention": dict(YARN, factor=2.0)})
    with pytest.raises(ValueError, match=r"^Gemma3 sliding_attention rope_parameters=.*'yarn'"
                       r".*: expected rope_type 'default' or the full_attention layers' own "
                       r"RoPE .*not implemented$") as error:
        convert.from_hf(config, {})
    assert "\n" not in str(error.value)


def test_every_none_default_model_key_can_be_set_from_the_command_line(monkeypatch):
    """`--config.model.KEY=VALUE` works for each model key whose default is None (its
    FieldReference keeps the type; a bare None is refused by ml_collections' flags)."""
    import ml_collections
    from absl import flags
    from ml_collections import config_flags

    from transformer.models import default_model_config

    sample = {int: "3", float: "0.5", bool: "true"}
    model = default_model_config()
    flat = {}

    def walk(group, prefix):
        for name, field in group._fields.items():
            if isinstance(field, ml_collections.ConfigDict):
                walk(field, f"{prefix}{name}.")
            elif (field.get() if isinstance(field, ml_collections.FieldReference)
                  else field) is None:
                flat[prefix + name] = getattr(field, "_field_type", None)

    walk(model, "")
    assert "rope_local_theta" in flat
    for name, kind in flat.items():
        argv = ["cmd", f"--config.model.{name}={sample.get(kind, '1')}"]
        monkeypatch.setattr("sys.argv", argv)  # config_flags reads the overrides from sys.argv
        values = flags.FlagValues()
        config_flags.DEFINE_config_dict(
            "config", ml_collections.ConfigDict({"model": default_model_config()}),
            flag_values=values)
        values(argv)
        got = values.config.model
        for part in name.split("."):
            got = got[part]
        assert got == kind(sample[kind]) if kind is not bool else got is True, name
