"""The optimizer: learning-rate schedules, the optimizers (all optax's) with clipping, and
fine-tuning's parameter groups (frozen params, a head at its own learning rate).

optimizer.name picks the update rule (`make_optimizer`): adamw (the default), adafactor, lion,
muon, sgd or schedule_free_adamw. Schedule-free training evaluates, samples and exports other
params than it trains (`eval_params`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from optax import contrib

from transformer.nn import lora as lora_lib
from transformer.training.state import param_name

# optimizer.decay after the warmup
DECAYS = ("cosine", "linear", "constant", "wsd", "inverse_sqrt")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # optimizer.decay_shape: WSD's final decay


def learning_rate_schedule(opt: ml_collections.ConfigDict, steps: int,
                           peak: float | None = None) -> optax.Schedule:
    """Linear warmup to `peak` (default optimizer.learning_rate), then cosine or linear decay to
    min_learning_rate_ratio of it, constant, WSD (`_wsd`) or inverse square root (`_inverse_sqrt`).
    The schedule takes the update's 0-based count (step - 1)."""
    peak = opt.learning_rate if peak is None else peak
    warmup = min(opt.warmup_steps, steps)
    end = peak * opt.min_learning_rate_ratio
    if opt.decay == "cosine" and not warmup:  # (optax's warmup of 1 would spend update 0 at 0)
        return optax.cosine_decay_schedule(peak, max(steps, 1), opt.min_learning_rate_ratio)
    if opt.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1),
                                                  end)
    if opt.decay == "linear":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                     optax.linear_schedule(peak, end, max(steps - warmup, 1))],
                                    [warmup])
    if opt.decay == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                     optax.constant_schedule(peak)], [warmup])
    if opt.decay == "wsd":
        return _wsd(opt, steps, warmup, peak, end)
    if opt.decay == "inverse_sqrt":
        return _inverse_sqrt(warmup, peak)
    raise ValueError(f"optimizer.decay={opt.decay!r}: expected one of {DECAYS}")


def _wsd(opt, steps: int, warmup: int, peak: float, end: float) -> optax.Schedule:
    """Warmup-stable-decay: the linear warmup, `peak` until the last optimizer.decay_fraction of
    the steps (rounded; never before the warmup ends), then down to `end` over them, shaped
    linear, cosine or 1-sqrt: end + (peak - end) * f(p), p the decay's progress in [0, 1),
    f(p) = 1 - p, (1 + cos(pi p)) / 2 or 1 - sqrt(p). The decay starts at steps - its length,
    so a run resumed with larger `steps` stays at the peak longer and decays at its new end."""
    start = max(steps - round(opt.decay_fraction * steps), warmup)  # (round: half to even)
    length = max(steps - start, 1)
    shape = opt.get("decay_shape", "linear")
    if shape == "linear":
        decay = optax.linear_schedule(peak, end, length)
    elif shape == "cosine":
        decay = optax.cosine_decay_schedule(peak, length, end / peak)
    elif shape == "1-sqrt":
        decay = lambda t: end + (peak - end) * (1 - jnp.sqrt(jnp.clip(t / length, 0.0, 1.0)))
    else:
        raise ValueError(f"optimizer.decay_shape={shape!r}: expected one of {DECAY_SHAPES}")
    return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                 optax.constant_schedule(peak), decay], [warmup, start])


def check_schedule(opt: ml_collections.ConfigDict, steps: int) -> None:
    """One line for a WSD decay_fraction that decays nothing: its first update takes the peak
    (progress 0), so a decay of one step (decay_fraction * steps rounding to 1, or to 0)
    trains at a constant rate. (A warmup as long as the run leaves no decay either, as it
    leaves cosine's none.)"""
    length = round(opt.decay_fraction * steps)
    if opt.decay == "wsd" and opt.decay_fraction > 0 and length < 2:
        raise ValueError(f"optimizer.decay_fraction={opt.decay_fraction} with steps={steps}: "
                         f"a decay of {length} step(s) never leaves the peak (its first "
                         "update takes it): expected decay_fraction * steps >= 1.5 (2 steps "
                         "or more), or decay_fraction=0")


