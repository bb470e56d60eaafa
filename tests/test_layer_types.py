"""`model.layer_types` and the token-mixer registry (`transformer.nn.mixers`): the window pattern
is a special case (same params, same outputs, bit for bit), patterns repeat and lay the scanned
params out by their shortest period, FLOPs follow each layer's mixer, and bad values get one
line before anything runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model_knobs import model_config, tokens

from transformer.configs import base_config, validate_config
from transformer.models import build_model
from transformer.nn.config import TransformerConfig, parse_layer_types
from transformer.nn.mixers import MIXERS


def _init_apply(model_cfg):
    model = build_model(model_cfg)
    x = tokens()
    params = model.init(jax.random.key(0), x)["params"]
    return params, model.apply({"params": params}, x)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_the_window_pattern_is_a_special_case_bit_for_bit(scan):
    """sliding_window_pattern=2 and layer_types 'sliding_attention,full_attention' build the same
    params (paths, shapes, values) and the same logits, scanned or not."""
    old = model_config(num_layers=4, sliding_window=3, sliding_window_pattern=2, scan_layers=scan)
    new = model_config(num_layers=4, sliding_window=3, scan_layers=scan,
                       layer_types="sliding_attention,full_attention")
    (p_old, y_old), (p_new, y_new) = _init_apply(old), _init_apply(new)
    assert jax.tree.structure(p_old) == jax.tree.structure(p_new)
    for a, b in zip(jax.tree.leaves(p_old), jax.tree.leaves(p_new), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(y_old, y_new)
    # and windows matter: all-full layers give other logits
    full = model_config(num_layers=4, scan_layers=scan)
    assert not np.allclose(_init_apply(full)[1], y_new)


def test_a_written_out_pattern_scans_as_its_shortest_period():
    """'full_attention*4' is the default stack: one scanned `layers` unit, not groups of 4."""
    plain = _init_apply(model_config(num_layers=4, scan_layers=True))[0]
    written = _init_apply(model_config(num_layers=4, scan_layers=True,
                                       layer_types="full_attention*4"))[0]
    assert jax.tree.structure(plain) == jax.tree.structure(written)
    assert "block_0" not in str(jax.tree.structure(plain))


def test_layer_types_repeat_as_a_pattern():
    cfg = TransformerConfig(num_layers=6, sliding_window=4,
                            layer_types="sliding_attention*2,full_attention")
    assert [cfg.layer_type(i) for i in range(6)] == ["sliding_attention"] * 2 + [
        "full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    assert cfg.layer_period == 3
    assert [cfg.is_local_layer(i) for i in range(3)] == [True, True, False]
    assert parse_layer_types(" full_attention , sliding_attention*2") == (
        "full_attention", "sliding_attention", "sliding_attention")


def test_every_registered_mixer_declares_what_the_stack_reads():
    for name, mixer in MIXERS.items():
        assert mixer.param_name and mixer.decode_state in (
            "kv cache", "latent cache", "recurrent state"), name
        cfg = TransformerConfig(num_layers=1)
        assert mixer.flops_per_token(cfg, 64) >= 0 and mixer.cache_bytes_per_token(cfg) >= 0


def _check(**model):
    config = base_config()
    config.model.update(num_layers=2, d_model=32, num_heads=4)
    for name, value in model.items():
        config.model[name] = value
    config.seq_len = 8
    validate_config(config, num_devices=1, num_processes=1)


@pytest.mark.parametrize("model,message", [
    (dict(layer_types="full_attention,dense"),
     "model.layer_types='full_attention,dense': 'dense' is not a layer type"),
    (dict(layer_types="full_attention*0"), "expected a count n > 0"),
    (dict(num_layers=4, layer_types="full_attention*3"),
     "model.layer_types='full_attention*3': 3 layers, expected num_layers=4 or a pattern"),
    (dict(num_layers=2, layer_types="full_attention*4"), "4 layers, expected num_layers=2"),
    (dict(layer_types="sliding_attention,full_attention"),
     "model.sliding_window=None with layer_types='sliding_attention,full_attention': expected "
     "a sliding_window exactly when"),
    (dict(sliding_window=4, layer_types="full_attention"),
     "model.sliding_window=4 with layer_types='full_attention'"),
    (dict(sliding_window=4, sliding_window_pattern=2,
          layer_types="sliding_attention,full_attention"),
     "model.sliding_window_pattern=2 with layer_types="),
    (dict(layer_types=" "), "model.layer_types=' ': '' is not a layer type"),
    (dict(attention_kind="mqa"), "model.attention_kind='mqa': expected one of"),
    # softmax attention's settings where no layer attends: trained as without them
    *[(dict(layer_types=types, **{key: value}),
       f"model.{key}={value!r} with layer_types={types!r}: expected a full_attention or "
       "sliding_attention layer") for types, key, value in (
          ("mamba2", "attention_sinks", True), ("mamba2", "attention_softcap", 30.0),
          ("linear_attention", "attention_gate", "element"), ("conv", "qk_norm", True),
          ("linear_attention,mamba2", "attention_kind", "mla"))],
])
def test_bad_layer_types_get_one_line(model, message):
    with pytest.raises(ValueError) as error:
        _check(**model)
    assert message in str(error.value) and "\n" not in str(error.value)


# Every key declared `attention_only` (softmax attention's alone: the linear mixers, Mamba 2 and
# conv never read it), with a value off its default. A new such key needs its row here. (Not
# the kernel choices, attention_impl and sequence_parallel: compute settings a launch may set
# for every run, whatever its mixers.)
ATTENTION_ONLY = dict(
    qk_norm=True, qk_norm_scope="projection", attention_kind="mla",
    attention_gate="element", attention_softcap=30.0, attention_sinks=True, qkv_bias=True,
    attention_scale=0.5, attention_dropout_rate=0.1, t5_num_buckets=16, t5_max_distance=64,
    rope_theta=500000.0,
    rope_layout="interleaved", rope_scale=8.0, rope_scaling="yarn", rope_low_freq_factor=2.0,
    rope_high_freq_factor=8.0, rope_original_max_len=4096, rope_yarn_beta_fast=16.0,
    rope_yarn_beta_slow=2.0, rope_yarn_mscale=0.707, rope_yarn_mscale_all_dim=0.707,
    rope_yarn_truncate=False, rope_fraction=0.25, rope_local_theta=10000.0)


def test_the_attention_only_keys_are_those_declared():
    from transformer.utils.keys import declarations
    assert {name for name, key in declarations(TransformerConfig) if key.attention_only} == set(
        ATTENTION_ONLY)


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_a_softmax_attention_key_without_attention_layers_is_refused(name):
    """On a stack of conv and Gated DeltaNet layers the key would do nothing (same params, same
    logits): refused off its default in one line, accepted at it."""
    value, types = ATTENTION_ONLY[name], "conv,linear_attention"
    with pytest.raises(ValueError) as error:
        _check(layer_types=types, **{name: value})
    assert str(error.value) == (
        f"model.{name}={value!r} with layer_types={types!r}: expected a full_attention or "
        "sliding_attention layer (it sets softmax attention, which no layer has)")
    _check(layer_types=types, **{name: TransformerConfig.__dataclass_fields__[name].default})



# With attention_kind='mla', the attention-only keys multi-head latent attention has no place
# for: refused off their default in one line (mla.HONOURED leaves them out). Every other key of
# ATTENTION_ONLY must change the MLA layer's params or output, so a new attention knob fails
# below (MLA refuses it) until it is wired into MLA, or named here as refused.
MLA_REFUSES = ("qk_norm", "qk_norm_scope", "attention_gate", "t5_num_buckets", "t5_max_distance",
               "rope_fraction")
_MLA = dict(num_layers=1, d_model=32, num_heads=4, use_bias=False, init_std=0.3,
            attention_kind="mla", mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                           qk_rope_head_dim=16, v_head_dim=8))
_LLAMA3, _YARN = dict(rope_scaling="llama3", rope_scale=8.0), dict(rope_scaling="yarn",
                                                                  rope_scale=8.0)
# What a key needs beside it to act at all (as under multi-head attention): its RoPE scaling, a
# sliding layer (and a base other than rope_theta's); at 16 RoPE dims
_MLA_CONTEXT = dict(
    rope_scaling=dict(rope_scale=8.0), rope_low_freq_factor=_LLAMA3,
    rope_high_freq_factor=_LLAMA3, rope_original_max_len=_LLAMA3,
    rope_yarn_beta_fast=dict(_YARN, rope_yarn_truncate=False),  # (whole pairs: the same ramp)
    rope_yarn_beta_slow=_YARN, rope_yarn_mscale=dict(_YARN, rope_yarn_mscale_all_dim=1.0),
    rope_yarn_mscale_all_dim=_YARN, rope_yarn_truncate=_YARN,
    rope_local_theta=dict(layer_types="sliding_attention", sliding_window=4))


def _mla_layer(**fields):
    """(param shapes, params, output) of one MLA layer, dropout on, from fixed seeds."""
    cfg = TransformerConfig(**_MLA, **fields)
    layer = cfg.mixer(0).layer(cfg, "attention")
    x = jax.random.normal(jax.random.key(1), (2, 8, 32))
    params = layer.init(jax.random.key(0), x)["params"]
    out = layer.apply({"params": params}, x, deterministic=False,
                      rngs={"dropout": jax.random.key(2)})
    return jax.tree.map(lambda a: (a.shape, a.dtype), params), params, out


@pytest.mark.parametrize("name", [n for n in ATTENTION_ONLY if n != "attention_kind"])
def test_each_attention_only_key_acts_on_mla_or_is_refused(name):
    context = _MLA_CONTEXT.get(name, {})
    value = 500.0 if name == "rope_local_theta" else ATTENTION_ONLY[name]
    if name in MLA_REFUSES:
        with pytest.raises(ValueError) as error:
            TransformerConfig(**_MLA, **context, **{name: value})
        assert str(error.value).startswith(f"{name}={value!r} with attention_kind='mla': ")
        assert "\n" not in str(error.value)
        return
    shapes, params, out = _mla_layer(**context)
    new_shapes, new_params, new_out = _mla_layer(**context, **{name: value})
    assert new_shapes != shapes or not np.array_equal(new_out, out), (
        f"{name}={value!r} changes nothing in an attention_kind='mla' layer: wire it into "
        "nn/mixers/mla.py, or leave it out of mla.HONOURED (refused) and add it to MLA_REFUSES")


def test_the_docs_mixer_recipe_shows_short_convs_own_code():
    """docs/extending.md's ShortConv snippet is the file's code, line for line in order (the
    file may hold more: docstrings, imports), not placeholders that drift from it."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs/extending.md").read_text()
    snippet = re.search(r"## A token mixer.*?```python\n(.*?)```", doc, re.S).group(1)
    source = iter((repo / "transformer/nn/mixers/short_conv.py").read_text().splitlines())
    missing = next((line for line in snippet.splitlines() if line.strip()
                    and line not in source), None)  # (`in` consumes: in order)
    assert missing is None, f"docs/extending.md's ShortConv line {missing!r}: not in the file"

