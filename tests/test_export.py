"""Export to Hugging Face (transformer.export; the mapping in transformer.hf.export): to_hf
inverts convert.from_hf exactly, an exported workdir loads with AutoModel*.from_pretrained and
gives our logits and greedy tokens, and every model setting an exporter does not map is
refused before anything is written."""

import re

import flax.linen as nn
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers_hf = pytest.importorskip("tokenizers")

from test_hf_equivalence import (  # noqa: E402
    CASES,
    MOE_CASES,
    our_logits,
    randomized,
    relative_difference,
    tokens,
)
from test_train import TINY_MODEL, assert_succeeded, cli_env, run_cli, tiny_flags  # noqa: E402

from transformer import export as export_cli  # noqa: E402
from transformer import generate  # noqa: E402
from transformer.data import tokenizers  # noqa: E402
from transformer.generation import text  # noqa: E402
from transformer.hf import convert, export  # noqa: E402
from transformer.models import build_model, default_model_config  # noqa: E402

EXPORTABLE = ["gpt2", "gpt2_untied", "gpt2_unscaled_attention", "llama_gqa",
              "llama_tied_linear_rope", "llama_mqa_head_dim_16", "llama_rope_llama3",
              "mistral_window_4", "qwen2_qkv_bias", "qwen3_tied_qk_norm",
              "gemma2_window_softcaps", "olmo2_untied", "bert_mlm", "bert_classifier", "t5_v1_0",
              "t5_v1_1", "mixtral_top2", "qwen2_moe_shared_gate", "qwen3_moe_sparse_step_2",
              "qwen3_moe_window_4", "olmo3_window_4", "gemma3_local_rope"]
# Gemma's norms hold weight w as our scale 1 + w in float32: w comes back as (1 + w) - 1, within
# half a float32 ulp of 1 (and our scale s exactly only for s in [0.5, 2], where s - 1 is exact).
GEMMA_NORM_ATOL = 2.0 ** -24


def tolerance(case: str, key: str) -> float:
    return GEMMA_NORM_ATOL if case.startswith("gemma") and "norm" in key else 0.0


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = np.asarray(value)
    return out


def assert_imports_back(hf, params) -> None:
    """Importing the loaded export gives back exactly `params`, every key."""
    _, imported = convert.from_hf(hf.config, hf.state_dict())
    expected = flat(jax.tree.map(np.asarray, dict(params)))
    assert flat(imported).keys() == expected.keys()
    assert all(np.array_equal(v, expected[k]) for k, v in flat(imported).items())


@pytest.mark.parametrize("case", EXPORTABLE)
def test_to_hf_inverts_from_hf_bit_for_bit(case, tmp_path):
    torch.manual_seed(0)
    hf = randomized(CASES[case]()[0])
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    if case in MOE_CASES:  # experts one by one, as save_pretrained (and the export) writes them
        from safetensors.numpy import load_file

        hf.save_pretrained(tmp_path)
        state = load_file(tmp_path / "model.safetensors")
    config, params = convert.from_hf(hf.config, state)
    hf_config, exported = export.to_hf(config, params)
    assert type(hf_config) is type(hf.config)
    assert case not in MOE_CASES or exported.keys() == state.keys()
    for key, value in exported.items():  # every tensor written is HF's own, exactly
        np.testing.assert_allclose(value, state[key], rtol=0, atol=tolerance(case, key),
                                   err_msg=key)
    again_config, again = convert.from_hf(hf_config, exported)
    assert again_config.to_dict() == config.to_dict()
    expected = flat(params)
    assert flat(again).keys() == expected.keys()
    for key, value in flat(again).items():
        np.testing.assert_allclose(value, expected[key], rtol=0, atol=tolerance(case, key),
                                   err_msg=key)


def test_scanned_params_export_as_the_unrolled_ones():
    torch.manual_seed(0)
    hf = randomized(CASES["llama_gqa"]()[0])
    config, params = convert.from_hf(hf.config, hf.state_dict())
    _, unrolled = export.to_hf(config, params)
    config.scan_layers = True
    _, scanned = export.to_hf(config, convert.scan_params(config, params))
    assert scanned.keys() == unrolled.keys()
    assert all(np.array_equal(scanned[k], unrolled[k]) for k in unrolled)


@pytest.mark.parametrize("case", ["gpt2", "llama_gqa", "gemma3_local_rope", "mixtral_top2"])
def test_a_causal_lm_export_names_no_token_ids_of_its_class(case):
    """A transformers config class's default ids (GPT-2's 50256, Llama's bos 1 / eos 2) are
    not our vocabulary's: to_hf names none, and transformer.export sets the tokenizer's."""
    torch.manual_seed(0)
    hf = randomized(CASES[case]()[0])
    config, params = convert.from_hf(hf.config, hf.state_dict())
    hf_config, _ = export.to_hf(config, params)
    assert (hf_config.bos_token_id, hf_config.eos_token_id, hf_config.pad_token_id) == (
        None, None, None)


ROPE = dict(position="rope", norm="rmsnorm", activation="swiglu", use_bias=False)


