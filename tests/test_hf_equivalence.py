"""Our GPT-2, BERT, T5, Llama (Mistral, Qwen2, Qwen3, Gemma 2, OLMo 2) and MoE (Mixtral,
Qwen2-MoE, Qwen3-MoE) models equal Hugging Face's PyTorch models given the same weights."""

import contextlib
import math
from unittest import mock

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformer.hf import convert  # noqa: E402
from transformer.models import build_model  # noqa: E402

# Max |logit difference| / max(1, max |HF logit|). float32 differences come from summation
# order (about 1e-6 here, up to 3e-5 seen when other processes load the two cores); a wrong
# weight or formula shows at 1e-2 and above. float64 is the exact check.
TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
# MoE routers take their softmax in float32 in both (HF's and ours) whatever the dtype: a gate
# differs by float32 rounding, so float64 agrees to about 1e-7 there, not 1e-12.
MOE_FLOAT64_TOLERANCE = 1e-6
VOCAB = 101


def randomized(hf_model, seed=0):
    """Perturb every parameter (norm scales, biases and the T5 bias table included) so that a
    swapped or dropped tensor cannot hide behind a default init."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return hf_model.eval()


def tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, VOCAB, shape)


def gpt2(tie=True, **more):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, **more))
    ids = tokens(0, (2, 12))
    return hf, dict(input_ids=ids), (ids,), {}, None


def bert(head="mlm"):
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, num_labels=3)
    cls = transformers.BertForMaskedLM if head == "mlm" else \
        transformers.BertForSequenceClassification
    ids = tokens(2, (2, 10))
    attention_mask = np.ones((2, 10), np.int64)
    attention_mask[1, 6:] = 0  # the second example is padded after 6 tokens
    types = np.zeros((2, 10), np.int64)
    types[:, 5:] = 1
    valid = attention_mask.astype(bool) if head == "mlm" else None  # compare real tokens only
    return (cls(config), dict(input_ids=ids, attention_mask=attention_mask, token_type_ids=types),
            (ids,), dict(token_types=types, segment_ids=attention_mask), valid)


def t5(v1_1=False):
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=3, d_model=32, d_kv=8, num_heads=4, d_ff=48,
        vocab_size=VOCAB, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu" if v1_1 else "relu", tie_word_embeddings=not v1_1,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        initializer_factor=0.5 if v1_1 else 1.0))  # unscaled, untied v1.1 logits grow large
    enc_ids, dec_ids = tokens(3, (2, 11)), tokens(4, (2, 7))
    enc_mask = np.ones((2, 11), np.int64)
    enc_mask[0, 8:] = 0  # padded encoder input
    return (hf, dict(input_ids=enc_ids, attention_mask=enc_mask, decoder_input_ids=dec_ids),
            (enc_ids, dec_ids), dict(encoder_segment_ids=enc_mask), None)


def llama(tie=False, rope=None, head_dim=None, kv_heads=2, kind="Llama", layers=2, **more):
    """Llama (or Mistral, Qwen2, Qwen3, Gemma2, Olmo2): GQA (4 query heads over `kv_heads`),
    RMSNorm, SwiGLU, RoPE; right padding in the second row."""
    config = getattr(transformers, f"{kind}Config")(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
        num_key_value_heads=kv_heads, **({"head_dim": head_dim} if head_dim else {}),
        intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 500000.0}, **more)
    hf = getattr(transformers, f"{kind}ForCausalLM")(config)
    ids = tokens(6, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, 9:] = 0
    return hf, dict(input_ids=ids, attention_mask=mask), (ids,), dict(segment_ids=mask), \
        mask.astype(bool)


def gemma3():
    """Gemma 3 (text): 4 layers, sliding (a window of 4), full, sliding, full; the local
    layers' RoPE at base 100, the full layers' at 5,000 with linear scaling 4; q/k norms with
    Gemma's 1 + weight; no soft-caps; right padding in the second row."""
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=4,
        query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 5000.0}})
    hf = transformers.Gemma3ForCausalLM(config)
    ids = tokens(6, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, 9:] = 0
    return hf, dict(input_ids=ids, attention_mask=mask), (ids,), dict(segment_ids=mask), \
        mask.astype(bool)


