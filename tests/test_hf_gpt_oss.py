"""gpt-oss from Hugging Face (transformer.hf.convert_gpt_oss): a small GptOssForCausalLM with
perturbed random weights (sinks, biases, alternating 4-token windows and full layers, YaRN,
experts with biases and the clamped SwiGLU) gives our logits, scanned or not, and HF's greedy
tokens; each feature binds."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_deepseek import (  # noqa: E402
    assert_greedy_equals_generate,
    converted_pair,
    difference,
    hf_logits,
    our_logits,
    perturbed,
)

from transformer.hf import convert  # noqa: E402

VOCAB = 97
YARN = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=8,
            beta_fast=8.0, beta_slow=1.0, truncate=False)


def gpt_oss(**overrides):
    """4 layers (sliding, full, sliding, full; a window of 4 < 12 tokens), 4 query heads over
    2 KV heads, 8 experts top-2 with every tensor perturbed (the sinks too)."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32,
                    sliding_window=4, rope_parameters=YARN, swiglu_limit=1.5, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, experts_implementation="eager")
    return perturbed(transformers.GptOssForCausalLM,
                     transformers.GptOssConfig(**{**settings, **overrides}), scale=0.3)


@pytest.fixture(scope="module")
def converted():
    return converted_pair(gpt_oss())


def test_the_config_is_gpt_oss(converted):
    _, config, params = converted
    assert (config.attention_sinks, config.sliding_window, config.sliding_window_pattern,
            config.rope_scaling, config.rope_yarn_truncate, config.use_bias) == (
        True, 4, 2, "yarn", False, True)
    assert (config.moe.use_bias, config.moe.swiglu_limit, config.moe.num_experts,
            config.moe.top_k) == (True, 1.5, 8, 2)
    assert params["decoder"]["layers_0"]["moe"]["wo_bias"].shape == (8, 32)


def test_logits_equal_transformers(converted):
    hf, config, params = converted
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4


def test_scanned_import_gives_the_same_logits(converted):
    _, config, params = converted
    scanned = config.copy_and_resolve_references()
    scanned.scan_layers = True
    stacked = convert.scan_params(scanned, params)
    assert sorted(stacked["decoder"]["layers"]) == ["block_0", "block_1"]  # sliding, full
    np.testing.assert_allclose(our_logits(scanned, stacked), our_logits(config, params),
                               atol=1e-5)


def test_each_feature_binds(converted):
    """Sinks, the clamp, the window and the experts' biases each move HF's logits by far more
    than the tolerance, so the equality above checks them."""
    hf, _, _ = converted
    base = hf_logits(hf)
    layers = hf.model.layers
    changes = {
        "sinks": [(layer.self_attn.sinks, 0.0) for layer in layers],
        "expert biases": [(layer.mlp.experts.down_proj_bias, 0.0) for layer in layers],
        "router bias": [(layer.mlp.router.bias, 0.0) for layer in layers]}
    for name, tensors in changes.items():
        saved = [t.clone() for t, _ in tensors]
        with torch.no_grad():
            for t, value in tensors:
                t.fill_(value)
        assert difference(hf_logits(hf), base) > 1e-2, name
        with torch.no_grad():
            for (t, _), old in zip(tensors, saved, strict=True):
                t.copy_(old)
    for name, owner, attr, value in [("clamp", layers[0].mlp.experts, "limit", 100.0),
                                     ("window", hf.config, "sliding_window", 64)]:
        old = getattr(owner, attr)
        setattr(owner, attr, value)
        assert difference(hf_logits(hf), base) > 1e-2, name
        setattr(owner, attr, old)
    assert difference(hf_logits(hf), base) == 0.0


def test_greedy_decoding_equals_transformers_generate(converted):
    assert_greedy_equals_generate(*converted)