@pytest.mark.parametrize("overrides,match", [
    (dict(position="alibi"), "model.position='alibi': the GPT export needs 'learned'"),
    (dict(position="learned", norm_placement="post"),
     "export to gpt2: model.norm_placement='post' has no Hugging Face GPT-2 equivalent"),
    (dict(position="rope", norm="layernorm", activation="swiglu", use_bias=False),
     "export to llama: model.norm='layernorm' has no Hugging Face Llama equivalent"),
    (dict(position="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
          qkv_bias=True, sliding_window=8), "no Hugging Face class has both"),
    (dict(ROPE, qk_norm=True, qk_norm_scope="projection"),
     "export to qwen3: model.qk_norm_scope='projection' has no Hugging Face Qwen3 equivalent"),
    (dict(ROPE, qk_norm=True, attention_softcap=5.0),
     "export to qwen3: model.attention_softcap=5.0 has no Hugging Face Qwen3 equivalent"),
    (dict(ROPE, qk_norm=True, attention_gate="element"),
     "export to qwen3: model.attention_gate='element' has no Hugging Face Qwen3 equivalent"),
    (dict(ROPE, norm_placement="sandwich"), "export to gemma2: model.activation='swiglu' has no "
     "Hugging Face Gemma 2 equivalent"),
    (dict(ROPE, norm_placement="sandwich", activation="geglu", scale_embeddings=True,
          attention_scale=0.3), "model.attention_scale=0.3 has no Hugging Face Gemma 2 "
     "equivalent .expected 1 / sqrt"),
    (dict(ROPE, norm_placement="post_sublayer"), "export to olmo2: model.qk_norm=False has no "
     "Hugging Face OLMo 2 equivalent .expected True"),
    (dict(ROPE, norm_placement="post_sublayer", qk_norm=True, qk_norm_scope="head",
          sliding_window=4), "export to olmo3: model.qk_norm_scope='head' has no Hugging Face "
     "OLMo 3 equivalent"),
    (dict(ROPE, norm_placement="sandwich", activation="geglu", scale_embeddings=True,
          qk_norm=True, attention_softcap=5.0), "export to gemma3_text: model.attention_softcap"
     "=5.0 has no Hugging Face Gemma 3 equivalent"),
    (dict(ROPE, final_logit_softcap=30.0),
     "export to llama: model.final_logit_softcap=30.0 has no Hugging Face Llama equivalent"),
    (dict(ROPE, parallel_block=True), "model.parallel_block=True has no Hugging Face Llama "
     "equivalent .expected the default False"),
    (dict(ROPE, sliding_window=4, sliding_window_pattern=2),
     "export to mistral: model.sliding_window_pattern=2 has no Hugging Face Mistral equivalent"),
    (dict(position="learned", qk_norm=True), "model.qk_norm=True has no Hugging Face GPT-2 "
     "equivalent .expected the default False"),
    (dict(ROPE, attention_sinks=True), "^export to llama: model.attention_sinks=True has no "
     "Hugging Face Llama equivalent .expected the default False.$"),
    (dict(family="lstm"), "model.family='lstm': expected 'gpt', 'bert' or 't5'"),
    (dict(family="t5", position="t5", norm="rmsnorm", use_bias=False, attention_scale=1.0,
          activation="relu", tie_embeddings=False), "export to t5: model.tie_embeddings=False "
     "has no Hugging Face T5 equivalent .expected True: transformers 5's"),
    (dict(head="classify", num_classes=2), "a GPT classifier is not exported"),
    (dict(ROPE, moe=dict(num_experts=4, normalize_gates=False)),
     "export to mixtral: model.moe.normalize_gates=False has no Hugging Face Mixtral equivalent"),
    (dict(ROPE, moe=dict(num_experts=4, top_k=1)),
     "model.moe.top_k=1 has no Hugging Face Mixtral equivalent .expected >= 2"),
    (dict(ROPE, moe=dict(num_experts=4, d_ff=16)),
     "model.moe.d_ff=16 has no Hugging Face Mixtral equivalent .expected 0 or 64"),
    (dict(ROPE, qkv_bias=True, moe=dict(num_experts=4)),
     "export to qwen2_moe: model.moe.shared_gate=False has no Hugging Face Qwen2-MoE equivalent"),
    (dict(ROPE, qk_norm=True, moe=dict(num_experts=4, num_shared=1)),
     "export to qwen3_moe: model.moe.num_shared=1 has no Hugging Face Qwen3-MoE equivalent"),
    (dict(position="learned", moe=dict(num_experts=4)),
     "a mixture of experts is not exported but as a RoPE GPT"),
    # transformers reads YaRN's truncate off the top level of a per-layer-type rope_parameters
    (dict(ROPE, norm_placement="post_sublayer", qk_norm=True, qk_norm_scope="projection",
          sliding_window=4, rope_scaling="yarn", rope_scale=4.0, rope_yarn_truncate=False),
     r"^export to olmo3: model.rope_yarn_truncate=False has no Hugging Face OLMo 3 equivalent "
     r"\(expected True: its RoPE is per layer type, and transformers then always truncates\)$"),
    (dict(ROPE, norm_placement="sandwich", activation="geglu", scale_embeddings=True,
          qk_norm=True, rope_scaling="yarn", rope_scale=4.0, rope_yarn_truncate=False),
     "^export to gemma3_text: model.rope_yarn_truncate=False has no Hugging Face Gemma 3"),
])
def test_architectures_without_a_hugging_face_class_are_refused(overrides, match):
    config = default_model_config()
    config.update(**TINY_MODEL, **overrides)
    with pytest.raises(ValueError, match=match) as error:
        export.to_hf(config, {})
    assert "\n" not in str(error.value)


# YaRN on a Llama-like model (Qwen's long-context setting): 4 x an original context of 16 in 64
# positions; heads of 16 at base 100 put RoPE pairs on both sides of YaRN's ramp and one in it,
# so each setting below moves transformers' logits (test_hf_config_fields' YARN_CASES).
YARN = dict(ROPE, num_layers=2, head_dim=16, max_len=64, rope_theta=100.0, rope_scaling="yarn",
            rope_scale=4.0, rope_original_max_len=16)
YARN_EXPORTS = {
    "qwen3": ("Qwen3ForCausalLM", dict(qk_norm=True)),
    "llama": ("LlamaForCausalLM", {}),
    "qwen3_betas_untruncated": ("Qwen3ForCausalLM", dict(
        qk_norm=True, rope_yarn_beta_fast=2.0, rope_yarn_beta_slow=0.25,
        rope_yarn_truncate=False)),
    "llama_mscales": ("LlamaForCausalLM", dict(rope_yarn_mscale=0.9,
                                               rope_yarn_mscale_all_dim=0.7)),
    # RoPE written per layer type (and the local layers' plain)
    "olmo3_mscales": ("Olmo3ForCausalLM", dict(
        norm_placement="post_sublayer", qk_norm=True, qk_norm_scope="projection",
        sliding_window=4, sliding_window_pattern=2, rope_yarn_mscale=0.9,
        rope_yarn_mscale_all_dim=0.7)),
    "gemma3_local_rope": ("Gemma3ForCausalLM", dict(
        norm_placement="sandwich", activation="geglu", scale_embeddings=True, qk_norm=True,
        sliding_window=4, sliding_window_pattern=2, rope_local_theta=50.0)),
}