def _inverse_sqrt(warmup: int, peak: float) -> optax.Schedule:
    """Vaswani's and T5's: the linear warmup to `peak` at step `warmup`, then
    peak * sqrt(warmup / step). warmup_steps=0 has no ramp: peak / sqrt(max(step, 1)) (the
    first update, step 0, at the peak)."""
    w = float(max(warmup, 1))

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        decayed = peak * jnp.sqrt(w / jnp.maximum(t, w))
        return jnp.where(t < warmup, peak * t / w, decayed)

    return schedule


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` on the updates cast to float32, then cast back: optax sums
    the norm in the updates' own dtype, and under bfloat16 params a sum over many leaves rounds
    their small squares away (a 48-layer GPT's norm came out 1.2% low). The norm clipped is
    then the logged `grad_norm`. Under float32 params the casts do nothing."""
    clip = optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None):
        clipped, state = clip.update(optax.tree.cast(updates, jnp.float32), state, params)
        return optax.tree.cast_like(clipped, updates), state

    return optax.GradientTransformation(clip.init, update)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """optimizer.name's update rule (`update_rule`) at the warmup + decay schedule, after
    global-norm clipping (optimizer.grad_clip_norm; 0: no clipping).

    Fine-tuning groups (`param_labels`): params matching the regex optimizer.freeze
    never change (their gradients are zeroed before clipping), and those matching
    optimizer.head train at optimizer.head_learning_rate (0: the same rate; under muon its
    Muon matrices at muon_learning_rate * head_learning_rate / learning_rate). Under muP
    (model.parametrization="mup") the hidden matrices (`mup_hidden`) form groups of their own
    at those rates / m (`mup_multiplier`); embeddings, the output head, norms and biases keep
    them. Under nonfinite="skip", optax.apply_if_finite wraps it all.
    """
    opt = config.optimizer
    clip = clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm else optax.identity()
    freeze, head = frozen_regex(config), opt.get("head", "")
    m = mup_multiplier(config)
    if freeze or head or m != 1.0:
        hidden = mup_hidden(config) if m != 1.0 else None
        labels = lambda params: param_labels(params, freeze, head, hidden)
        frozen = lambda params: jax.tree.map(lambda label: label == "frozen", labels(params))
        rates = {"backbone": opt.learning_rate,
                 "head": opt.get("head_learning_rate", 0.0) or opt.learning_rate}
        groups = {"frozen": optax.set_to_zero(),
                  **{name: update_rule(config, rate) for name, rate in rates.items()}}
        if m != 1.0:
            groups.update({f"{name}/hidden": update_rule(config, rate / m)
                           for name, rate in rates.items()})
        tx = optax.chain(optax.masked(optax.set_to_zero(), frozen), clip,
                         optax.multi_transform(groups, labels))
    else:
        tx = optax.chain(clip, update_rule(config, opt.learning_rate))
    if config.get("nonfinite", "stop") == "skip":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=config.max_nonfinite_skips)
    return tx


def decay_mask(config: ml_collections.ConfigDict):
    """optax's weight-decay mask (params -> a tree of bools): decay on matrices, a param with
    two or more axes besides the stacking ones (`BATCH_AXES`: a scanned stack's layers, MoE's
    experts), so a scanned stack decays what an unrolled one does; never on biases or norm
    scales (params named *bias, scale or norm: q/k/v biases are [heads, head_dim], Mamba 2's
    gated norm weight `norm` [heads, head_dim]). The axes are read from the model's abstract
    init, once, when the mask is first applied."""
    axes = []

    def decays(path, names, param) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "norm" or name.endswith(("bias", "scale")):
            return False
        return (param.ndim if names is None else sum(n not in BATCH_AXES for n in names)) >= 2

    def mask(params):
        axes[:] = axes or [logical_axes(config)]
        try:
            return jax.tree_util.tree_map_with_path(
                lambda path, names, p: jax.tree.map(lambda leaf: decays(path, names, leaf), p),
                axes[0], params, is_leaf=_IS_AXES)
        except ValueError:  # not the model's params (a hand-made tree): by their own ndim
            return jax.tree_util.tree_map_with_path(lambda path, p: decays(path, None, p),
                                                    params)

    return mask


class Optimizer(NamedTuple):
    """One `optimizer.name`: `build(config, schedule, peak)` gives its optax transformation at
    `schedule` (the warmup + decay to `peak`). `adam_like`: per-param learning rates scale as
    Adam's do, which muP's per-group rates assume (configs refuses muP with the others)."""
    build: Callable[[ml_collections.ConfigDict, optax.Schedule, float],
                    optax.GradientTransformation]
    adam_like: bool = False


def _adamw(config, schedule, peak):
    """optax.adamw (b1, b2, weight_decay on matrices)."""
    opt = config.optimizer
    return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                       mask=decay_mask(config))


def _adafactor(config, schedule, peak):
    """optax.adafactor with the optimizer.adafactor_* keys: factored second moments of every
    param with two dims >= adafactor_min_dim_size_to_factor, decay_rate, update
    clipping_threshold (0: off), multiply_by_parameter_scale (the learning rate is relative to
    each param's RMS), momentum (0: none); weight_decay on matrices, decoupled as AdamW's:
    p -= lr(t) * weight_decay * p. (optax's own weight_decay_rate is not scaled by the rate:
    0.1 took 10% of every matrix at every step.)"""
    opt = config.optimizer
    tx = optax.adafactor(
        schedule, min_dim_size_to_factor=opt.adafactor_min_dim_size_to_factor,
        decay_rate=opt.adafactor_decay_rate,
        multiply_by_parameter_scale=opt.adafactor_parameter_scale,
        clipping_threshold=opt.adafactor_clipping_threshold or None,
        momentum=opt.adafactor_momentum or None)
    if config.model.get("scan_layers"):  # its factors and block RMS are per matrix: per layer
        tx = optax.multi_transform({"layer": per_layer(tx), "whole": tx},
                                   lambda params: stacked_labels(config, params))
    if not opt.weight_decay:
        return tx
    return optax.chain(tx, optax.add_decayed_weights(
        lambda count: -opt.weight_decay * schedule(count), decay_mask(config)))


def per_layer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` on each layer of stacked params apart (vmapped over their leading axis): what it
    does to an unrolled stack's params, where a whole-array statistic (Adafactor's factored
    moments, block RMS) would mix the layers of a scanned one."""
    # (a group that holds no stacked param, MaskedNodes alone, has no axis to map over)
    mapped = lambda f, tree: jax.vmap(f) if jax.tree.leaves(tree) else f
    return optax.GradientTransformation(
        lambda params: mapped(tx.init, params)(params),
        lambda updates, state, params=None: mapped(tx.update, updates)(updates, state, params))


def stacked_labels(config: ml_collections.ConfigDict, params):
    """"layer" for each param of a scanned stack (its first logical axis `layers`), else
    "whole" (`logical_axes`)."""
    return jax.tree.map(lambda names, p: jax.tree.map(
        lambda _: "layer" if names and names[0] == "layers" else "whole", p),
        logical_axes(config), params, is_leaf=_IS_AXES)


def _lion(config, schedule, peak):
    """optax.lion (b1, b2, weight_decay on matrices)."""
    opt = config.optimizer
    return optax.lion(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                      mask=decay_mask(config))


def _sgd(config, schedule, peak):
    """optax.sgd (momentum, 0: none; nesterov) after optax.add_decayed_weights (L2,
    weight_decay on matrices, carried by the momentum as in PyTorch's SGD)."""
    opt = config.optimizer
    return optax.chain(optax.add_decayed_weights(opt.weight_decay, decay_mask(config)),
                       optax.sgd(schedule, momentum=opt.momentum or None,
                                 nesterov=opt.nesterov))


def _schedule_free_adamw(config, schedule, peak):
    """optax.contrib.schedule_free_adamw at a constant `peak` after the warmup
    (optimizer.decay must be "constant"), b1, b2, weight_decay on every param."""
    opt = config.optimizer
    return contrib.schedule_free_adamw(peak, min(opt.warmup_steps, config.steps) or None,
                                       b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay)


# optimizer.name -> its update rule. A new optimizer is one entry here (and its hyperparameter
# keys, if it has new ones, in configs); docs/extending.md walks through one.
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(_adamw, adam_like=True),
    "adafactor": Optimizer(_adafactor),
    "lion": Optimizer(_lion, adam_like=True),
    "muon": Optimizer(lambda config, schedule, peak: muon(config, schedule, peak)),
    "sgd": Optimizer(_sgd),
    "schedule_free_adamw": Optimizer(_schedule_free_adamw, adam_like=True),
}
NAMES = tuple(OPTIMIZERS)
ADAM_LIKE = tuple(name for name, entry in OPTIMIZERS.items() if entry.adam_like)