def moe(kind="Mixtral", **more):
    """`llama` of a mixture-of-experts class: 4 experts, top-2, in every layer unless
    decoder_sparse_step says otherwise; Qwen's experts 16 wide, not intermediate_size 48. HF's
    eager per-expert loop: its grouped_mm kernel takes no float64."""
    experts = dict(num_local_experts=4) if kind == "Mixtral" else dict(
        num_experts=4, moe_intermediate_size=16)
    return llama(kind=kind, num_experts_per_tok=2, experts_implementation="eager", **experts,
                 **more)


MOE_CASES = {
    "mixtral_top2": lambda: moe(),
    # the shared expert 2 x 16 wide behind its sigmoid gate; gates are the router probabilities
    "qwen2_moe_shared_gate": lambda: moe("Qwen2Moe", shared_expert_intermediate_size=32),
    # layer 0 dense (48 wide), layer 1 MoE; renormalised gates; per-head qk-norm
    "qwen3_moe_sparse_step_2": lambda: moe("Qwen3Moe", head_dim=16, decoder_sparse_step=2,
                                           norm_topk_prob=True),
    # a window of 4 < 12 tokens on every layer, as Mistral's
    "qwen3_moe_window_4": lambda: moe("Qwen3Moe", head_dim=16, use_sliding_window=True,
                                      sliding_window=4),
}
CASES = {
    "gpt2": gpt2, "gpt2_untied": lambda: gpt2(tie=False),
    "gpt2_unscaled_attention": lambda: gpt2(scale_attn_weights=False), "bert_mlm": bert,
    "bert_classifier": lambda: bert("classify"), "t5_v1_0": t5, "t5_v1_1": lambda: t5(True),
    "llama_gqa": llama,
    "llama_tied_linear_rope": lambda: llama(
        tie=True, kv_heads=4, rope={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama_mqa_head_dim_16": lambda: llama(head_dim=16, kv_heads=1),
    # Llama 3.1's frequency-dependent scaling: with head_dim 16, theta 500 and an original
    # context of 32, wavelengths fall in all three bands (kept < 8 <= blended <= 32 < scaled)
    "llama_rope_llama3": lambda: llama(head_dim=16, rope={
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral_window_4": lambda: llama(kind="Mistral", sliding_window=4),
    "qwen2_qkv_bias": lambda: llama(kind="Qwen2"),
    "qwen3_tied_qk_norm": lambda: llama(kind="Qwen3", tie=True, head_dim=16),
    # Layers sliding, full, sliding, full (pattern 2) with a window of 4 < 12 tokens; a logit
    # scale of 12^-0.5 with head_dim 16; both caps bind (test_gemma2_caps_and_windows_bind).
    "gemma2_window_softcaps": lambda: llama(
        kind="Gemma2", tie=True, head_dim=16, layers=4, sliding_window=4,
        query_pre_attn_scalar=12, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
    "olmo2_untied": lambda: llama(kind="Olmo2"),
    # OLMo 3: three 4-token sliding layers, then one full (test_olmo3_windows_bind)
    "olmo3_window_4": lambda: llama(kind="Olmo3", layers=4, sliding_window=4),
    "gemma3_local_rope": gemma3,
    **MOE_CASES,
}
# Their rotary embeddings are per layer type: the float64 patches do not apply.
FLOAT32_ONLY = {"olmo3_window_4", "gemma3_local_rope"}


def t5_norm_in_float64(self, hidden):
    """HF's T5LayerNorm takes the variance in float32 even for float64 inputs; for the float64
    comparison, use the same formula at full precision."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def llama_norm_in_float64(self, hidden):
    """HF's LlamaRMSNorm also normalizes in float32; the same formula at full precision."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def gemma_norm_in_float64(self, hidden):
    """Gemma2RMSNorm normalizes in float32 and scales by (1 + weight); the same at full
    precision."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return (1.0 + self.weight) * (hidden * torch.rsqrt(variance + self.eps))


def gemma_attention_in_float64(module, query, key, value, attention_mask, scaling=None,
                               softcap=None, **kwargs):
    """Gemma 2's eager attention takes its softmax in float32; the same attention (GQA, scale,
    soft-cap, additive mask) with the softmax at full precision."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    logits = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if attention_mask is not None:
        logits = logits + attention_mask
    weights = logits.softmax(dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def llama_rope_in_float64(self, x, position_ids):
    """HF's rotary angles are float32 whatever the model's dtype; the same angles in float64
    (default, linear: inv_freq / factor, and llama3, Llama 3.1's published formula)."""
    rope = self.config.rope_parameters
    dim = 2 * self.inv_freq.shape[0]
    inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    factor = rope.get("factor", 1.0)
    if rope["rope_type"] == "llama3":
        old = rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq,
                               scaled)
        factor = 1.0
    angles = position_ids[..., None].double() * inv_freq / factor
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def float64_patches():
    """(owner, attribute, replacement): HF's float32 islands replaced by the same formulas."""
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    from transformers.models.t5 import modeling_t5
    patches = [(modeling_t5.T5LayerNorm, "forward", t5_norm_in_float64),
               (modeling_gemma2.Gemma2RMSNorm, "forward", gemma_norm_in_float64),
               (modeling_gemma2, "eager_attention_forward", gemma_attention_in_float64),
               (modeling_gemma2.Gemma2RotaryEmbedding, "forward", llama_rope_in_float64)]
    for module, kind in ((modeling_llama, "Llama"), (modeling_mistral, "Mistral"),
                         (modeling_qwen2, "Qwen2"), (modeling_qwen3, "Qwen3"),
                         (modeling_olmo2, "Olmo2"), (modeling_mixtral, "Mixtral"),
                         (modeling_qwen2_moe, "Qwen2Moe"), (modeling_qwen3_moe, "Qwen3Moe")):
        patches += [(getattr(module, f"{kind}RMSNorm"), "forward", llama_norm_in_float64),
                    (getattr(module, f"{kind}RotaryEmbedding"), "forward", llama_rope_in_float64)]
    return patches


def max_logit_difference(case: str, dtype: str) -> float:
    """Max |our logits - HF logits| / max(1, max |HF logits|) for one model, both run in `dtype`
    from the same weights."""
    torch.manual_seed(0)  # HF initializes its weights from torch's global generator
    hf, hf_inputs, args, kwargs, valid = CASES[case]()
    hf = randomized(hf).to(getattr(torch, dtype))
    with contextlib.ExitStack() as stack:
        if dtype == "float64":
            for owner, name, replacement in float64_patches():
                stack.enter_context(mock.patch.object(owner, name, replacement))
            embed = getattr(getattr(hf, "model", None), "embed_tokens", None)
            if hasattr(embed, "scalar_embed_scale"):  # Gemma's sqrt(d_model), a float32 buffer
                embed.embed_scale.fill_(embed.scalar_embed_scale)
        with torch.no_grad():
            expected = hf(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).logits.numpy()
    with jax.enable_x64(dtype == "float64"):
        config, params = convert.from_hf(hf.config, hf.state_dict(), dtype=getattr(np, dtype))
        config.dtype = config.param_dtype = dtype
        got = our_logits(config, params, args, kwargs)
    if valid is not None:
        got, expected = got[valid], expected[valid]
    return float(np.abs(got - expected).max() / max(1.0, np.abs(expected).max()))


@pytest.mark.slow
@pytest.mark.parametrize("case, dtype", [
    (c, dtype) for c in CASES if c not in MOE_CASES for dtype in ("float32", "float64")
    if dtype == "float32" or c not in FLOAT32_ONLY])
def test_logits_match_hf(case, dtype):
    assert max_logit_difference(case, dtype) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_logits_match_hf(case, dtype):
    """Dropless routing (capacity_factor 0) as HF's: no token is dropped."""
    tolerance = MOE_FLOAT64_TOLERANCE if dtype == "float64" else TOLERANCE[dtype]
    assert max_logit_difference(case, dtype) <= tolerance


def test_moe_features_bind():
    """Each MoE feature of the cases changes HF's logits by far more than the tolerance (so
    test_moe_logits_match_hf checks it): the shared expert's gate, Qwen2-MoE's unnormalised
    gates, the dense layer of decoder_sparse_step 2, top-2 (vs top-1) routing and Qwen3-MoE's
    window (vs one as long as the input)."""

    def logits(case, change=lambda hf: None):
        torch.manual_seed(0)
        hf, hf_inputs, _, _, valid = CASES[case]()
        hf = randomized(hf)
        with torch.no_grad():
            change(hf)
            return hf(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).logits.numpy()[valid]

    ungated = lambda hf: [layer.mlp.shared_expert_gate.weight.zero_() for layer in hf.model.layers]
    changes = [("qwen2_moe_shared_gate", ungated),  # sigmoid(0) = 1/2 for every token
               ("qwen2_moe_shared_gate", lambda hf: [setattr(layer.mlp.gate, "norm_topk_prob",
                                                             True) for layer in hf.model.layers]),
               ("qwen3_moe_sparse_step_2", lambda hf: hf.model.layers[0].mlp.down_proj.weight
                .zero_()),
               ("mixtral_top2", lambda hf: [setattr(layer.mlp.gate, "top_k", 1)
                                            for layer in hf.model.layers]),
               ("qwen3_moe_window_4", lambda hf: setattr(hf.config, "sliding_window", 64))]
    for case, change in changes:
        assert relative_difference(logits(case, change), logits(case)) > 1e-2, case


def test_gemma2_caps_and_windows_bind():
    """Each Gemma 2 feature of gemma2_window_softcaps changes HF's logits by far more than the
    tolerance (so test_logits_match_hf checks it): the attention and final soft-caps, the
    window (vs one as long as the input) and the global layers (vs all sliding)."""

    def logits(change=lambda hf: None):
        torch.manual_seed(0)
        hf, hf_inputs, _, _, valid = CASES["gemma2_window_softcaps"]()
        hf = randomized(hf)
        change(hf)
        with torch.no_grad():
            return hf(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).logits.numpy()[valid]

    expected = logits()
    assert np.abs(expected).max() > 0.9 * 2.0  # the final cap's tanh saturates
    changes = [
        lambda hf: setattr(hf.config, "final_logit_softcapping", None),
        lambda hf: [setattr(layer.self_attn, "attn_logit_softcapping", None)
                    for layer in hf.model.layers],
        lambda hf: setattr(hf.config, "sliding_window", 64),
        lambda hf: setattr(hf.config, "layer_types", ["sliding_attention"] * 4)]
    for change in changes:
        assert relative_difference(logits(change), expected) > 1e-2


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_checkpoint_files_import_as_the_fused_state_dict(case, tmp_path):
    """save_pretrained's files (as the hub's) hold each expert's tensors apart (Mixtral's under
    block_sparse_moe.experts.j.w1 / w3 / w2): they import to exactly the params of the
    in-memory model's fused experts.gate_up_proj / down_proj."""
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    hf = randomized(CASES[case]()[0])
    hf.save_pretrained(tmp_path)
    files = load_file(tmp_path / "model.safetensors")
    assert not any("gate_up_proj" in k for k in files)
    assert any("block_sparse_moe.experts.0.w1" in k for k in files) == (case == "mixtral_top2")
    _, expected = convert.from_hf(hf.config, hf.state_dict())
    _, got = convert.from_hf(hf.config, files)
    flat = lambda tree: {"/".join(k): np.asarray(v) for k, v in
                         traverse_util.flatten_dict(tree).items()}
    assert flat(got).keys() == flat(expected).keys()
    assert all(np.array_equal(v, flat(expected)[k]) for k, v in flat(got).items())


@pytest.mark.slow
def test_gpt2_conversion_is_causal():
    hf, _, (ids,), _, _ = gpt2()
    config, params = convert.from_hf(randomized(hf).config, hf.state_dict())
    forward = jax.jit(build_model(config).apply)  # one compile for both inputs
    apply = lambda x: np.asarray(forward({"params": params}, x))
    changed = ids.copy()
    changed[:, 7:] = tokens(1, (2, 5))
    got_changed, got = apply(changed), apply(ids)
    np.testing.assert_allclose(got_changed[:, :7], got[:, :7], atol=1e-6)
    assert not np.allclose(got_changed[:, 7:], got[:, 7:])


@pytest.mark.slow
def test_scanned_conversion_gives_the_same_logits():
    hf = randomized(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
        eos_token_id=0)))
    config, params = convert.from_hf(hf.config, hf.state_dict())
    ids = tokens(5, (1, 9))
    unrolled = np.asarray(jax.jit(build_model(config).apply)({"params": params}, ids))
    config.scan_layers = True
    scanned_params = convert.scan_params(config, params)
    assert scanned_params["decoder"]["layers"]["mlp"]["wi"].shape[0] == 3
    scanned = np.asarray(jax.jit(build_model(config).apply)({"params": scanned_params}, ids))
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5)


def test_missing_and_unexpected_parameters_are_named():
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
        eos_token_id=0))
    state = dict(hf.state_dict())
    missing = {k: v for k, v in state.items() if k != "transformer.h.0.ln_2.bias"}
    with pytest.raises(KeyError, match=r"transformer.h.0.ln_2.bias.*expected the tensors its "
                                       r"config.json describes"):
        convert.from_hf(hf.config, missing)
    extra = {**state, "transformer.h.0.attn.rotary.weight": state["transformer.ln_f.bias"]}
    with pytest.raises(ValueError, match="transformer.h.0.attn.rotary.weight"):
        convert.from_hf(hf.config, extra)
    with pytest.raises(ValueError, match="model_type='falcon'"):
        convert.from_hf(type("C", (), {"model_type": "falcon"})(), state)