def export_perturbed(config, ids, directory):
    """(model, params, exported state dict) of `config` initialised on `ids` plus N(0, 0.2)
    noise (norm scales away from 1 as well), exported into `directory` as save_pretrained."""
    from safetensors.numpy import save_file

    model = build_model(config)
    params = jax.tree.map(np.asarray, nn.unbox(model.init(jax.random.PRNGKey(0), ids)["params"]))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: p + rng.normal(0, 0.2, p.shape).astype(np.float32), params)
    hf_config, state = export.to_hf(config, params)
    hf_config.save_pretrained(directory)
    save_file(state, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return model, params, state


@pytest.mark.parametrize("case", list(YARN_EXPORTS))
def test_a_llama_like_yarn_model_exports_with_our_logits_and_imports_back_alike(case, tmp_path):
    """The HF class loaded from the export gives our logits on 50 tokens, past the original
    context, and importing the export gives back our config."""
    architecture, overrides = YARN_EXPORTS[case]
    config = default_model_config()
    config.update(**{**TINY_MODEL, **YARN, **overrides, "vocab_size": 101})
    ids = tokens(13, (2, 50))
    model, params, state = export_perturbed(config, ids, tmp_path)
    hf = getattr(transformers, architecture).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids)).logits.numpy()
    assert relative_difference(np.asarray(model.apply({"params": params}, ids)), expected) <= 1e-5
    again, _ = convert.from_hf(hf.config, state)
    assert {k: again[k] for k in config if k.startswith("rope")} == {
        k: config[k] for k in config if k.startswith("rope")}


TITLES = {"gpt2": "GPT-2", "bert": "BERT", "t5": "T5", "llama": "Llama", "mistral": "Mistral",
          "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma 2", "olmo2": "OLMo 2",
          "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE",
          "olmo3": "OLMo 3", "gemma3_text": "Gemma 3"}


def with_new_model_keys(monkeypatch):
    """Model keys added after the exporters were written: a config entry `new_knob` (0), a
    `TransformerConfig` field `new_field` (0.5), a field `new_kernel` ("a") declared
    export-neutral, and `moe.new_knob` and `lora.new_knob` (0)."""
    import dataclasses

    from transformer.hf import allowlist
    from transformer.nn.config import TransformerConfig
    from transformer.utils.keys import STR, key

    def defaults():
        config = default_model_config()
        config.new_knob = 0
        config.moe.new_knob = 0
        config.lora.new_knob = 0
        return config

    monkeypatch.setattr(allowlist, "default_model_config", defaults)
    monkeypatch.setattr(allowlist, "TransformerConfig", dataclasses.make_dataclass(
        "Later", [("new_field", float, dataclasses.field(default=0.5)),
                  ("new_kernel", str, key("a", "A kernel choice.", STR, structural=False,
                                          export_neutral=True))],
        bases=(TransformerConfig,), frozen=True))


@pytest.mark.parametrize("case", EXPORTABLE)
def test_a_model_key_no_exporter_maps_is_refused_by_every_exporter(case, monkeypatch):
    torch.manual_seed(0)
    hf = CASES[case]()[0]
    name = hf.config.model_type
    config, params = convert.from_hf(hf.config, hf.state_dict())
    with_new_model_keys(monkeypatch)
    settings = [("new_knob", 1, 0), ("new_field", 2.0, 0.5)]
    if config.moe.num_experts:
        settings.append(("moe.new_knob", 1, 0))
    for key, value, default in settings:
        changed = config.copy_and_resolve_references()
        changed.update_from_flattened_dict({key: value}) if "." in key else \
            changed.update({key: value})
        with pytest.raises(ValueError) as error:
            export.to_hf(changed, params)
        assert str(error.value) == (f"export to {name}: model.{key}={value!r} has no Hugging "
                                    f"Face {TITLES[name]} equivalent (expected the default "
                                    f"{default!r})")
    # At their defaults the new keys export as before, and the export-neutral one at any
    # value, to the same HF state; a key no model has is refused too.
    config.new_knob, config.new_field = 0, 0.5
    hf_config, state = export.to_hf(config, params)
    assert type(hf_config) is type(hf.config)
    config.new_kernel = "b"
    assert export.to_hf(config, params)[1].keys() == state.keys()
    config.not_a_model_key = True
    with pytest.raises(ValueError, match=f"export to {name}: model.not_a_model_key=True has no "):
        export.to_hf(config, params)


def test_lora_settings_are_refused_unmerged_and_by_the_peft_export_unless_mapped(monkeypatch):
    import ml_collections

    torch.manual_seed(0)
    hf = CASES["llama_gqa"]()[0]
    model, params = convert.from_hf(hf.config, hf.state_dict())
    model.lora.rank = 4
    with pytest.raises(ValueError, match=re.escape(
            "export to llama: model.lora.rank=4 has no Hugging Face Llama equivalent (expected "
            "the default 0)")):
        export.to_hf(model, params)  # the adapters would be dropped: merge them first
    assert export.base_model_config(model).lora.rank == 0 and model.lora.rank == 4
    with_new_model_keys(monkeypatch)
    model.lora.new_knob = 1
    with pytest.raises(ValueError) as error:
        export.peft_state(ml_collections.ConfigDict({"model": model, "init_from": ""}), params)
    assert str(error.value) == ("export to peft: model.lora.new_knob=1 has no Hugging Face peft "
                                "LoRA equivalent (expected the default 0)")


