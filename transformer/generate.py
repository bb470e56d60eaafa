"""Sampling text from a decoder LM (full recomputation per token; the KV-cache path replaces it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data import tokenizers as tokenizers_lib


@functools.partial(jax.jit, static_argnames=("apply_fn", "length", "temperature"))
def _sample_loop(params, buffer, start, rng, *, apply_fn, length, temperature):
    """Fills buffer[:, start:length] one token at a time (each step reruns the whole prefix)."""

    def step(t, carry):
        buffer, rng = carry
        logits = apply_fn(params, buffer)[:, t - 1]  # position t - 1 predicts token t
        rng, key = jax.random.split(rng)
        if temperature == 0.0:
            token = jnp.argmax(logits, axis=-1)
        else:
            token = jax.random.categorical(key, logits / temperature)
        return buffer.at[:, t].set(token.astype(buffer.dtype)), rng

    buffer, _ = jax.lax.fori_loop(start, length, step, (buffer, rng))
    return buffer


def sample_texts(model, params, tokenizer, config, *, num_samples: int = 3, prompt: str = "",
                 temperature: float = 0.8, seed: int = 0) -> list[str]:
    """`num_samples` continuations of `prompt` (after an <eos>, i.e. a document start), each
    filling the model's training context of config.seq_len tokens."""
    prompt_ids = np.concatenate([[tokenizers_lib.EOS_ID], tokenizer.encode(prompt)])
    length = config.seq_len
    if len(prompt_ids) >= length:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens: expected < seq_len={length}")
    buffer = np.zeros((num_samples, length), np.int32)
    buffer[:, :len(prompt_ids)] = prompt_ids
    apply_fn = functools.partial(_apply_tokens, model)
    out = _sample_loop(params, jnp.asarray(buffer), len(prompt_ids), jax.random.key(seed),
                       apply_fn=apply_fn, length=length, temperature=temperature)
    texts = []
    for row in np.asarray(out):
        ids = row[1:]
        ends = np.flatnonzero(ids[len(prompt_ids) - 1:] == tokenizers_lib.EOS_ID)
        if ends.size:
            ids = ids[:len(prompt_ids) - 1 + ends[0]]
        texts.append(tokenizer.decode(ids))
    return texts


def _apply_tokens(model, params, tokens):
    return model.apply({"params": params}, tokens)