def test_converted_params_match_a_fresh_init_in_structure_and_shape():
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, num_decoder_layers=1, d_model=16, d_kv=4, num_heads=2, d_ff=24,
        vocab_size=VOCAB, decoder_start_token_id=0))
    config, params = convert.from_hf(hf.config, hf.state_dict())
    ids = np.zeros((1, 4), np.int32)
    fresh = jax.eval_shape(build_model(config).init, jax.random.key(0), ids, ids)["params"]
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
    assert shapes(params) == shapes(nn.unbox(fresh))


def our_logits(config, params, args, kwargs) -> np.ndarray:
    """Our model's output on HF's inputs (`args`, `kwargs`: NumPy arrays, which jit takes as
    they are), compiled as one program: op by op, a forward is about 100 small compiles."""
    return np.asarray(jax.jit(lambda params, args, kwargs: build_model(config).apply(
        {"params": params}, *args, **kwargs))(params, tuple(args), kwargs))


def relative_difference(got, expected) -> float:
    return float(np.abs(got - expected).max() / max(1.0, np.abs(expected).max()))


@pytest.mark.slow
@pytest.mark.parametrize("prefixed", [False, True])
def test_a_bert_base_model_without_a_head_imports_with_old_buffers(prefixed):
    """BertModel (every sentence-transformers checkpoint) as saved, with the position_ids buffer
    older transformers versions wrote: its encoder equals HF's last_hidden_state, and the
    pooler comes along for a classifier."""
    torch.manual_seed(0)
    hf, hf_inputs, (ids,), kwargs, valid = bert()
    base = randomized(transformers.BertModel(hf.config))
    state = {("bert." if prefixed else "") + k: v for k, v in base.state_dict().items()}
    state[("bert." if prefixed else "") + "embeddings.position_ids"] = torch.arange(64)[None]
    with torch.no_grad():
        expected = base(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).last_hidden_state
    config, params = convert.from_hf(hf.config, state)
    assert "pooler" in params and not any(k.startswith("mlm") for k in params)
    model = build_model(config)  # (head "mlm": fresh head params, as init_from would add)
    fresh = nn.unbox(jax.jit(model.init)(jax.random.key(0), ids)["params"])
    merged = {**fresh, **{k: v for k, v in params.items() if k in fresh}}
    encode = jax.jit(lambda params, ids, kwargs: model.apply(
        {"params": params}, ids, method="encode", **kwargs))
    got = encode(merged, ids, kwargs)
    assert relative_difference(np.asarray(got)[valid], expected.numpy()[valid]) <= 1e-4


