"""The pure train step: one optimizer update on a global batch, with gradient accumulation and
the record of the first non-finite step (transformer.training.nonfinite reads it)."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import optax

from transformer.models import family_of, transformer_config
from transformer.nn import blocks, routing
from transformer.nn import lora as lora_lib
from transformer.nn import mtp as mtp_lib
from transformer.parallel import pipeline_parallel
from transformer.training import optim
from transformer.training.state import TrainState, param_name


def make_train_step(model, config, optimizer):
    """(state, batch) -> (state, metrics): one optimizer update on the global batch.

    With optimizer.grad_accumulation_steps = k the batch is split into k micro-batches whose
    gradients are averaged (weighted by their token counts) before the update. The step's
    randomness (dropout, ...) is `jax.random.key(config.seed)` folded with the step number.
    """
    seeded = make_seeded_train_step(model, config, optimizer)

    def train_step(state, batch):  # named: the jitted step is jit_train_step in a profile
        return seeded(state, batch, jax.random.key(config.seed))

    return train_step


def make_seeded_train_step(model, config, optimizer):
    """(state, batch, base_rng) -> (state, metrics): `make_train_step`'s step with the seed's
    key as an argument. It is `update(state, *gradients(state, batch, base_rng))`, with the
    two halves as attributes: transformer.batched vmaps the first over seeds."""
    gradients, update = _halves(model, config, optimizer)

    def train_step(state: TrainState, batch, base_rng):
        return update(state, *gradients(state, batch, base_rng))

    train_step.gradients, train_step.update = gradients, update
    return train_step


def _halves(model, config, optimizer):
    """The train step's (gradients, update): (state, batch, base_rng) -> (grads, metrics), and
    (state, grads, metrics) -> (state, metrics)."""
    accumulation = config.optimizer.grad_accumulation_steps
    family = family_of(config)

    def grads_of(params, batch, rng, mtp_ratio=None, per_token=None):
        def loss_fn(p):
            return family.loss_and_metrics(model, config, p, batch, rng, deterministic=False,
                                           loads=True, mtp=True, mtp_ratio=mtp_ratio)
        with (contextlib.nullcontext() if per_token is None
              else routing.token_weight(per_token)):
            (_, metrics), grads = trained_value_and_grad(loss_fn, params,
                                                         optim.frozen_regex(config))
        return grads, metrics

    def gradients(state: TrainState, batch, base_rng):
        rng = jax.random.fold_in(base_rng, state.step)
        ratio = _token_ratio(config, batch, accumulation)
        if accumulation == 1:
            return grads_of(state.params, batch, rng,
                            per_token=None if ratio is None else _per_token(ratio, batch))
        return _accumulated(grads_of, state.params, batch, rng, accumulation,
                            _mtp_ratio(config, batch), ratio)

    def update(state: TrainState, grads, metrics):
        # (a frozen param's gradient is zero, never computed: `trained_value_and_grad`, so
        # this is the trainable params' norm, the one optimizer.grad_clip_norm clips; summed
        # in float32 as `optim.clip_by_global_norm` sums it, whatever the params' dtype)
        grad_norm = optax.tree.norm(optax.tree.cast(grads, jnp.float32))
        exploded = jnp.asarray(False)
        if config.get("max_grad_norm", 0.0):
            exploded = grad_norm > config.max_grad_norm
            # Under nonfinite="skip", optax.apply_if_finite then skips (and counts) the step.
            grads = jax.tree.map(lambda g: jnp.where(exploded, jnp.nan, g), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params_finite = jax.tree.reduce(
            jnp.logical_and, jax.tree.map(lambda p: jnp.isfinite(p).all(), params))
        finite = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & params_finite
                  & ~exploded)
        step = state.step + 1  # the number the logs and checkpoints give this step
        first_bad = jnp.where((state.first_nonfinite_step < 0) & ~finite, step,
                              state.first_nonfinite_step)
        metrics = {**metrics, "grad_norm": grad_norm}
        params, metrics = expert_balance(model, config, params, state.params, metrics,
                                         finite)
        return TrainState(state.step + 1, params, opt_state, first_bad), metrics

    return gradients, update


def _accumulated(grads_of, params, batch, rng, accumulation: int, mtp_ratio, ratio=None):
    """(grads, metrics) of the batch as `accumulation` micro-batches: `grads_of`'s (params,
    micro-batch, rng, mtp_ratio, per_token) -> (grads, metrics), averaged weighted by token
    counts; `ratio` (`_token_ratio`) sets the MoE layers' per-token weight."""
    # Micro-batch i takes rows i, i + k, i + 2k, ...: each device keeps its own rows
    # (a contiguous split would move rows between data-parallel shards).
    micro = jax.tree.map(
        lambda x: x.reshape(x.shape[0] // accumulation, accumulation,
                            *x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(carry, inputs):
        grads_sum, tokens, sums = carry
        micro_batch, i = inputs
        grads, m = grads_of(params, micro_batch, jax.random.fold_in(rng, i), mtp_ratio,
                            None if ratio is None else _per_token(ratio, micro_batch))
        # perplexity = exp(mean unsmoothed ce): its log is averaged and exp'd back
        # below (the loss is label smoothing's objective, not that ce)
        m = {**m, "perplexity": jnp.log(m["perplexity"])}
        n = m["num_tokens"]
        grads_sum = jax.tree.map(lambda a, g: a + g.astype(a.dtype) * n, grads_sum, grads)
        sums = jax.tree.map(lambda a, v: a + v * n, sums, {k: m[k] for k in sums})
        return (grads_sum, tokens + n, sums), None

    # Every metric but the counts is a token-weighted mean over the micro-batches (the MTP
    # losses through mtp_ratio; the MoE layers' router z-loss, dropped fraction and expert
    # loads [E] through `ratio`).
    shapes = jax.eval_shape(grads_of, params, jax.tree.map(lambda x: x[0], micro), rng,
                            mtp_ratio, ratio)[1]
    # Summed in float32 (16-bit params' gradients too), each averaged back to its own dtype.
    zeros = lora_lib.zero_grads(params)
    sum_zeros = jax.tree.map(lambda z: z.astype(jnp.float32), zeros)
    sums = {k: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), v)
            for k, v in shapes.items() if k != "num_tokens"}
    (grads_sum, tokens, sums), _ = jax.lax.scan(
        accumulate, (sum_zeros, 0.0, sums), (micro, jnp.arange(accumulation)))
    denominator = jnp.maximum(tokens, 1.0)
    grads = jax.tree.map(lambda g, z: (g / denominator).astype(z.dtype), grads_sum, zeros)
    metrics = jax.tree.map(lambda v: v / denominator, sums)
    metrics.update(perplexity=jnp.exp(metrics["perplexity"]), num_tokens=tokens)
    return grads, metrics