LLAMA_SHAPED = dict(position="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
                    num_kv_heads=1, tie_embeddings=False)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_a_trained_workdir_exports_and_hf_gives_our_logits_and_greedy_tokens(
        tmp_path, monkeypatch, architecture):
    """The Llama-shaped run trains sharded over four devices (fsdp=4); the export runs on one.
    The GPT-2 one trains with multi-token prediction: its MTP modules only train the model (its
    next-token logits are the same without them) and only DeepSeek-V3's files hold them, so the
    export leaves them out, saying so (it was refused)."""
    workdir, output = tmp_path / "run", tmp_path / "hf"
    model = {"position": "learned", "max_len": 64, "mtp.depth": 2} \
        if architecture == "GPT2LMHeadModel" else LLAMA_SHAPED
    flags = [f"--config.model.{k}={v}" for k, v in model.items()]
    if architecture == "LlamaForCausalLM":
        monkeypatch.setenv("XLA_FLAGS", cli_env(4)["XLA_FLAGS"])
        flags += ["--config.batch_size=4", "--config.mesh.fsdp=4", "--config.mesh.data=1"]
    assert_succeeded(run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                             f"--workdir={workdir}", *tiny_flags(3), *flags, logs=tmp_path))
    monkeypatch.undo()
    result = run_cli("transformer.export", f"--workdir={workdir}", f"--output={output}",
                     logs=tmp_path)
    assert_succeeded(result)
    assert f"as {architecture}" in result.stdout
    mtp_note = "note: model.mtp.depth=2: the export leaves out the multi-token prediction"
    assert (mtp_note in result.stdout + result.stderr) == (architecture == "GPT2LMHeadModel")
    hf = transformers.AutoModelForCausalLM.from_pretrained(output).eval()
    assert type(hf).__name__ == architecture

    from transformer.parallel import sharding
    from transformer.training import checkpoint

    one_device = sharding.make_mesh({axis: 1 for axis in sharding.MESH_AXES},
                                    devices=jax.local_devices()[:1])
    saved = checkpoint.restore_params(str(workdir), mesh=one_device)
    mtp = {name for name in saved.params if name.startswith("mtp_")}
    assert bool(mtp) == (architecture == "GPT2LMHeadModel")
    ours = build_model(saved.config.model)
    ids = tokens(8, (2, 16)) % saved.config.model.vocab_size
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids)).logits.numpy()
    got = np.asarray(jax.jit(ours.apply)({"params": saved.params}, ids))
    assert relative_difference(got, expected) <= 1e-4
    # generation_config.json suppresses what our generate never emits (the specials other than
    # <eos>: sentinels, a padded vocabulary's ids past the tokenizer's); HF applies the file:
    # the greedy continuations are ours (10 tokens: <eos> held off on both sides)
    tokenizer = tokenizers.load_tokenizer(str(workdir / "tokenizer"))
    banned = text.banned_for(tokenizer, saved.config.model.vocab_size, saved.config)
    assert transformers.GenerationConfig.from_pretrained(output).suppress_tokens == list(banned)
    assert set(tokenizer.sentinel_ids) <= set(banned) and tokenizer.eos_id not in banned
    prompt = ids[:1, :5]
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt), max_new_tokens=10, do_sample=False,
                          min_new_tokens=10, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    assert all(np.isneginf(step[0, list(banned)].numpy()).all() for step in out.scores)
    our_tokens, _ = generate.decode(ours, saved.params, prompt, max_new_tokens=10, eos_id=None,
                                    banned_ids=(*banned, tokenizer.eos_id))
    np.testing.assert_array_equal(our_tokens[0], out.sequences[0, 5:].numpy())
    assert_imports_back(hf, {k: v for k, v in saved.params.items() if k not in mtp})
    # An existing output is never overwritten.
    result = run_cli("transformer.export", f"--workdir={workdir}", f"--output={output}",
                     logs=tmp_path)
    assert result.returncode != 0 and "exists: expected a new directory" in result.stderr


@pytest.mark.slow
def test_a_lora_run_with_multi_token_prediction_exports_its_peft_adapter(tmp_path):
    """A LoRA fine-tune of a Llama-shaped model trained with MTP: its peft adapter leaves the
    MTP modules out as the merged export does (it was refused, naming mtp.depth), and peft
    on the base's export gives the fine-tune's logits."""
    peft = pytest.importorskip("peft")
    from transformer.training import finetune

    base, tuned, base_hf, adapter = (tmp_path / name for name in ("base", "tuned", "base_hf",
                                                                   "adapter"))
    flags = [*tiny_flags(2), *(f"--config.model.{k}={v}" for k, v in LLAMA_SHAPED.items()),
             "--config.model.mtp.depth=1"]
    assert_succeeded(run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                             f"--workdir={base}", *flags, logs=tmp_path))
    assert_succeeded(run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                             f"--workdir={tuned}", *flags, f"--config.init_from={base}",
                             "--config.model.lora.rank=2", "--config.optimizer.learning_rate=0.05",
                             logs=tmp_path))
    assert_succeeded(run_cli("transformer.export", f"--workdir={base}", f"--output={base_hf}",
                             logs=tmp_path))
    result = run_cli("transformer.export", f"--workdir={tuned}", f"--output={adapter}",
                     logs=tmp_path)
    assert_succeeded(result)
    assert "as a peft LoRA adapter" in result.stdout and "model.mtp.depth=1" in result.stdout
    saved = finetune.restore_params(str(tuned))
    ids = tokens(8, (2, 12)) % saved.config.model.vocab_size
    ours = np.asarray(build_model(saved.config.model).apply({"params": saved.params}, ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_hf).eval()
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf, adapter).eval()(
            input_ids=torch.tensor(ids)).logits.numpy()
    assert relative_difference(ours, got) <= 1e-4


