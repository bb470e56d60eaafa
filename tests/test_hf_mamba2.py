"""Mamba 2 from Hugging Face (transformer.hf.convert_mamba2): a small Mamba2ForCausalLM with
perturbed random weights (2 groups, a time-step limit that clips) is our `mamba2` stack
without feed-forward sublayers: the same params as a fresh init, the same logits, scanned or
not, and HF's greedy tokens."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
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
from transformer.models import build_model  # noqa: E402

VOCAB = 97


def mamba2(**overrides):
    return perturbed(transformers.Mamba2ForCausalLM, transformers.Mamba2Config(**{**dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8,
        num_heads=8, n_groups=2, expand=2, conv_kernel=4, chunk_size=4,
        time_step_limit=(0.0, 0.6), bos_token_id=1, eos_token_id=2, pad_token_id=0),
        **overrides}))


@pytest.fixture(scope="module")
def converted():
    return converted_pair(mamba2())


def test_the_params_are_a_fresh_inits_with_no_feed_forward(converted):
    _, config, params = converted
    assert (config.layer_types, config.d_ff, config.position) == ("mamba2", 0, "none")
    fresh = jax.eval_shape(build_model(config).init, jax.random.key(0), jnp.zeros((1, 4), int))
    assert jax.tree.map(jnp.shape, nn.unbox(fresh["params"])) == jax.tree.map(jnp.shape, params)
    assert sorted(params["decoder"]["layers_0"]) == ["mamba2", "mamba2_norm"]


def test_logits_equal_transformers(converted):
    hf, config, params = converted
    assert difference(our_logits(config, params), hf_logits(hf)) <= 1e-4


def test_scanned_import_gives_the_same_logits(converted):
    _, config, params = converted
    scanned = config.copy_and_resolve_references()
    scanned.scan_layers = True
    np.testing.assert_allclose(our_logits(scanned, convert.scan_params(scanned, params)),
                               our_logits(config, params), atol=1e-5)


def test_greedy_decoding_equals_transformers_generate(converted):
    assert_greedy_equals_generate(*converted)


def test_what_the_model_cannot_hold_is_refused_in_one_line():
    hf = mamba2(use_bias=True)
    with pytest.raises(ValueError, match="mamba2 use_bias=True: expected False"):
        convert.from_hf(hf.config, hf.state_dict())
    hf = mamba2(hidden_act="gelu")  # the convolution's activation
    with pytest.raises(ValueError, match="mamba2 hidden_act='gelu': expected 'silu'"):
        convert.from_hf(hf.config, hf.state_dict())


def test_norm_before_gate_in_config_json_is_what_transformers_ignores(converted):
    """Mamba-Codestral's config.json says norm_before_gate: true, and transformers' Mamba 2
    gates before its norm all the same: the import follows its logits, and an export of a
    model that norms first is refused rather than written for it to misread."""
    from transformer.hf import export

    hf, config, params = converted
    hf.config.norm_before_gate = True
    imported, same = convert.from_hf(hf.config, hf.state_dict())
    assert imported.mamba2.norm_before_gate is False
    assert difference(our_logits(imported, same), hf_logits(hf)) <= 1e-4
    changed = config.copy_and_resolve_references()
    changed.mamba2.norm_before_gate = True
    with pytest.raises(ValueError, match=r"export to mamba2: model.mamba2.norm_before_gate=True "
                                         r"has no Hugging Face Mamba 2 equivalent \(expected "
                                         r"False\)"):
        export.to_hf(changed, params)


def test_export_inverts_the_import_bit_for_bit_and_loads_in_transformers(converted):
    from transformer.hf import export

    hf, config, params = converted
    hf_config, state = export.to_hf(config, params)
    want = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert sorted(state) == sorted(want)
    for name, value in state.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    back = transformers.Mamba2ForCausalLM(hf_config)
    back.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    assert difference(our_logits(config, params), hf_logits(back.eval())) <= 1e-4
    changed = config.copy_and_resolve_references()
    changed.d_ff = 16  # a feed-forward sublayer Mamba 2 has no place for
    with pytest.raises(ValueError, match="export to mamba2: model.d_ff=16 has no Hugging Face "
                                         "Mamba 2 equivalent"):
        export.to_hf(changed, params)


def test_an_unused_activation_does_not_block_the_export(converted):
    """With d_ff 0 there is no feed-forward sublayer, so model.activation is never used: any
    value exports, to the same HF logits."""
    from transformer.hf import export

    _, config, params = converted
    changed = config.copy_and_resolve_references()
    changed.activation = "swiglu"
    hf_config, state = export.to_hf(changed, params)
    back = transformers.Mamba2ForCausalLM(hf_config)
    back.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    assert difference(our_logits(changed, params), hf_logits(back.eval())) <= 1e-4


def test_the_export_names_no_token_ids_of_its_class(converted):
    """Mamba2Config's default ids (bos 0, eos 2, pad 1) are no ids of our vocabulary: none are
    written (the CLI sets the run's tokenizer's)."""
    from transformer.hf import export

    _, config, params = converted
    hf_config, _ = export.to_hf(config, params)
    assert (hf_config.bos_token_id, hf_config.eos_token_id, hf_config.pad_token_id) == (
        None, None, None)
