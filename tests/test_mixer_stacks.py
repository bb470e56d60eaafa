"""Whole decoder LMs built from the token mixers (`model.layer_types`): hybrid stacks scanned in
groups and unrolled give the same logits, decoding with right-padded prompts equals recompute,
packed documents equal each document alone, greedy generation equals the argmax of recompute,
and scan + remat gradients equal plain ones."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_cache import cached_logits
from test_model_knobs import VOCAB, model_config, tokens

from transformer.generation.programs import decode
from transformer.models import build_model
from transformer.nn.mixers import MIXERS

RECURRENT = [name for name, m in MIXERS.items() if m.decode_state == "recurrent state"]
KINDS = RECURRENT + ["mla"]
MIXER_KEYS = {"mamba2": dict(head_dim=8, state_size=8, chunk_size=4),
              "linear_attention": dict(key_head_dim=8, value_head_dim=8, chunk_size=4),
              "mla": dict(kv_lora_rank=12, q_lora_rank=0, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=6)}


def hybrid_config(kind: str, **overrides):
    """4 layers, 32 wide: `kind` in layers 0-2, full attention in layer 3 (Qwen3-Next's 3:1);
    for "mla", every layer multi-head latent attention (its last one full, the others
    windowed)."""
    if kind == "mla":
        config = model_config(num_layers=4, attention_kind="mla", sliding_window=5,
                              layer_types="sliding_attention*3,full_attention", **overrides)
    else:
        config = model_config(num_layers=4, layer_types=f"{kind}*3,full_attention", **overrides)
    for name, value in MIXER_KEYS.get(kind, {}).items():
        config[kind][name] = value
    return config


@functools.cache
def built(kind: str, scan: bool = False):
    """The model and its params, initialised under jit (eager Linen init runs op by op: 2x the
    time); with `scan`, the params' shapes only."""
    model = build_model(hybrid_config(kind, scan_layers=scan))
    init = jax.eval_shape if scan else lambda f, key: jax.jit(f)(key)
    params = init(lambda key: nn.unbox(model.init(key, tokens())["params"]), jax.random.key(0))
    return model, params


def forward(model, params, x, **kwargs):
    """The logits, compiled (eager Linen runs op by op)."""
    return jax.jit(lambda p, x, kw: model.apply({"params": p}, x, **kw))(params, x, kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_scanned_hybrid_equals_the_unrolled_one(kind):
    """The scan runs one group of 4 blocks (3 `kind`, 1 full); its params are the unrolled
    layers' stacked, and the logits agree."""
    (plain, p_plain), (scanned, p_scan) = built(kind), built(kind, True)
    group = p_scan["decoder"]["layers"]
    assert sorted(group) == [f"block_{i}" for i in range(4)]
    name = "self_attention" if kind == "mla" else MIXERS[kind].param_name
    assert name in group["block_0"] and "self_attention" in group["block_3"]
    stacked = {f"block_{i}": p_plain["decoder"][f"layers_{i}"] for i in range(4)}
    stacked = jax.tree.map(lambda x: x[None], stacked)
    p_from_plain = {**p_plain, "decoder": {**{k: v for k, v in p_plain["decoder"].items()
                                              if not k.startswith("layers_")},
                                           "layers": stacked}}
    np.testing.assert_allclose(forward(scanned, p_from_plain, tokens()),
                               forward(plain, p_plain, tokens()), atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_decoding_right_padded_prompts_equals_recompute(kind):
    """Prompts of 3 and 7 tokens prefilled together (the shorter one padded), then one token per
    step: every logit equals the full forward's (the recurrent state skips the padding)."""
    model, params = built(kind)
    x = tokens()
    want = np.asarray(forward(model, params, x))
    got = cached_logits(model, params, x, prompt_lengths=[3, 7])
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_documents_equal_each_document_alone(kind):
    """Two documents packed in one row (segment ids, per-document positions) give the logits
    each gives alone: the recurrent state and convolution restart at the second."""
    model, params = built(kind)
    x = tokens((1, 12))
    segments = jnp.asarray([[1] * 5 + [2] * 7])
    positions = jnp.asarray([list(range(5)) + list(range(7))])
    packed = forward(model, params, x, segment_ids=segments, positions=positions)
    # Each document alone, as the rows of one batch (one compile): the first right-padded to 7,
    # which its logits never see (every mixer here is causal).
    alone = forward(model, params, jnp.concatenate([jnp.pad(x[:, :5], ((0, 0), (0, 2))),
                                                    x[:, 5:]]))
    np.testing.assert_allclose(packed[:, :5], alone[:1, :5], atol=2e-5)
    np.testing.assert_allclose(packed[:, 5:], alone[1:], atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_equals_the_argmax_of_recompute(kind):
    """`decode` (prefill of prompts of 3 and 6 tokens, then steps): each new token is the argmax
    of the full forward over the prompt and the tokens before it."""
    model, params = built(kind)
    prompts = [[5, 9, 2], [7, 1, 3, 3, 8, 2]]
    new, _ = decode(model, params, prompts, max_new_tokens=5, eos_id=None)
    for prompt, row in zip(prompts, new, strict=True):
        sequence = jnp.asarray([prompt + row.tolist()])
        greedy = jnp.argmax(forward(model, params, sequence)[0], -1)
        assert row.tolist() == greedy[len(prompt) - 1:-1].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", RECURRENT)
def test_prompts_of_one_token_decode_as_recompute(kind):
    """Every prompt one token long (an empty prompt is <eos> alone): the prefill's segment ids
    are [B, 1], whose document starts the recurrent state and convolution still find (they
    once came out [B, 0] and the prefill failed on a reshape)."""
    model, params = built(kind)
    prompts = [[7], [3]]
    new, _ = decode(model, params, prompts, max_new_tokens=4, eos_id=None)
    for prompt, row in zip(prompts, new, strict=True):
        greedy = jnp.argmax(forward(model, params, jnp.asarray([prompt + row.tolist()]))[0], -1)
        assert row.tolist() == greedy[:-1].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_scan_and_remat_give_the_plain_gradients(kind):
    """Full remat of every block changes where activations come from, never the gradients."""
    plain, params = built(kind)
    config = hybrid_config(kind, remat_policy="full")
    remat = build_model(config)
    x = tokens()
    loss = lambda model: jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2) / VOCAB)
    want, got = jax.jit(loss(plain))(params), jax.jit(loss(remat))(params)
    # float32 rounding in the recurrences grows with a leaf's scale (CI's CPU once gave 1.3e-4
    # on a leaf whose largest entry is ~10); a wrong remat or scan is off by O(1)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5 * np.abs(a).max(), rtol=1e-4)


@pytest.mark.parametrize("kind", RECURRENT)
def test_a_recurrent_layer_under_a_sequence_axis_is_refused_where_it_is_traced(kind):
    """A `sequence` axis splits the tokens a recurrent state runs through in order, and the
    state is not passed between devices: `configs.validate_config` refuses it for the CLIs,
    and a model built in Python (which skips it) is refused as it is traced, never run on
    wrong numbers. Traced on an abstract mesh: no devices needed."""
    from jax.sharding import AbstractMesh, AxisType

    from transformer.parallel import sharding

    model, params = built(kind, scan=True)
    # Auto axes, as the run's meshes have (sharding.make_mesh): newer JAX makes an abstract
    # mesh's axes Explicit by default, under which the sharding constraints would assert
    mesh = AbstractMesh(tuple(2 if a == "sequence" else 1 for a in sharding.MESH_AXES),
                        sharding.MESH_AXES, axis_types=(AxisType.Auto,) * len(sharding.MESH_AXES))
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        with pytest.raises(ValueError) as error:
            jax.eval_shape(lambda p: model.apply({"params": p}, tokens()), params)
    assert str(error.value) == MIXERS[kind].refuses(None, {"sequence": 2})
    # the same trace without the split runs
    assert jax.eval_shape(lambda p: model.apply({"params": p}, tokens()), params).ndim == 3