@pytest.mark.slow
def test_a_refused_export_writes_nothing(tmp_path):
    workdir, output = tmp_path / "run", tmp_path / "hf"
    assert_succeeded(run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                             f"--workdir={workdir}", *tiny_flags(2),
                             "--config.model.position=alibi", logs=tmp_path))
    result = run_cli("transformer.export", f"--workdir={workdir}", f"--output={output}",
                     logs=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: model.position='alibi': the GPT export needs")
    assert not output.exists() and [p.name for p in tmp_path.iterdir() if
                                    p.name.startswith(".export")] == []


@pytest.mark.slow
def test_a_hugging_face_tokenizer_is_exported_with_its_roles(tmp_path):
    from test_hf_tokenizers import SHAKESPEARE, gpt2_style

    from transformer.data import tokenizers

    tokenizer_dir = gpt2_style(tmp_path / "tokenizer")
    workdir, output = tmp_path / "run", tmp_path / "hf"
    assert_succeeded(run_cli(
        "transformer.train", "--config=experiments/gpt_tiny.py", f"--workdir={workdir}",
        *tiny_flags(2), "--config.model.position=learned", "--config.model.max_len=64",
        f"--config.data.path={SHAKESPEARE}", "--config.data.unit=stream",
        "--config.data.tokenizer=hf", f"--config.data.tokenizer_path={tokenizer_dir}",
        "--config.data.num_sentinels=0", logs=tmp_path))
    result = run_cli("transformer.export", f"--workdir={workdir}", f"--output={output}",
                     logs=tmp_path)
    assert_succeeded(result)
    assert "with its tokenizer" in result.stdout
    ours = tokenizers.load_hf_tokenizer(str(tokenizer_dir))
    auto = transformers.AutoTokenizer.from_pretrained(output)
    text = SHAKESPEARE.read_text(encoding="utf-8")[:3000]
    assert auto(text, add_special_tokens=False)["input_ids"] == ours.encode(text).tolist()
    assert auto.eos_token_id == ours.eos_id
    hf_config = transformers.AutoConfig.from_pretrained(output)
    assert hf_config.eos_token_id == ours.eos_id and hf_config.vocab_size == ours.vocab_size
    # generation_config.json: HF generate stops at the tokenizer's own <eos>
    assert transformers.GenerationConfig.from_pretrained(output).eos_token_id == ours.eos_id


@pytest.mark.slow
def test_an_exports_token_ids_are_its_tokenizers_alone(tmp_path):
    """A Mamba 2 run whose tokenizer names bos and eos but no pad: config.json and
    generation_config.json name its bos and eos and no pad (not Mamba2Config's default 1)."""
    import json

    from test_hf_tokenizers import SHAKESPEARE, gpt2_style

    from transformer.data import tokenizers

    tokenizer_dir = gpt2_style(tmp_path / "tokenizer")
    workdir, output = tmp_path / "run", tmp_path / "hf"
    mamba2 = dict(layer_types="mamba2", position="none", d_ff=0, norm="rmsnorm",
                  use_bias=False, **{"mamba2.head_dim": 16, "mamba2.state_size": 16})
    assert_succeeded(run_cli(
        "transformer.train", "--config=experiments/gpt_tiny.py", f"--workdir={workdir}",
        *tiny_flags(1), *[f"--config.model.{k}={v}" for k, v in mamba2.items()],
        f"--config.data.path={SHAKESPEARE}", "--config.data.unit=stream",
        "--config.data.tokenizer=hf", f"--config.data.tokenizer_path={tokenizer_dir}",
        "--config.data.num_sentinels=0", logs=tmp_path))
    assert_succeeded(run_cli("transformer.export", f"--workdir={workdir}", f"--output={output}",
                             logs=tmp_path))
    ours = tokenizers.load_hf_tokenizer(str(tokenizer_dir))
    assert ours.pad_id is None
    for name in ("config.json", "generation_config.json"):
        written = json.loads((output / name).read_text())
        assert (written.get("bos_token_id"), written.get("eos_token_id"),
                written.get("pad_token_id")) == (ours.bos_id, ours.eos_id, None), name


def hub_bert(directory, model_input_names: bool):
    """A BERT WordPiece as a hub checkpoint ships it: tokenizer.json with the [CLS] A [SEP] B
    [SEP] post-processor (type ids 0, 1), truncation and padding; tokenizer_config.json as
    `BertTokenizer.save_pretrained` writes it (no model_input_names) or naming them."""
    import json

    from test_hf_tokenizers import bert_style

    bert_style(directory)
    tok = tokenizers_hf.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.enable_truncation(512)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["model_max_length"] = 512
    if model_input_names:
        config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def hub_chatml(directory):
    """A Qwen-style byte-level BPE: <|endoftext|> then the added special tokens <|im_start|>,
    <|im_end|>, with a tokenizer_config.json as Qwen's (added_tokens_decoder,
    additional_special_tokens, the ChatML chat_template, <|im_end|> as eos, no bos)."""
    import json

    from test_hf_tokenizers import gpt2_style
    from test_sft import CHATML

    gpt2_style(directory)
    tok = tokenizers_hf.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": {str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")},
        "chat_template": CHATML, "model_max_length": 32768, "split_special_tokens": False,
        "clean_up_tokenization_spaces": False}), encoding="utf-8")
    return directory


def exported_tokenizer(original, tmp_path, model_type=None):
    """`original` loaded as `init_from=hf:DIR` / data.tokenizer=hf load it, saved into a workdir
    and read back as the export does, and written by the export's `_tokenizer_files`."""
    from transformer import export as export_cli
    from transformer.data import tokenizers

    tokenizers.load_hf_tokenizer(str(original)).save(str(tmp_path / "workdir_tokenizer"))
    (tmp_path / "exported").mkdir()
    export_cli._tokenizer_files(tokenizers.load_tokenizer(str(tmp_path / "workdir_tokenizer")),
                                str(tmp_path / "exported"), model_type)
    return transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")


def assert_tokenizes_alike(got, expected, texts):
    """`got` (the export's AutoTokenizer) encodes, decodes and names specials as `expected`."""
    assert got.model_input_names == expected.model_input_names
    assert got.all_special_tokens == expected.all_special_tokens
    assert {i: (str(t), t.special) for i, t in got.added_tokens_decoder.items()} == \
        {i: (str(t), t.special) for i, t in expected.added_tokens_decoder.items()}
    assert got.model_max_length == expected.model_max_length
    pair = dict(expected(*texts[:2]))
    assert dict(got(*texts[:2])) == pair
    assert dict(got(texts, padding=True, truncation=True)) == \
        dict(expected(texts, padding=True, truncation=True))
    for skip in (True, False):
        assert got.decode(pair["input_ids"], skip_special_tokens=skip) == \
            expected.decode(pair["input_ids"], skip_special_tokens=skip)


@pytest.mark.parametrize("model_input_names", [False, True], ids=["as_saved", "named"])
def test_an_exported_bert_tokenizer_gives_the_originals_token_type_ids(tmp_path,
                                                                       model_input_names):
    from test_hf_tokenizers import corpus

    original = hub_bert(tmp_path / "bert", model_input_names)
    expected = transformers.AutoTokenizer.from_pretrained(original)
    got = exported_tokenizer(original, tmp_path, None if model_input_names else "bert")
    texts = ["Hear me speak.", "Before we proceed [MASK] any further", " ".join(corpus()[:40])]
    assert_tokenizes_alike(got, expected, texts)
    assert "token_type_ids" in got(*texts[:2])