def _mtp_ratio(config, batch):
    """[D]: each multi-token prediction module's target count over the next-token loss's in
    the whole batch (`Family.loss_and_metrics`' mtp_ratio); None without modules. A module's
    cross-entropy is a mean over its own targets, fewer than the next-token loss's (document
    and row ends), in a share that differs between micro-batches: weighted by the next-token
    counts, those means would not average to the batch's."""
    depth = config.model.get("mtp", {}).get("depth", 0)
    if not depth:
        return None
    # Only gpt (token_loss) has modules: its metrics["num_tokens"] is the sum of the batch's
    # weights, so the micro-batches' counts add up to this one.
    tokens = jnp.sum(batch["weights"], dtype=jnp.float32)
    return mtp_lib.token_counts(batch, depth) / jnp.maximum(tokens, 1.0)


def _token_ratio(config, batch, accumulation: int):
    """N / V, the batch's target count (the sum of its weights) over its valid tokens
    (segment_ids > 0: the tokens its MoE layers route), where the step averages the MoE
    layers' token means over parts of the batch (accumulation > 1, or a pipeline's
    microbatches); else None. The step weighs a micro-batch's values by its n targets, the
    pipeline its M microbatches' equally (`MoEFeedForward._per_token`): a valid token's weight
    N / (V n) (`_per_token`) makes either the whole batch's token mean. Only families whose
    loss is `token_loss` (n: the sum of the weights) and whose MoE layers route the batch's
    `segment_ids` (gpt, prefix_lm, bert); the others' micro-batches keep their own means."""
    if accumulation == 1 and pipeline_parallel.stages_in_mesh() == 1:
        return None  # (one part: the ordinary step, untouched)
    family = family_of(config)
    if (not config.model.get("moe", {}).get("num_experts") or not family.per_row
            or "segment_ids" not in family.features or "weights" not in batch):
        return None
    valid = jnp.sum(batch["segment_ids"] > 0, dtype=jnp.float32)
    return jnp.sum(batch["weights"], dtype=jnp.float32) / jnp.maximum(valid, 1.0)


