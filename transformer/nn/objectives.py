"""Training objectives on token arrays: cross-entropy, next-token targets, BERT masking, T5 span
corruption and prefix-LM splits. Pure functions, deterministic given a key, jit-compatible.

Shapes: B=batch, T=sequence length, V=vocabulary, L=raw (uncorrupted) length. Rates, ids and
lengths are static Python values (pass them as static args under `jax.jit`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raises unless `value` is an int with low <= value (< high when given)."""
    if not _is_int(value) or value < low or (high is not None and value >= high):
        expected = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
        raise ValueError(f"{name}={value!r}: expected {expected}")


def _check_fraction(name: str, value: Any, low: float, high: float, *, open_low: bool = False,
                    open_high: bool = False) -> None:
    """Raises unless `value` is a real number in the interval (open or closed at each end)."""
    ok = isinstance(value, float | int | np.floating | np.integer) and not isinstance(value, bool)
    ok = ok and (value > low if open_low else value >= low)
    ok = ok and (value < high if open_high else value <= high)
    if not ok:
        interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        raise ValueError(f"{name}={value!r}: expected a number in {interval}")


# -----------------------------------------------------------------------------
# cross-entropy


def cross_entropy(logits, targets, weights=None, *, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, rows: bool = False
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted token cross-entropy with label smoothing and z-loss, computed in float32.

    Per token: lse = logsumexp(logits), ce = lse - (1 - ls) * logits[target] - ls * mean(logits)
    (the cross-entropy against targets smoothed toward uniform over V), plus z_loss * lse^2.
    logits [B, T, V], targets [B, T] int, weights [B, T] (None = all ones). Returns
    (loss, metrics): loss = sum(w * (ce + z_loss * lse^2)) / max(sum(w), 1) is what to
    differentiate; metrics hold the weighted means "loss" (ce), "z_loss", "accuracy",
    "perplexity" = exp(mean unsmoothed ce), and "num_tokens" = sum(w); with `rows`, also per
    row (the leading axis) "row_loss_sum" = sum(w * ce) and "row_num_tokens" = sum(w), [B] each
    (per-window evaluation: `evaluation.evaluate`). Positions with weight 0
    contribute exactly zero to the loss and its gradient, whatever their logits (even inf/nan).

    Uniform logits over V = 4 give ce = log 4 and perplexity 4; the weight-0 position is ignored:

    >>> logits_BTV = jnp.array([[[0.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0]]])
    >>> loss, metrics = cross_entropy(logits_BTV, jnp.array([[2, 3]]), jnp.array([[1.0, 0.0]]))
    >>> round(float(loss), 4), round(float(metrics["perplexity"]), 4)
    (1.3863, 4.0)
    >>> float(metrics["num_tokens"]), float(metrics["accuracy"])
    (1.0, 0.0)
    """
    _check_fraction("label_smoothing", label_smoothing, 0.0, 1.0, open_high=True)
    _check_fraction("z_loss", z_loss, 0.0, float("inf"), open_high=True)
    logits_BTV, targets_BT = jnp.asarray(logits), jnp.asarray(targets)
    if logits_BTV.ndim < 1 or logits_BTV.shape[:-1] != targets_BT.shape:
        raise ValueError(f"logits of shape {logits_BTV.shape}: expected targets.shape + (V,) = "
                         f"{targets_BT.shape} + (V,)")
    if weights is None:
        weights_BT = jnp.ones(targets_BT.shape, jnp.float32)
    else:
        weights_BT = jnp.asarray(weights, jnp.float32)
        if weights_BT.shape != targets_BT.shape:
            raise ValueError(f"weights of shape {weights_BT.shape}: expected the targets' shape "
                             f"{targets_BT.shape}")
        # Swap in zeros *before* any math, so garbage (inf/nan) at weight-0 positions reaches
        # neither the value nor the gradient (the gradient of `where` there is exactly 0).
        keep_BT = weights_BT != 0
        logits_BTV = jnp.where(keep_BT[..., None], logits_BTV, 0)
        targets_BT = jnp.where(keep_BT, targets_BT, 0)
    # Bfloat16 logits stay bfloat16: each reduction upcasts as it reads them, so no float32
    # [B, T, V] copy is made or kept for the backward pass.
    acc = jnp.promote_types(logits_BTV.dtype, jnp.float32)
    lse_BT = log_normalizer(logits_BTV)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    nll_BT = lse_BT - target_logit_BT.astype(acc)  # unsmoothed ce
    if label_smoothing:
        mean_logit_BT = jnp.mean(logits_BTV, axis=-1, dtype=acc)
        ce_BT = nll_BT + label_smoothing * (target_logit_BT.astype(acc) - mean_logit_BT)
    else:
        ce_BT = nll_BT
    z_BT = z_loss * jnp.square(lse_BT)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)

    num_tokens = jnp.sum(weights_BT)
    denominator = jnp.maximum(num_tokens, 1.0)
    mean = lambda x_BT: jnp.sum(weights_BT * x_BT) / denominator
    loss = mean(ce_BT + z_BT) if z_loss else mean(ce_BT)
    metrics = {
        "loss": mean(ce_BT),
        "z_loss": mean(z_BT),
        "perplexity": jnp.exp(mean(nll_BT)),
        "accuracy": mean(correct_BT),
        "num_tokens": num_tokens,
    }
    if rows:
        axes = tuple(range(1, weights_BT.ndim))
        metrics.update(row_loss_sum=jnp.sum(weights_BT * ce_BT, axis=axes),
                       row_num_tokens=jnp.sum(weights_BT, axis=axes))
    return loss, metrics


@jax.custom_vjp
def log_normalizer(logits: jax.Array) -> jax.Array:
    """logsumexp over the last axis, in float32 (float64 for float64 logits) whatever the logits'
    dtype. The backward pass keeps only the logits as given (bfloat16 stays bfloat16) and the
    result, and returns g * softmax(logits) in the logits' dtype.

    >>> float(log_normalizer(jnp.zeros(4, jnp.bfloat16)))  # log 4
    1.3862943649291992
    """
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    peak = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0)
    return jnp.log(jnp.sum(jnp.exp(x - peak), axis=-1)) + peak[..., 0]


def _log_normalizer_fwd(logits):
    lse = log_normalizer(logits)
    return lse, (logits, lse)


def _log_normalizer_bwd(residuals, g):
    logits, lse = residuals
    x = logits.astype(lse.dtype)
    return ((g[..., None] * jnp.exp(x - lse[..., None])).astype(logits.dtype),)


log_normalizer.defvjp(_log_normalizer_fwd, _log_normalizer_bwd)


# -----------------------------------------------------------------------------
# next-token prediction and prefix LM


def next_token_targets(tokens, pad_id: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens [B, T] -> (inputs [B, T-1], targets [B, T-1], weights [B, T-1] float32).

    inputs = tokens[:, :-1], targets = tokens[:, 1:], weights = (targets != pad_id).

    >>> inputs, targets, weights = next_token_targets(jnp.array([[5, 6, 7, 0]]))
    >>> inputs.tolist(), targets.tolist(), weights.tolist()
    ([[5, 6, 7]], [[6, 7, 0]], [[1.0, 1.0, 0.0]])
    """
    _check_int("pad_id", pad_id, 0)
    tokens_BT = jnp.asarray(tokens)
    if tokens_BT.ndim != 2 or tokens_BT.shape[1] < 2:
        raise ValueError(f"tokens of shape {tokens_BT.shape}: expected [batch, length >= 2]")
    targets_BT = tokens_BT[:, 1:]
    return tokens_BT[:, :-1], targets_BT, (targets_BT != pad_id).astype(jnp.float32)


def prefix_lm_split(rng, tokens, pad_id: int = 0) -> tuple[jax.Array, jax.Array]:
    """A random prefix-LM split of each right-padded row: (prefix_lengths [B] int32, weights).

    With n = number of non-pad tokens in a row, the prefix length p is uniform in [1, n - 1]
    (p = n when n < 2), so at least one token is left to predict. `weights` [B, T-1] float32 go
    with `next_token_targets(tokens)`: input position t predicts tokens[t + 1] and gets weight 1
    iff t + 1 >= p and tokens[t + 1] != pad_id, i.e. loss on the continuation tokens only (the
    last prefix position predicts the first continuation token). Use `masks.PrefixLM(p)` for
    attention. E.g. tokens [5 6 7 8 0] with p = 2: prefix 5 6, weights [0 1 1 0].

    A row of two tokens can only split as p = 1; a row of one token gets p = 1 and no weights:

    >>> prefix, weights = prefix_lm_split(jax.random.key(0), jnp.array([[5, 6, 0], [5, 0, 0]]))
    >>> prefix.tolist(), weights.tolist()
    ([1, 1], [[1.0, 0.0], [0.0, 0.0]])
    """
    _check_int("pad_id", pad_id, 0)
    tokens_BT = jnp.asarray(tokens)
    if tokens_BT.ndim != 2 or tokens_BT.shape[1] < 2:
        raise ValueError(f"tokens of shape {tokens_BT.shape}: expected [batch, length >= 2]")
    batch, length = tokens_BT.shape
    lengths_B = jnp.sum(tokens_BT != pad_id, axis=1, dtype=jnp.int32)
    drawn_B = jax.random.randint(rng, (batch,), 1, jnp.maximum(lengths_B, 2), dtype=jnp.int32)
    prefix_B = jnp.where(lengths_B >= 2, drawn_B, lengths_B)
    target_pos_T = jnp.arange(1, length, dtype=jnp.int32)  # token index predicted at input t
    weights_BT = (target_pos_T[None, :] >= prefix_B[:, None]) & (tokens_BT[:, 1:] != pad_id)
    return prefix_B, weights_BT.astype(jnp.float32)


# -----------------------------------------------------------------------------
# BERT masked LM


def mlm_corrupt(rng, tokens, *, vocab_size: int, mask_id: int, special_ids=(), rate: float = 0.15,
                mask_fraction: float = 0.8, random_fraction: float = 0.1,
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """BERT masked-LM corruption: (inputs [B, T], targets [B, T] = tokens, weights [B, T]).

    Each token not in `special_ids` (list pad, CLS, SEP, ... there) is selected independently
    with probability `rate`. A selected token becomes `mask_id` with probability
    `mask_fraction`, a uniformly random id with probability `random_fraction` (drawn from
    [0, vocab_size) minus `special_ids` and `mask_id`, so never a special token), and stays
    unchanged otherwise. weights (float32) are 1 exactly on the selected positions.

    >>> tokens = jnp.array([[0, 5, 6, 7, 8, 9, 1]])  # 0 = pad, 1 = [SEP]
    >>> inputs, targets, weights = mlm_corrupt(jax.random.key(0), tokens, vocab_size=16,
    ...                                        mask_id=2, special_ids=(0, 1, 2), rate=0.5)
    >>> bool((targets == tokens).all()), float(weights[0, 0] + weights[0, -1])
    (True, 0.0)
    >>> bool(jnp.where(weights == 0, inputs == tokens, True).all())  # unselected: unchanged
    True
    """
    _check_int("vocab_size", vocab_size, 1)
    _check_int("mask_id", mask_id, 0, vocab_size)
    for special in special_ids:
        _check_int("special id", special, 0, vocab_size)
    _check_fraction("rate", rate, 0.0, 1.0, open_low=True, open_high=True)
    _check_fraction("mask_fraction", mask_fraction, 0.0, 1.0)
    _check_fraction("random_fraction", random_fraction, 0.0, 1.0)
    if mask_fraction + random_fraction > 1:
        raise ValueError(f"mask_fraction + random_fraction = {mask_fraction + random_fraction!r}:"
                         f" expected <= 1")
    special = np.unique(np.asarray([*special_ids], np.int64))
    allowed = np.setdiff1d(np.arange(vocab_size), np.append(special, mask_id))
    if random_fraction > 0 and allowed.size == 0:
        raise ValueError(f"random_fraction={random_fraction!r}: no non-special ids to sample")
    tokens_BT = jnp.asarray(tokens)

    select_key, kind_key, random_key = jax.random.split(rng, 3)
    is_special_BT = (tokens_BT[..., None] == jnp.asarray(special, tokens_BT.dtype)).any(-1)
    selected_BT = jax.random.bernoulli(select_key, rate, tokens_BT.shape) & ~is_special_BT
    kind_BT = jax.random.uniform(kind_key, tokens_BT.shape)  # which replacement, by interval
    to_mask_BT = selected_BT & (kind_BT < mask_fraction)
    inputs_BT = jnp.where(to_mask_BT, jnp.asarray(mask_id, tokens_BT.dtype), tokens_BT)
    if random_fraction > 0:
        to_random_BT = selected_BT & ~to_mask_BT & (kind_BT < mask_fraction + random_fraction)
        choice_BT = jax.random.randint(random_key, tokens_BT.shape, 0, allowed.size)
        random_BT = jnp.asarray(allowed, tokens_BT.dtype)[choice_BT]
        inputs_BT = jnp.where(to_random_BT, random_BT, inputs_BT)
    return inputs_BT, tokens_BT, selected_BT.astype(jnp.float32)


# -----------------------------------------------------------------------------
# T5 span corruption


def _span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(num_noise, num_spans) for a raw row of `length` >= 2 tokens; Python's round() (ties to
    even). num_spans is also capped at num_noise and at the kept count, so every span of
    either kind can be non-empty (a no-op for usual settings such as density 0.15, mean 3)."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(1, round(num_noise / mean_span_length))
    return num_noise, min(num_spans, num_noise, length - num_noise)


def _check_span_args(noise_density: Any, mean_span_length: Any) -> None:
    _check_fraction("noise_density", noise_density, 0.0, 1.0, open_low=True, open_high=True)
    _check_fraction("mean_span_length", mean_span_length, 1.0, float("inf"), open_high=True)


def span_corruption_lengths(inputs_length: int, noise_density: float = 0.15,
                            mean_span_length: float = 3.0) -> tuple[int, int]:
    """(raw length L, targets length) so that span-corrupted inputs fill `inputs_length` tokens.

    For L raw tokens: num_noise = round(L * noise_density) clipped to [1, L - 1], num_spans =
    max(1, round(num_noise / mean_span_length)) (Python's round(), ties to even; also capped at
    num_noise and L - num_noise), inputs length = L - num_noise + num_spans + 1 (a sentinel per
    span, then EOS), targets length = num_noise + num_spans + 1. Returns the largest L whose
    inputs length is <= `inputs_length`, and that L's targets length. The T5 numbers:

    >>> span_corruption_lengths(512)
    (568, 114)
    """
    _check_int("inputs_length", inputs_length, 3)
    _check_span_args(noise_density, mean_span_length)
    # With num_noise <= L * density + 1/2, the inputs length is >= L * (1 - d + d / mean), or
    # >= 2 L (1 - d) where num_spans is capped at the kept count; no L beyond this bound fits.
    rate = min(1 - noise_density + noise_density / mean_span_length, 2 * (1 - noise_density))
    best = None
    for length in range(2, int(inputs_length / rate) + 2):
        num_noise, num_spans = _span_counts(length, noise_density, mean_span_length)
        if length - num_noise + num_spans + 1 <= inputs_length:
            best = (length, num_noise + num_spans + 1)
    assert best is not None  # L = 2 always fits: inputs length 3
    return best


def span_corruption_spans(inputs_length: int, noise_density: float = 0.15,
                          mean_span_length: float = 3.0) -> int:
    """Noise spans per row, so sentinel ids needed, when span corruption fills encoder rows of
    `inputs_length` (`span_corruption_lengths`' raw rows). The T5 numbers:

    >>> span_corruption_spans(512), span_corruption_spans(2048)
    (28, 114)
    """
    length = span_corruption_lengths(inputs_length, noise_density, mean_span_length)[0]
    return _span_counts(length, noise_density, mean_span_length)[1]


def _random_segment_lengths(key, num_items: int, num_segments: int) -> jax.Array:
    """Uniformly random split of num_items into num_segments non-empty runs -> lengths [S]."""
    if num_segments == 1:
        return jnp.full((1,), num_items, jnp.int32)
    # num_segments - 1 segment starts among the num_items - 1 gaps between items.
    starts_G = (jnp.arange(num_items - 1) < num_segments - 1).astype(jnp.int32)
    starts_G = jax.random.permutation(key, starts_G)
    segment_ids = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(starts_G)])
    return jnp.zeros((num_segments,), jnp.int32).at[segment_ids].add(1)