@pytest.mark.slow
def test_gpt2_llama_and_t5_base_models_without_a_head_import():
    torch.manual_seed(0)
    hf, _, (ids,), _, _ = gpt2()
    base = randomized(transformers.GPT2Model(hf.config))
    state = dict(base.state_dict())  # keys without "transformer."
    config, params = convert.from_hf(hf.config, state)
    with torch.no_grad():
        hidden = base(input_ids=torch.tensor(ids)).last_hidden_state
    expected = (hidden @ base.wte.weight.T).detach().numpy()  # the tied head of GPT2LMHeadModel
    got = np.asarray(jax.jit(build_model(config).apply)({"params": params}, ids))
    assert relative_difference(got, expected) <= 1e-4
    hf, *_ = llama()
    config, params = convert.from_hf(hf.config, dict(transformers.LlamaModel(
        hf.config).state_dict()))
    assert set(params) == {"embed", "decoder"}  # init_from starts the untied head fresh
    # T5Model: no lm_head; T5 v1.0's head is the shared embedding behind d_model^-0.5.
    hf, hf_inputs, args, kwargs, _ = t5()
    base = randomized(transformers.T5Model(hf.config))
    config, params = convert.from_hf(hf.config, base.state_dict())
    with torch.no_grad():
        hidden = base(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).last_hidden_state
    expected = (hidden * hf.config.d_model ** -0.5 @ base.shared.weight.T).detach().numpy()
    got = our_logits(config, params, args, kwargs)
    assert relative_difference(got, expected) <= 1e-4


