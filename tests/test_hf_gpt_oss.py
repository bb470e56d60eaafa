"""gpt-oss from Hugging Face (transformer.hf.convert_gpt_oss): a small GptOssForCausalLM with
perturbed random weights (sinks, biases, alternating 4-token windows and full layers, YaRN,
experts with biases and the clamped SwiGLU) gives our logits, scanned or not, and HF's greedy
tokens; each feature binds."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_deepseek import difference, hf_logits, our_logits  # noqa: E402

from transformer.generation.programs import decode  # noqa: E402
from transformer.hf import convert  # noqa: E402
from transformer.models import build_model  # noqa: E402

VOCAB = 97
YARN = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=8,
            beta_fast=8.0, beta_slow=1.0, truncate=False)


def gpt_oss(seed=0, **overrides):
    """4 layers (sliding, full, sliding, full; a window of 4 < 12 tokens), 4 query heads over
    2 KV heads, 8 experts top-2 with every tensor perturbed (the sinks too)."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32,
                    sliding_window=4, rope_parameters=YARN, swiglu_limit=1.5, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0, experts_implementation="eager")
    config = transformers.GptOssConfig(**{**settings, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return hf.eval()


@pytest.fixture(scope="module")
def converted():
    hf = gpt_oss()
    config, params = convert.from_hf(hf.config, hf.state_dict())
    return hf, config, params


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
    hf, config, params = converted
    prompts = [[5, 9, 33, 42, 17, 8], [7, 61, 3]]
    ours, _ = decode(build_model(config), params, prompts, max_new_tokens=6, eos_id=None)
    for prompt, row in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert row.tolist() == want


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



@pytest.mark.slow
def test_a_short_fine_tune_through_the_cli_with_no_model_flags(tmp_path):
    import json

    from test_train import assert_succeeded, run_cli, tiny_flags

    directory = tmp_path / "gpt_oss"
    gpt_oss(vocab_size=263).save_pretrained(directory)
    result = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                     f"--config.init_from=hf:{directory}", "--config.data.tokenizer=byte",
                     "--config.data.num_sentinels=0", f"--workdir={tmp_path / 'run'}",
                     *[f for f in tiny_flags(2) if not f.startswith("--config.model.")],
                     logs=tmp_path)
    assert_succeeded(result)
    line = next(x for x in result.stdout.splitlines() if x.startswith("init_from"))
    assert line.endswith("new 0; dropped 0"), line
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert np.isfinite([r["loss"] for r in records if r.get("split") == "train"]).all()


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
