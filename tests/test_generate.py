"""Generation: sampling filters and their statistics, the while-loop drivers on fake models,
KV-cache decoding of batched prompts of different lengths (gpt, prefix_lm, t5), beam search
against brute force, streaming, text sampling and argument errors."""

from __future__ import annotations

import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from transformer import generate
from transformer.configs import base_config
from transformer.data import tokenizers
from transformer.generation import loop, programs
from transformer.generation import sampling as sampling_lib
from transformer.models import build_model, default_model_config

VOCAB = 48


@pytest.fixture(scope="module")
def models():
    """Tiny untrained models with spread-out logits (init_std=1), one per cached family."""
    out = {}
    for family, position in (("gpt", "learned"), ("prefix_lm", "rope"), ("t5", "t5")):
        config = default_model_config()
        config.update(family=family, num_layers=2, d_model=32, num_heads=4, d_ff=64,
                      vocab_size=VOCAB, position=position, max_len=32, init_std=1.0)
        if family == "t5":
            config.num_layers = 1
        model = build_model(config)
        tokens = jnp.ones((1, 4), jnp.int32)
        args = (tokens, tokens) if family == "t5" else (tokens,)
        out[family] = model, jax.jit(model.init)(jax.random.key(0), *args)["params"]
    return out


PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]  # different lengths: the batch pads the second


# --- sampling filters ---------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
    kept = lambda **kw: np.flatnonzero(generate.kept_tokens(logits, **kw)[0]).tolist()
    assert kept(top_p=0.4) == [1]  # 0.4 alone reaches 0.4
    assert kept(top_p=0.41) == [1, 3]
    assert kept(top_p=0.7) == [1, 3]  # exactly reached (up to rounding)
    assert kept(top_p=0.71) == [1, 2, 3]
    assert kept(top_p=0.05) == [1]  # the best token is always kept
    assert kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=3, top_p=0.6) == [1, 3]  # top-p over the renormalized top 3: 4/9 < 0.6
    ties = jnp.zeros((1, 4))  # four tokens of 0.25: the lower ids win, deterministically
    assert np.flatnonzero(generate.kept_tokens(ties, top_p=0.5)[0]).tolist() == [0, 1]
    assert np.flatnonzero(generate.kept_tokens(ties, top_k=3)[0]).tolist() == [0, 1, 2, 3]


def _kept_by_sorting(logits, top_k, top_p):
    """The reference: HF's top-k (every logit >= the k-th best), then top-p over a stable
    best-first sort of the whole row (ties: lower id first)."""
    logits = np.where(logits < np.sort(logits)[-top_k], -np.inf, logits)
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    keep = np.cumsum(probs) - probs < top_p - sampling_lib._TOP_P_TOLERANCE
    keep[0] = True
    return sorted(order[keep & (probs > 0)].tolist())


def test_top_k_keeps_every_token_tied_with_the_kth_best_as_hf():
    """HF's TopKLogitsWarper keeps every token whose logit is >= the k-th largest (ties are
    common in bf16 logits), so more than k tokens where the k-th best is tied; top-p after it
    ranks those ties lower id first."""
    logits = jnp.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    kept = lambda **kw: np.flatnonzero(generate.kept_tokens(logits, **kw)[0]).tolist()
    assert kept(top_k=2) == [0, 1, 2, 3]
    assert kept(top_k=1) == [0] and kept(top_k=5) == [0, 1, 2, 3, 4]
    # top-p over the four: e/(e+3) = 0.48, then 1/(e+3) = 0.17 each: cumulative 0.48, 0.65,
    # 0.83, 1 (the ties past the k: ids 2 and 3)
    assert kept(top_k=2, top_p=0.4) == [0]
    assert kept(top_k=2, top_p=0.6) == [0, 1]
    assert kept(top_k=2, top_p=0.7) == [0, 1, 2]
    assert kept(top_k=2, top_p=0.9) == [0, 1, 2, 3]
    rows = np.asarray(jax.random.randint(jax.random.key(0), (64, 12), 0, 4), np.float32)
    for top_k, top_p in itertools.product((1, 2, 3, 5), (0.3, 0.6, 0.9, 1.0)):
        got = np.asarray(generate.kept_tokens(jnp.asarray(rows), top_k=top_k, top_p=top_p))
        for row, keep in zip(rows, got, strict=True):
            assert np.flatnonzero(keep).tolist() == _kept_by_sorting(row, top_k, top_p), (
                row, top_k, top_p)
    tokens = generate.sample_tokens(jnp.broadcast_to(logits, (20_000, 6)), jax.random.key(1),
                                    top_k=2)
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[4:].sum() == 0
    probs = np.exp([3.0, 2.0, 2.0, 2.0])
    assert stats.chisquare(counts[:4], probs / probs.sum() * 20_000).pvalue > 1e-3


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.75)])
def test_sampled_frequencies_match_the_filtered_softmax(top_k, top_p):
    """Chi-square over 40k draws from one fixed logits vector, drawn in one vectorised call."""
    probs = np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02])
    logits = np.log(probs) * 2.0  # temperature 2 recovers `probs`
    n = 40_000
    tokens = generate.sample_tokens(jnp.broadcast_to(jnp.asarray(logits, jnp.float32),
                                                     (n, len(probs))),
                                    jax.random.key(1), temperature=2.0, top_k=top_k, top_p=top_p)
    counts = np.bincount(np.asarray(tokens), minlength=len(probs))
    keep = np.ones(len(probs), bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:  # cumulative 0.3, 0.55, 0.75: the first three reach 0.75
        keep[3:] = False
    assert counts[~keep].sum() == 0
    expected = probs[keep] / probs[keep].sum() * n
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-3


def test_greedy_picks_the_argmax_and_low_temperature_converges_to_it():
    logits = jax.random.normal(jax.random.key(0), (64, 50)) * 3
    greedy = generate.sample_tokens(logits, jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))
    # 2e-38: logits / T would overflow float32 (inf - inf is NaN in the softmax) but for the
    # row's max coming off first
    for kw in (dict(temperature=1e-6), dict(temperature=2e-38), dict(temperature=1.0, top_k=1),
               dict(temperature=1.0, top_p=1e-3), dict(temperature=2e-38, top_p=0.5)):
        np.testing.assert_array_equal(
            generate.sample_tokens(logits, jax.random.key(3), **kw), greedy, err_msg=str(kw))


# --- the loops on fake models -------------------------------------------------------------------


def _counting_step(params, context, cache, tokens_B1, positions_B1):
    """A fake model: the next token is (token + context) % V; the cache records the positions
    it was fed at and how many steps ran."""
    positions, steps = cache
    rows = jnp.arange(tokens_B1.shape[0])
    positions = positions.at[rows, steps].set(positions_B1[:, 0])
    logits = jax.nn.one_hot((tokens_B1[:, 0] + context) % 10, 10) * 10.0
    return logits, (positions, steps + 1)


