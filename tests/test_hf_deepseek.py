"""DeepSeek-V3 from Hugging Face (transformer.hf.convert_deepseek): a small DeepseekV3ForCausalLM
with perturbed random weights (MLA with a low-rank query and YaRN, a dense first layer, then 8
experts in 2 groups with the score-correction bias, a shared expert) gives our logits, scanned
or not, and HF's greedy tokens; each feature binds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformer.generation.programs import decode  # noqa: E402
from transformer.hf import convert  # noqa: E402
from transformer.models import build_model  # noqa: E402

VOCAB = 97
YARN = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=8,
            beta_fast=8.0, beta_slow=1.0, mscale=0.9, mscale_all_dim=0.7)


def deepseek(seed=0, **overrides):
    """A 3-layer DeepSeek-V3 (layer 0 dense), every tensor and the routers' biases perturbed."""
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=32,
        rope_parameters=YARN, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        experts_implementation="eager")
    hf = perturbed(transformers.DeepseekV3ForCausalLM,
                   transformers.DeepseekV3Config(**{**settings, **overrides}), seed=seed)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:  # a buffer, not a parameter
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return hf


def perturbed(model_class, config, scale=0.2, seed=0):
    """`model_class(config)` (eager attention) with every parameter moved by scale x N(0, 1),
    so that a swapped or dropped tensor cannot hide behind a default init."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = model_class(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * scale)
    return hf.eval()


def converted_pair(hf):
    """(hf, our config, our params) of an HF model."""
    return (hf, *convert.from_hf(hf.config, hf.state_dict()))


def inputs():
    ids = np.random.default_rng(6).integers(3, VOCAB, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, 9:] = 0  # right padding in the second row
    return ids, mask


def hf_logits(hf) -> np.ndarray:
    ids, mask = inputs()
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def our_logits(config, params) -> np.ndarray:
    ids, mask = inputs()
    return np.asarray(jax.jit(lambda p, x, s: build_model(config).apply({"params": p}, x,
                                                                        segment_ids=s))(
        params, jnp.asarray(ids), jnp.asarray(mask)))


def difference(got, want) -> float:
    valid = inputs()[1].astype(bool)
    return float(np.abs(got[valid] - want[valid]).max() / max(1.0, np.abs(want[valid]).max()))


@pytest.fixture(scope="module")
def converted():
    return converted_pair(deepseek())


def test_the_config_is_deepseeks(converted):
    _, config, params = converted
    assert (config.attention_kind, config.rope_layout, config.rope_scaling) == (
        "mla", "interleaved", "yarn")
    moe = config.moe
    assert (moe.score, moe.n_group, moe.topk_group, moe.top_k, moe.first_dense_layers,
            moe.num_shared, moe.routed_scaling_factor, moe.balance_bias, moe.capacity_factor) == (
        "sigmoid", 2, 1, 3, 1, 1, 2.5, True, 0.0)
    layers = params["decoder"]
    assert "mlp" in layers["layers_0"] and "moe" in layers["layers_1"]
    assert layers["layers_2"]["moe"]["balance_bias"].shape == (8,)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["low-rank q", "full q"])
def test_logits_equal_transformers(q_lora_rank, converted):
    hf, config, params = converted if q_lora_rank else (None, None, None)
    if hf is None:
        hf = deepseek(seed=1, q_lora_rank=None, rope_interleave=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        config, params = convert.from_hf(hf.config, hf.state_dict())
        assert (config.mla.q_lora_rank, config.rope_layout) == (0, "half")
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4


@pytest.mark.parametrize("hidden_size", [28, 30])
def test_a_width_whose_heads_mla_does_not_use_imports(hidden_size):
    """MLA's heads are sized by its own dims: a hidden_size that 4 heads split into an odd 7,
    or do not divide (30), is a valid DeepSeek-V3, not a RoPE head_dim to refuse."""
    hf = deepseek(seed=2, hidden_size=hidden_size)
    config, params = convert.from_hf(hf.config, hf.state_dict())
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4


def test_scanned_import_gives_the_same_logits(converted):
    """Scanned, the dense first layer and the expert layers stack apart."""
    _, config, params = converted
    scanned = config.copy_and_resolve_references()
    scanned.scan_layers = True
    stacked = convert.scan_params(scanned, params)
    assert stacked["decoder"]["dense_layers"]["mlp"]["wo"].shape[0] == 1
    assert stacked["decoder"]["layers"]["moe"]["wo"].shape[0] == 2
    np.testing.assert_allclose(our_logits(scanned, stacked), our_logits(config, params),
                               atol=1e-5)


def test_each_routing_feature_binds(converted):
    """The bias, the groups and the gate scaling each move HF's logits by far more than the
    tolerance, so the equality above checks them."""
    hf, _, _ = converted
    base = hf_logits(hf)
    gates = [layer.mlp.gate for layer in hf.model.layers[1:]]
    for name, change, undo in [
            ("bias", lambda g: g.e_score_correction_bias.mul_(0), None),
            ("groups", lambda g: setattr(g, "topk_group", 2),
             lambda g: setattr(g, "topk_group", 1)),
            ("scale", lambda g: setattr(g, "routed_scaling_factor", 1.0),
             lambda g: setattr(g, "routed_scaling_factor", 2.5))]:
        saved = [g.e_score_correction_bias.clone() for g in gates]
        with torch.no_grad():
            for g in gates:
                change(g)
        assert difference(hf_logits(hf), base) > 1e-2, name
        with torch.no_grad():
            for g, bias in zip(gates, saved, strict=True):
                g.e_score_correction_bias.copy_(bias)
                if undo:
                    undo(g)
    assert difference(hf_logits(hf), base) == 0.0


def assert_greedy_equals_generate(hf, config, params):
    """Prompts of 6 and 3 tokens decoded together (the shorter padded), 6 new tokens each:
    ours equal transformers' `generate`, prompt by prompt."""
    prompts = [[5, 9, 33, 42, 17, 8], [7, 61, 3]]
    ours, _ = decode(build_model(config), params, prompts, max_new_tokens=6, eos_id=None)
    for prompt, row in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert row.tolist() == want