def update_rule(config: ml_collections.ConfigDict, peak: float) -> optax.GradientTransformation:
    """optimizer.name's optax transformation (`OPTIMIZERS`), at `learning_rate_schedule` to
    `peak`. muon: `muon` on the hidden matrices beside adamw on everything else."""
    name = config.optimizer.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name={name!r}: expected one of {NAMES}")
    schedule = learning_rate_schedule(config.optimizer, config.steps, peak)
    return OPTIMIZERS[name].build(config, schedule, peak)


def muon(config: ml_collections.ConfigDict, schedule: optax.Schedule,
         peak: float) -> optax.GradientTransformation:
    """Muon on the hidden matrices, AdamW (`schedule` to `peak`, as optimizer.name="adamw") on
    the rest.

    optax.contrib.muon (Newton-Schulz orthogonalized Nesterov momentum, optimizer.muon_momentum,
    weight_decay) takes the params that `muon_dimension_numbers` reshapes to matrices, at the
    schedule to optimizer.muon_learning_rate * peak / optimizer.learning_rate: a group at its
    own `peak` (optimizer.head's head_learning_rate) scales both parts by that ratio.
    Embeddings, the output and classifier heads, norms and biases take optax.adamw.
    """
    opt = config.optimizer
    ratio = peak / opt.learning_rate  # 1 but in optimizer.head's group
    dims = muon_dimension_numbers(config)
    orthogonal = contrib.muon(learning_rate_schedule(opt, config.steps,
                                                     opt.muon_learning_rate * ratio),
                              beta=opt.muon_momentum, weight_decay=opt.weight_decay,
                              nesterov=True, muon_weight_dimension_numbers=dims)
    adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                        mask=decay_mask(config))
    return optax.multi_transform({"muon": orthogonal, "adamw": adamw},
                                 lambda params: muon_labels(dims, params))