def test_generate_tokens_loop_stops_at_eos_and_max_length():
    first = jax.nn.one_hot(jnp.array([3, 7]), 10) * 10.0
    cache = (jnp.full((2, 8), -1), jnp.zeros((), jnp.int32))
    run = jax.jit(lambda first, cache, start: generate.generate_tokens(
        _counting_step, None, jnp.array([1, 2]), cache, first, start, max_new_tokens=6,
        eos_id=9))
    tokens, lengths = run(first, cache, jnp.array([4, 2]))
    # Row 0 counts up by 1 from 3 and stops at 9; row 1 by 2 from 7: 7, 9 (EOS), then pads.
    np.testing.assert_array_equal(tokens, [[3, 4, 5, 6, 7, 8], [7, 9, 0, 0, 0, 0]])
    np.testing.assert_array_equal(lengths, [6, 2])
    no_eos = jax.jit(lambda first, cache: generate.generate_tokens(
        _counting_step, None, jnp.array([1, 2]), cache, first, jnp.array([4, 2]),
        max_new_tokens=4, eos_id=None))
    np.testing.assert_array_equal(no_eos(first, cache)[0], [[3, 4, 5, 6], [7, 9, 1, 3]])


def test_a_row_stops_at_the_first_of_several_stop_ids():
    """eos_id may list several ids (a checkpoint's generation_config.json eos_token_id list, as
    Llama 3.1's <|end_of_text|>, <|eom_id|>, <|eot_id|>): a row stops at whichever it emits
    first, and its length counts it."""
    first = jax.nn.one_hot(jnp.array([3, 7]), 10) * 10.0
    cache = (jnp.full((2, 8), -1), jnp.zeros((), jnp.int32))
    run = jax.jit(lambda first, cache: generate.generate_tokens(
        _counting_step, None, jnp.array([1, 2]), cache, first, jnp.array([4, 2]),
        max_new_tokens=6, eos_id=[9, 5]))
    tokens, lengths = run(first, cache)
    # Row 0 counts up by 1 from 3 and stops at 5; row 1 by 2 from 7: 7, 9.
    np.testing.assert_array_equal(tokens, [[3, 4, 5, 0, 0, 0], [7, 9, 0, 0, 0, 0]])
    np.testing.assert_array_equal(lengths, [3, 2])
    np.testing.assert_array_equal(loop._lengths(np.asarray(tokens), (9, 5)), [3, 2])


def test_generate_tokens_feeds_positions_and_exits_once_every_row_is_done():
    first = jax.nn.one_hot(jnp.array([7, 8]), 10) * 10.0
    mode, knobs = sampling_lib._split(sampling_lib.Sampling(), 10, eos_id=9)
    state = loop._start_state((jnp.full((2, 8), -1), jnp.zeros((), jnp.int32)),
                              jnp.array([1, 1]), first, jnp.array([4, 2]), 0, knobs,
                              max_new_tokens=8, mode=mode)
    state = loop._run(_counting_step, None, state, 8, mode)
    positions, steps = state.cache
    assert int(steps) == 2 and int(state.step) == 3  # row 0: 7 8 9, row 1: 8 9; then stop
    np.testing.assert_array_equal(positions[:, :2], [[4, 5], [2, 3]])


def _history_step(params, context, cache, tokens_B1, positions_B1):
    """A fake model whose next-token logits depend on the whole history held in its cache, so
    beam search must reorder the cache rows with the beams."""
    rows = jnp.arange(tokens_B1.shape[0])
    cache = cache.at[rows, positions_B1[:, 0]].set(tokens_B1[:, 0])
    code = (cache * jnp.array([1, 5, 25, 125])).sum(1) % params.shape[0] + context
    return params[code % params.shape[0]], cache


def _best_by_enumeration(table, first_logits, context, alpha, stops, n):
    """The highest-scoring sequence over every sequence of up to n tokens (a stop only last)."""
    vocab = table.shape[1]
    logp = lambda x: np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32)))
    best, best_score = None, -np.inf
    for length in range(1, n + 1):
        for seq in itertools.product(range(vocab), repeat=length):
            if set(seq[:-1]) & set(stops) or (length < n and seq[-1] not in stops):
                continue
            history, total = np.zeros(4, np.int64), logp(first_logits)[seq[0]]
            for t in range(1, length):
                history[t] = seq[t - 1]
                code = (history * np.array([1, 5, 25, 125])).sum() % len(table) + context
                total += logp(table[code % len(table)])[seq[t]]
            score = total / generate.length_penalty_factor(length, alpha)
            if score > best_score:
                best, best_score = list(seq) + [0] * (n - length), score
    return best, best_score


@pytest.mark.parametrize("alpha,eos_id", [(0.0, 2), (2.0, 2), (2.0, (2, 3))])
def test_beam_search_with_every_prefix_kept_finds_the_best_sequence(alpha, eos_id):
    vocab, n, batch = 4, 3, 2
    stops = (eos_id,) if isinstance(eos_id, int) else eos_id
    beam = vocab ** (n - 1)  # wide enough to keep every prefix: the search is exhaustive
    table = np.asarray(jax.random.normal(jax.random.key(2), (11, vocab)) * 1.5)
    first = np.asarray(jax.random.normal(jax.random.key(3), (batch, vocab)))
    context = np.array([0, 3])
    rows = lambda x: jnp.repeat(jnp.asarray(x), beam, axis=0)
    search = jax.jit(lambda: generate.beam_search_tokens(
        _history_step, jnp.asarray(table), rows(context), jnp.zeros((batch * beam, 4), jnp.int32),
        rows(first), jnp.ones(batch * beam, jnp.int32), beam_size=beam, max_new_tokens=n,
        length_penalty=alpha, eos_id=eos_id))
    tokens, lengths, scores = search()
    for b in range(batch):
        want, want_score = _best_by_enumeration(table, first[b], context[b], alpha, stops, n)
        assert tokens[b].tolist() == want
        ends = [i for i, token in enumerate(want) if token in stops]
        assert lengths[b] == (ends[0] + 1 if ends else n)
        np.testing.assert_allclose(scores[b], want_score, rtol=1e-5)


def _unsure_counting_step(params, context, cache, tokens_B1, positions_B1):
    """A fake model counting up as `_counting_step`, with little confidence: the next token has
    probability ~0.15, so a sequence that ends soon has a higher log-probability than one that
    goes on."""
    return jax.nn.one_hot((tokens_B1[:, 0] + context) % 10, 10) * 0.5, cache


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_one_beam_is_greedy_even_where_eos_ranks_second(alpha):
    """beam_size=1 is greedy decoding (as HF's num_beams=1): row 0's EOS (9) ranks second
    after the first token, and ending there would score higher than greedy's continuation,
    which one beam must take anyway; row 1's greedy reaches EOS, and stops there."""
    first = jnp.array([[0, 0, 0, 2.0, 0, 0, 0, 0, 0, 1.9], [0, 0, 0, 0, 0, 0, 0, 2.0, 0, 1.9]])
    cache = jnp.zeros((2, 1))  # (the step needs none)
    context, start = jnp.array([1, 2]), jnp.array([4, 2])
    greedy, greedy_lengths = jax.jit(lambda: generate.generate_tokens(
        _unsure_counting_step, None, context, cache, first, start, max_new_tokens=6,
        eos_id=9))()
    tokens, lengths, scores = jax.jit(lambda: generate.beam_search_tokens(
        _unsure_counting_step, None, context, cache, first, start, beam_size=1,
        max_new_tokens=6, length_penalty=alpha, eos_id=9))()
    np.testing.assert_array_equal(greedy, [[3, 4, 5, 6, 7, 8], [7, 9, 0, 0, 0, 0]])
    np.testing.assert_array_equal(tokens, greedy)
    np.testing.assert_array_equal(lengths, greedy_lengths)
    ended_first = np.log(np.asarray(jax.nn.softmax(first[0]))[9])
    assert ended_first / generate.length_penalty_factor(1, alpha) > scores[0]  # EOS would win