def _per_token(ratio, batch):
    """A valid token's weight (`routing.token_weight`) in a part of the batch whose values the
    step weighs by its n targets: ratio / n (0 without targets: weighed by 0 anyway)."""
    n = jnp.sum(batch["weights"], dtype=jnp.float32)
    return jnp.where(n > 0, ratio / jnp.where(n > 0, n, 1.0), 0.0)


def trained_value_and_grad(loss_fn, params, frozen: str):
    """jax.value_and_grad(loss_fn, has_aux=True)(params), differentiated by the params the regex
    `frozen` (`optim.frozen_regex`: optimizer.freeze's, a LoRA run's base) does not match by
    name alone: ((loss, aux), grads), zeros for the frozen ones. The optimizer zeroes their
    gradients before clipping anyway; never computing them keeps their weight gradients out
    of the traced step (the work HFU counts) and never differentiates QLoRA's int8 base."""
    if not frozen:
        return jax.value_and_grad(loss_fn, has_aux=True)(params)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    fixed = [bool(re.search(frozen, param_name(path))) for path, _ in leaves]  # frozen leaves
    values = [leaf for _, leaf in leaves]

    def loss_of(trained):
        trained = iter(trained)
        return loss_fn(tree.unflatten([jax.lax.stop_gradient(v) if f else next(trained)
                                       for v, f in zip(values, fixed, strict=True)]))

    out, grads = jax.value_and_grad(loss_of, has_aux=True)(
        [v for v, f in zip(values, fixed, strict=True) if not f])
    grads = iter(grads)
    return out, tree.unflatten([lora_lib.zero_grads(v) if f else next(grads)
                                for v, f in zip(values, fixed, strict=True)])


def expert_balance(model, config, params, before, metrics, finite):
    """The MoE layers' expert loads out of the step's metrics: each layer's imbalance logged
    (moe_imbalance/<stack>_<layer>, and their max), and each balance bias (moe.balance_bias)
    back to its value before the optimizer, moved by moe.bias_update_rate towards balance on
    a finite step (DeepSeek-V3), unless optimizer.freeze names it. (params, metrics)."""
    loads = metrics.pop("moe_expert_load", None)
    if not loads:
        return params, metrics
    # (the stacks' MoE layout, first dense layers and layer period, is the model config's:
    # a T5's two stacks differ only in depth)
    layers = blocks.layer_imbalance(loads, transformer_config(config.model))
    metrics = {**metrics, **{f"moe_imbalance/{name}": value for name, value in layers.items()}}
    if pipeline_parallel.stages_in_mesh() == 1:  # (stages sow no loads: a max over an MTP
        # module's layers alone would read as the model's)
        metrics["moe_imbalance"] = jnp.max(jnp.stack(list(layers.values())))
    moe = config.model.moe
    if moe.balance_bias:
        params = blocks.move_balance_biases(params, before, loads, moe.bias_update_rate, finite)
        freeze = optim.frozen_regex(config)
        if freeze:  # a frozen param stays: the optimizer's frozen ones already are `before`'s
            labels = optim.param_labels(params, freeze, "")
            params = jax.tree.map(lambda label, new, old: old if label == "frozen" else new,
                                  labels, params, before)
    return params, metrics