@pytest.mark.parametrize("change,match", [
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope scaling type 'dynamic': expected 'default', 'linear', 'llama3' or 'yarn'"),
    (dict(attention_bias=True), "Llama attention_bias=True: expected False"),
    (dict(mlp_bias=True), "Llama mlp_bias=True: expected False"),
    (dict(hidden_act="gelu"), "Llama hidden_act='gelu': expected 'silu'"),
])
def test_llama_settings_the_model_cannot_represent_are_refused(change, match):
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16,
                                      num_attention_heads=2, intermediate_size=24,
                                      vocab_size=VOCAB, **change)
    with pytest.raises(ValueError, match=match):
        convert.from_hf(config, {})


MIXED = ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("kind,change,match", [
    ("Qwen3", dict(attention_bias=True), "Qwen3 attention_bias=True: expected False"),
    ("Qwen3", dict(hidden_act="gelu"), "Qwen3 hidden_act='gelu': expected 'silu'"),
    ("Qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
     r"Qwen3 layer_types=\['full_attention', 'sliding_attention'\] with sliding_window=4: "
     "expected a window and 'full_attention' exactly at layers P-1, 2P-1"),
    ("Gemma2", dict(hidden_activation="silu"),
     "Gemma2 hidden_activation='silu': expected 'gelu_pytorch_tanh' or 'gelu_new'"),
    ("Gemma2", dict(attention_bias=True), "Gemma2 attention_bias=True: expected False"),
    ("Gemma2", dict(use_bidirectional_attention=True),
     "Gemma2 use_bidirectional_attention=True: expected False or None"),
    ("Gemma2", dict(layer_types=MIXED), r"Gemma2 layer_types=\['full_attention', "),
    ("Gemma2", dict(sliding_window=None), "Gemma2 layer_types=.* with sliding_window=None"),
    ("Gemma2", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope scaling type 'dynamic': expected 'default', 'linear', 'llama3' or 'yarn'"),
    ("Olmo2", dict(attention_bias=True), "Olmo2 attention_bias=True: expected False"),
    ("Olmo2", dict(hidden_act="relu"), "Olmo2 hidden_act='relu': expected 'silu'"),
])
def test_qwen3_gemma2_olmo2_settings_the_model_cannot_represent_are_refused(kind, change,
                                                                          match):
    config = getattr(transformers, f"{kind}Config")(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=24,
        vocab_size=VOCAB, head_dim=8, **change)
    with pytest.raises(ValueError, match=match) as error:
        convert.from_hf(config, {})
    assert "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt2", "llama_gqa", "mistral_window_4", "qwen2_qkv_bias",
                                  "qwen3_tied_qk_norm", "gemma2_window_softcaps",
                                  "olmo2_untied", "olmo3_window_4", "gemma3_local_rope",
                                  *MOE_CASES])