def test_greedy_decoding_equals_transformers_generate(converted):
    assert_greedy_equals_generate(*converted)


def test_what_the_model_cannot_hold_is_refused_in_one_line():
    hf = deepseek(num_experts_per_tok=1, topk_group=1)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 with norm_topk_prob=True"):
        convert.from_hf(hf.config, hf.state_dict())
    config = deepseek().config
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="deepseek_v3 rope_type='dynamic': expected 'default', "
                                         "'linear' or 'yarn'"):
        convert.from_hf(config, deepseek().state_dict())


def test_no_shared_expert_imports_though_transformers_keeps_an_empty_one():
    """n_shared_experts=0: transformers still builds the shared expert, 0 wide (its tensors
    empty, its output 0); the import has none and gives transformers' logits."""
    hf = deepseek(n_shared_experts=0)
    assert hf.model.layers[1].mlp.shared_experts.gate_proj.weight.numel() == 0
    config, params = convert.from_hf(hf.config, hf.state_dict())
    assert config.moe.num_shared == 0
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4


def test_export_round_trips_and_loads_in_transformers_with_our_logits(converted, tmp_path):
    """The export (experts one tensor each, as the hub's files) imports back to the same params
    bit for bit, and from_pretrained of the written files gives our logits."""
    from safetensors.numpy import save_file

    from transformer.hf import export

    hf, config, params = converted
    hf_config, state = export.to_hf(config, params)
    config_back, params_back = convert.from_hf(hf_config, state)
    flat = lambda tree: {"/".join(map(str, k)): v for k, v in
                         __import__("flax").traverse_util.flatten_dict(tree).items()}
    assert flat(params_back).keys() == flat(params).keys()
    for name, value in flat(params).items():
        np.testing.assert_array_equal(flat(params_back)[name], value, err_msg=name)
    hf_config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    back.config._attn_implementation = "eager"
    assert difference(our_logits(config, params), hf_logits(back)) <= 1e-4