def test_an_exported_chat_tokenizer_keeps_its_special_tokens_and_template(tmp_path):
    from test_sft import conversation

    original = hub_chatml(tmp_path / "chatml")
    expected = transformers.AutoTokenizer.from_pretrained(original)
    got = exported_tokenizer(original, tmp_path)
    messages = conversation(3, turns=2)
    text = expected.apply_chat_template(messages, tokenize=False)
    assert got.apply_chat_template(messages, tokenize=False) == text
    ids = expected.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert got.apply_chat_template(messages, tokenize=True)["input_ids"] == ids
    assert {"<|im_start|>", "<|im_end|>"} <= set(got.all_special_tokens)
    assert got.decode(ids, skip_special_tokens=True) == \
        expected.decode(ids, skip_special_tokens=True)
    assert_tokenizes_alike(got, expected, [text, "<|im_start|>user\nHello<|im_end|>", "x"])


def train_export_and_load(tmp_path, experiment: str, family: str, auto_class: str):
    """(HF model loaded from the export, our restored params) of a tiny run of `experiment`
    trained and exported through the CLI."""
    from transformer.training import checkpoint

    workdir, output = tmp_path / "run", tmp_path / "hf"
    assert_succeeded(run_cli("transformer.train", f"--config=experiments/{experiment}.py",
                             f"--workdir={workdir}", *tiny_flags(2, family=family),
                             logs=tmp_path))
    assert_succeeded(run_cli("transformer.export", f"--workdir={workdir}",
                             f"--output={output}", logs=tmp_path))
    hf = getattr(transformers, auto_class).from_pretrained(output).eval()
    return hf, checkpoint.restore_params(str(workdir))


@pytest.mark.slow
def test_a_trained_t5_exports_and_hf_gives_our_logits_and_greedy_tokens(tmp_path):
    hf, saved = train_export_and_load(tmp_path, "t5_span", "t5", "AutoModelForSeq2SeqLM")
    assert type(hf).__name__ == "T5ForConditionalGeneration"
    ours = build_model(saved.config.model)
    vocab = saved.config.model.vocab_size
    enc, dec = tokens(9, (2, 12)) % vocab, tokens(10, (2, 6)) % vocab
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits
    got = np.asarray(jax.jit(ours.apply)({"params": saved.params}, enc, dec))
    assert relative_difference(got, expected.numpy()) <= 1e-4
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor(enc[:1]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8).numpy()[0, 1:]  # after the start token
    # span corruption's decoder writes sentinels: the export suppresses the other specials only
    banned = hf.generation_config.suppress_tokens
    assert banned and not set(banned) & {*range(vocab - 100, vocab), hf.config.eos_token_id}
    our_tokens, _ = generate.decode(ours, saved.params, enc[:1], max_new_tokens=8, eos_id=None,
                                    start_id=hf.config.decoder_start_token_id,
                                    banned_ids=(*banned, hf.config.eos_token_id))
    np.testing.assert_array_equal(our_tokens[0], hf_tokens)
    assert_imports_back(hf, saved.params)


@pytest.mark.slow
def test_a_trained_bert_exports_and_hf_gives_our_logits(tmp_path):
    hf, saved = train_export_and_load(tmp_path, "bert_mlm", "bert", "AutoModelForMaskedLM")
    assert type(hf).__name__ == "BertForMaskedLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.model_input_names == ["input_ids", "token_type_ids", "attention_mask"]
    ids = tokens(13, (2, 12)) % saved.config.model.vocab_size
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # padding
    types = np.zeros_like(ids)
    types[:, 6:] = 1
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                      token_type_ids=torch.tensor(types)).logits.numpy()
    forward = jax.jit(lambda params, ids, types, mask: build_model(saved.config.model).apply(
        {"params": params}, ids, token_types=types, segment_ids=mask))
    got = np.asarray(forward(saved.params, ids, types, mask))
    valid = mask.astype(bool)
    assert relative_difference(got[valid], expected[valid]) <= 1e-4
    assert_imports_back(hf, saved.params)


