"""Model families: each trains on its objective, plus the properties each family promises."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from transformer.models import (
    LSTMLM,
    EncoderDecoder,
    build_model,
    default_model_config,
    shift_right,
)
from transformer.nn import objectives

VOCAB, B, T = 64, 4, 16
PAD, EOS, MASK, CLS = 0, 1, 2, 3


def small_config(family, **overrides):
    config = default_model_config()
    config.update(dict(family=family, vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
                       d_ff=64, max_len=64), **overrides)
    return config


def family_loss(family, model, params, tokens_BT, rng):
    """The pretraining objective of each family on a batch of token rows."""
    if family in ("gpt", "lstm"):
        inputs, targets, weights = objectives.next_token_targets(tokens_BT)
        logits = model.apply({"params": params}, inputs)
    elif family == "prefix_lm":
        inputs, targets, _ = objectives.next_token_targets(tokens_BT)
        prefix_lengths, weights = objectives.prefix_lm_split(rng, tokens_BT)
        logits = model.apply({"params": params}, inputs, prefix_lengths=prefix_lengths)
    elif family == "bert":
        inputs, targets, weights = objectives.mlm_corrupt(
            rng, tokens_BT, vocab_size=VOCAB, mask_id=MASK, special_ids=(PAD, EOS, MASK, CLS),
            rate=0.3)
        logits = model.apply({"params": params}, inputs)
    else:  # t5
        inputs, targets = objectives.span_corrupt(rng, tokens_BT, vocab_size=VOCAB, eos_id=EOS)
        weights = jnp.ones(targets.shape, jnp.float32)
        logits = model.apply({"params": params}, inputs, shift_right(targets, PAD))
    loss, _ = objectives.cross_entropy(logits, targets, weights)
    return loss


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "prefix_lm", "bert", "t5", "lstm"])
def test_every_family_trains_with_decreasing_loss(family):
    model = build_model(small_config(family))
    rng = np.random.default_rng(0)
    # Learnable data: each row counts up from a random start (mod the non-special ids).
    starts = rng.integers(0, VOCAB - 4, (B, 1))
    tokens = jax.device_put((4 + (starts + np.arange(T)) % (VOCAB - 4)).astype(np.int32))
    init_args = (tokens, tokens) if family == "t5" else (tokens,)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), *init_args))["params"]
    optimizer = optax.adamw(3e-3)
    opt_state = jax.jit(optimizer.init)(params)

    @jax.jit
    def step(params, opt_state, key):
        loss, grads = jax.value_and_grad(
            lambda p: family_loss(family, model, p, tokens, key))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(100):
        params, opt_state, loss = step(params, opt_state, jax.random.key(i))
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


@pytest.mark.slow
def test_prefix_lm_sees_the_prefix_bidirectionally_and_the_rest_causally():
    model = build_model(small_config("prefix_lm", position="rope"))
    tokens = np.random.default_rng(1).integers(4, VOCAB, (1, 10)).astype(np.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    prefix = jax.device_put(np.array([4], np.int32))
    apply = jax.jit(lambda t: model.apply(params, t, prefix_lengths=prefix))
    base = np.asarray(apply(tokens))
    changed = tokens.copy()
    changed[0, 7] = 5  # a continuation token: earlier logits unchanged
    after = np.asarray(apply(changed))
    np.testing.assert_allclose(after[0, :7], base[0, :7], atol=1e-5)
    changed = tokens.copy()
    changed[0, 3] = 5  # a prefix token: the whole prefix sees it
    inside = np.asarray(apply(changed))
    assert not np.allclose(inside[0, 0], base[0, 0])
    # without a prefix it is a causal LM
    causal = np.asarray(jax.jit(model.apply)(params, tokens))
    assert not np.allclose(causal[0, 0], base[0, 0])


@pytest.mark.slow
def test_bert_classifier_reads_cls_and_ignores_padding():
    model = build_model(small_config("bert", head="classify", num_classes=3))
    tokens = np.random.default_rng(2).integers(4, VOCAB, (2, 8)).astype(np.int32)
    tokens[:, 0] = CLS
    segment_ids = jax.device_put(np.array([[1] * 8, [1] * 5 + [0] * 3], np.int32))
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    apply = jax.jit(lambda t: model.apply(params, t, segment_ids=segment_ids))
    logits = np.asarray(apply(tokens))
    assert logits.shape == (2, 3)
    padded = tokens.copy()
    padded[1, 6] = 7
    changed = np.asarray(apply(padded))
    np.testing.assert_allclose(changed[1], logits[1], atol=1e-5)  # padding is invisible


@pytest.mark.slow
def test_t5_padding_in_the_encoder_is_invisible_to_the_decoder():
    model = build_model(small_config("t5", position="t5", norm="rmsnorm", use_bias=False))
    assert isinstance(model, EncoderDecoder)
    enc = np.random.default_rng(3).integers(4, VOCAB, (1, 9)).astype(np.int32)
    dec = jax.jit(shift_right, static_argnums=1)(
        np.random.default_rng(4).integers(4, VOCAB, (1, 5)).astype(np.int32), PAD)
    enc_ids = jax.device_put(np.array([[1] * 6 + [0] * 3], np.int32))
    params = jax.jit(model.init)(jax.random.key(0), enc, dec)
    apply = jax.jit(lambda e: model.apply(params, e, dec, encoder_segment_ids=enc_ids))
    logits = np.asarray(apply(enc))
    padded = enc.copy()
    padded[0, 7] = 9
    changed = np.asarray(apply(padded))
    np.testing.assert_allclose(changed, logits, atol=1e-5)
    assert "relative_position_bias" in params["params"]["encoder"]  # one table per stack
    assert "relative_position_bias" not in params["params"]["encoder"]["layers_0"]


def test_t5_decoder_padding_takes_no_expert_slot():
    """Capacity routing (the MoE default): a decoder row's right padding must not push out a
    real token's expert choice, so the real tokens' logits are those of the unpadded rows (2
    tokens: their ceil(1.25 x 2 x 2 / 4) = 2 slots per expert drop nothing)."""
    config = small_config("t5", num_layers=1, num_decoder_layers=1)
    config.moe.update(num_experts=4, top_k=2)
    rng = np.random.default_rng(0)
    enc = rng.integers(4, VOCAB, (8, 12)).astype(np.int32)
    real = rng.integers(4, VOCAB, (8, 2)).astype(np.int32)
    real[:, 0] = PAD  # <bos> = <pad> = 0, as in T5's vocabulary
    padded = np.pad(real, ((0, 0), (0, 14)))
    model = build_model(config)
    params = jax.jit(model.init)(jax.random.key(0), enc, padded)
    apply = jax.jit(model.apply)
    np.testing.assert_allclose(apply(params, enc, padded)[:, :2], apply(params, enc, real),
                               atol=1e-5)


@pytest.mark.slow
def test_lstm_is_causal_and_resets_at_document_boundaries():
    model = LSTMLM(VOCAB, d_model=16, num_layers=2)
    docs = [np.random.default_rng(5 + i).integers(4, VOCAB, (1, n)).astype(np.int32)
            for i, n in enumerate((5, 3))]
    packed = np.concatenate(docs, axis=1)
    segment_ids = np.array([[1] * 5 + [2] * 3], np.int32)
    params = jax.jit(model.init)(jax.random.key(0), packed)
    forward = jax.jit(model.apply)
    apply = lambda x, **kwargs: np.asarray(forward(params, x, **kwargs))
    out = apply(packed, segment_ids=segment_ids)
    np.testing.assert_allclose(out[:, 5:], apply(docs[1]), atol=1e-5)
    np.testing.assert_allclose(out[:, :5], apply(docs[0]), atol=1e-5)
    changed = packed.copy()
    changed[0, 4] = 9
    future = apply(changed)
    np.testing.assert_allclose(future[:, :4], apply(packed)[:, :4], atol=1e-6)


def test_an_lstm_with_16_bit_params_initialises_its_recurrence_orthogonal():
    """The orthogonal init's QR has no 16-bit kernel on CPU: a bfloat16 param_dtype raised
    NotImplementedError before any step."""
    model = LSTMLM(VOCAB, d_model=16, num_layers=1, param_dtype=jnp.bfloat16)
    params = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    w_h = nn.unbox(params["lstm_0"]["recurrent_kernel"])
    assert w_h.dtype == jnp.bfloat16
    flat = np.asarray(w_h, np.float32).reshape(-1, 16)  # orthonormal columns, to bf16 rounding
    np.testing.assert_allclose(flat.T @ flat, np.eye(16), atol=3e-2)


def test_build_model_rejects_unknown_keys_and_families():
    with pytest.raises(ValueError, match="model.family='gtp'"):
        build_model(small_config("gtp"))
    config = default_model_config().to_dict()
    config["num_layer"] = 3
    with pytest.raises(ValueError, match=r"unknown model config keys \['num_layer'\]"):
        build_model(ml_collections.ConfigDict(config))


def test_optional_config_fields_accept_typed_overrides():
    config = default_model_config()
    config.num_kv_heads = 2
    config.init_std = 0.02
    with pytest.raises(TypeError):
        config.num_kv_heads = "two"
    model = build_model(small_config("gpt", num_kv_heads=2))
    params = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 4), np.int32))
    assert params["params"]["decoder"]["layers_0"]["self_attention"]["key"].value.shape == (
        32, 2, 8)


# --- the family table -----------------------------------------------------------------------


def _pretraining_batch(config):
    """One batch of the real pipeline for the family's pretraining objective (text families)."""
    from transformer.data import pipeline, tokenizers

    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=config.data.num_sentinels)
    docs = [(np.arange(n) % 200 + 10).astype(np.int32) for n in (70, 23)]  # uneven lengths
    dataset = pipeline.make_dataset(
        docs, objective=pipeline.objective_for(config), tokenizer=tokenizer,
        seq_len=config.seq_len, batch_size=2, seed=0, rows=[0, 1], prefetch=0,
        mlm_rate=config.data.mlm_rate, noise_density=config.data.noise_density,
        mean_span_length=config.data.mean_span_length)
    return next(iter(dataset))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "prefix_lm", "bert", "t5", "lstm", "vit", "clip",
                                  "captioner"])