# --- models -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "prefix_lm", "t5"])
def test_batched_prompts_of_different_lengths_decode_as_alone(models, family):
    model, params = models[family]
    kw = dict(max_new_tokens=6, prefix_lm=family == "prefix_lm")
    tokens, lengths = generate.decode(model, params, PROMPTS, **kw)
    assert tokens.shape == (2, 6)
    for prompt, row in zip(PROMPTS, tokens, strict=True):
        alone, _ = generate.decode(model, params, [prompt], **kw)
        np.testing.assert_array_equal(alone[0], row)
    again, _ = generate.decode(model, params, PROMPTS, **kw)
    np.testing.assert_array_equal(again, tokens)  # greedy is deterministic
    if family != "t5":  # the cached tokens are the full forward's argmax, token by token
        seq = list(PROMPTS[0]) + tokens[0].tolist()
        kwargs = dict(prefix_lengths=jnp.array([5])) if family == "prefix_lm" else {}
        logits = jax.jit(model.apply)({"params": params}, jnp.array([seq[:-1]]), **kwargs)
        np.testing.assert_array_equal(jnp.argmax(logits[0, 4:], -1), tokens[0])


@pytest.mark.slow
def test_decode_stops_each_row_at_eos_and_sampling_is_seeded(models):
    model, params = models["gpt"]
    greedy, _ = generate.decode(model, params, PROMPTS, max_new_tokens=6, eos_id=None)
    eos = int(greedy[0, 2])
    tokens, lengths = generate.decode(model, params, PROMPTS, max_new_tokens=6, eos_id=eos)
    first_eos = [int(np.flatnonzero(np.append(r, eos) == eos)[0]) for r in greedy]
    for row, full, end in zip(tokens, greedy, first_eos, strict=True):
        np.testing.assert_array_equal(row[:end + 1], full[:end + 1])
        assert (row[end + 1:] == tokenizers.PAD_ID).all()
    assert lengths.tolist() == [min(e + 1, 6) for e in first_eos]
    for kw in (dict(temperature=1e-6), dict(temperature=1.0, top_k=1)):
        same, _ = generate.decode(model, params, PROMPTS, max_new_tokens=6, eos_id=None, **kw)
        np.testing.assert_array_equal(same, greedy, err_msg=str(kw))
    same_prompt = [PROMPTS[0], PROMPTS[0]]  # the shapes of PROMPTS: no new compile
    sample = lambda seed: generate.decode(model, params, same_prompt, max_new_tokens=6,
                                          temperature=1.0, seed=seed, eos_id=None)[0]
    a = sample(0)
    np.testing.assert_array_equal(a, sample(0))
    assert not np.array_equal(a, sample(1))
    assert not np.array_equal(a[0], a[1])  # the same prompt in two rows draws differently


def test_decode_stops_each_row_at_the_first_of_several_stop_ids(models):
    """Each row stops at the first of the stop ids it emits: here row 0 at one and row 1 at the
    other (the prefix LM's greedy rows are varied where the gpt's repeat one token)."""
    model, params = models["prefix_lm"]
    kw = dict(max_new_tokens=7, prefix_lm=True)
    full, _ = generate.decode(model, params, PROMPTS, eos_id=None, **kw)
    stops = [int(full[0, 4]), int(full[1, 2])]
    ends = [int(np.flatnonzero(np.isin(row, stops))[0]) for row in full]
    assert full[0, ends[0]] != full[1, ends[1]]  # (each row stops at another id)
    tokens, lengths = generate.decode(model, params, PROMPTS, eos_id=stops, **kw)
    assert lengths.tolist() == [end + 1 for end in ends]
    for row, whole, end in zip(tokens, full, ends, strict=True):
        np.testing.assert_array_equal(row[:end + 1], whole[:end + 1])
        assert (row[end + 1:] == tokenizers.PAD_ID).all()


def test_streaming_in_chunks_gives_the_same_tokens(models):
    model, params = models["gpt"]
    seen = []
    tokens, _ = generate.decode(model, params, PROMPTS, max_new_tokens=7, temperature=1.0,
                                top_p=0.9, seed=3, eos_id=None, chunk_size=3,
                                callback=seen.append)
    whole, _ = generate.decode(model, params, PROMPTS, max_new_tokens=7, temperature=1.0,
                               top_p=0.9, seed=3, eos_id=None)
    np.testing.assert_array_equal(tokens, whole)
    assert [s.shape[1] for s in seen] == [1, 4, 7]
    np.testing.assert_array_equal(seen[-1], tokens)


def test_a_capacity_routed_moe_decodes_a_batched_prompt_as_alone():
    """A capacity-routed MoE's row is one routing group whose slots per expert grow with its
    width, so a padded prompt would drop other tokens than alone: prompts of different lengths
    decode in batches of one length, put back in order (greedy and beam search), and a sampled
    row draws with its key in the whole batch, however the rows are grouped."""
    config = default_model_config()
    config.update(family="gpt", num_layers=2, d_model=32, num_heads=4, d_ff=64,
                  vocab_size=VOCAB, position="rope", max_len=64, init_std=1.0)
    config.moe.update(num_experts=4, top_k=1, capacity_factor=1.25)
    model = build_model(config)
    params = jax.jit(model.init)(jax.random.key(1), jnp.ones((1, 4), jnp.int32))["params"]
    assert programs.routes_with_capacity(model)
    long, short = list(range(5, 17)), [10, 11]
    padded = jax.jit(model.apply)({"params": params}, jnp.array([short + [0] * 10]))[0, :2]
    alone = jax.jit(model.apply)({"params": params}, jnp.array([short]))[0]
    assert not np.allclose(padded, alone, atol=1e-3)  # (a padded row routes otherwise)
    kw = dict(max_new_tokens=8, eos_id=None)
    both, lengths = generate.decode(model, params, [long, short], **kw)
    assert lengths.tolist() == [8, 8]
    for prompt, row in zip([long, short], both, strict=True):
        np.testing.assert_array_equal(generate.decode(model, params, [prompt], **kw)[0][0], row)
    beams, _, _ = generate.beam_search(model, params, [short, long], beam_size=1, **kw)
    np.testing.assert_array_equal(beams, both[::-1])  # one beam: greedy, in the input order
    kw.update(temperature=1.0, seed=3)
    # (JAX's default PRNG: conftest's rbg draws other bits for a key in a batch of another size)
    with jax.default_prng_impl("threefry2x32"):
        sampled, _ = generate.decode(model, params, [long, short], **kw)
        batched, _ = generate.decode(model, params, [[7, 8], short], **kw)  # one batch
    np.testing.assert_array_equal(sampled[1], batched[1])