def test_what_the_model_cannot_hold_is_refused_in_one_line():
    for overrides, message in [
            (dict(num_experts_per_tok=1), "gpt_oss num_experts_per_tok=1: expected >= 2"),
            (dict(attention_bias=False), "gpt_oss attention_bias=False: expected True")]:
        hf = gpt_oss(**overrides)
        with pytest.raises(ValueError, match=message):
            convert.from_hf(hf.config, hf.state_dict())
    config = gpt_oss().config
    config.swiglu_alpha = 1.0
    with pytest.raises(ValueError, match="gpt_oss swiglu_alpha=1.0: expected 1.702"):
        convert.from_hf(config, gpt_oss().state_dict())




def save_mxfp4(hf, directory):
    """`hf` saved as gpt-oss's hub files keep it: each expert tensor as MXFP4 blocks and scales
    (every 32 values along a row: a power-of-two scale with the largest at most 8 times it,
    each value its nearest FP4), the rest in float32, and config.json's quantization_config."""
    from safetensors.numpy import save_file

    from transformer.hf.quantized import FP4_E2M1

    tensors = {}
    for name, tensor in hf.state_dict().items():
        value = tensor.detach().numpy()
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = value
            continue
        rows = np.swapaxes(value, -1, -2)  # [E, out, in]: transformers quantizes along `in`
        groups = rows.reshape(*rows.shape[:-1], -1, 32)
        exponent = np.floor(np.log2(np.abs(groups).max(-1))).astype(np.int32) - 2
        scaled = groups / np.ldexp(1.0, exponent)[..., None]
        codes = np.abs(scaled[..., None] - FP4_E2M1).argmin(-1).astype(np.uint8)
        tensors[name + "_blocks"] = np.ascontiguousarray(codes[..., 0::2] | codes[..., 1::2] << 4)
        tensors[name + "_scales"] = (exponent + 127).astype(np.uint8)
    hf.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_an_mxfp4_checkpoint_imports_as_transformers_dequantizes_it(tmp_path):
    """gpt-oss as the hub keeps it (experts in MXFP4) imports with the logits of transformers'
    own dequantized load; the rounding moved them far beyond the tolerance, so the blocks were
    read, each nibble and scale in its place."""
    from flax import traverse_util

    from transformer.training import finetune

    hf = gpt_oss(intermediate_size=32)  # MXFP4 groups 32 values: D and F multiples of 32
    directory = save_mxfp4(hf, tmp_path / "gpt-oss")
    want = transformers.GptOssForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    _, config, flat = finetune.hf_convert(str(directory))
    params = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})
    got = our_logits(config, params)
    assert difference(got, hf_logits(want)) <= 1e-4
    assert difference(got, hf_logits(hf)) > 1e-2


def test_export_inverts_the_import_bit_for_bit_and_loads_in_transformers(converted, tmp_path):
    from transformer.hf import export

    hf, config, params = converted
    hf_config, state = export.to_hf(config, params)
    assert type(hf_config).__name__ == "GptOssConfig"
    want = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert sorted(state) == sorted(want)
    for name, value in state.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    back = transformers.GptOssForCausalLM(hf_config)
    back.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    back.config._attn_implementation = "eager"
    assert difference(our_logits(config, params), hf_logits(back.eval())) <= 1e-4


def test_plain_swiglu_experts_are_refused_on_export(converted):
    """moe.swiglu_limit 0 is plain SwiGLU experts; HF's gpt-oss experts always clamp (and use
    up + 1), so such a model has no gpt-oss equivalent."""
    from transformer.hf import export

    _, config, params = converted
    changed = config.copy_and_resolve_references()
    changed.moe.swiglu_limit = 0.0
    with pytest.raises(ValueError, match=r"^export to gpt_oss: model.moe.swiglu_limit=0.0 has "
                                         r"no Hugging Face gpt-oss equivalent \(expected > 0"):
        export.to_hf(changed, params)


def test_a_linear_rope_imports_with_transformers_logits():
    """rope_type "linear" (which our export writes for rope_scale != 1 without YaRN) imports
    as linear scaling, to HF's logits."""
    hf = gpt_oss(rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0})
    config, params = convert.from_hf(hf.config, hf.state_dict())
    assert (config.rope_scaling, config.rope_scale) == ("linear", 4.0)
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4