def test_good_layer_types_pass():
    _check(num_layers=4, sliding_window=2, layer_types="sliding_attention*3,full_attention")
    assert jnp.isfinite(_init_apply(model_config(num_layers=4, sliding_window=2, layer_types=(
        "sliding_attention*3,full_attention")))[1]).all()


def test_a_resume_with_other_layer_types_is_named():
    from transformer.training.checkpoint_manager import structural_differences
    saved = {"model": {"layer_types": "linear_attention*3,full_attention"}}
    assert structural_differences(saved, {"model": {"layer_types": ""}}) == [
        "model.layer_types: checkpoint 'linear_attention*3,full_attention', config ''"]
    assert structural_differences({"model": {}}, {"model": {"attention_kind": "mla"}}) == [
        "model.attention_kind: checkpoint 'mha', config 'mla'"]
    # a checkpoint from before the key has its default: nothing differs
    assert structural_differences({"model": {}}, {"model": {"layer_types": ""}}) == []


@pytest.mark.parametrize("kind,message", [
    ("linear_attention", "linear_attention layers: mesh.sequence=2: expected 1"),
    ("mamba2", "mamba2 layers: mesh.sequence=2: expected 1"),
    ("conv", "conv layers: mesh.sequence=2: expected 1"),
])
def test_recurrent_layers_under_a_sequence_axis_are_refused_in_one_line(kind, message):
    config = base_config()
    config.model.update(num_layers=2, d_model=32, num_heads=4, layer_types=kind)
    config.seq_len, config.batch_size = 8, 2
    config.mesh.update(data=1, sequence=2)
    with pytest.raises(ValueError) as error:
        validate_config(config, num_devices=2, num_processes=1)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_recurrent_layers_outside_the_causal_decoder_are_refused():
    config = base_config()
    config.model.update(family="bert", num_layers=2, d_model=32, num_heads=4,
                        layer_types="conv,full_attention")
    config.seq_len = 8
    with pytest.raises(ValueError, match=r"model.layer_types='conv,full_attention': conv layers "
                       r"with model.family='bert': expected family 'gpt'"):
        validate_config(config, num_devices=1, num_processes=1)


def test_a_mixer_group_that_does_not_fit_the_model_is_one_line():
    with pytest.raises(ValueError, match=r"^mamba2.head_dim=48: expected a divisor of expand x "
                       r"d_model = 64$"):
        TransformerConfig(num_layers=2, d_model=32, num_heads=4, layer_types="mamba2",
                          mamba2={"head_dim": 48})
    # a group the layers do not use is not checked against the model
    TransformerConfig(num_layers=2, d_model=32, num_heads=4, mamba2={"head_dim": 48})