def exported(config, params, directory):
    """(HF config, state, from_pretrained model) of our export of (config, params)."""
    from safetensors.numpy import save_file

    from transformer.hf import export

    hf_config, state = export.to_hf(config, params)
    hf_config.save_pretrained(directory)
    save_file(state, str(directory / "model.safetensors"))
    back = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    back.config._attn_implementation = "eager"
    return hf_config, state, back


def test_a_linear_rope_scale_exports_and_imports_back(converted, tmp_path):
    """rope_scale 4 with linear scaling: HF's rope_type "linear" gives our logits, and the
    import reads the scale back."""
    _, config, params = converted
    linear = config.copy_and_resolve_references()
    linear.rope_scaling, linear.rope_scale = "linear", 4.0
    hf_config, state, back = exported(linear, params, tmp_path)
    assert hf_config.rope_parameters["rope_type"] == "linear"
    want = our_logits(linear, params)
    assert difference(want, our_logits(config, params)) > 1e-2  # the scale matters here
    assert difference(want, hf_logits(back)) <= 1e-4
    config_back, params_back = convert.from_hf(hf_config, state)
    assert (config_back.rope_scaling, config_back.rope_scale) == ("linear", 4.0)
    assert difference(our_logits(config_back, params_back), want) <= 1e-6


def test_top1_routing_exports_without_renormalised_gates(converted, tmp_path):
    """Our top-1 gate is the expert's score (normalize_gates has nothing to renormalise): the
    export sets norm_topk_prob False, so HF gives our logits and the import takes it back."""
    _, config, params = converted
    top1 = config.copy_and_resolve_references()
    top1.moe.top_k = 1
    assert top1.moe.normalize_gates
    hf_config, state, back = exported(top1, params, tmp_path)
    assert not hf_config.norm_topk_prob
    want = our_logits(top1, params)
    assert difference(want, hf_logits(back)) <= 1e-4
    config_back, params_back = convert.from_hf(hf_config, state)
    assert difference(our_logits(config_back, params_back), want) <= 1e-6


def test_a_norm_epsilon_other_than_1e6_is_refused_on_export(converted):
    """transformers' latent norms (q_a, kv_a) keep eps 1e-6 whatever rms_norm_eps says."""
    from transformer.hf import export

    _, config, params = converted
    changed = config.copy_and_resolve_references()
    changed.norm_epsilon = 1e-5
    with pytest.raises(ValueError, match=r"^export to deepseek_v3: model.norm_epsilon=1e-05 has "
                                         r"no Hugging Face DeepSeek-V3 equivalent \(expected "
                                         r"1e-06\)$"):
        export.to_hf(changed, params)


def with_mtp_layer(seed=0):
    """(HF model of 3 layers, its state dict plus one MTP layer as DeepSeek-V3's files hold it:
    layer 3 of a 4-layer twin, enorm / hnorm / eh_proj / shared_head.norm, and copies of the
    embedding and head), and a torch function giving that layer's logits (the reference)."""
    twin = deepseek(seed=seed, num_hidden_layers=4)
    hf = deepseek(seed=seed)
    hf.load_state_dict({k: v for k, v in twin.state_dict().items()
                        if not k.startswith("model.layers.3.")}, strict=False)
    generator = torch.Generator().manual_seed(seed + 1)
    extra = {"enorm.weight": 1 + 0.2 * torch.randn(32, generator=generator),
             "hnorm.weight": 1 + 0.2 * torch.randn(32, generator=generator),
             "eh_proj.weight": 0.2 * torch.randn(32, 64, generator=generator),
             "shared_head.norm.weight": 1 + 0.2 * torch.randn(32, generator=generator),
             "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
             "shared_head.head.weight": hf.lm_head.weight.detach().clone()}
    state = {**hf.state_dict(), **{k: v for k, v in twin.state_dict().items()
                                   if k.startswith("model.layers.3.")},
             **{f"model.layers.3.{k}": v for k, v in extra.items()}}
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def reference(ids):
        """Module 1's logits at each position i, from the LM's final hidden state and the
        embedding of token i + 1 (the last position reads token 0: ignore it)."""
        with torch.no_grad():
            ids = torch.tensor(ids)
            hidden = hf.model(input_ids=ids).last_hidden_state
            ahead = hf.model.embed_tokens(torch.roll(ids, -1, dims=1))
            x = torch.cat([rms(ahead, extra["enorm.weight"]), rms(hidden, extra["hnorm.weight"])],
                          -1) @ extra["eh_proj.weight"].T
            positions = torch.arange(ids.shape[1])[None]
            length = ids.shape[1]
            mask = torch.full((length, length), -torch.inf).triu(1)[None, None]
            x = twin.model.layers[3](x, attention_mask=mask, position_ids=positions,
                                     position_embeddings=hf.model.rotary_emb(x, positions))
            return (rms(x, extra["shared_head.norm.weight"]) @ hf.lm_head.weight.T).numpy()

    return hf, {k: v.detach().numpy() for k, v in state.items()}, reference