def export_difference(case: str, directory) -> float:
    """Max relative logit difference between our model and HF's class loaded from our export
    of it (random weights perturbed as in test_hf_equivalence), float32."""
    import test_hf_equivalence as eq
    from safetensors.numpy import save_file

    torch.manual_seed(0)
    hf, hf_inputs, args, kwargs, valid = CASES[case]()
    config, params = convert.from_hf(hf.config, randomized(hf).state_dict())
    hf_config, state = export.to_hf(config, params)
    hf_config.save_pretrained(directory)
    save_file(state, f"{directory}/model.safetensors", metadata={"format": "pt"})
    loaded = getattr(transformers, hf_config.architectures[0]).from_pretrained(directory).eval()
    with torch.no_grad():
        expected = loaded(**{k: torch.tensor(v) for k, v in hf_inputs.items()}).logits.numpy()
    got = our_logits(config, params, args, kwargs)
    if valid is not None:
        got, expected = got[valid], expected[valid]
    return eq.relative_difference(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("case", EXPORTABLE)
def test_each_exported_architecture_loads_in_hf_with_our_logits(case, tmp_path):
    assert export_difference(case, tmp_path) <= 1e-4


if __name__ == "__main__":  # the export half of the tolerance table for the issue note
    import tempfile

    print(f"{'model':<26} {'float32':>10}   (max relative logit difference, HF class loaded "
          "from our export vs ours)")
    for name in EXPORTABLE:
        with tempfile.TemporaryDirectory() as d:
            print(f"{name:<26} {export_difference(name, d):>10.2e}")



@pytest.mark.parametrize("experiment", ["bert_finetune_cls", "gpt_finetune_cls",
                                        "t5_finetune_text2text", "gpt_tiny"])
def test_the_exported_tokenizers_default_call_gives_what_the_model_read(experiment, tmp_path):
    """`AutoTokenizer(text)` (add_special_tokens=True, as pipelines call it) gives the inputs a
    fine-tuned model read ([CLS] text [SEP], <eos> text, text <eos>): with none, the exported
    BERT classifier's pipeline disagreed with the run on 161 of 385 test texts. A language
    model's windows have no template: its default call stays the plain ids."""
    from transformer import configs
    from transformer import export as export_cli
    from transformer.data import tasks, tokenizers

    config = configs.experiment(experiment)
    tokenizer = tokenizers.ByteTokenizer(num_sentinels=0)
    export_cli._tokenizer_files(tokenizer, str(tmp_path), None, config)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hear me, good people"
    ids = tokenizer.encode(text)
    if experiment.startswith("t5"):
        row = tasks.text2text_features(ids, 0, np.array([40]), seq_len=64, target_len=4,
                                       tokenizer=tokenizer)
        expected = row["encoder_inputs"][row["encoder_segment_ids"] == 1]
    elif experiment.endswith("cls"):
        row = tasks.classification_features(ids, 0, seq_len=64, tokenizer=tokenizer,
                                            cls=experiment.startswith("bert"))
        expected = row["inputs"][row["segment_ids"] == 1]
    else:
        expected = ids
    assert auto(text)["input_ids"] == expected.tolist()
    assert auto(text, add_special_tokens=False)["input_ids"] == ids.tolist()
    assert auto.decode(auto(text)["input_ids"], skip_special_tokens=True) == text


def test_a_classifiers_label_names_are_not_read_from_data_changed_since_training(tmp_path,
                                                                                 capsys):
    """400 speeches of a new speaker appended after training made him class 0 of the
    export's id2label, every trained class's name shifted, silently: with the checkpoint's
    saved stream, changed data leaves LABEL_i, with a warning."""
    from test_finetune import play_text, task_config

    from transformer.data import inputs

    play = tmp_path / "play.txt"
    play.write_text(play_text())
    config = task_config(play)
    saved = inputs.data_stream(config)  # as the checkpoint saved it
    assert export.task_labels(config, saved) == ["ROMEO", "JULIET", "NURSE"]
    moved = tmp_path / "moved.txt"  # (a new path: tasks are built once per process and path)
    moved.write_text(play.read_text())
    config.data.path = str(moved)
    assert export.task_labels(config, saved) == ["ROMEO", "JULIET", "NURSE"]  # only moved
    changed = tmp_path / "changed.txt"
    changed.write_text(play_text() + "".join(f"\nAARON:\nwords {i}.\n" for i in range(400)))
    config.data.path = str(changed)
    assert export.task_labels(config)[0] == "AARON"  # the new data's classes
    # the names the checkpoint records, the data unread; saved before they were: LABEL_i
    assert export.task_labels(config, saved) == ["ROMEO", "JULIET", "NURSE"]
    assert export.task_labels(config, {k: v for k, v in saved.items() if k != "labels"}) is None
    err = capsys.readouterr().err
    assert "the data changed since the checkpoint was saved (a different fingerprint)" in err
    assert "LABEL_0" in err


def test_an_exported_classifiers_tokenizer_truncates_as_training_did(tmp_path):
    """A text longer than seq_len crashed the exported BERT classifier's pipeline (146
    position ids for 64): model_max_length is the run's seq_len, so `truncation=True` gives
    training's row ([CLS] text [SEP] cut to seq_len), and HF's logits on it equal ours."""
    from flax import linen as nn
    from safetensors.numpy import save_file

    from transformer import configs
    from transformer import export as export_cli
    from transformer.data import tasks, tokenizers

    config = configs.experiment("bert_finetune_cls")
    tokenizer = tokenizers.ByteTokenizer(num_sentinels=0)
    config.update(seq_len=32)
    config.model.update(**TINY_MODEL, max_len=32, num_classes=3, dropout_rate=0.0,
                        attention_dropout_rate=0.0, vocab_size=tokenizer.vocab_size)
    model = build_model(config.model)
    text = "Now is the winter of our discontent made glorious summer by this sun of York"
    ids = tokenizer.encode(text)
    row = tasks.classification_features(ids, 0, seq_len=32, tokenizer=tokenizer, cls=True)
    params = nn.unbox(model.init(jax.random.key(0), row["inputs"][None])["params"])
    hf_config, state = export.to_hf(config.model, params)
    hf_config.save_pretrained(tmp_path)
    save_file(state, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    export_cli._tokenizer_files(tokenizer, str(tmp_path), hf_config.model_type, config)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert auto.model_max_length == 32
    cut = auto(text, truncation=True, return_tensors="pt")
    assert cut["input_ids"][0].tolist() == row["inputs"].tolist()  # full: no padding
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = hf(**cut).logits.numpy()
    got = np.asarray(model.apply({"params": params}, row["inputs"][None],
                                 segment_ids=row["segment_ids"][None]))
    assert relative_difference(got, expected) <= 1e-4
    pipe = transformers.pipeline("text-classification", model=hf, tokenizer=auto)
    assert pipe(text, truncation=True)[0]["label"] == f"LABEL_{int(got.argmax())}"


@pytest.mark.parametrize("style", ["gpt2", "bert"])
def test_a_hub_tokenizers_post_processor_gives_way_to_the_template_only_where_it_differs(
        style, tmp_path):
    """GPT-2's ByteLevel post-processor adds no token: a GPT classifier fine-tuned on it read
    <|endoftext|> text, so the export puts the template after it (keeping its offsets). BERT's
    own [CLS] text [SEP] already gives the template, and stays with its sentence-pair form."""
    import json

    from test_hf_tokenizers import bert_style, gpt2_style

    from transformer import configs
    from transformer import export as export_cli
    from transformer.data import hf_tokenizer, tasks

    hub = (gpt2_style if style == "gpt2" else bert_style)(tmp_path / "hub")
    if style == "gpt2":  # as GPT-2's own tokenizer.json has it, with offsets trimmed
        data = json.loads((hub / "tokenizer.json").read_text())
        data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False,
                                  "trim_offsets": True, "use_regex": True}
        (hub / "tokenizer.json").write_text(json.dumps(data))
    tokenizer = hf_tokenizer.load_hf_tokenizer(str(hub))
    config = configs.experiment("gpt_finetune_cls" if style == "gpt2" else "bert_finetune_cls")
    (tmp_path / "out").mkdir()
    export_cli._tokenizer_files(tokenizer, str(tmp_path / "out"), None, config)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "Hear me, good people"
    ids = tokenizer.encode(text)
    row = tasks.classification_features(ids, 0, seq_len=64, tokenizer=tokenizer,
                                        cls=style == "bert")
    assert auto(text)["input_ids"] == row["inputs"][row["segment_ids"] == 1].tolist()
    original = transformers.AutoTokenizer.from_pretrained(hub)
    offsets = auto(text, return_offsets_mapping=True)["offset_mapping"]
    expected = original(text, return_offsets_mapping=True)["offset_mapping"]
    assert (offsets if style == "bert" else offsets[1:]) == expected
    if style == "bert":  # the hub's sentence-pair template is kept
        pair = auto("first part", "second part")["input_ids"]
        assert pair == original("first part", "second part")["input_ids"]
        assert pair.count(original.sep_token_id) == 2


def lora_model(**overrides):
    """A tiny RoPE GPT's model config with rank-4 adapters, plus `overrides`."""
    config = default_model_config()
    config.update(**{**TINY_MODEL, **LLAMA_SHAPED, **overrides})
    config.lora.rank = 4
    return config


@pytest.mark.parametrize("overrides,says", [
    (dict(moe=dict(num_experts=4, top_k=2)), "model.moe.num_experts=4"),
    (dict(attention_kind="mla", num_kv_heads=None), "model.attention_kind='mla'"),
    (dict(num_layers=2, layer_types="linear_attention,full_attention"),
     "model.layer_types='linear_attention,full_attention'"),
    (dict(position="learned"), "model.position='learned'"),
])
def test_the_peft_export_refusal_names_the_setting_it_cannot_write(overrides, says):
    """An MoE's peft export once said "model.family='gpt', position='rope'", both accepted."""
    import ml_collections

    model = lora_model(**overrides)
    with pytest.raises(ValueError) as error:
        export.peft_state(ml_collections.ConfigDict({"model": model, "init_from": ""}), {})
    assert str(error.value) == (
        f"{says}: the peft adapter export writes a dense Llama-like GPT's (family 'gpt', "
        "position 'rope', softmax attention layers); export with --merge_lora instead")


def test_an_adapter_peft_has_no_module_for_is_refused_not_dropped():
    """A gated attention's `gate` takes adapters but peft has no module for it."""
    import ml_collections
    from flax import linen as nn

    model = lora_model(attention_gate="head")
    model.lora.targets = r"attention/(query|gate)$"
    params = build_model(model).init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    with pytest.raises(ValueError) as error:
        export.peft_state(ml_collections.ConfigDict({"model": model, "init_from": ""}),
                          jax.tree.map(np.asarray, nn.unbox(params)))
    assert str(error.value).startswith(
        r"model.lora.targets='attention/(query|gate)$' adapts decoder/layers_0/self_attention/"
        "gate, which the peft adapter export has no module for (it writes query, key, value, "
        "out, wi_gate, wi_up, wo); export with --merge_lora instead")


def llama_import(directory):
    """A tiny Llama save_pretrained directory whose tokenizer names no pad token (Llama 3's
    layout: tokenizer_config.json's pad_token null) and whose config.json names a
    pad_token_id (<|pad|>'s). Returns (directory, its vocabulary)."""
    import json

    from test_sft import LLAMA3, build_tokenizer

    build_tokenizer(directory, LLAMA3)
    meta = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**meta, "pad_token": None}))
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=len(vocab), max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=vocab["<|begin_of_text|>"],
        eos_token_id=vocab["<|end_of_text|>"], pad_token_id=vocab["<|pad|>"],
    )).save_pretrained(directory)
    return directory, vocab