def test_kv_cache_greedy_decoding_matches_hf_generate(case):
    """12 new tokens after a 5-token prompt: the windows of mistral_window_4 and Gemma 2's
    sliding layers slide past the prompt, so the decode-time window mask is exercised as well
    as the training one."""
    from transformer import generate

    torch.manual_seed(0)
    hf = randomized(CASES[case]()[0])
    prompt = tokens(7, (1, 5))
    with torch.no_grad():
        expected = hf.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False,
                               min_new_tokens=12, attention_mask=torch.ones(1, 5, dtype=int),
                               pad_token_id=0).numpy()[0, 5:]
    config, params = convert.from_hf(hf.config, hf.state_dict())
    got, _ = generate.decode(build_model(config), params, prompt, max_new_tokens=12, eos_id=None)
    np.testing.assert_array_equal(got[0], expected)


@pytest.mark.parametrize("labels,problem", [(1, None), (1, "regression"),
                                            (3, "multi_label_classification")])
def test_bert_regression_and_multi_label_classifiers_are_refused(labels, problem):
    """transformers trains these with MSE / per-label sigmoids; our classify head is a softmax
    (with one label its loss is always 0), so importing them as one would be silently wrong."""
    config = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=VOCAB, num_labels=labels, problem_type=problem)
    state = transformers.BertForSequenceClassification(config).state_dict()
    with pytest.raises(ValueError, match=f"BERT problem_type={problem!r} with {labels} label"):
        convert.from_hf(config, state)
    config.num_labels, config.problem_type = 2, "single_label_classification"
    convert.from_hf(config, transformers.BertForSequenceClassification(config).state_dict())
    # token classification (NER) and multiple choice hold a `classifier` too: not [CLS]'s
    for cls in (transformers.BertForTokenClassification, transformers.BertForMultipleChoice):
        config.architectures = [cls.__name__]
        with pytest.raises(ValueError, match=f"architectures=.'{cls.__name__}'.: its classifier"):
            convert.from_hf(config, cls(config).state_dict())