@pytest.mark.slow
def test_the_mtp_layer_of_a_hub_checkpoint_imports_and_gives_deepseeks_prediction():
    """transformers drops DeepSeek-V3's MTP layer; we keep it: module 1 on the imported weights
    gives the logits of the layer's own math in torch, the LM's logits stay HF's, the export
    writes the layer back bit for bit, and a head copy that is not the head is refused."""
    from transformer.hf import export

    hf, state, reference = with_mtp_layer()
    config, params = convert.from_hf(hf.config, state)
    assert config.mtp.depth == 1 and set(params["mtp_0"]) == {
        "embedding_norm", "hidden_norm", "projection", "final_norm", "layers_0"}
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4
    ids = np.random.default_rng(3).integers(3, VOCAB, (2, 10))
    model = build_model(config)
    _, sown = model.apply({"params": params}, jnp.asarray(ids), mtp_tokens=jnp.asarray(
        np.roll(ids, -1, axis=1)), mutable=["mtp"])
    got = np.asarray(sown["mtp"]["logits"][0][0])[:, :-1]
    want = reference(ids)[:, :-1]
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    hf_config, out = export.to_hf(config, params)
    assert hf_config.num_nextn_predict_layers == 1
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                 "embed_tokens", "self_attn.kv_b_proj", "mlp.gate"):
        key = f"model.layers.3.{name}.weight"
        np.testing.assert_array_equal(np.asarray(out[key], np.float32), state[key], key)
    flat = lambda tree: {"/".join(map(str, k)): v for k, v in
                         __import__("flax").traverse_util.flatten_dict(tree).items()}
    back = flat(convert.from_hf(hf_config, out)[1])
    assert back.keys() == flat(params).keys()
    for name, value in flat(params).items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    state["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="shared_head.head.weight: expected a copy"):
        convert.from_hf(hf.config, state)


@pytest.mark.parametrize("routing", ["deepseek", "default"])
def test_a_dense_mla_model_is_refused_on_export_for_having_no_experts(converted, routing):
    """DeepSeek-V3 routes to experts after first_k_dense_replace: without experts the export
    wrote n_routed_experts 0 and dense mlp tensors transformers cannot load (DeepSeek's routing
    keys, unused, passed the allowlist), or named the default moe.score instead."""
    from transformer.hf import export
    from transformer.models import default_model_config

    _, config, params = converted
    dense = config.copy_and_resolve_references()
    if routing == "default":
        dense.moe = default_model_config().moe
    dense.moe.num_experts, dense.moe.first_dense_layers = 0, 0
    with pytest.raises(ValueError, match=r"^export to deepseek_v3: model.moe.num_experts=0 has "
                                         r"no Hugging Face DeepSeek-V3 equivalent \(expected >= "
                                         r"1: DeepSeek-V3's layers after first_k_dense_replace "
                                         r"route to experts\)$"):
        export.to_hf(dense, params)


def test_the_export_names_no_token_ids_of_its_class(converted):
    """DeepseekV3Config's default ids are no ids of our vocabulary: none are written (the CLI
    sets the run's tokenizer's)."""
    from transformer.hf import export

    _, config, params = converted
    hf_config, _ = export.to_hf(config, params)
    assert (hf_config.bos_token_id, hf_config.eos_token_id, hf_config.pad_token_id) == (
        None, None, None)