@pytest.mark.slow
def test_t5_beam_search_scores_are_length_penalized_log_probabilities(models):
    model, params = models["t5"]
    tokens, lengths, scores = generate.beam_search(model, params, PROMPTS, beam_size=3,
                                                   max_new_tokens=6, length_penalty=0.6)
    alone = generate.beam_search(model, params, PROMPTS[1:], beam_size=3, max_new_tokens=6,
                                 length_penalty=0.6)  # the prompt the batch pads
    np.testing.assert_array_equal(alone[0][0], tokens[1])
    np.testing.assert_allclose(alone[2][0], scores[1], rtol=1e-5)
    # Teacher-forced log-probabilities of the returned sequences (both rows in one batch).
    encoder_inputs, encoder_lengths = programs._as_batch(PROMPTS, None, VOCAB)
    segments = (np.arange(encoder_inputs.shape[1]) < encoder_lengths[:, None]).astype(np.int32)
    decoder_inputs = np.concatenate([np.full((2, 1), tokenizers.BOS_ID), tokens[:, :-1]], 1)
    logits = jax.jit(model.apply)({"params": params}, encoder_inputs, decoder_inputs,
                                  encoder_segment_ids=segments)
    logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)),
                              tokens[:, :, None], -1)[:, :, 0]
    logp = (logp * (np.arange(6) < lengths[:, None])).sum(1)
    np.testing.assert_allclose(
        scores, logp / generate.length_penalty_factor(lengths, 0.6), rtol=1e-4)
    # One beam is greedy decoding.
    greedy, greedy_lengths = generate.decode(model, params, PROMPTS, max_new_tokens=6)
    one_beam, one_beam_lengths, _ = generate.beam_search(model, params, PROMPTS, beam_size=1,
                                                         max_new_tokens=6, length_penalty=0.0)
    np.testing.assert_array_equal(one_beam, greedy)
    np.testing.assert_array_equal(one_beam_lengths, greedy_lengths)


@pytest.mark.slow
def test_sample_texts():
    tokenizer = tokenizers.ByteTokenizer(num_sentinels=0)
    small = default_model_config()
    small.update(vocab_size=tokenizer.vocab_size, num_layers=1, d_model=16, num_heads=2,
                 d_ff=32)
    config = base_config()
    config.seq_len, config.model = 12, small
    for family in ("gpt", "lstm"):
        small.family = family
        model = build_model(small)
        params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
        texts = generate.sample_texts(model, params, tokenizer, config, num_samples=2,
                                      prompt="ab", seed=1)
        assert len(texts) == 2 and all(t.startswith("ab") for t in texts), texts
        assert texts == generate.sample_texts(model, params, tokenizer, config, num_samples=2,
                                              prompt="ab", seed=1)


def test_end_of_run_samples_run_past_document_ends():
    """The end-of-training samples fill their length: an <eos> the model emits becomes a
    paragraph break instead of the end of the sample (a gpt whose every logit favours <eos>)."""
    tokenizer = tokenizers.ByteTokenizer(num_sentinels=0)
    small = default_model_config()
    small.update(vocab_size=tokenizer.vocab_size, num_layers=1, d_model=16, num_heads=2, d_ff=32)
    config = base_config()
    config.seq_len, config.model = 12, small
    model = build_model(small)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4), jnp.int32))[
        "params"])
    final = params["decoder"]["final_norm"]
    params["decoder"]["final_norm"] = {**final, "scale": jnp.zeros_like(final["scale"]),
                                       "bias": jnp.ones_like(final["bias"])}
    eos = params["embed"]["embedding"][tokenizer.eos_id]
    params["embed"]["embedding"] = params["embed"]["embedding"].at[tokenizer.eos_id].set(
        jnp.where(eos == 0, 1.0, 100.0 * jnp.abs(eos) + 100.0))
    stop = generate.sample_texts(model, params, tokenizer, config, num_samples=1, prompt="ab",
                                 temperature=0.0, max_new_tokens=5)
    past = generate.sample_texts(model, params, tokenizer, config, num_samples=1, prompt="ab",
                                 temperature=0.0, max_new_tokens=5, past_eos=True)
    assert stop == ["ab"] and past == ["ab" + "\n\n" * 5]


def test_max_new_tokens_0_gives_the_prompt_alone_and_a_negative_count_is_named():
    """0 new tokens: the prompt (a decoder LM) or nothing (an encoder-decoder), without
    decoding (params=None); -5 is an error naming max_new_tokens, not the prompt."""
    tokenizer = tokenizers.ByteTokenizer(num_sentinels=0)
    config = base_config()
    config.seq_len, config.model.vocab_size = 12, tokenizer.vocab_size
    for family, expected in (("gpt", "ab"), ("lstm", "ab"), ("t5", "")):
        config.model.family = family
        model = build_model(config.model)
        assert generate.sample_texts(model, None, tokenizer, config, num_samples=2, prompt="ab",
                                     max_new_tokens=0) == [expected] * 2
        if family != "lstm":
            assert generate.beam_search_text(model, None, tokenizer, config, prompt="ab",
                                             max_new_tokens=0) == expected
        for text in (generate.sample_texts, generate.beam_search_text):
            with pytest.raises(ValueError, match=r"^max_new_tokens=-5: expected an int >= 0"):
                text(model, None, tokenizer, config, prompt="ab", max_new_tokens=-5)