_IS_DIMS = lambda x: x is None or isinstance(x, contrib.MuonDimensionNumbers)
BATCH_AXES = ("layers", "expert")  # stacked matrices: each orthogonalized on its own
RESIDUAL_AXES = ("embed", "expert_embed")
# MLA's low-rank latent: q_a and kv_a's output, q_b, k_b and v_b's input (`latent_in`); state:
# Mamba 2's B and C [embed, kv_heads, state]; projection: MTP's [2 * embed, embed]
LATENT_AXES = ("latent", "latent_in")
HIDDEN_AXES = RESIDUAL_AXES + LATENT_AXES + ("mlp", "heads", "kv_heads", "kv", "state",
                                             "projection")


def muon_labels(dims, params):
    """"muon" for each param with dimension numbers, "adamw" for the others (`params` may be
    boxed, or hold optax.MaskedNode in another group's places)."""
    return jax.tree.map(lambda d, p: jax.tree.map(lambda _: "adamw" if d is None else "muon", p),
                        dims, params, is_leaf=_IS_DIMS)


_IS_AXES = lambda x: x is None or isinstance(x, tuple)


_AXES_CACHE: dict[str, object] = {}


def logical_axes(config: ml_collections.ConfigDict):
    """The params' tree of logical axis names (a tuple per param; None for a param without),
    from the model's abstract init (the names do not depend on sizes), kept by the config's
    JSON: an optimizer asks for it in its mask, its labels and each trace of its update."""
    key = config.to_json_best_effort(sort_keys=True)
    if key not in _AXES_CACHE:
        if len(_AXES_CACHE) >= 16:
            _AXES_CACHE.clear()
        _AXES_CACHE[key] = _abstract_axes(config)
    return _AXES_CACHE[key]