@pytest.mark.parametrize("change,match", [
    (dict(scale_attn_by_inverse_layer_idx=True), "GPT-2 scale_attn_by_inverse_layer_idx=True"),
    (dict(reorder_and_upcast_attn=True), "GPT-2 reorder_and_upcast_attn=True"),
    (dict(add_cross_attention=True), "GPT-2 add_cross_attention=True"),
    (dict(embd_pdrop=0.0), "GPT-2 embd_pdrop=0.0 with resid_pdrop=0.1: expected them equal"),
])
def test_gpt2_settings_the_model_cannot_represent_are_refused(change, match):
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, **change)
    with pytest.raises(ValueError, match=match):
        convert.from_hf(config, {})


if __name__ == "__main__":  # the import half of the tolerance table for the issue note
    print(f"{'model':<26} {'float32':>10} {'float64':>10}   (max |logit difference| / "
          "max(1, max |HF logit|), ours vs HF's class)")
    for name in CASES:
        print(f"{name:<26} {max_logit_difference(name, 'float32'):>10.2e} "
              f"{max_logit_difference(name, 'float64'):>10.2e}")



def test_gemma3_local_rope_and_qk_norms_bind():
    """Gemma 3's local RoPE base (vs the full layers'), its q / k norms and its window each
    move HF's logits by far more than the tolerance, so test_logits_match_hf checks them."""
    torch.manual_seed(0)
    hf, hf_inputs, _, _, valid = CASES["gemma3_local_rope"]()
    config, _ = convert.from_hf(hf.config, hf.state_dict())
    assert (config.rope_local_theta, config.rope_theta, config.rope_scale,
            config.sliding_window_pattern, config.qk_norm) == (100.0, 5000.0, 4.0, 2, True)
    hf = randomized(hf)
    run = lambda: hf(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).logits.numpy()[valid]
    with torch.no_grad():
        base = run()
        layer = hf.model.layers[0].self_attn
        saved = layer.q_norm.weight.clone()
        layer.q_norm.weight.zero_()
        assert relative_difference(run(), base) > 1e-2
        layer.q_norm.weight.copy_(saved)
        local = hf.model.rotary_emb
        for name in ("sliding_attention_inv_freq", "sliding_attention_original_inv_freq"):
            if hasattr(local, name):
                getattr(local, name).copy_(getattr(local, name.replace("sliding", "full")))
        assert relative_difference(run(), base) > 1e-2


def test_olmo3_windows_bind():
    """OLMo 3's window (vs one as long as the input) moves HF's logits by far more than the
    tolerance, so test_logits_match_hf checks it; three sliding layers to one full."""
    torch.manual_seed(0)
    hf, hf_inputs, _, _, valid = CASES["olmo3_window_4"]()
    config, _ = convert.from_hf(hf.config, hf.state_dict())
    assert (config.sliding_window, config.sliding_window_pattern) == (4, 4)
    hf = randomized(hf)
    run = lambda: hf(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).logits.numpy()
    with torch.no_grad():
        base = run()
        hf.config.sliding_window = 64
        assert relative_difference(run()[valid], base[valid]) > 1e-2
