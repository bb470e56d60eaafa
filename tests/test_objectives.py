"""Objectives: cross-entropy against float64 and optax references, masking statistics, span
corruption decoded back to the original, prefix-LM weights against their definition."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.nn import objectives

SIGMAS = 5.0  # tolerance of the statistical tests, in binomial standard deviations


def within_binomial(count, trials, p, sigmas=SIGMAS):
    """|count - trials * p| <= sigmas * sqrt(trials * p * (1 - p))."""
    return abs(count - trials * p) <= sigmas * math.sqrt(trials * p * (1 - p))


# -----------------------------------------------------------------------------
# cross-entropy

B, T, V = 3, 5, 7


def reference_cross_entropy(logits, targets, weights, label_smoothing=0.0, z_loss=0.0):
    """Float64 NumPy: log-softmax, smoothed one-hot labels, weighted means."""
    x = np.asarray(logits, np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    log_probs = x - lse[..., None]
    one_hot = np.eye(x.shape[-1])[np.asarray(targets)]
    labels = (1 - label_smoothing) * one_hot + label_smoothing / x.shape[-1]
    ce = -(labels * log_probs).sum(-1)
    nll = -(one_hot * log_probs).sum(-1)
    z = z_loss * lse**2
    w = np.asarray(weights, np.float64)
    denominator = max(w.sum(), 1.0)
    mean = lambda v: (w * v).sum() / denominator
    accuracy = mean(x.argmax(-1) == np.asarray(targets))
    metrics = {"loss": mean(ce), "z_loss": mean(z), "perplexity": np.exp(mean(nll)),
               "accuracy": accuracy, "num_tokens": w.sum()}
    return mean(ce + z), metrics


def random_case(seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal((B, T, V))).astype(np.float32)
    targets = rng.integers(0, V, (B, T))
    weights = (rng.random((B, T)) < 0.7).astype(np.float32)
    weights[0, 0] = 1.0
    return logits, targets, weights


@functools.cache
def jitted_cross_entropy(label_smoothing=0.0, z_loss=0.0):
    return jax.jit(functools.partial(objectives.cross_entropy, label_smoothing=label_smoothing,
                                     z_loss=z_loss))


@jax.jit
def optax_integer_label_ce(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@jax.jit
def optax_smoothed_ce(logits, targets, label_smoothing):
    labels = optax.smooth_labels(jax.nn.one_hot(targets, V), label_smoothing)
    return optax.softmax_cross_entropy(logits, labels)


@pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3),
                                                    (0.2, 1e-2)])
def test_cross_entropy_equals_float64_reference(label_smoothing, z_loss):
    logits, targets, weights = random_case()
    loss, metrics = jitted_cross_entropy(label_smoothing, z_loss)(logits, targets, weights)
    ref_loss, ref_metrics = reference_cross_entropy(logits, targets, weights, label_smoothing,
                                                    z_loss)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert set(metrics) == set(ref_metrics)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_cross_entropy_without_weights_is_the_plain_mean():
    logits, targets, _ = random_case(1)
    loss, metrics = jitted_cross_entropy()(logits, targets, None)
    ref_loss, _ = reference_cross_entropy(logits, targets, np.ones((B, T)))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert float(metrics["num_tokens"]) == B * T


def test_cross_entropy_equals_optax_integer_labels():
    logits, targets, weights = random_case(2)
    loss, _ = jitted_cross_entropy()(logits, targets, weights)
    per_token = np.asarray(optax_integer_label_ce(logits, targets))
    expected = float(np.sum(per_token * weights) / weights.sum())
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


@pytest.mark.parametrize("label_smoothing", [0.1, 0.3])
def test_cross_entropy_label_smoothing_equals_optax_smooth_labels(label_smoothing):
    logits, targets, weights = random_case(3)
    loss, metrics = jitted_cross_entropy(label_smoothing)(logits, targets, weights)
    per_token = np.asarray(optax_smoothed_ce(logits, targets, label_smoothing))
    expected = float(np.sum(per_token * weights) / weights.sum())
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)


def test_cross_entropy_perplexity_is_exp_loss_and_ignores_smoothing():
    logits, targets, weights = random_case(4)
    loss, metrics = jitted_cross_entropy()(logits, targets, weights)
    np.testing.assert_allclose(float(metrics["perplexity"]), math.exp(float(loss)), rtol=1e-6)
    _, smoothed = jitted_cross_entropy(0.2)(logits, targets, weights)
    np.testing.assert_allclose(float(smoothed["perplexity"]), float(metrics["perplexity"]),
                               rtol=1e-6)
    assert float(smoothed["loss"]) > float(metrics["loss"])  # smoothing changes the ce itself


def test_cross_entropy_z_loss_is_reported_separately_and_added_to_loss():
    logits, targets, weights = random_case(5)
    loss, metrics = jitted_cross_entropy(0.0, 0.01)(logits, targets, weights)
    plain, _ = jitted_cross_entropy()(logits, targets, weights)
    np.testing.assert_allclose(float(metrics["loss"]), float(plain), rtol=1e-6)
    total = np.asarray(metrics["loss"]) + np.asarray(metrics["z_loss"])  # float32, as before
    np.testing.assert_allclose(float(loss), float(total), rtol=1e-6)
    assert float(metrics["z_loss"]) > 0


def test_cross_entropy_accuracy_on_hand_made_example():
    logits = np.full((1, 4, 3), -1.0, np.float32)
    logits[0, 0, 2] = logits[0, 1, 0] = logits[0, 2, 1] = logits[0, 3, 1] = 5.0  # argmax 2 0 1 1
    targets = np.array([[2, 0, 0, 1]])  # right, right, wrong, right
    _, metrics = jitted_cross_entropy()(logits, targets, np.ones((1, 4), np.float32))
    assert float(metrics["accuracy"]) == pytest.approx(0.75)
    _, metrics = jitted_cross_entropy()(logits, targets, np.array([[1, 0, 1, 0]], np.float32))
    assert float(metrics["accuracy"]) == pytest.approx(0.5)


@pytest.mark.parametrize("garbage", [1e30, -1e30, np.inf, np.nan])
def test_cross_entropy_weight_zero_contributes_nothing_to_loss_or_gradient(garbage):
    logits, targets, weights = random_case(6)
    pad = weights == 0
    assert pad.any()

    @jax.jit
    def loss_and_grad(logits):
        fn = lambda x: objectives.cross_entropy(x, targets, weights, label_smoothing=0.1,
                                                z_loss=1e-3)[0]
        return jax.value_and_grad(fn)(logits)

    loss, grad = loss_and_grad(logits)
    assert np.all(np.asarray(grad)[pad] == 0.0)  # exactly zero, not just small
    corrupted = logits.copy()
    corrupted[pad] = garbage
    loss2, grad2 = loss_and_grad(corrupted)
    assert float(loss2) == float(loss)
    np.testing.assert_array_equal(np.asarray(grad2), np.asarray(grad))

    ref_loss, _ = reference_cross_entropy(logits, targets, weights, 0.1, 1e-3)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)


def test_cross_entropy_gradient_is_softmax_minus_labels():
    logits, targets, weights = random_case(7)
    ls = 0.1
    grad = jax.jit(jax.grad(lambda x: objectives.cross_entropy(
        x, targets, weights, label_smoothing=ls)[0]))(logits)
    x = logits.astype(np.float64)
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    labels = (1 - ls) * np.eye(V)[targets] + ls / V
    expected = weights[..., None] * (probs - labels) / weights.sum()
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)


def test_cross_entropy_all_padding_is_zero_not_nan():
    logits, targets, _ = random_case(8)
    loss, metrics = jitted_cross_entropy(0.1, 1e-3)(logits, targets, np.zeros((B, T), np.float32))
    assert float(loss) == 0.0 and float(metrics["num_tokens"]) == 0.0
    assert float(metrics["perplexity"]) == 1.0


def test_cross_entropy_computes_in_float32_for_bfloat16_logits():
    logits, targets, weights = random_case(9)
    low = logits.astype(jnp.bfloat16)
    loss, _ = jitted_cross_entropy()(low, targets, weights)
    assert loss.dtype == jnp.float32
    ref_loss, _ = reference_cross_entropy(np.asarray(low, np.float32), targets, weights)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)


def test_bfloat16_logits_are_kept_in_bfloat16_for_the_backward_pass():
    """No float32 copy of the [B, T, V] logits is kept for the gradient, which is bfloat16 and
    equals the float32 computation's (softmax - labels, scaled by the weights)."""
    logits, targets, weights = random_case(10)
    low_np = logits.astype(jnp.bfloat16)
    low = jax.device_put(low_np)

    def loss(x):
        return objectives.cross_entropy(x, targets, weights, label_smoothing=0.1,
                                        z_loss=1e-3)[0]

    _, vjp = jax.vjp(loss, low)
    kept = [x for x in jax.tree.leaves(vjp) if x.shape == low.shape]
    assert kept and all(x.dtype in (jnp.bfloat16, jnp.bool_) for x in kept), [
        x.dtype for x in kept]
    # The forward pass above stays eager (its residuals are the subject); the backward pass
    # reads those same residuals under jit (the vjp is a pytree of them).
    grad = jax.jit(lambda vjp: vjp(jnp.float32(1.0))[0])(vjp)
    want = jax.jit(jax.grad(loss))(low_np.astype(np.float32))
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad, np.float32), want, atol=2e-4, rtol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_log_normalizer_and_its_gradient_equal_logsumexp(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        x = (np.random.default_rng(0).normal(size=(4, 7)) * 5).astype(dtype)
        x[0, 3] = -np.inf  # a banned entry: weight exactly 0
        g = np.arange(1.0, 5.0, dtype=dtype)

        @jax.jit
        def values_and_grads(x, g):
            got, vjp = jax.vjp(objectives.log_normalizer, x)
            want, want_vjp = jax.vjp(lambda x: jax.nn.logsumexp(x, axis=-1), x)
            return got, want, vjp(g)[0], want_vjp(g)[0]

        got, want, grad, want_grad = map(np.asarray, values_and_grads(x, g))
        assert got.dtype == grad.dtype == dtype
        tol = 1e-12 if dtype == jnp.float64 else 1e-6
        np.testing.assert_allclose(got, want, rtol=tol)
        np.testing.assert_allclose(grad, want_grad, rtol=tol, atol=tol)
        assert float(grad[0, 3]) == 0.0


# -----------------------------------------------------------------------------
# next-token targets


def test_next_token_targets_shift_by_one_and_weight_non_pad():
    tokens = np.array([[5, 6, 7, 8, 0, 0], [9, 3, 0, 0, 0, 0], [4, 4, 4, 4, 4, 4]])
    (inputs, targets, weights), (_, _, pad_4_weights) = jax.jit(lambda t: (
        objectives.next_token_targets(t), objectives.next_token_targets(t, pad_id=4)))(tokens)
    np.testing.assert_array_equal(inputs, tokens[:, :-1])
    np.testing.assert_array_equal(targets, tokens[:, 1:])
    assert weights.dtype == jnp.float32
    np.testing.assert_array_equal(weights, [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(pad_4_weights,
                                  [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])


# -----------------------------------------------------------------------------
# BERT masked LM

MLM_VOCAB, PAD, CLS, SEP, MASK = 50, 0, 1, 2, 3
SPECIAL = (PAD, CLS, SEP, MASK)


def mlm_tokens(batch=64, length=512, seed=0):
    """[CLS] words [SEP] words [SEP] pad..., with random lengths; words are ids 4..49."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, MLM_VOCAB, (batch, length))
    tokens[:, 0] = CLS
    for row, n in zip(tokens, rng.integers(length // 2, length + 1, batch), strict=True):
        row[rng.integers(1, n)] = SEP
        row[n - 1] = SEP
        row[n:] = PAD
    return tokens


@functools.cache
def jitted_mlm(rate=0.15, mask_fraction=0.8, random_fraction=0.1):
    return jax.jit(functools.partial(objectives.mlm_corrupt, vocab_size=MLM_VOCAB, mask_id=MASK,
                                     special_ids=SPECIAL, rate=rate, mask_fraction=mask_fraction,
                                     random_fraction=random_fraction))


def run_mlm(seed=0, **kwargs):
    tokens = mlm_tokens()
    inputs, targets, weights = jitted_mlm(**kwargs)(jax.random.key(seed), tokens)
    return tokens, np.asarray(inputs), np.asarray(targets), np.asarray(weights)


@pytest.mark.parametrize("rate", [0.15, 0.3])
def test_mlm_selected_fraction_within_binomial_tolerance_of_rate(rate):
    tokens, _, _, weights = run_mlm(rate=rate)
    eligible = ~np.isin(tokens, SPECIAL)
    assert within_binomial(weights[eligible].sum(), eligible.sum(), rate)


@pytest.mark.parametrize("rate", [0.15, 0.3])
@pytest.mark.parametrize("mask_fraction,random_fraction", [(0.8, 0.1), (0.6, 0.3)])
def test_mlm_replacement_fractions_within_tolerance(rate, mask_fraction, random_fraction):
    _, inputs, targets, weights = run_mlm(rate=rate, mask_fraction=mask_fraction,
                                          random_fraction=random_fraction)
    selected = weights == 1
    n = selected.sum()
    masked = (inputs == MASK)[selected].sum()
    random = ((inputs != targets) & (inputs != MASK))[selected].sum()
    unchanged = (inputs == targets)[selected].sum()
    assert masked + random + unchanged == n
    # A random draw equals the original token with probability 1 / (number of word ids).
    same = 1 / (MLM_VOCAB - len(SPECIAL))
    assert within_binomial(masked, n, mask_fraction)
    assert within_binomial(random, n, random_fraction * (1 - same))
    assert within_binomial(unchanged, n, 1 - mask_fraction - random_fraction * (1 - same))


def test_mlm_special_tokens_never_selected_or_changed():
    tokens, inputs, _, weights = run_mlm(rate=0.3)
    special = np.isin(tokens, SPECIAL)
    assert special.sum() > 1000 and (tokens == PAD).any()
    assert not weights[special].any()
    np.testing.assert_array_equal(inputs[special], tokens[special])


def test_mlm_unselected_unchanged_and_targets_are_the_tokens():
    tokens, inputs, targets, weights = run_mlm(rate=0.3)
    np.testing.assert_array_equal(targets, tokens)
    assert set(np.unique(weights)) == {0.0, 1.0} and weights.dtype == np.float32
    np.testing.assert_array_equal(inputs[weights == 0], tokens[weights == 0])


def test_mlm_weights_are_exactly_the_selection():
    # With every selected token masked, the selection is visible in the inputs.
    tokens, inputs, _, weights = run_mlm(rate=0.3, mask_fraction=1.0, random_fraction=0.0)
    np.testing.assert_array_equal(weights == 1, inputs == MASK)
    # With none replaced, the inputs are untouched yet the weights still select.
    tokens, inputs, _, weights = run_mlm(rate=0.3, mask_fraction=0.0, random_fraction=0.0)
    np.testing.assert_array_equal(inputs, tokens)
    assert within_binomial(weights.sum(), (~np.isin(tokens, SPECIAL)).sum(), 0.3)


def test_mlm_random_replacements_are_uniform_over_non_special_ids():
    tokens, inputs, _, weights = run_mlm(rate=0.3, mask_fraction=0.0, random_fraction=1.0)
    drawn = inputs[weights == 1]
    assert not np.isin(drawn, SPECIAL).any()
    counts = np.bincount(drawn, minlength=MLM_VOCAB)
    words = MLM_VOCAB - len(SPECIAL)
    assert all(within_binomial(counts[i], drawn.size, 1 / words) for i in range(4, MLM_VOCAB))


def test_mlm_random_replacements_never_special_with_default_fractions():
    tokens, inputs, _, weights = run_mlm(rate=0.3)
    changed = inputs != tokens
    assert changed.any()
    assert not np.isin(inputs[changed & (inputs != MASK)], SPECIAL).any()


def test_mlm_deterministic_given_key_and_different_for_different_keys():
    a = run_mlm(seed=1)
    b = run_mlm(seed=1)
    c = run_mlm(seed=2)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[3], b[3])
    assert (a[3] != c[3]).any() and (a[1] != c[1]).any()


# -----------------------------------------------------------------------------
# T5 span corruption

SPAN_VOCAB, EOS = 1000, 1
SENTINEL_FLOOR = SPAN_VOCAB - 200  # test tokens stay below this; sentinels are above


def brute_force_counts(length, density, mean):
    """The definition: noise = round(L d) in [1, L-1]; spans = max(1, round(noise / mean)),
    at most min(noise, L - noise)."""
    noise = round(length * density)
    noise = 1 if noise < 1 else length - 1 if noise > length - 1 else noise
    spans = max(1, round(noise / mean))
    return noise, min(spans, noise, length - noise)


def brute_force_lengths(inputs_length, density, mean):
    fits = []
    for length in range(2, 40 * inputs_length):  # far beyond any fitting length
        noise, spans = brute_force_counts(length, density, mean)
        if length - noise + spans + 1 <= inputs_length:
            fits.append((length, noise + spans + 1))
    return fits[-1]


def test_span_corruption_lengths_t5_numbers():
    assert objectives.span_corruption_lengths(512) == (568, 114)
    assert objectives.span_corruption_lengths(512, 0.15, 3.0) == (568, 114)


@pytest.mark.parametrize("inputs_length,density,mean", [
    (512, 0.15, 3.0), (3, 0.15, 3.0), (10, 0.15, 3.0), (100, 0.15, 3.0), (64, 0.3, 2.0),
    (128, 0.5, 1.0), (57, 0.25, 5.0), (256, 0.9, 10.0), (33, 0.4, 1.5), (64, 0.9, 1.0),
    (50, 0.8, 1.5), (100, 0.6, 1.0),
])
def test_span_corruption_lengths_match_brute_force(inputs_length, density, mean):
    assert objectives.span_corruption_lengths(inputs_length, density, mean) == \
        brute_force_lengths(inputs_length, density, mean)


def decode(inputs, targets):
    """Rebuilds the raw row from one (inputs, targets) pair; returns it with the span layout.

    Walks the targets into {sentinel: noise tokens}, then the inputs, substituting spans.
    """
    assert inputs[-1] == EOS and targets[-1] == EOS
    spans, order, current = {}, [], None
    for tok in targets[:-1]:
        if tok >= SENTINEL_FLOOR:
            assert tok not in spans, "sentinel repeated in targets"
            spans[tok], current = [], tok
            order.append(tok)
        else:
            assert current is not None, "targets must start with a sentinel"
            spans[current].append(tok)
    raw, kept_runs, input_sentinels, run = [], [], [], 0
    for tok in inputs[:-1]:
        if tok >= SENTINEL_FLOOR:
            input_sentinels.append(tok)
            kept_runs.append(run)
            run = 0
            raw.extend(spans[tok])
        else:
            raw.append(tok)
            run += 1
    assert run == 0, "a row must end with a noise span"
    return np.array(raw), order, input_sentinels, [len(spans[s]) for s in order], kept_runs


# The last two cap num_spans at the kept count (7: 4 noise, 3 kept; 30: 24 noise, 6 kept).
SPAN_CONFIGS = [(568, 0.15, 3.0), (40, 0.3, 2.0), (25, 0.5, 1.0), (12, 0.15, 3.0), (3, 0.3, 3.0),
                (7, 0.5, 1.0), (30, 0.8, 1.0)]


@functools.cache
def jitted_span(density, mean):
    return jax.jit(functools.partial(objectives.span_corrupt, vocab_size=SPAN_VOCAB, eos_id=EOS,
                                     noise_density=density, mean_span_length=mean))


@functools.cache
def span_batch(length, density, mean, batch=64, seed=0):
    tokens = np.random.default_rng(seed).integers(2, SENTINEL_FLOOR, (batch, length))
    inputs, targets = jitted_span(density, mean)(jax.random.key(seed), tokens)
    return tokens, np.asarray(inputs), np.asarray(targets)


@pytest.mark.slow
@pytest.mark.parametrize("length,density,mean", SPAN_CONFIGS)
def test_span_corrupt_static_shapes_match_lengths_formula(length, density, mean):
    tokens, inputs, targets = span_batch(length, density, mean)
    noise, spans = brute_force_counts(length, density, mean)
    assert inputs.shape == (len(tokens), length - noise + spans + 1)
    assert targets.shape == (len(tokens), noise + spans + 1)
    dtype = jnp.asarray(tokens).dtype  # int64 becomes int32 without jax_enable_x64
    assert inputs.dtype == dtype and targets.dtype == dtype
    assert (inputs[:, -1] == EOS).all() and (targets[:, -1] == EOS).all()
    if length == 568:  # the raw length that fills 512 inputs, as the pipeline would use it
        assert inputs.shape[1] == 512 and targets.shape[1] == 114


@pytest.mark.parametrize("length,density,mean", SPAN_CONFIGS)
def test_span_corrupt_inputs_and_targets_reconstruct_the_original(length, density, mean):
    tokens, inputs, targets = span_batch(length, density, mean)
    for row in range(len(tokens)):
        raw = decode(inputs[row], targets[row])[0]
        np.testing.assert_array_equal(raw, tokens[row])


@pytest.mark.parametrize("length,density,mean", SPAN_CONFIGS)
def test_span_corrupt_sentinels_unique_ordered_once_in_each(length, density, mean):
    tokens, inputs, targets = span_batch(length, density, mean)
    _, spans = brute_force_counts(length, density, mean)
    expected = [SPAN_VOCAB - 1 - i for i in range(spans)]
    for row in range(len(tokens)):
        _, order, input_sentinels, _, _ = decode(inputs[row], targets[row])
        assert order == expected and input_sentinels == expected


@pytest.mark.parametrize("length,density,mean", SPAN_CONFIGS)
def test_span_corrupt_noise_and_span_counts_and_non_empty_spans(length, density, mean):
    tokens, inputs, targets = span_batch(length, density, mean)
    noise, spans = brute_force_counts(length, density, mean)
    assert noise == round(length * density) or noise in (1, length - 1)
    for row in range(len(tokens)):
        _, order, _, noise_runs, kept_runs = decode(inputs[row], targets[row])
        assert len(noise_runs) == spans and sum(noise_runs) == noise
        assert len(kept_runs) == spans and sum(kept_runs) == length - noise
        assert min(noise_runs) >= 1 and min(kept_runs) >= 1


def test_span_corrupt_mean_span_length_close_to_requested():
    tokens, inputs, targets = span_batch(568, 0.15, 3.0)
    lengths = [n for row in range(len(tokens)) for n in decode(inputs[row], targets[row])[3]]
    assert abs(np.mean(lengths) - 3.0) < 0.1  # 85 noise tokens in 28 spans: 3.04


def composition_first_part(total, parts, k):
    """P(first part = k) for a uniformly random composition of `total` into `parts` parts."""
    return math.comb(total - k - 1, parts - 2) / math.comb(total - 1, parts - 1)


def test_span_corrupt_segmentation_is_uniform():
    # L=20, density 0.3, mean 2: 6 noise tokens and 14 kept tokens, each in 3 spans.
    tokens, inputs, targets = span_batch(20, 0.3, 2.0, batch=4096, seed=1)
    layouts = [decode(inputs[row], targets[row]) for row in range(len(tokens))]
    first_noise = np.bincount([layout[3][0] for layout in layouts], minlength=15)
    first_kept = np.bincount([layout[4][0] for layout in layouts], minlength=15)
    for k in range(1, 5):
        assert within_binomial(first_noise[k], len(tokens), composition_first_part(6, 3, k))
    for k in range(1, 13):
        assert within_binomial(first_kept[k], len(tokens), composition_first_part(14, 3, k))


@pytest.mark.parametrize("impl", ["rbg", "threefry2x32"])
def test_span_corrupt_rows_independent_and_deterministic_given_key(impl):
    # Under vmap, "rbg" draws a batch from the first key alone, so only threefry can tell
    # per-row keys from one key shared by every row.
    tokens = np.tile(np.arange(2, 42), (16, 1))
    fn = jitted_span(0.3, 2.0)
    inputs, targets = map(np.asarray, fn(jax.random.key(3, impl=impl), tokens))
    assert len({tuple(row) for row in inputs}) > 8  # same tokens, different noise per row
    again, _ = fn(jax.random.key(3, impl=impl), tokens)
    np.testing.assert_array_equal(np.asarray(again), inputs)
    other, _ = fn(jax.random.key(4, impl=impl), tokens)
    assert (np.asarray(other) != inputs).any()


def test_span_corrupt_docstring_example_layout():
    inputs, targets = jax.jit(functools.partial(
        objectives.span_corrupt, vocab_size=100, eos_id=1, noise_density=0.3))(
        jax.random.key(0), np.array([[10, 11, 12]]))
    assert inputs.tolist() == [[10, 11, 99, 1]] and targets.tolist() == [[99, 12, 1]]


# -----------------------------------------------------------------------------
# prefix LM

split = jax.jit(objectives.prefix_lm_split, static_argnames="pad_id")


def right_padded(lengths, total, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 100, (len(lengths), total))
    tokens[np.arange(total)[None, :] >= np.asarray(lengths)[:, None]] = 0
    return tokens


def test_prefix_lm_split_prefix_within_one_and_n_minus_one():
    lengths = np.array([0, 1, 2, 3, 5, 8, 8, 4] * 16)
    prefix, _ = split(jax.random.key(0), right_padded(lengths, 8))
    prefix = np.asarray(prefix)
    assert prefix.dtype == np.int32 and prefix.shape == lengths.shape
    long = lengths >= 2
    assert (prefix[long] >= 1).all() and (prefix[long] <= lengths[long] - 1).all()
    np.testing.assert_array_equal(prefix[~long], lengths[~long])


def test_prefix_lm_weights_are_exactly_the_continuation_targets():
    lengths = np.array([0, 1, 2, 3, 5, 8, 8, 4] * 16)
    tokens = right_padded(lengths, 8)
    prefix, weights = map(np.asarray, split(jax.random.key(1), tokens))
    _, targets, pad_weights = jax.jit(objectives.next_token_targets)(tokens)
    assert weights.shape == targets.shape and weights.dtype == np.float32
    for b, (p, n) in enumerate(zip(prefix, lengths, strict=True)):
        # Input position t predicts token t + 1: weighted iff token t + 1 is in the continuation.
        expected = [1.0 if p <= t + 1 < n else 0.0 for t in range(7)]
        np.testing.assert_array_equal(weights[b], expected)
        if n >= 2:
            assert weights[b, p - 1] == 1  # the last prefix position predicts token p
            assert p == 1 or weights[b, p - 2] == 0
            assert weights[b].sum() == n - p
    assert not (weights * (1 - np.asarray(pad_weights))).any()  # never on padding


def test_prefix_lm_split_custom_pad_id():
    tokens = np.array([[7, 8, 9, 5, 5]])
    prefix, weights = map(np.asarray, split(jax.random.key(0), tokens, pad_id=5))
    assert 1 <= int(prefix[0]) <= 2
    assert weights[0, 2:].sum() == 0 and weights[0, 1] == 1


def test_prefix_lm_split_points_roughly_uniform():
    lengths = np.full(4000, 6)
    prefix, _ = split(jax.random.key(2), right_padded(lengths, 8))
    counts = np.bincount(np.asarray(prefix), minlength=7)
    assert counts[0] == 0 and counts[6] == 0
    assert all(within_binomial(counts[p], 4000, 1 / 5) for p in range(1, 6))


def test_prefix_lm_split_deterministic_given_key():
    tokens = right_padded(np.full(64, 8), 8)
    a, _ = split(jax.random.key(5), tokens)
    b, _ = split(jax.random.key(5), tokens)
    c, _ = split(jax.random.key(6), tokens)
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()


# -----------------------------------------------------------------------------
# bad arguments

KEY = jax.random.key(0)
TOKENS = np.ones((2, 8), np.int32)
LOGITS = np.zeros((2, 8, 5), np.float32)
mlm = functools.partial(objectives.mlm_corrupt, KEY, TOKENS, vocab_size=10, mask_id=3)
span = functools.partial(objectives.span_corrupt, KEY, TOKENS, vocab_size=10, eos_id=1)


@pytest.mark.parametrize("call,match", [
    (lambda: objectives.cross_entropy(LOGITS, TOKENS, label_smoothing=1.0), "label_smoothing=1.0"),
    (lambda: objectives.cross_entropy(LOGITS, TOKENS, label_smoothing=-0.1),
     "label_smoothing=-0.1"),
    (lambda: objectives.cross_entropy(LOGITS, TOKENS, z_loss=-1e-4), "z_loss=-0.0001"),
    (lambda: objectives.cross_entropy(LOGITS[:, :4], TOKENS), r"logits of shape \(2, 4, 5\)"),
    (lambda: objectives.cross_entropy(LOGITS, TOKENS, np.ones((2, 7))),
     r"weights of shape \(2, 7\)"),
    (lambda: objectives.next_token_targets(np.ones((2, 1))), r"tokens of shape \(2, 1\)"),
    (lambda: objectives.next_token_targets(np.ones(5)), r"tokens of shape \(5,\)"),
    (lambda: objectives.next_token_targets(TOKENS, pad_id=-1), "pad_id=-1"),
    (lambda: mlm(rate=0.0), "rate=0.0"),
    (lambda: mlm(rate=1.0), "rate=1.0"),
    (lambda: mlm(mask_fraction=0.8, random_fraction=0.3), "mask_fraction \\+ random_fraction"),
    (lambda: mlm(mask_fraction=1.5, random_fraction=0.0), "mask_fraction=1.5"),
    (lambda: mlm(random_fraction=-0.1), "random_fraction=-0.1"),
    (lambda: objectives.mlm_corrupt(KEY, TOKENS, vocab_size=10, mask_id=10), "mask_id=10"),
    (lambda: mlm(special_ids=(0, 12)), "special id=12"),
    (lambda: mlm(vocab_size=0, mask_id=0), "vocab_size=0"),
    (lambda: objectives.mlm_corrupt(KEY, TOKENS, vocab_size=2, mask_id=0, special_ids=(1,)),
     "random_fraction=0.1"),
    (lambda: objectives.span_corruption_lengths(2), "inputs_length=2"),
    (lambda: objectives.span_corruption_lengths(512, noise_density=0.0), "noise_density=0.0"),
    (lambda: objectives.span_corruption_lengths(512, noise_density=1.0), "noise_density=1.0"),
    (lambda: objectives.span_corruption_lengths(512, mean_span_length=0.5),
     "mean_span_length=0.5"),
    (lambda: span(noise_density=1.2), "noise_density=1.2"),
    (lambda: span(eos_id=9), "eos_id=9"),  # 9 is sentinel <extra_id_0> for vocab 10
    (lambda: span(eos_id=-1), "eos_id=-1"),
    (lambda: objectives.span_corrupt(KEY, TOKENS, vocab_size=1, eos_id=0), "vocab_size=1"),
    (lambda: objectives.span_corrupt(KEY, TOKENS[:, :1], vocab_size=10, eos_id=1),
     r"tokens of shape \(2, 1\)"),
    (lambda: objectives.prefix_lm_split(KEY, TOKENS[:, :1]), r"tokens of shape \(2, 1\)"),
    (lambda: objectives.prefix_lm_split(KEY, TOKENS, pad_id=1.5), "pad_id=1.5"),
])
def test_bad_arguments_raise_value_error_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("seq_len", [24, 64, 512])
def test_span_corruption_spans_counts_the_sentinels_a_pipeline_row_uses(seq_len):
    """What config validation checks data.num_sentinels against: the sentinels in an encoder
    row of seq_len tokens, cut from the raw row the pipeline reads for it."""
    raw, _ = objectives.span_corruption_lengths(seq_len)
    tokens = jnp.arange(3, 3 + raw, dtype=jnp.int32)[None]
    inputs, _ = objectives.span_corrupt(jax.random.key(0), tokens, vocab_size=2000, eos_id=1)
    assert inputs.shape[1] == seq_len
    assert int(jnp.sum(inputs >= 2000 - 200)) == objectives.span_corruption_spans(seq_len)
