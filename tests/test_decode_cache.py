"""KV-cache decoding gives the logits of recomputing the whole sequence, at every step."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.configs import base_config
from transformer.models import build_model, init_cache

VOCAB, LENGTH, PROMPT = 40, 8, 3


def model_config(family="gpt", **overrides):
    config = base_config().model
    config.update(family=family, vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
                  d_ff=64, max_len=16, dropout_rate=0.0, **overrides)
    return config


def tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, shape), jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "length"))
def _step(model, length, params, cache, tokens_BT, positions_BT, prefix_lengths,
          segments_BT=None):
    return model.apply({"params": params, "cache": cache}, tokens_BT, positions=positions_BT,
                       prefix_lengths=prefix_lengths, decode=True, cache_length=length,
                       segment_ids=segments_BT, mutable=["cache"])


def cached_logits(model, params, tokens_BT, prompt_lengths, prefix_lengths=None):
    """Prefill each row's prompt (right-padded to the longest), then feed one token per step
    at per-row positions; returns each row's logits at positions 0..T-1 as the cache saw them."""
    batch, length = tokens_BT.shape
    prompt_lengths = np.asarray(prompt_lengths)
    width = int(prompt_lengths.max())
    cache = init_cache(model, batch, length)
    step_fn = jax.jit(functools.partial(_step, model, length))  # compiles prefill and step
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    # the prompt's tokens (1) and its right padding (0), which a recurrent layer's state skips
    segments = (positions < jnp.asarray(prompt_lengths)[:, None]).astype(jnp.int32)
    logits, mutated = step_fn(params, cache, tokens_BT[:, :width], positions, prefix_lengths,
                              segments)
    cache = mutated["cache"]
    out = np.zeros((batch, length, VOCAB), np.float32)
    for b in range(batch):
        out[b, :prompt_lengths[b]] = logits[b, :prompt_lengths[b]]
    for step in range(length - int(prompt_lengths.min())):
        position = jnp.minimum(jnp.asarray(prompt_lengths) + step, length - 1)[:, None]
        token = jnp.take_along_axis(tokens_BT, position, axis=1)
        logits, mutated = step_fn(params, cache, token, position.astype(jnp.int32),
                                  prefix_lengths)
        cache = mutated["cache"]
        for b in range(batch):
            if prompt_lengths[b] + step < length:
                out[b, prompt_lengths[b] + step] = logits[b, 0]
    return out