def test_the_default_length_fits_a_learned_position_table_shorter_than_seq_len():
    """An imported checkpoint's table (model.max_len) can be shorter than seq_len: the default
    continuation fills the table, and a prompt that fills it is named with it."""
    from transformer.generation import text

    config = base_config()
    config.seq_len = 128
    config.model.update(position="learned", max_len=32)
    assert text._new_tokens(None, config, "causal", 5) == 27
    assert text._new_tokens(9, config, "causal", 5) == 9  # a length asked for stays
    with pytest.raises(ValueError, match=r"^prompt of 32 tokens: expected < model.max_len=32"):
        text._new_tokens(None, config, "causal", 32, 32)
    # the <eos> read before a stream-trained model's prompt is named apart from the prompt's
    with pytest.raises(ValueError, match=r"^prompt of 31 tokens and the 1 read before it \(a "
                                         r"document's start\): expected < model.max_len=32 in all"):
        text._new_tokens(None, config, "causal", 32, 31)
    config.model.position = "rope"  # no table: seq_len
    assert text._new_tokens(None, config, "causal", 5) == 123


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.5), r"temperature=-0.5: expected a finite float >= 0"),
    (dict(temperature=1e-40), r"temperature=1e-40: expected 0 \(greedy\) or a float >= "
                              r"1.18e-38 \(float32's smallest normal number\)"),
    (dict(top_p=0.0), r"top_p=0.0: expected a float in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5: expected a float in \(0, 1\]"),
    (dict(top_k=-1), r"top_k=-1: expected an int >= 0"),
    (dict(max_new_tokens=0), r"max_new_tokens=0: expected an int >= 1"),
    (dict(max_new_tokens=29), r"prompt of 5 tokens \+ max_new_tokens=29 - 1 = 33 positions: "
                              r"expected <= the model's max_len=32"),
    (dict(prompts=[[1], []]), r"prompt lengths \[1, 0\]: expected every prompt"),
    (dict(prompts=[[1, VOCAB]]), rf"prompt token {VOCAB}: expected ids in \[0, {VOCAB}\)"),
])
def test_bad_arguments_fail_before_compiling(models, kwargs, match):
    model, params = models["gpt"]
    kwargs = {"prompts": PROMPTS, "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate.decode(model, params, kwargs.pop("prompts"), **kwargs)


# --- text decoders never emit ids without text ---------------------------------------------------

TEXT_TOKENIZER = tokenizers.CharTokenizer("abcdefgh", num_sentinels=3)  # ids 7..14, 15..17
TEXT_VOCAB = 24  # padded past the tokenizer's 18: ids 18..23 have no text
SENTINELS = [15, 16, 17]
UNUSABLE = [0, 1, 3, 4, 5, 6] + list(range(18, TEXT_VOCAB))  # specials but <eos>, and padding


def _preferring_specials(params, family):
    """Params whose logits are one fixed vector at every position: the specials and padding
    ids +12, sentinels +10, <eos> -4, the characters small random values. The decoder's final
    norm gives a constant (scale 0, bias 1) that the head maps onto the vector; the LSTM (no
    norm) gets a zero head: every id equally likely, most of them unusable."""
    preference = np.asarray(jax.random.normal(jax.random.key(5), (TEXT_VOCAB,))) * 0.5
    preference[UNUSABLE], preference[SENTINELS], preference[tokenizers.EOS_ID] = 12, 10, -4

    def change(path, x):
        name = jax.tree_util.keystr(path)
        if "['decoder']['final_norm']" in name:
            return jnp.zeros_like(x) if "['scale']" in name else jnp.ones_like(x)
        if "['lm_head']['kernel']" in name:
            scale = 0.0 if family == "lstm" else 1.0 / x.shape[0]
            return jnp.broadcast_to(jnp.asarray(preference * scale, x.dtype), x.shape)
        return x

    return jax.tree_util.tree_map_with_path(change, params)


def _text_setup(family, objective=""):
    from transformer import configs

    config = configs.base_config()
    config.seq_len = 12
    config.data.objective = objective
    config.model.update(family=family, num_layers=1, d_model=16, num_heads=2, d_ff=32,
                        vocab_size=TEXT_VOCAB, position="t5" if family == "t5" else "rope",
                        norm="layernorm", use_bias=True, tie_embeddings=False,
                        scale_decoder_output=False)
    model = build_model(config.model)
    tokens = jnp.ones((1, 4), jnp.int32)
    args = (tokens, tokens) if family == "t5" else (tokens,)
    params = jax.jit(model.init)(jax.random.key(0), *args)["params"]
    return model, _preferring_specials(params, family), config


@pytest.mark.slow
@pytest.mark.parametrize("family,objective", [("gpt", ""), ("t5", "text2text"), ("lstm", "")])
def test_text_decoders_never_emit_specials_sentinels_or_ids_past_the_tokenizer(family,
                                                                              objective):
    model, params, config = _text_setup(family, objective)
    if family != "lstm":  # the raw decoder, unbanned, prefers exactly those ids
        raw, _ = generate.decode(model, params, [[tokenizers.EOS_ID, 7]], max_new_tokens=3)
        assert set(raw[0].tolist()) <= set(UNUSABLE)
    texts = []
    for temperature in (0.0, 1.0, 2.0):
        texts += generate.sample_texts(model, params, TEXT_TOKENIZER, config, num_samples=4,
                                       prompt="ab", temperature=temperature, seed=1,
                                       max_new_tokens=8)
    if family != "lstm":
        texts.append(generate.beam_search_text(model, params, TEXT_TOKENIZER, config,
                                               prompt="ab", beam_size=3, max_new_tokens=6))
    # Special and sentinel names start with "<"; an id past the tokenizer would not decode.
    assert all("<" not in text for text in texts), texts
    assert any(len(text) > 4 for text in texts), texts  # the decoders did write characters


def test_span_corruption_t5_writes_sentinels_and_no_other_special():
    """A T5 pretrained on span corruption is trained to write `<extra_id_0> c d <eos>`: its
    sentinels stay allowed (the best allowed id here), the other specials do not."""
    model, params, config = _text_setup("t5", "")  # the family's objective: span_corruption
    text, = generate.sample_texts(model, params, TEXT_TOKENIZER, config, num_samples=1,
                                  prompt="ab", temperature=0.0, max_new_tokens=4)
    beam = generate.beam_search_text(model, params, TEXT_TOKENIZER, config, prompt="ab",
                                     beam_size=2, max_new_tokens=4)
    for out in (text, beam):
        assert "<extra_id_" in out
        assert not {"<pad>", "<bos>", "<unk>", "<mask>", "<cls>", "<sep>"} & set(
            out.replace(">", "> ").replace("<", " <").split()), out


def test_banned_ids_lists_what_has_no_text():
    banned = generate.banned_ids(TEXT_TOKENIZER, TEXT_VOCAB)
    assert sorted(banned) == sorted(UNUSABLE + SENTINELS)
    assert tokenizers.EOS_ID not in banned
    assert sorted(generate.banned_ids(TEXT_TOKENIZER, TEXT_VOCAB, sentinels_allowed=True)) == \
        sorted(UNUSABLE)


def test_a_prompt_with_unknown_characters_warns_once_naming_them(capsys):
    model, params, config = _text_setup("gpt")
    generate.sample_texts(model, params, TEXT_TOKENIZER, config, num_samples=1,
                          prompt="a€bßc€", temperature=0.0, max_new_tokens=2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning:"), err
    assert "'€', 'ß'" in err and "<unk>" in err
    generate.sample_texts(model, params, TEXT_TOKENIZER, config, num_samples=1, prompt="abc",
                          temperature=0.0, max_new_tokens=2)
    assert capsys.readouterr().err == ""
    assert tokenizers.ByteTokenizer().unknown_chars("a€ß") == []


# --- prompts laid out as training rows; the command's checks and streaming ---------------------


def _byte_setup(family):
    """(model, tokenizer, config) of a tiny untrained `family` with the byte tokenizer."""
    tokenizer = tokenizers.ByteTokenizer(num_sentinels=0)
    config = base_config()
    config.seq_len = 12
    config.model.update(family=family, num_layers=1, d_model=16, num_heads=2, d_ff=32,
                        vocab_size=tokenizer.vocab_size)
    return build_model(config.model), tokenizer, config


def test_a_prefix_lm_reads_the_prompt_as_its_training_rows_begin_a_document(monkeypatch):
    """The prefix_lm objective's rows start at a document's first token (position 0, no <eos>
    before it): sampling and beam search hand a prefix LM the prompt's ids alone, equal to the
    start of the training row of a document beginning with the prompt. A causal LM still
    continues <eos> + prompt; an empty prompt gives a prefix LM a lone <eos>."""
    from transformer.data import features, pipeline, sources, windows
    from transformer.generation import text

    read = []

    def fake_decode(model, params, prompts, *, max_new_tokens, prefix_lm, **kwargs):
        read.append((np.asarray(prompts[0]).tolist(), prefix_lm))
        return np.full((len(prompts), max_new_tokens), tokenizers.EOS_ID, np.int32), None

    monkeypatch.setattr(text, "decode", fake_decode)
    monkeypatch.setattr(text, "beam_search", lambda *a, **k: (*fake_decode(*a, **k), None))
    model, tokenizer, config = _byte_setup("prefix_lm")
    corpus = windows.tokenize_documents([sources.Document("d", "abcdef")], tokenizer)
    rows = pipeline._rows_of(corpus, "prefix_lm", config.seq_len, 0, True, True, 0.15, 3.0, "t")
    row = features.prefix_lm_features({k: v[None] for k, v in rows.row(0).items()},
                                      np.random.default_rng(0))
    start = row["inputs"][0, :3].tolist()
    assert row["positions"][0, :3].tolist() == [0, 1, 2]
    assert text.sample_texts(model, None, tokenizer, config, num_samples=1, prompt="abc",
                             max_new_tokens=2) == ["abc"]
    assert text.beam_search_text(model, None, tokenizer, config, prompt="abc",
                                 max_new_tokens=2) == "abc"
    assert read == [(start, True)] * 2
    read.clear()
    text.sample_texts(model, None, tokenizer, config, num_samples=1, prompt="", max_new_tokens=2)
    assert read == [([tokenizers.EOS_ID], True)]
    read.clear()
    gpt, _, config = _byte_setup("gpt")  # packed documents: the prompt alone, as a row begins
    text.sample_texts(gpt, None, tokenizer, config, num_samples=1, prompt="abc", max_new_tokens=2)
    assert read == [(start, False)]
    read.clear()
    config.data.unit = "stream"  # each document after the previous one's <eos>
    text.sample_texts(gpt, None, tokenizer, config, num_samples=1, prompt="abc", max_new_tokens=2)
    text.beam_search_text(gpt, None, tokenizer, config, prompt="abc", max_new_tokens=2)
    assert read == [([tokenizers.EOS_ID] + start, False)] * 2


def test_a_decoder_lm_reads_a_document_start_as_its_training_rows_began_one(tmp_path):
    """<eos> before a text where training ran its documents on as one stream (data.unit
    "stream", a folder of token shards, a prepared folder's .bin shards, a mixture with one
    such source) or the weights are a Hugging Face checkpoint's; nothing where training packed
    them (the default unit) or for a prefix LM; <eos> before an empty text."""
    import tokenizers as tokenizers_lib

    from transformer.data import prepare
    from transformer.data.hf_tokenizer import HFTokenizer
    from transformer.generation.text import document_prefix

    byte = tokenizers.build_tokenizer("byte")
    eos = byte.eos_id
    config = base_config()
    assert document_prefix(config, byte) == [] and document_prefix(config, byte, True) == [eos]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"paragraph {i} of a corpus.\n\n" for i in range(40)))
    for unit in ("file", "stream"):
        config.data.unit = unit
        assert document_prefix(config, byte) == [eos] * (unit == "stream"), unit
    config.data.unit = "paragraph"
    shards = tmp_path / "shards"  # nanoGPT's train.bin / val.bin
    shards.mkdir()
    for name in ("train.bin", "val.bin"):
        np.arange(3, 40, dtype=np.uint16).tofile(shards / name)
    prepare.prepare(str(tmp_path / "bin"), str(corpus), format="bin")
    prepare.prepare(str(tmp_path / "array_record"), str(corpus))
    for path, streams in ((shards, True), (tmp_path / "bin", True),
                          (tmp_path / "array_record", False), (corpus, False)):
        config.data.path = str(path)
        assert document_prefix(config, byte) == [eos] * streams, path
        config.data.path = ""
        config.data.sources = (f"name=text,path={corpus},weight=0.5",
                               f"name=other,path={path},weight=0.5")
        assert document_prefix(config, byte) == [eos] * streams, path
        config.data.sources = ()
    config.data.update(unit="stream", objective="sft")  # chat rows: a conversation at 0
    assert document_prefix(config, byte) == []
    config.data.update(unit="paragraph", objective="")
    config.init_from = "hf:/models/llama"
    assert document_prefix(config, byte) == [eos]
    # an imported checkpoint's tokenizer: its BOS where it puts one before a text (Llama,
    # Gemma), else its <eos> (GPT-2, Qwen: documents follow an <|endoftext|>)
    for template, expected in (("<s> $A", [0]), ("$A", [2]), ("<s> $A </s>", [0])):
        tok = tokenizers_lib.Tokenizer(tokenizers_lib.models.WordLevel(
            {"<s>": 0, "a": 1, "</s>": 2}, unk_token="a"))
        tok.post_processor = tokenizers_lib.processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", 0), ("</s>", 2)])
        hf = HFTokenizer(tok.to_str(), {"bos": "<s>", "eos": "</s>"})
        assert document_prefix(config, hf) == expected, template
        assert document_prefix(config, hf, empty=True) == expected, template
    config.init_from, config.data.unit = "", "stream"
    config.model.family = "prefix_lm"
    assert document_prefix(config, byte) == [] and document_prefix(config, byte, True) == [eos]