def _abstract_axes(config: ml_collections.ConfigDict):
    import flax.linen as nn

    from transformer.models import build_model, family_of
    from transformer.training.state import example_batch

    shaped = ml_collections.ConfigDict(config.to_dict())
    shaped.model.vocab_size = shaped.model.vocab_size or 8
    # The names do not depend on the kernel, and one the run names (splash: multiples of 128
    # tokens) may refuse the example batch's 8 tokens.
    shaped.model.attention_impl = "auto"
    if "num_classes" in shaped.model:
        shaped.model.num_classes = shaped.model.num_classes or 1
    model, args = build_model(shaped.model), family_of(shaped).init_args(example_batch(shaped))
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    is_box = lambda x: isinstance(x, nn.Partitioned)
    return jax.tree.map(lambda p: tuple(p.names) if is_box(p) else None, boxed,
                        is_leaf=is_box)


def muon_dimension_numbers(config: ml_collections.ConfigDict):
    """The params' tree of optax.contrib.MuonDimensionNumbers (None: AdamW), by each param's
    logical axes (the model's abstract init): a kernel whose axes, less the stacking axes
    `BATCH_AXES` (a scanned stack's leading `layers`, MoE's `expert`: Muon orthogonalizes each
    layer's, each expert's matrix apart), are two or more `HIDDEN_AXES` is a matrix

    - reading the residual stream, its first axis embed: rows embed, columns the rest, so
      q/k/v [embed, heads, kv] are [embed, heads * kv] and the MLP's wi [embed, mlp] stays;
    - or writing it, its last axis embed: rows the rest, so attention's out
      [heads, kv, embed] is [heads * kv, embed] and wo [mlp, embed] stays;
    - or reading MLA's latent, its first axis latent: rows latent, so q_b, k_b, v_b
      [latent, heads, kv] are [latent, heads * kv].

    Everything else is AdamW's: embeddings and the output head (a vocab axis), classifier
    heads (classes), learned positions (length), convolutions (conv), biases and norm scales
    (one hidden axis), the MoE router (an unnamed axis).
    """
    return jax.tree.map(lambda names: None if names is None else _muon_axes(names),
                        logical_axes(config), is_leaf=_IS_AXES)


def _muon_axes(names) -> contrib.MuonDimensionNumbers | None:
    matrix = [i for i, name in enumerate(names) if name not in BATCH_AXES]
    if len(matrix) < 2 or any(names[i] not in HIDDEN_AXES for i in matrix):
        return None
    if names[matrix[0]] in RESIDUAL_AXES:
        return contrib.MuonDimensionNumbers(tuple(matrix[:1]), tuple(matrix[1:]))
    if names[matrix[-1]] in RESIDUAL_AXES:
        return contrib.MuonDimensionNumbers(tuple(matrix[:-1]), tuple(matrix[-1:]))
    if names[matrix[0]] in LATENT_AXES:
        return contrib.MuonDimensionNumbers(tuple(matrix[:1]), tuple(matrix[1:]))
    return None