def span_corrupt(rng, tokens, *, vocab_size: int, eos_id: int, noise_density: float = 0.15,
                 mean_span_length: float = 3.0) -> tuple[jax.Array, jax.Array]:
    """T5 span corruption of full rows tokens [B, L] -> (inputs [B, I], targets [B, K]).

    Per row (independent randomness), num_noise and num_spans come from L as in
    `span_corruption_lengths`; the noise tokens are cut into num_spans non-empty spans and the
    kept tokens into num_spans non-empty spans (uniformly random splits), interleaved as
    kept_0 noise_0 kept_1 noise_1 ... (a row starts with kept and ends with noise tokens). Noise
    span i is replaced by the sentinel vocab_size - 1 - i (<extra_id_0> is the last id) in the
    inputs; the targets list each sentinel followed by its span. Both end with EOS, and every
    row is exactly full: I = L - num_noise + num_spans + 1, K = num_noise + num_spans + 1.
    Tokens must not use sentinel ids. Example: L = 10, density 0.3, mean 1.5 -> 3 noise tokens
    in 2 spans; with V = 100 (sentinels 99, 98) and EOS = 1 one draw could be

        tokens   10 11 12 13 14 15 16 17 18 19
        noise     .  .  .  x  .  .  .  .  x  x
        inputs   10 11 12 99 14 15 16 17 98  1
        targets  99 13 98 18 19  1

    Three tokens, one noise token: the only split is [kept kept][noise]:

    >>> inputs, targets = span_corrupt(jax.random.key(0), jnp.array([[10, 11, 12]]),
    ...                                vocab_size=100, eos_id=1, noise_density=0.3)
    >>> inputs.tolist(), targets.tolist()
    ([[10, 11, 99, 1]], [[99, 12, 1]])
    """
    _check_int("vocab_size", vocab_size, 2)
    _check_span_args(noise_density, mean_span_length)
    tokens_BL = jnp.asarray(tokens)
    if tokens_BL.ndim != 2 or tokens_BL.shape[1] < 2:
        raise ValueError(f"tokens of shape {tokens_BL.shape}: expected [batch, length >= 2]")
    length = tokens_BL.shape[1]
    num_noise, num_spans = _span_counts(length, noise_density, mean_span_length)
    if vocab_size - num_spans < 1:
        raise ValueError(f"vocab_size={vocab_size}: expected > {num_spans} sentinels")
    _check_int("eos_id", eos_id, 0, vocab_size - num_spans)  # not a sentinel
    inputs_len = length - num_noise + num_spans + 1
    targets_len = num_noise + num_spans + 1
    dtype = tokens_BL.dtype

    def corrupt_row(key, tokens_L):
        kept_key, noise_key = jax.random.split(key)
        kept_S = _random_segment_lengths(kept_key, length - num_noise, num_spans)
        noise_S = _random_segment_lengths(noise_key, num_noise, num_spans)
        run_lengths = jnp.stack([kept_S, noise_S], axis=1).reshape(-1)  # kept_0 noise_0 ...
        run_starts = jnp.cumsum(run_lengths)[:-1]  # where runs 1 .. 2S-1 begin, all < L
        run_L = jnp.cumsum(jnp.zeros((length,), jnp.int32).at[run_starts].add(1))
        is_noise_L = run_L % 2 == 1
        span_L = run_L // 2  # noise span index (for noise positions)
        first_L = jnp.concatenate([jnp.ones((1,), bool), run_L[1:] != run_L[:-1]])
        sentinel_L = (vocab_size - 1 - span_L).astype(dtype)

        # inputs: kept tokens, and one sentinel at the first token of each noise span.
        emit_L = ~is_noise_L | first_L
        where_L = jnp.where(emit_L, jnp.cumsum(emit_L) - 1, inputs_len)  # inputs_len: dropped
        inputs = jnp.zeros((inputs_len,), dtype).at[where_L].set(
            jnp.where(is_noise_L, sentinel_L, tokens_L), mode="drop")
        # targets: noise token j goes after the noise tokens before it and sentinels 0..span.
        target_pos_L = jnp.cumsum(is_noise_L) - 1 + span_L + 1
        targets = jnp.zeros((targets_len,), dtype)
        targets = targets.at[jnp.where(is_noise_L, target_pos_L, targets_len)].set(
            tokens_L, mode="drop")
        targets = targets.at[jnp.where(is_noise_L & first_L, target_pos_L - 1, targets_len)].set(
            sentinel_L, mode="drop")
        eos = jnp.asarray(eos_id, dtype)
        return inputs.at[-1].set(eos), targets.at[-1].set(eos)

    keys = jax.random.split(rng, tokens_BL.shape[0])
    return jax.vmap(corrupt_row)(keys, tokens_BL)


__all__ = [
    "cross_entropy", "next_token_targets", "prefix_lm_split", "mlm_corrupt",
    "span_corruption_lengths", "span_corruption_spans", "span_corrupt",
]