def _command_flags(*args):
    """The generate command's flags, parsed from `args` into their own FlagValues."""
    from absl import flags

    flag_values = flags.FlagValues()
    generate._define_flags(flag_values)
    flag_values(["generate", "--workdir=unused", *args])
    return flag_values


def test_the_command_generates_from_a_hugging_face_directory(tmp_path, capsys):
    """--workdir=hf:DIR generates from a save_pretrained directory as `transformer.load` does
    (greedy: the same text); --step, which it has none of, is refused in one line."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_sft import LLAMA3, build_tokenizer

    import transformer

    directory = build_tokenizer(tmp_path / "llama", LLAMA3)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, vocab_size=len(vocab), max_position_embeddings=32,
        eos_token_id=vocab["<|end_of_text|>"])).save_pretrained(directory)
    args = (f"--workdir=hf:{directory}", "--prompt=the cat", "--max_new_tokens=6")
    generate.main([], _command_flags(*args, "--temperature=0"))
    want = transformer.load(f"hf:{directory}").generate("the cat", max_new_tokens=6)
    assert capsys.readouterr().out == want + "\n" and len(want) > len("the cat")
    with pytest.raises(ValueError, match=r"^step=3 with 'hf:.*': a Hugging Face checkpoint has "
                                         "no steps; expected no step$"):
        generate.main([], _command_flags(*args, "--step=3"))


def _tiny_hf(tmp_path, kind: str, positions: int):
    """A tiny save_pretrained Llama (RoPE) or GPT-2 (a learned table) of `positions`
    max_position_embeddings, with a byte-level BPE tokenizer.json (its BOS read first)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_sft import LLAMA3, build_tokenizer

    directory = build_tokenizer(tmp_path / f"{kind}{positions}", LLAMA3)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    eos = vocab["<|end_of_text|>"]
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, vocab_size=len(vocab), max_position_embeddings=positions,
            eos_token_id=eos))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, n_positions=positions, vocab_size=len(vocab),
            eos_token_id=eos, bos_token_id=eos))
    model.save_pretrained(directory)
    return directory


