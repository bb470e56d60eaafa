"""Settings that would do nothing are refused in one line before anything runs (or, where the
value is legal but surely unintended, named in a one-line warning at the start): a run never
silently ignores what it was told (issue 56's list); a chat message names what is wrong with
it."""

from __future__ import annotations

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import configs, models
from transformer.data import chat
from transformer.nn import lora
from transformer.training import optim, startup, state


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
], ids=["window_pattern", "profile"])
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
    warnings = startup.unintended_settings(tiny_config(**{
        "model.mup_base_width": 64, "model.quantize_head": True, "pipeline.repeats": 2,
        "optimizer.warmup_steps": 20, "model.attention_softcap": 1e-30}))
    assert warnings[:3] == [
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
    assert startup.unintended_settings(tiny_config(**{
        "model.mup_base_width": 64, "model.parametrization": "mup"})) == []
    # a ViT over patch positions reads no model.position (CLIP's text tower would)
    vit = {"model.family": "vit", "model.position": "learned"}
    assert startup.unintended_settings(tiny_config(**vit)) == [
        "warning: model.position='learned' has no effect without model.patch_position='none'"]
    assert startup.unintended_settings(tiny_config(**{**vit, "model.family": "clip"})) == []
    assert startup.unintended_settings(tiny_config(
        **vit, **{"model.patch_position": "none"})) == []


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


# Legal values off the defaults for transformer keys, which an LSTM never reads.
UNREAD_BY_LSTM = {"num_heads": 8, "num_kv_heads": 2, "d_ff": 96, "position": "learned",
                  "max_len": 32, "norm": "rmsnorm", "activation": "relu", "use_bias": False,
                  "init_std": 0.5, "qk_norm": True, "norm_placement": "post",
                  "scan_layers": True, "embedding_norm": True, "scale_embeddings": True,
                  "attention_softcap": 30.0, "remat_policy": "full",
                  "mla.kv_lora_rank": 16}


def lstm_config(**overrides):
    config = configs.base_config()  # its transformer keys at their defaults
    config.model.update(family="lstm", num_layers=2, d_model=32, vocab_size=64)
    config.update_from_flattened_dict({f"model.{k}": v for k, v in overrides.items()})
    return config


def lstm_logits(**overrides):
    config = lstm_config(**overrides)
    model = models.build_model(config.model)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    params = model.init(jax.random.key(0), tokens)
    return config, model.apply(params, tokens)


def test_the_keys_a_family_never_reads_change_nothing_and_are_named_at_the_start():
    """`Family.reads`: each transformer key set off its default leaves the LSTM's logits as
    they were and is named in the start's one warning; the keys it reads change them."""
    config, base = lstm_logits()
    assert startup.unread_settings(config.model) == []
    for key, value in UNREAD_BY_LSTM.items():
        config, logits = lstm_logits(**{key: value})
        np.testing.assert_array_equal(logits, base, err_msg=key)
        # a group's key is named alone (mla.kv_lora_rank=16), not with the whole group
        assert startup.unread_settings(config.model) == [f"{key}={value!r}"], key
    for key, value in {"d_model": 48, "num_layers": 3, "tie_embeddings": False}.items():
        config, logits = lstm_logits(**{key: value})
        assert logits.shape != base.shape or not np.array_equal(logits, base), key
        assert startup.unread_settings(config.model) == [], key
    warnings = startup.unintended_settings(lstm_config(num_heads=8, position="none"))
    assert warnings == ["warning: model.family='lstm' never reads num_heads=8, "
                        "position='none': they change nothing"]
    # layer types it has no layers for: the same warning, not a refusal naming causality
    config = lstm_config(layer_types="mamba2")
    configs.validate_config(config, num_devices=1, num_processes=1, files=False)
    assert startup.unintended_settings(config) == [
        "warning: model.family='lstm' never reads layer_types='mamba2': they change nothing"]
