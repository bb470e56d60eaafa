"""Qwen3-Next from Hugging Face (transformer.hf.convert_qwen3_next): a small
Qwen3NextForCausalLM with perturbed random weights (three Gated DeltaNet layers to one gated
full-attention layer with partial RoPE, experts with a gated shared expert) gives our logits,
scanned or not, and HF's greedy tokens; the attention gate and the partial RoPE bind."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_deepseek import (  # noqa: E402
    assert_greedy_equals_generate,
    converted_pair,
    difference,
    exported,
    hf_logits,
    our_logits,
    perturbed,
)

from transformer.hf import convert  # noqa: E402

VOCAB = 97


def qwen3_next(**overrides):
    return perturbed(transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, experts_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                         "partial_rotary_factor": 0.5}), **overrides}))


@pytest.fixture(scope="module")
def converted():
    return converted_pair(qwen3_next())


def test_the_config_is_qwen3_nexts(converted):
    _, config, params = converted
    assert (config.layer_types, config.attention_gate, config.rope_fraction,
            config.moe.num_shared, config.moe.shared_gate) == (
        "linear_attention,linear_attention,linear_attention,full_attention", "element", 0.5, 1,
        True)
    assert "linear_attention" in params["decoder"]["layers_0"]
    assert "gate" in params["decoder"]["layers_3"]["self_attention"]


def test_logits_equal_transformers(converted):
    """Measured 6e-5 relative: HF's delta rule and norms run in float32 (its float64 model
    too), as ours does here."""
    hf, config, params = converted
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4


def test_scanned_import_gives_the_same_logits(converted):
    _, config, params = converted
    scanned = config.copy_and_resolve_references()
    scanned.scan_layers = True
    np.testing.assert_allclose(our_logits(scanned, convert.scan_params(scanned, params)),
                               our_logits(config, params), atol=2e-5)


def test_the_gate_and_the_partial_rope_bind(converted):
    """Each moves our logits by far more than the tolerance, so the equality above checks
    them (the gate: its kernel zeroed, sigmoid 1/2 everywhere; RoPE: all dims rotating)."""
    _, config, params = converted
    base = our_logits(config, params)
    full_rope = config.copy_and_resolve_references()
    full_rope.rope_fraction = 1.0
    assert difference(our_logits(full_rope, params), base) > 1e-2
    attention = params["decoder"]["layers_3"]["self_attention"]
    ungated = {**params, "decoder": {**params["decoder"], "layers_3": {
        **params["decoder"]["layers_3"],
        "self_attention": {**attention, "gate": 0 * attention["gate"]}}}}
    assert difference(our_logits(config, ungated), base) > 1e-2


@pytest.mark.slow
def test_greedy_decoding_equals_transformers_generate(converted):
    assert_greedy_equals_generate(*converted)


def test_export_round_trips_and_loads_in_transformers_with_our_logits(converted, tmp_path):
    """The export (experts one tensor each, as the hub's files) imports back to the same params
    bit for bit, and from_pretrained of the written files gives our logits."""
    from flax import traverse_util
    from safetensors.numpy import save_file

    from transformer.hf import export

    hf, config, params = converted
    hf_config, state = export.to_hf(config, params)
    _, params_back = convert.from_hf(hf_config, state)
    flat, back = traverse_util.flatten_dict(params), traverse_util.flatten_dict(params_back)
    assert flat.keys() == back.keys()
    for name, value in flat.items():
        np.testing.assert_array_equal(back[name], value, err_msg=str(name))
    hf_config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    loaded.config._attn_implementation = "eager"
    assert difference(our_logits(config, params), hf_logits(loaded)) <= 1e-4


def test_top1_routing_exports_without_renormalised_gates(converted, tmp_path):
    """Our top-1 gate is the router probability (normalize_gates has nothing to renormalise):
    the export sets norm_topk_prob False, so HF gives our logits and the import takes it back."""
    _, config, params = converted
    top1 = config.copy_and_resolve_references()
    top1.moe.top_k = 1
    assert top1.moe.normalize_gates
    hf_config, state, loaded = exported(top1, params, tmp_path)
    assert not hf_config.norm_topk_prob
    want = our_logits(top1, params)
    assert difference(want, hf_logits(loaded)) <= 1e-4
    config_back, params_back = convert.from_hf(hf_config, state)
    assert difference(our_logits(config_back, params_back), want) <= 1e-6


@pytest.mark.parametrize("routing", ["qwen3_next", "default"])
def test_a_model_without_experts_is_refused_on_export_for_that(converted, routing):
    """Without experts the refusal names moe.num_experts, not a routing key (moe.shared_gate at
    its default) that such a model does not use."""
    from transformer.hf import export
    from transformer.models import default_model_config

    _, config, params = converted
    dense = config.copy_and_resolve_references()
    if routing == "default":
        dense.moe = default_model_config().moe
    dense.moe.num_experts = 0
    with pytest.raises(ValueError, match=r"^export to qwen3_next: model.moe.num_experts=0 has no "
                                         r"Hugging Face Qwen3-Next equivalent \(expected >= 1: "
                                         r"Qwen3-Next's layers route to experts\)$"):
        export.to_hf(dense, params)