def _decoded_lengths(monkeypatch) -> list[int]:
    """The max_new_tokens of every `programs.decode` and `beam_search` that text generation
    runs from now on."""
    from transformer.generation import text

    asked = []

    def spy(run):
        def counted(*args, max_new_tokens, **kwargs):
            asked.append(max_new_tokens)
            return run(*args, max_new_tokens=max_new_tokens, **kwargs)
        return counted
    for name in ("decode", "beam_search"):
        monkeypatch.setattr(text, name, spy(getattr(text, name)))
    return asked


def test_an_imported_checkpoint_s_context_is_its_max_position_embeddings(tmp_path, monkeypatch):
    """An imported checkpoint has no training context (seq_len is base_config's 128, which no
    one set): the default length fills its max_position_embeddings after the prompt, at most
    seq_len tokens (a 131k context makes no 131k cache unasked; a seq_len set is honoured), and
    a prompt that fills it is refused in one line naming it."""
    import transformer

    asked = _decoded_lengths(monkeypatch)
    short = _tiny_hf(tmp_path, "llama", 32)  # shorter than seq_len
    args = (f"--workdir=hf:{short}",)
    prompt = "the cat"
    lm = transformer.load(f"hf:{short}")
    P = len(lm.ids(prompt))  # its BOS, then the prompt's tokens
    generate.main([], _command_flags(*args, f"--prompt={prompt}"))
    generate.main([], _command_flags(*args, f"--prompt={prompt}", "--beam_size=2"))
    assert asked == [32 - P, 32 - P]
    long_prompt = "the cat " * 10
    P_long = len(lm.ids(long_prompt))
    assert P_long >= 32
    with pytest.raises(ValueError, match=rf"^prompt of {P_long - 1} tokens and the 1 read before "
                                         r"it \(a document's start\): expected < the checkpoint's "
                                         r"max_position_embeddings=32 in all \(or pass "
                                         r"max_new_tokens\)$"):
        generate.main([], _command_flags(*args, f"--prompt={long_prompt}"))

    lm = transformer.load(f"hf:{_tiny_hf(tmp_path, 'llama', 256)}")  # longer than seq_len
    assert lm.config.seq_len == 128
    lm.generate(prompt)
    assert asked[-1] == 128  # seq_len bounds it
    long_prompt = "the cat " * 45  # past seq_len, within the 256 positions
    P_long = len(lm.ids(long_prompt))
    assert 128 < P_long < 256
    assert lm.generate(long_prompt).startswith(long_prompt)
    assert asked[-1] == 256 - P_long
    lm.config.seq_len = 10  # a seq_len set is honoured
    lm.generate(prompt)
    assert asked[-1] == 10


def test_max_new_tokens_past_an_imported_rope_model_s_positions_warns_and_a_table_refuses(
        tmp_path, monkeypatch, capsys):
    """An explicit --max_new_tokens that runs a RoPE checkpoint past its max_position_embeddings
    warns on stderr (as HF `generate` does) and decodes: RoPE extrapolates; a learned table
    (GPT-2's) has no rows there and refuses it in one line. Its default stays inside."""
    from transformer.utils import cli

    asked = _decoded_lengths(monkeypatch)
    cli.warn_once.cache_clear()
    rope = _tiny_hf(tmp_path, "llama", 32)
    capsys.readouterr()  # (what saving it printed)
    args = (f"--workdir=hf:{rope}", "--temperature=0", "--prompt=the cat")
    P = len(generate.load_hf(str(rope))[2].encode("the cat")) + 1  # after its BOS
    generate.main([], _command_flags(*args, f"--max_new_tokens={33 - P}"))  # the last fits
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("the cat")
    generate.main([], _command_flags(*args, "--max_new_tokens=40"))
    out, err = capsys.readouterr()
    assert asked == [33 - P, 40] and out.startswith("the cat")
    assert err == (f"warning: prompt of {P} tokens + max_new_tokens=40 - 1 = {P + 39} "
                   "positions, past the checkpoint's max_position_embeddings=32: "
                   "model.position='rope' runs beyond the positions it was trained on, and the "
                   "text may degrade\n")

    learned = _tiny_hf(tmp_path, "gpt2", 32)
    capsys.readouterr()
    args = (f"--workdir=hf:{learned}", "--temperature=0", "--prompt=the cat")
    with pytest.raises(ValueError, match=rf"^prompt of {P} tokens \+ max_new_tokens=40 - 1 = "
                                         rf"{P + 39} positions: expected <= the model's "
                                         r"max_len=32$"):
        generate.main([], _command_flags(*args, "--max_new_tokens=40"))
    generate.main([], _command_flags(*args))
    assert asked[-1] == 32 - P and capsys.readouterr().err == ""


def test_a_trained_workdir_keeps_its_training_context_seq_len(capsys):
    """A trained run's context is seq_len, also a fine-tune of an imported checkpoint
    (init_from="hf:DIR"): its default fills seq_len past a RoPE model's max_len, and a longer
    max_new_tokens within seq_len has no warning (only `generate.load_hf`'s config is
    `text.imported`)."""
    from transformer.generation import text

    config = base_config()
    config.seq_len = 128
    config.init_from = "hf:/models/llama"
    config.model.update(position="rope", max_len=32)
    assert text._new_tokens(None, config, "causal", 5, 4) == 123
    assert text._new_tokens(124, config, "causal", 5, 4) == 124
    with pytest.raises(ValueError, match=r"^prompt of 127 tokens and the 1 read before it \(a "
                                         r"document's start\): expected < seq_len=128 in all "
                                         r"\(or pass max_new_tokens\)$"):
        text._new_tokens(None, config, "causal", 128, 127)
    assert capsys.readouterr().err == ""


