"""Settings that would do nothing are refused in one line before anything runs (or, where the
value is legal but surely unintended, named in a one-line warning at the start): a run never
silently ignores what it was told (issue 56's list); a chat message names what is wrong with
it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import config_keys, configs, models
from transformer.config_keys import KEYS
from transformer.data import chat
from transformer.models.family import ALWAYS_READ, Family, transformer_config
from transformer.nn import layers, lora
from transformer.nn.config import TransformerConfig
from transformer.training import optim, startup, state
from transformer.utils.keys import declarations

REPO = Path(__file__).resolve().parents[1]


def tiny_config(**overrides):
    config = configs.base_config()
    config.update(steps=10, batch_size=2, seq_len=16)
    config.optimizer.warmup_steps = 5
    config.model.update(num_layers=2, d_model=32, num_heads=2, d_ff=64, vocab_size=64)
    config.update_from_flattened_dict(overrides)
    return config


@pytest.mark.parametrize("overrides, message", [
    ({"model.sliding_window": 4, "model.sliding_window_pattern": 3},
     "model.sliding_window_pattern=3: expected <= model.num_layers=2"),
    ({"profile.num_steps": 2, "profile.start_step": 11},
     "profile.start_step=11: expected <= steps=10"),
    ({"model.mtp.depth": 16}, "model.mtp.depth=16: expected < seq_len=16"),
], ids=["window_pattern", "profile", "mtp_depth"])
def test_a_setting_with_no_effect_is_refused_before_anything_runs(overrides, message):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        configs.validate_config(config, num_devices=1, num_processes=1, files=False)
    named = list(overrides)[-1]  # the rule binds on its key: at the default, the config passes
    configs.validate_config(tiny_config(**{k: v for k, v in overrides.items() if k != named}),
                            num_devices=1, num_processes=1, files=False)


def test_legal_but_surely_unintended_values_are_one_line_warnings():
    """A key that acts only with another one left off warns (a sweep's shared base config may
    hold it for the variants that set the other, as experiments/ablations/mup_transfer.py),
    and so do values that defeat themselves."""
    assert startup.unintended_settings(tiny_config()) == []
    config = tiny_config(**{
        "model.mup_base_width": 64, "model.quantize_head": True, "pipeline.repeats": 2,
        "optimizer.warmup_steps": 20, "model.attention_softcap": 1e-30})
    warnings = startup.unintended_settings(config, config_keys.idle_settings(config))
    assert sorted(warnings[:3]) == [
        "warning: model.mup_base_width=64 has no effect without model.parametrization='mup'",
        "warning: model.quantize_head=True has no effect without model.quantization 'int8' or "
        "'fp8'",
        "warning: pipeline.repeats=2 has no effect without mesh.stage > 1"]
    assert "warmup_steps=20 > steps=10: the warmup is shortened to the run's 10 steps" in \
        warnings[3]  # as the schedule does it (the warning said the peak was never reached)
    opt = tiny_config(**{"optimizer.warmup_steps": 20}).optimizer
    rates = [float(optim.learning_rate_schedule(opt, 10)(t)) for t in range(10)]
    np.testing.assert_allclose(rates, opt.learning_rate * np.arange(10) / 10, rtol=1e-6)
    assert "attention_softcap=1e-30" in warnings[4] and all("\n" not in w for w in warnings)
    for acting in ({"model.mup_base_width": 64, "model.parametrization": "mup"},
                   {"model.quantize_head": True, "model.quantization": "int8"}):
        assert config_keys.idle_settings(tiny_config(**acting)) == [], acting
    # probe p3 of stop 110: a causal model on masked-LM rows trained without a word
    for family, warned in (("gpt", True), ("lstm", True), ("prefix_lm", False)):
        said = [w for w in startup.unintended_settings(tiny_config(**{
            "model.family": family, "data.objective": "mlm"})) if "data.objective='mlm'" in w]
        assert len(said) == warned, (family, said)
    # a ViT over patch positions reads no model.position (CLIP's text tower would)
    vit = {"model.family": "vit", "model.position": "learned"}
    assert startup.unintended_settings(tiny_config(**vit)) == [
        "warning: model.position='learned' has no effect without model.patch_position='none'"]
    assert startup.unintended_settings(tiny_config(**{**vit, "model.family": "clip"})) == []
    assert startup.unintended_settings(tiny_config(
        **vit, **{"model.patch_position": "none"})) == []


def test_lengths_a_run_cannot_evaluate_are_refused_or_said_at_the_start():
    """Probe p3 of stop 110: `evaluate --eval_seq_len=5,16,24` on a ViT printed three rows of
    the same images (its rows are images, whatever the length); probe p2: an eval_seq_lens
    entry the model or mesh cannot run at was dropped only after the whole training."""
    from transformer.models import vision
    from transformer.training import evaluation

    vit = family_config("vit")
    tokens = vision.image_tokens(vit.model)
    evaluation.check_eval_seq_len(vit, tokens)
    with pytest.raises(ValueError, match=rf"^eval_seq_len=24: a ViT reads {tokens} tokens an "
                                         rf"image .*: expected only seq_len={tokens}$"):
        evaluation.check_eval_seq_len(vit, 24)
    config = tiny_config(**{"model.position": "learned", "model.max_len": 32,
                            "eval_seq_lens": (32, 64)})
    assert [w for w in startup.unintended_settings(config) if "eval_seq_lens" in w] == [
        "warning: the eval_seq_lens entry 64 will be skipped after training: eval_seq_len=64: "
        "the model learned positions for 32 tokens (model.max_len), and a learned position "
        "table cannot extrapolate: expected <= 32"]


# An off-default value for each run-config key declared with `needs` (config_keys.KEYS): a new
# such key needs its row here.
NEEDY_RUN_KEYS = {
    "optimizer.decay_fraction": 0.3, "optimizer.decay_shape": "cosine",
    "optimizer.min_learning_rate_ratio": 0.0, "optimizer.muon_learning_rate": 0.05,
    "optimizer.muon_momentum": 0.9, "optimizer.momentum": 0.5, "optimizer.nesterov": True,
    "optimizer.adafactor_decay_rate": 0.5, "optimizer.adafactor_clipping_threshold": 0.0,
    "optimizer.adafactor_parameter_scale": False,
    "optimizer.adafactor_min_dim_size_to_factor": 16, "optimizer.adafactor_momentum": 0.9,
    "optimizer.head_learning_rate": 0.1, "pipeline.microbatches": 2, "pipeline.repeats": 2,
    "model.quantize_head": True, "optimizer.b1": 0.8, "optimizer.b2": 0.95}


def needy_model_keys() -> set[str]:
    """The model keys that act only with another setting: declared with `needs`, or in a
    group whose class says `NEEDS` (`model.moe.*`)."""
    return {name for name, key in declarations(TransformerConfig) if key.needs}


@pytest.mark.slow  # (a model built and run: 5 s)
def test_a_key_that_acts_only_with_another_warns_without_it_and_changes_nothing():
    """Probe p2 of stop 109: muon_learning_rate under adamw, a WSD knob under cosine, moe.* with
    no experts, mtp.* at depth 0, mla.* under multi-head attention, mamba2.* and
    linear_attention.* without such a layer, pipeline.microbatches without stages passed without
    a word. Each now warns at the start, where what it needs is off, and not where it is on;
    the model keys among them, set all at once, change neither the params nor the logits."""
    assert {name for name, key in KEYS.items() if key.needs} == set(NEEDY_RUN_KEYS)
    config = tiny_config(**NEEDY_RUN_KEYS)  # adamw, cosine, no stages, no head regex
    warned = dict(config_keys.idle_settings(config))
    idle = {k for k in NEEDY_RUN_KEYS if k not in (  # (cosine, adamw)
        "optimizer.min_learning_rate_ratio", "optimizer.b1", "optimizer.b2")}
    assert set(warned) == {f"{k}={v!r}" for k, v in NEEDY_RUN_KEYS.items() if k in idle}
    assert warned["optimizer.muon_learning_rate=0.05"] == "optimizer.name='muon'"
    assert dict(config_keys.idle_settings(tiny_config(**NEEDY_RUN_KEYS, **{
        "optimizer.name": "sgd"})))["optimizer.b2=0.95"] == (
            "optimizer.name in ('adamw', 'lion', 'schedule_free_adamw', 'muon')")
    for needed, acting in (({"optimizer.name": "muon"}, "muon_"), ({"optimizer.decay": "wsd"},
                           "decay_"), ({"optimizer.name": "sgd"}, ("momentum=", "nesterov"))):
        assert not any(k.startswith("optimizer." + a) for k in dict(config_keys.idle_settings(
            tiny_config(**NEEDY_RUN_KEYS, **needed))) for a in ((acting,) if isinstance(
                acting, str) else acting))
    base = transformer_config(family_config("gpt").model)  # what each key needs is off here
    model_keys = {k: v for k, v in OFF_DEFAULT.items() if k in needy_model_keys()
                  and not dict(declarations(TransformerConfig))[k].needs[0](base)}
    assert "head_dim" in needy_model_keys() and {k.split(".")[0] for k in model_keys} >= {
        "moe", "mtp", "mla", "mamba2", "linear_attention", "qk_norm_scope", "rope_yarn_beta_fast",
        "rope_low_freq_factor"}
    config, shapes, run = built("gpt")
    assert not changes_model("gpt", (config, shapes, run()), **model_keys)
    idle = dict(config_keys.idle_settings(family_config("gpt", **model_keys)))
    assert set(idle) == {f"model.{k}={v!r}" for k, v in model_keys.items()}
    assert idle["model.moe.top_k=1"] == "model.moe.num_experts > 0"
    config = family_config("gpt", **model_keys)
    warnings = startup.unintended_settings(config, config_keys.idle_settings(config))
    assert "warning: model.mtp.loss_weight=0.5 has no effect without model.mtp.depth > 0" in \
        warnings
    # where what they need is on, they act: no warning
    for needed, key in (({"moe.num_experts": 2}, "moe.top_k"), ({"mtp.depth": 1},
                        "mtp.loss_weight"), ({"qk_norm": True}, "qk_norm_scope"),
                        ({"rope_scaling": "yarn", "rope_scale": 2.0}, "rope_yarn_beta_fast"),
                        ({"layer_types": "mamba2,full_attention"}, "mamba2.chunk_size")):
        config = family_config("gpt", **needed, **{key: OFF_DEFAULT[key]})
        assert config_keys.idle_settings(config) == [], key
    # Under MLA, num_kv_heads sizes no head of a decoder LM; an encoder-decoder's
    # cross-attention stays multi-head and reads it
    mla = {"attention_kind": "mla", "num_kv_heads": 2, "mla.kv_lora_rank": 16}
    assert config_keys.idle_settings(family_config("gpt", **mla)) == [
        ("model.num_kv_heads=2", "a multi-head attention layer (attention_kind='mha')")]
    assert config_keys.idle_settings(family_config("t5", **mla)) == []


def test_a_structural_key_idle_in_both_configs_does_not_block_a_resume():
    """moe.top_k on a dense model changes nothing (the start warns so): a resume that changes
    it was refused as a different model (probe p2 of stop 109); with experts it is one."""
    from transformer.training.checkpoint_manager import structural_differences

    dense, top_k = tiny_config(), {"model.moe.top_k": 1}
    assert structural_differences(dense.to_dict(), tiny_config(**top_k).to_dict()) == []
    experts = {"model.moe.num_experts": 4}
    assert structural_differences(tiny_config(**experts).to_dict(), tiny_config(
        **experts, **top_k).to_dict()) == ["model.moe.top_k: checkpoint 2, config 1"]
    # idle in one config only (experts added): every difference counts
    assert "model.moe.num_experts: checkpoint 0, config 4" in structural_differences(
        dense.to_dict(), tiny_config(**experts, **top_k).to_dict())


def params_of(config):
    model = models.build_model(config.model)
    return nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                   jnp.ones((1, 8), jnp.int32))["params"])


def test_a_freeze_regex_matching_every_param_or_none_is_refused():
    params = params_of(tiny_config())
    state.check_freeze(params, tiny_config(**{"optimizer.freeze": "^decoder/layers_0/"}))
    with pytest.raises(ValueError, match=r"optimizer.freeze='\.\*' matches every param"):
        state.check_freeze(params, tiny_config(**{"optimizer.freeze": ".*"}))
    with pytest.raises(ValueError, match=r"optimizer.freeze='encoder/' matches no param: "
                                         r"expected a regex over param paths such as "):
        state.check_freeze(params, tiny_config(**{"optimizer.freeze": "encoder/"}))
    # Under LoRA the base is frozen too (probe p1 of stop 110: freeze='_lora_' trained nothing,
    # exit 0, and the start line counted every adapter trainable; a head regex on the base
    # trained nothing at head_learning_rate)
    adapted = {"model.lora.rank": 4}
    params = params_of(tiny_config(**adapted))
    with pytest.raises(ValueError, match=r"^optimizer.freeze='_lora_' matches every param that "
                                         r"would train \(LoRA freezes the base\), so nothing"):
        state.check_freeze(params, tiny_config(**adapted, **{"optimizer.freeze": "_lora_"}))
    with pytest.raises(ValueError, match=r"^optimizer.head='embed' matches only frozen params "
                                         r"\(LoRA freezes the base\), so head_learning_rate"):
        state.check_freeze(params, tiny_config(**adapted, **{"optimizer.head": "embed"}))
    state.check_freeze(params, tiny_config(**adapted, **{"optimizer.freeze": "mlp/",
                                                         "optimizer.head": "attention/"}))
    total, adapters = lora.counts(params)
    mlp = sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if "/mlp/" in state.param_name(path) and "_lora_" in state.param_name(path))
    assert mlp and lora.counts(params, "mlp/") == (total, adapters - mlp)


def test_lora_targets_matching_nothing_or_a_rank_above_full_rank_are_refused():
    def check(**settings):
        config = tiny_config(**{f"model.lora.{k}": v for k, v in settings.items()})
        lora.check_targets(params_of(config), lora.LoraConfig(**config.model.lora))

    check(rank=4)
    with pytest.raises(ValueError, match=r"targets='nothing_here\$' matches no kernel"):
        check(rank=4, targets="nothing_here$")
    # the attention kernels [32, 2, 16] have full rank min(32, 32) = 32, the MLP's 32 too
    check(rank=32)
    with pytest.raises(ValueError, match=r"model.lora.rank=33: expected <= 32, the full rank "):
        check(rank=33)


@pytest.mark.parametrize("message, error", [
    ({"role": 3, "content": "x"}, "message 1 has role=3: expected a non-empty string"),
    ({"role": "", "content": "x"}, "message 1 has role='': expected a non-empty string"),
    ({"role": "user"}, 'message 1 has no "content"'),
    ({"role": "user", "content": None}, "message 1 has content=None: expected a string"),
    ({"content": "x"}, 'message 1 has no "role"'),
    ("hi", "message 1 is 'hi': expected"),
])
def test_a_chat_message_names_what_is_wrong_with_it(message, error):
    """A non-string role is not reported as missing, and a message without content is refused
    (it would render as the string 'None' or fail deep in the template)."""
    line = json.dumps({"messages": [{"role": "user", "content": "hi"}, message]})
    with pytest.raises(ValueError, match="^" + re.escape(f"--chat: {error}")):
        chat.parse_conversation(line, "--chat")


# A legal value off its default for every model key outside `family.ALWAYS_READ` (a group by
# one of its keys: moe.top_k, not moe.num_experts, which build_model refuses without attention).
OFF_DEFAULT = {
    "activation": "relu", "attention_dropout_rate": 0.1, "attention_gate": "head",
    "attention_impl": "dense", "attention_kind": "mla", "attention_scale": 0.5,
    "attention_sinks": True, "attention_softcap": 30.0, "channels": 3, "d_ff": 96, "d_model": 48,
    "dropout_rate": 0.1, "dtype": "bfloat16", "embedding_norm": True, "head": "none",
    "head_dim": 8, "image_size": 16, "init_std": 0.5, "layer_types": "mamba2,full_attention",
    "linear_attention.chunk_size": 32, "mamba2.chunk_size": 32, "max_len": 32,
    "mla.kv_lora_rank": 16, "moe.top_k": 1, "mtp.loss_weight": 0.5, "mup_base_width": 32,
    "norm": "rmsnorm", "norm_epsilon": 0.1, "norm_placement": "post", "num_classes": 3,
    "num_decoder_layers": 3, "num_heads": 8, "num_kv_heads": 2, "num_layers": 3,
    "parallel_block": True, "param_dtype": "bfloat16", "patch_position": "none",
    "patch_size": 4, "pooling": "mean", "position": "learned", "projection_dim": 32,
    "qk_norm": True, "qk_norm_scope": "projection", "qkv_bias": True, "remat_policy": "full",
    "rope_fraction": 0.5, "rope_high_freq_factor": 8.0, "rope_layout": "interleaved",
    "rope_local_theta": 1e4, "rope_low_freq_factor": 2.0, "rope_original_max_len": 4096,
    "rope_scale": 2.0, "rope_scaling": "yarn", "rope_theta": 1e5, "rope_yarn_beta_fast": 16.0,
    "rope_yarn_beta_slow": 2.0, "rope_yarn_mscale": 0.5, "rope_yarn_mscale_all_dim": 1.0,
    "rope_yarn_truncate": False, "scale_decoder_output": False, "scale_embeddings": True,
    "scale_residual_init": True, "scan_layers": True, "sequence_load_balance": False,
    "sequence_parallel": "ring", "t5_max_distance": 64,
    "t5_num_buckets": 16, "tie_embeddings": False, "type_vocab_size": 3, "use_bias": False}
# Keys left out of OFF_DEFAULT, and why: set alone, each is refused in one line outside a
# decoder LM (build_model), or without a sliding window (refused there), so never ignored.
REFUSED_ALONE = {"sliding_window": 4, "parametrization": "mup", "final_logit_softcap": 30.0,
                 "sliding_window_pattern": 2}
# The keys a declared-`reads` family's model reads which leave its outputs and params as they
# were in the test below, and why (none yet: dropout acts, as the test applies it in training).
READ_BUT_INERT: dict[str, str] = {}


def test_every_model_key_has_an_off_default_value_or_a_refusal():
    """So that the check below covers a key added later, whatever family reads it."""
    covered = {key.split(".")[0] for key in OFF_DEFAULT} | set(REFUSED_ALONE)
    assert covered | set(ALWAYS_READ) == set(models.default_model_config().keys())
    for key, value in REFUSED_ALONE.items():
        config = family_config("lstm", **{key: value})
        with pytest.raises(ValueError, match=f"^{key}=.*: expected"):
            models.build_model(config.model)


def family_config(family, **overrides):
    config = configs.base_config()  # its transformer keys at their defaults
    config.model.update(family=family, num_layers=2, d_model=32, vocab_size=64)
    config.update_from_flattened_dict({f"model.{k}": v for k, v in overrides.items()})
    return config


def built(family, **overrides):
    """(config, its param shapes and dtypes, a function giving (params, logits) of the family's
    model on a tiny batch, applied as in training (dropout on), from fixed seeds)."""
    config = family_config(family, **overrides)
    model, fam = models.build_model(config.model), models.FAMILIES[family]
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    made = {"inputs": tokens, "targets": tokens, "weights": jnp.ones((2, 16)),
            "segment_ids": jnp.ones((2, 16), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(16), (2, 16))}
    batch = {name: made[name] for name in fam.inputs + fam.features + ("targets", "weights")}
    init = lambda: model.init(jax.random.key(0), *fam.init_args(batch))["params"]

    def run():
        params = init()
        return params, fam.logits(model, params, batch, rngs={"dropout": jax.random.key(2)},
                                  deterministic=False)
    return config, jax.eval_shape(init), run


def same(a, b) -> bool:
    """Whether two param trees or logits are equal: structure, shapes, dtypes and values."""
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    pairs = zip(leaves_a, leaves_b, strict=False)  # (the trees' equality compares the counts)
    return tree_a == tree_b and all(x.shape == y.shape and x.dtype == y.dtype
                                    and np.array_equal(x, y) for x, y in pairs)


def changes_model(family, base, **overrides) -> bool:
    """Whether the overrides change the family's params or logits from `base`'s (`built`'s):
    by the param shapes and dtypes where they differ (read without initialising), else by the
    values."""
    _, shapes, run = built(family, **overrides)
    if jax.tree.structure(shapes) != jax.tree.structure(base[1]) or \
            jax.tree.leaves(shapes) != jax.tree.leaves(base[1]):
        return True
    return not all(map(same, run(), base[2]))


def check_reads(family):
    """`Family.reads`: each key it declares changes its model (params or logits), and every other
    key set off its default (all at once) changes nothing and is named in the start's warning."""
    reads = models.FAMILIES[family].reads
    assert reads is not None, f"{family}: Family.reads=None (every transformer key)"
    unknown = set(reads) - set(models.default_model_config().keys())
    assert not unknown, f"{family}: reads names no model key {sorted(unknown)}"
    config, shapes, run = built(family)
    base = (config, shapes, run())
    assert startup.unread_settings(config.model) == []
    for key, value in OFF_DEFAULT.items():
        if key.split(".")[0] in reads and key not in READ_BUT_INERT:
            assert changes_model(family, base, **{key: value}), (
                f"{family} declares it reads {key}, but {key}={value!r} changes nothing")
            assert startup.unread_settings(family_config(family, **{key: value}).model) == []
    unread = {k: v for k, v in OFF_DEFAULT.items() if k.split(".")[0] not in reads}
    for group in groups_that_build(family, unread):
        if changes_model(family, base, **group):  # name the keys it reads undeclared
            acting = [k for k, v in group.items() if changes_model(family, base, **{k: v})]
            pytest.fail(f"{family} reads {acting} but leaves them out of its Family.reads")
        # a group's key is named alone (mla.kv_lora_rank=16), not with the whole group
        assert sorted(startup.unread_settings(family_config(family, **group).model)) == sorted(
            f"{k}={v!r}" for k, v in group.items())


def groups_that_build(family, settings):
    """The settings split (greedily) into groups the family's model builds with, each set at
    once (some exclude others: parallel_block needs norm_placement 'pre'). A key refused even
    alone (at d_model=32, attention_kind='mla' with mla.kv_lora_rank=512) is left out: it
    cannot pass silently."""
    groups = []
    for key, value in settings.items():
        for group in groups + [{}]:
            try:
                models.build_model(family_config(family, **group, **{key: value}).model)
            except ValueError:
                continue
            if not group:
                groups.append(group)
            group[key] = value
            break
    return groups


def test_each_family_reads_what_it_declares_and_names_the_rest():
    """Over every registered family: a transformer family reads the transformer's keys (reads=
    None; which act where is checked by the refusals in build_model and configs); any other
    declares `reads`, which registration enforces and `check_reads` verifies."""
    for name, family in models.FAMILIES.items():
        assert family.attention or family.reads is not None, name
        if family.reads is not None:
            check_reads(name)


def test_a_family_without_attention_must_declare_what_it_reads():
    with pytest.raises(ValueError, match="^Family 'fake': attention=False with reads=None"):
        Family("fake", models.FAMILIES["lstm"].build, inputs=("inputs",),
               objectives=("next_token",), attention=False)


def doc_family_module():
    """The doc's model family recipe (docs/extending.md), its code block run as a module."""
    text = (REPO / "docs/extending.md").read_text()
    code = re.search(r"## A model family.*?```python\n(.*?)```", text, re.S).group(1)
    scope = {"nn": nn, "jnp": jnp, "Family": Family, "transformer_config": transformer_config,
             "TransformerConfig": TransformerConfig, "MLP": layers.MLP,
             "TokenEmbedding": layers.TokenEmbedding, "norm_layer": layers.norm_layer}
    exec(compile(code, "docs/extending.md", "exec"), scope)
    return scope


def test_the_docs_family_recipe_declares_what_its_model_reads(monkeypatch):
    """The recipe's conv LM, registered, passes the check every family passes: its `reads=`
    names exactly the keys that change it (`tie_embeddings=False`, `num_heads` warn)."""
    monkeypatch.setitem(models.FAMILIES, "conv", doc_family_module()["CONV"])
    check_reads("conv")
    warnings = startup.unintended_settings(family_config("conv", tie_embeddings=False,
                                                         num_heads=8))
    assert warnings == ["warning: model.family='conv' never reads num_heads=8, "
                        "tie_embeddings=False: they change nothing"]


def test_the_start_names_a_familys_unread_keys_in_one_warning():
    warnings = startup.unintended_settings(family_config("lstm", num_heads=8, position="none"))
    assert warnings == ["warning: model.family='lstm' never reads num_heads=8, "
                        "position='none': they change nothing"]
    # layer types it has no layers for: the same warning, not a refusal naming causality
    config = family_config("lstm", layer_types="mamba2")
    configs.validate_config(config, num_devices=1, num_processes=1, files=False)
    assert startup.unintended_settings(config) == [
        "warning: model.family='lstm' never reads layer_types='mamba2': it changes nothing"]
