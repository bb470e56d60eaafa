"""The optimizer: learning-rate schedules, AdamW with clipping, and fine-tuning's parameter
groups (frozen params, a head at its own learning rate)."""

from __future__ import annotations

import re

import jax
import ml_collections
import optax

DECAYS = ("cosine", "linear", "constant")  # optimizer.decay after the warmup


def learning_rate_schedule(opt: ml_collections.ConfigDict, steps: int,
                           peak: float | None = None) -> optax.Schedule:
    """Linear warmup to `peak` (default optimizer.learning_rate), then cosine or linear decay to
    min_learning_rate_ratio of it, or constant."""
    peak = opt.learning_rate if peak is None else peak
    warmup = min(opt.warmup_steps, steps)
    end = peak * opt.min_learning_rate_ratio
    if opt.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1),
                                                  max(steps, warmup + 1), end)
    if opt.decay == "linear":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                     optax.linear_schedule(peak, end, max(steps - warmup, 1))],
                                    [warmup])
    if opt.decay == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                     optax.constant_schedule(peak)], [warmup])
    raise ValueError(f"optimizer.decay={opt.decay!r}: expected one of {DECAYS}")


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW with warmup + decay and global-norm clipping (optimizer.grad_clip_norm; 0: no
    clipping); matrices decay, vectors do not.

    Fine-tuning groups (`param_labels`): params matching the regex optimizer.freeze
    never change (their gradients are zeroed before clipping), and those matching
    optimizer.head train at optimizer.head_learning_rate (0: the same rate).
    """
    opt = config.optimizer
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)

    def adamw(peak):
        return optax.adamw(learning_rate_schedule(opt, config.steps, peak), b1=opt.b1,
                           b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask)

    clip = optax.clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm else \
        optax.identity()
    freeze, head = opt.get("freeze", ""), opt.get("head", "")
    if freeze or head:
        labels = lambda params: param_labels(params, freeze, head)
        frozen = lambda params: jax.tree.map(lambda label: label == "frozen", labels(params))
        tx = optax.chain(optax.masked(optax.set_to_zero(), frozen), clip, optax.multi_transform(
            {"frozen": optax.set_to_zero(), "backbone": adamw(opt.learning_rate),
             "head": adamw(opt.get("head_learning_rate", 0.0) or opt.learning_rate)}, labels))
    else:
        tx = optax.chain(clip, adamw(opt.learning_rate))
    if config.get("nonfinite", "stop") == "skip":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=config.max_nonfinite_skips)
    return tx


def param_labels(params, freeze: str, head: str):
    """Each param's optimizer group by its "/"-joined name: "frozen" if it matches the regex
    `freeze`, else "head" if it matches `head`, else "backbone" (empty regexes match nothing).

    >>> param_labels({"encoder": {"w": 0}, "classifier": {"w": 0}}, "^encoder/", "^classifier/")
    {'classifier': {'w': 'head'}, 'encoder': {'w': 'frozen'}}
    """
    def label(path, _):
        name = "/".join(getattr(k, "key", str(k)) for k in path)
        if freeze and re.search(freeze, name):
            return "frozen"
        return "head" if head and re.search(head, name) else "backbone"

    return jax.tree_util.tree_map_with_path(label, params)