@pytest.mark.parametrize("overrides", [
    dict(position="rope", num_kv_heads=1),  # MQA: one KV head
    dict(position="rope", attention_kind="mla"),  # MLA: one latent
], ids=["mqa", "mla"])
def test_a_one_row_decode_step_writes_each_cache_buffer_once_in_place(overrides):
    """Batch 1, one token: each cache buffer is written by one instruction, in place, and
    copied nowhere (`attention.write_slots`; XLA:CPU copied a one-slot write's buffer into each
    reader, 4 copies of the whole cache a layer a step), and the logits are the full forward's."""
    config = model_config(**overrides)
    if overrides.get("attention_kind") == "mla":
        config.mla.update(kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=8)
    model, length = build_model(config), 96  # buffer sizes no other array in the step has
    sequence = tokens((1, LENGTH))
    params = jax.jit(model.init)(jax.random.key(0), sequence)["params"]
    full = np.asarray(jax.jit(model.apply)({"params": params}, sequence))
    cache = init_cache(model, 1, length)
    step = jax.jit(functools.partial(_step, model, length), donate_argnums=1)
    positions = jnp.arange(LENGTH, dtype=jnp.int32)[None]
    _, mutated = step(params, cache, sequence[:, :PROMPT], positions[:, :PROMPT], None)
    one = (params, mutated["cache"], sequence[:, PROMPT:PROMPT + 1],
           positions[:, PROMPT:PROMPT + 1], None)
    logits, _ = step(*one)
    np.testing.assert_allclose(logits[0, 0], full[0, PROMPT], atol=2e-5, rtol=2e-5)

    hlo = step.lower(*one).compile().as_text()
    sizes = {x.size for x in jax.tree.leaves(cache)}
    written = [op for dims, op in re.findall(r"= f32\[([0-9,]*)\]\{[0-9,]*\} (\w[\w-]*)\(", hlo)
               if op not in ("parameter", "bitcast", "get-tuple-element")
               and math.prod(int(d) for d in dims.split(",") if d) in sizes]
    # one fusion writes each buffer (a scatter, or the loop the test flags expand it into)
    assert written.count("fusion") == len(jax.tree.leaves(cache)), written
    assert "copy" not in written, written


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(position="rope"), dict(position="learned"), dict(position="sinusoidal"),
    dict(position="alibi"), dict(position="t5"), dict(position="none"),
    dict(position="rope", num_kv_heads=1),  # MQA
    dict(position="rope", num_kv_heads=2, scan_layers=True),  # GQA, scanned layers
    dict(position="rope", rope_layout="interleaved", norm_placement="post"),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_cached_decoding_equals_full_recomputation(overrides):
    model = build_model(model_config(**overrides))
    sequence = tokens((2, LENGTH))
    params = jax.jit(model.init)(jax.random.key(0), sequence)["params"]
    full = np.asarray(jax.jit(model.apply)({"params": params}, sequence))
    # Row 0 has a 3-token prompt, row 1 a 5-token one: per-row positions in the same batch.
    cached = cached_logits(model, params, sequence, [PROMPT, PROMPT + 2])
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_prefix_lm_cached_decoding_equals_full_recomputation():
    model = build_model(model_config("prefix_lm", position="rope"))
    sequence = tokens((2, LENGTH), seed=1)
    params = model.init(jax.random.key(0), sequence)["params"]
    prefix = jnp.array([PROMPT, PROMPT + 2])  # the prompt is the bidirectional prefix
    full = np.asarray(model.apply({"params": params}, sequence, prefix_lengths=prefix))
    cached = cached_logits(model, params, sequence, np.asarray(prefix), prefix_lengths=prefix)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)
    # And it is not the causal model's answer: the prefix really is bidirectional.
    causal = np.asarray(model.apply({"params": params}, sequence))
    assert np.abs(causal[:, :PROMPT] - full[:, :PROMPT]).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_t5_cached_decoding_reuses_the_encoder_and_equals_full_recomputation(scan_layers):
    model = build_model(model_config("t5", position="t5", scan_layers=scan_layers,
                                     num_decoder_layers=2))
    encoder_tokens, decoder_tokens = tokens((2, 6), seed=2), tokens((2, LENGTH), seed=3)
    valid = jnp.array([[1] * 6, [1] * 4 + [0] * 2], jnp.int32)  # row 1 has 2 padded tokens
    params = jax.jit(model.init)(jax.random.key(0), encoder_tokens, decoder_tokens)["params"]
    full = np.asarray(jax.jit(lambda p: model.apply({"params": p}, encoder_tokens, decoder_tokens,
                                                    encoder_segment_ids=valid))(params))
    encoded = jax.jit(lambda p: model.apply({"params": p}, encoder_tokens, segment_ids=valid,
                                            method=model.encode))(params)
    cache = init_cache(model, 2, LENGTH, encoder_length=6)
    decode = jax.jit(lambda cache, encoded, token, position: model.apply(
        {"params": params, "cache": cache}, encoded, token, encoder_segment_ids=valid,
        decoder_positions=position, decode=True, cache_length=LENGTH, method=model.decode,
        mutable=["cache"]))
    for t in range(LENGTH):
        position = jnp.full((2, 1), t, jnp.int32)
        # Only the first step sees the encoder output; later steps use the cached K/V.
        logits, mutated = decode(cache, encoded if t == 0 else None, decoder_tokens[:, t:t + 1],
                                 position)
        cache = mutated["cache"]
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_decode_needs_positions():
    model = build_model(model_config())
    sequence = tokens((1, LENGTH))
    params = model.init(jax.random.key(0), sequence)["params"]
    with pytest.raises(ValueError, match="decode=True needs positions"):
        model.apply({"params": params, "cache": init_cache(model, 1, LENGTH)}, sequence,
                    decode=True, mutable=["cache"])


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_cached_decoding_with_attention_sinks_equals_full_recomputation(scan_layers):
    """With `attention_sinks` (GQA), each decode step's softmax has the sink in it as the
    recomputation's does; the sinks are set large so that they matter."""
    model = build_model(model_config(position="rope", num_kv_heads=2, attention_sinks=True,
                                     scan_layers=scan_layers))
    sequence = tokens((2, LENGTH), seed=4)
    params = jax.jit(model.init)(jax.random.key(0), sequence)["params"]
    set_sinks = lambda value: jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.broadcast_to(value, x.shape) if "sinks" in jax.tree_util.keystr(
            path) else x, params)
    assert len([p for p, _ in jax.tree_util.tree_leaves_with_path(params)
                if "sinks" in jax.tree_util.keystr(p)]) == (1 if scan_layers else 2)
    params = set_sinks(jnp.array([2.0, -1.0, 0.5, 3.0]))
    full = np.asarray(jax.jit(model.apply)({"params": params}, sequence))
    cached = cached_logits(model, params, sequence, [PROMPT, PROMPT + 2])
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)
    without = np.asarray(jax.jit(model.apply)({"params": set_sinks(-1e4)}, sequence))
    assert np.abs(without - full).max() > 1e-2  # the sinks take part