def test_every_family_in_the_table_builds_initializes_and_runs_from_its_entry(name):
    """A family's table entry alone drives building, initializing (`state.initial_state`) and
    the loss: its declared inputs and features are what the pipeline feeds it."""
    from transformer.configs import base_config
    from transformer.data import pipeline
    from transformer.models import FAMILIES, family_of
    from transformer.parallel import sharding
    from transformer.training import state

    family = FAMILIES[name]
    config = base_config()
    config.seq_len = 16
    config.model.update(family=name, num_layers=1, d_model=16, num_heads=2, d_ff=32,
                        vocab_size=384, num_classes=3 if family.classifier(config.model) else 0)
    assert family_of(config) is family and family.name == name
    assert pipeline.objective_for(config) == family.objective
    model = build_model(config.model)
    abstract, shardings, init = state.initial_state(
        config, model, sharding.make_mesh(config.mesh, jax.devices()[:1]))
    assert abstract.opt_state is None and state.num_params(abstract) > 0
    params = init(jax.random.key(0)).params
    if family.objective in pipeline.OBJECTIVES:  # text: a real pipeline batch
        batch = _pretraining_batch(config)
        assert set(family.inputs + family.features) <= set(batch), sorted(batch)
        loss, metrics = jax.device_get(jax.jit(
            lambda p, b: family.loss_and_metrics(model, config, p, b))(params, batch))
        assert np.isfinite(loss) and metrics["num_tokens"] > 0
    else:  # images: the example batch the state was built from
        logits = jax.jit(lambda p, b: family.logits(model, p, b))(
            params, state.example_batch(config))
        assert logits.shape[0] == 1 and np.all(np.isfinite(logits))