def mup_hidden(config: ml_collections.ConfigDict):
    """muP's hidden matrices, whose Adam rates are divided by m (a tree of bools): Muon's
    (`muon_dimension_numbers`), and the MoE router and shared experts' gate ([embed, None]:
    fan-in embed readouts, whose logit updates would grow with the width at the base rate;
    their init stays init_std)."""
    def hidden(names) -> bool:
        matrix = [name for name in names if name not in BATCH_AXES]
        return _muon_axes(names) is not None or matrix == ["embed", None]

    return jax.tree.map(lambda names: names is not None and hidden(names),
                        logical_axes(config), is_leaf=_IS_AXES)


def eval_params(state, config: ml_collections.ConfigDict):
    """The params to evaluate, sample from and export: `state.params`, except under
    schedule_free_adamw, whose train state holds the gradients' point y and whose evaluation
    point is x = (y - (1 - b1) z) / b1 (optax.contrib.schedule_free_eval_params, with each
    group's z: a frozen param stays, and so does a MoE balance bias, which only the train step
    moves: its z is stale). run_eval.evaluate_split (validation and test during training
    and at its end) and the samples after training call it; checkpoint.read_params applies it to
    a saved schedule-free run for every command reading one (evaluate, generate, export,
    visualize, harness, fine-tuning's init_from)."""
    if config.optimizer.get("name", "adamw") != "schedule_free_adamw" or \
            state.opt_state is None:
        return state.params
    is_free = lambda x: isinstance(x, contrib.ScheduleFreeState)
    masked = lambda x: isinstance(x, optax.MaskedNode)
    params = state.params
    for free in [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_free) if is_free(s)]:
        z = jax.tree.map(lambda z, p: p if masked(z) else z, free.z, params, is_leaf=masked)
        evaluated = contrib.schedule_free_eval_params(free._replace(z=z), params)
        params = jax.tree.map(lambda z, e, p: p if masked(z) else e, free.z, evaluated, params,
                              is_leaf=masked)
    return jax.tree_util.tree_map_with_path(
        lambda path, x, y: y if getattr(path[-1], "key", None) == "balance_bias" else x,
        params, state.params)


def mup_multiplier(config: ml_collections.ConfigDict) -> float:
    """muP's width multiplier m = d_model / model.mup_base_width (1: standard, or no base)."""
    model = config.model
    if model.get("parametrization", "standard") != "mup" or not model.get("mup_base_width"):
        return 1.0
    return model.d_model / model.mup_base_width


def frozen_regex(config: ml_collections.ConfigDict) -> str:
    """The regex of the params no update changes: optimizer.freeze's, and under LoRA every
    param but the adapters (no optimizer state for them either)."""
    freeze = config.optimizer.get("freeze", "")
    return lora_lib.frozen_regex(freeze) if lora_lib.enabled(config) else freeze


def param_labels(params, freeze: str, head: str, hidden=None):
    """Each param's optimizer group by its "/"-joined name: "frozen" if it matches the regex
    `freeze`, else "head" if it matches `head`, else "backbone" (empty regexes match nothing);
    with `hidden` (`mup_hidden`'s tree of bools), "/hidden" added for its matrices.

    >>> param_labels({"encoder": {"w": 0}, "classifier": {"w": 0}}, "^encoder/", "^classifier/")
    {'classifier': {'w': 'head'}, 'encoder': {'w': 'frozen'}}
    """
    def label(path, _):
        name = param_name(path)
        if freeze and re.search(freeze, name):
            return "frozen"
        return "head" if head and re.search(head, name) else "backbone"

    labels = jax.tree_util.tree_map_with_path(label, params)
    if hidden is None:
        return labels
    return jax.tree.map(lambda h, group: jax.tree.map(
        lambda g: f"{g}/hidden" if h and g != "frozen" else g, group), hidden, labels)