def test_max_new_tokens_past_a_trained_workdir_s_positions_warns_as_an_import_s(capsys):
    """An explicit max_new_tokens that runs a trained workdir past the positions it learned
    (seq_len; a fine-tune's imported max_position_embeddings where more) warns in one line, as
    for an imported checkpoint, and decodes; not where a learned table refuses it, nor an LSTM."""
    from transformer.generation import text
    from transformer.utils import cli

    cli.warn_once.cache_clear()
    config = base_config()
    config.seq_len = 64
    config.model.update(position="rope", max_len=32)
    capsys.readouterr()
    assert text._new_tokens(60, config, "causal", 5, 4) == 60  # 64 positions: within
    assert capsys.readouterr().err == ""
    assert text._new_tokens(61, config, "prefix", 5, 4) == 61
    assert capsys.readouterr().err == (
        "warning: prompt of 5 tokens + max_new_tokens=61 - 1 = 65 positions, past the "
        "training context seq_len=64: model.position='rope' runs beyond the positions it was "
        "trained on, and the text may degrade\n")
    assert text._new_tokens(99, config, "recompute", 5, 4) == 99  # an LSTM: no positions
    config.model.update(position="learned", max_len=80)  # rows past seq_len never trained
    text._new_tokens(70, config, "causal", 5, 4)
    assert "74 positions, past the training context seq_len=64: model.position='learned'" in \
        capsys.readouterr().err
    text._new_tokens(90, config, "causal", 5, 4)  # past the table: `programs` refuses it
    config.init_from = "hf:/models/llama"
    config.model.update(position="rope", max_len=128)  # its import learned 128 positions
    text._new_tokens(120, config, "causal", 5, 4)
    text._new_tokens(125, config, "causal", 5, 4)
    assert capsys.readouterr().err == (
        "warning: prompt of 5 tokens + max_new_tokens=125 - 1 = 129 positions, past the "
        "imported checkpoint's max_position_embeddings=128: model.position='rope' runs beyond "
        "the positions it was trained on, and the text may degrade\n")


class _Loaded(Exception):
    """Raised by a stand-in load_workdir: the command got past its up-front checks."""


def test_beam_search_refuses_an_lstm_and_the_sampling_flags_in_one_line(monkeypatch):
    """An LSTM has no KV cache to beam-search on: refused before anything compiles (params
    None). Beam search does not sample: --temperature, --top_k, --top_p and --seed other than
    their defaults are refused before loading; not passing them (or passing a default) is fine.
    Nor does --speculative without --temperature (greedy): --top_k, --top_p or --seed alone."""
    model, tokenizer, config = _byte_setup("lstm")
    with pytest.raises(ValueError, match=r"^beam search with model.family='lstm': expected a "
                                         r"family with a KV cache \['gpt', 'prefix_lm', 't5'\]"):
        generate.beam_search_text(model, None, tokenizer, config, prompt="ab", beam_size=2,
                                  max_new_tokens=6)
    monkeypatch.setattr(generate, "load_workdir", lambda *a: (model, None, tokenizer, config))
    with pytest.raises(ValueError, match=r"^beam search with model.family='lstm'"):
        generate.main([], _command_flags("--prompt=ab", "--beam_size=2", "--max_new_tokens=6"))

    def loaded(*args):
        raise _Loaded

    monkeypatch.setattr(generate, "load_workdir", loaded)
    for flag in ("--temperature=0.5", "--top_k=3", "--top_p=0.9", "--seed=3"):
        with pytest.raises(ValueError, match=rf"^--beam_size=2 with {flag}: beam search does "
                                             r"not sample; expected no sampling flags"):
            generate.main([], _command_flags("--beam_size=2", flag))
    for args in ((), ("--temperature=0.8", "--seed=0")):
        with pytest.raises(_Loaded):
            generate.main([], _command_flags("--beam_size=2", *args))
    with pytest.raises(_Loaded):  # sampling takes them
        generate.main([], _command_flags("--temperature=0.5", "--seed=3"))
    # --speculative decodes greedily unless --temperature is given: the others alone, refused
    for flag in ("--top_k=3", "--top_p=0.9", "--seed=3"):
        with pytest.raises(ValueError, match=rf"^--speculative with {flag} but no --temperature"):
            generate.main([], _command_flags("--speculative", flag))
    for args in ((), ("--temperature=0.8", "--top_k=3"), ("--seed=0",)):
        with pytest.raises(_Loaded):
            generate.main([], _command_flags("--speculative", *args))


def test_chunk_size_and_length_penalty_are_checked_before_loading_where_unused_too(monkeypatch):
    """--chunk_size (read only when stdout is a terminal: here it is not) and --length_penalty
    (read by beam search) are refused in one line before the checkpoint loads."""
    def loaded(*args):
        raise _Loaded

    monkeypatch.setattr(generate, "load_workdir", loaded)
    for args, line in [(("--chunk_size=0",), "chunk_size=0: expected an int >= 1 (tokens a "
                                              "streamed chunk)"),
                       (("--chunk_size=-2",), "chunk_size=-2: expected an int >= 1 (tokens a "
                                               "streamed chunk)"),
                       (("--length_penalty=-1", "--beam_size=2"),
                        "length_penalty=-1.0: expected a finite float >= 0"),
                       (("--length_penalty=nan",), "length_penalty=nan: expected a finite float "
                                                   ">= 0")]:
        with pytest.raises(ValueError) as error:
            generate.main([], _command_flags(*args))
        assert str(error.value) == line
    with pytest.raises(_Loaded):
        generate.main([], _command_flags("--chunk_size=1", "--length_penalty=0",
                                         "--beam_size=2"))


def test_the_streamed_text_ends_as_piped_output_does(monkeypatch):
    """On a terminal the text streams, holding back a trailing U+FFFD (a partial UTF-8
    character) mid-stream; the final text's own trailing U+FFFD are printed as when piped."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model, tokenizer, config = _byte_setup("gpt")
    monkeypatch.setattr(generate, "load_workdir", lambda *a: (model, None, tokenizer, config))

    def sample_texts(*args, callback=None, **kwargs):
        if callback is not None:
            callback(["ab\ufffd"])  # mid-stream: maybe the start of a character
        return ["ab\ufffd\ufffd"]

    monkeypatch.setattr(generate, "sample_texts", sample_texts)
    for out in (Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stdout", out)
        generate.main([], _command_flags("--prompt=ab"))
        assert out.getvalue() == "ab\ufffd\ufffd\n"


def test_the_command_names_the_step_it_read_on_stderr(monkeypatch, capsys):
    """A training beside the command may delete the latest step (keep_checkpoints) and save
    another: stderr names the one the text came from, as export and evaluate do; stdout stays
    the text alone (it may be piped)."""
    from transformer.training import checkpoint, finetune

    model, tokenizer, config = _byte_setup("gpt")
    params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
    monkeypatch.setattr(finetune, "restore_params",  # the latest: 7, when it read
                        lambda workdir, step: checkpoint.SavedParams(step or 7, config, params))
    monkeypatch.setattr(tokenizers, "load_tokenizer", lambda folder: tokenizer)
    monkeypatch.setattr(checkpoint, "saved_stream", lambda *args, **kwargs: None)
    args = ("--workdir=runs/live", "--prompt=ab", "--max_new_tokens=3", "--temperature=0")
    generate.main([], _command_flags(*args))
    out, err = capsys.readouterr()
    assert err == "step 7 of runs/live\n" and out.startswith("ab") and "step" not in out
    generate.main([], _command_flags(*args, "--step=5"))
    assert capsys.readouterr().err == "step 5 of runs/live\n"