def test_an_imports_token_ids_fill_in_the_roles_its_tokenizer_names_none(tmp_path):
    """`transformer.export.token_ids`: the tokenizer's id for each role it defines, else the
    config.json's of the checkpoint the run was imported from, only where it is an id of the
    vocabulary; nothing for a run from scratch."""
    import json

    import ml_collections

    from transformer.data import tokenizers

    directory, vocab = llama_import(tmp_path / "llama")
    tokenizer = tokenizers.load_hf_tokenizer(str(directory))
    assert tokenizer.pad_id is None
    config = ml_collections.ConfigDict({"init_from": f"hf:{directory}",
                                        "model": {"vocab_size": len(vocab)}})
    assert export_cli.token_ids(config, tokenizer) == {
        "bos_token_id": vocab["<|begin_of_text|>"], "eos_token_id": vocab["<|end_of_text|>"],
        "pad_token_id": vocab["<|pad|>"]}
    tokenizer.pad_id = 3  # a tokenizer's own id comes first
    assert export_cli.token_ids(config, tokenizer)["pad_token_id"] == 3
    tokenizer.pad_id = None
    config.init_from = ""
    assert "pad_token_id" not in export_cli.token_ids(config, tokenizer)
    config.init_from = f"hf:{directory}"
    source = json.loads((directory / "config.json").read_text())
    for bad in (len(vocab), -1, True, [len(vocab)]):  # no id of the vocabulary (LLaMA 1's -1)
        (directory / "config.json").write_text(json.dumps({**source, "pad_token_id": bad}))
        assert "pad_token_id" not in export_cli.token_ids(config, tokenizer), bad


@pytest.mark.slow
def test_an_export_of_an_import_keeps_its_pad_id_where_its_tokenizer_names_none(tmp_path):
    """A run imported from a checkpoint whose config.json names a pad id and whose tokenizer
    names no pad token: its export's config.json and generation_config.json keep that pad id
    (they dropped it: only the tokenizer's ids were written), as does the export of a run
    that started from that run's workdir."""
    import json

    from transformer import configs, train

    directory, vocab = llama_import(tmp_path / "llama")
    config = configs.experiment("gpt_tiny")
    config.update(steps=1, batch_size=2, seq_len=16, log_every=1, eval_every=1, eval_steps=1,
                  checkpoint_every=1, init_from=f"hf:{directory}")
    config.data.update(tokenizer="hf", tokenizer_path="", num_sentinels=0)
    train.train_and_evaluate(config, str(tmp_path / "run"))
    export_cli.export_workdir(str(tmp_path / "run"), str(tmp_path / "hf"))
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["pad_token_id"] == vocab["<|pad|>"]
    assert exported["eos_token_id"] == vocab["<|end_of_text|>"]  # the tokenizer's
    assert exported["bos_token_id"] == vocab["<|begin_of_text|>"]  # (to_hf names none)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["pad_token_id"] == vocab["<|pad|>"]
    assert generation["bos_token_id"] == vocab["<|begin_of_text|>"]
    assert vocab["<|end_of_text|>"] in np.atleast_1d(generation["eos_token_id"])
    again = config.copy_and_resolve_references()
    again.update(steps=2, init_from=str(tmp_path / "run"))
    train.train_and_evaluate(again, str(tmp_path / "again"))
    export_cli.export_workdir(str(tmp_path / "again"), str(tmp_path / "hf_again"))
    exported = json.loads((tmp_path / "hf_again" / "config.json").read_text())
    assert exported["pad_token_id"] == vocab["<|pad|>"]
