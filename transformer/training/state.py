"""The train state, and the one function that lays it out on a mesh (`initial_state`): used by
training, evaluation, generation, fine-tuning and the TPU AOT compile alike."""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from transformer.models import family_of
from transformer.nn import lora as lora_lib
from transformer.nn import moe as moe_lib
from transformer.parallel import sharding


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any  # None for a params-only state (evaluation, generation)
    first_nonfinite_step: jax.Array  # -1 until a step's loss or grads are NaN/Inf


def example_batch(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    """A one-row batch of zeros with the family's model inputs: param shapes do not depend on
    the data, so this stands in for it when only the params' shapes are needed.

    >>> from transformer.configs import base_config
    >>> {k: v.shape for k, v in example_batch(base_config()).items()}
    {'inputs': (1, 8)}
    """
    m = config.model
    return {name: np.zeros((1, m.image_size, m.image_size, m.channels), np.float32)
            if name == "images" else np.zeros((1, 8), np.int32)
            for name in family_of(config).inputs}


def initial_state(config: ml_collections.ConfigDict, model: nn.Module, mesh: jax.sharding.Mesh,
                  batch: dict | None = None,
                  optimizer: optax.GradientTransformation | None = None):
    """(abstract state, shardings, init) of `config`'s train state laid out on `mesh`.

    `init(jax.random.key(config.seed))` creates the state directly in its shards; the abstract
    state and shardings serve restoring and ahead-of-time compiles. Params (and the optimizer's
    moments) are sharded by their logical axis names (`sharding.LOGICAL_AXIS_RULES`). `batch`
    (default `example_batch(config)`) gives the model's input shapes; without an `optimizer`
    the state holds no optimizer state.
    """
    family = family_of(config)
    args = family.init_args(example_batch(config) if batch is None else batch)

    def init(rng):
        params = model.init(rng, *args)["params"]
        check_freeze(nn.unbox(params), config)
        if lora_lib.enabled(config):  # QLoRA: the frozen targeted kernels quantized
            lora_lib.check_targets(nn.unbox(params), model_lora(config))
            params = lora_lib.quantize_base(params, model_lora(config))
        return TrainState(jnp.zeros((), jnp.int32), params,
                          None if optimizer is None else optimizer.init(params),
                          jnp.full((), -1, jnp.int32))

    return sharding.sharded_init(init, mesh, jax.random.key(config.seed))


def model_lora(config: ml_collections.ConfigDict) -> lora_lib.LoraConfig:
    return lora_lib.LoraConfig(**config.model.lora.to_dict())


def num_params(abstract_state: TrainState) -> int:
    """Its params; a QLoRA kernel counts its values, not its per-channel scales."""
    return lora_lib.counts(abstract_state.params)[0]


def param_name(path) -> str:
    """A param's tree path as the name optimizer.freeze matches: "encoder/layers_0/mlp/wo"."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def active_params(abstract_state: TrainState, config: ml_collections.ConfigDict,
                  matching: str | tuple[str, ...] | None = None) -> int:
    """The params a token passes through: all of them less, in each mixture-of-experts layer,
    the experts it is not routed to (E - top_k of E; the router and shared experts are active).
    A dense model's active params are all its params. `matching`: only those whose name
    (`param_name`) the regex (each of the regexes) finds a match in (e.g. an encoder-decoder's
    encoder side)."""
    moe = config.model.get("moe")
    routed = moe.num_experts if moe else 0
    patterns = (matching,) if isinstance(matching, str) else tuple(matching or ())
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            abstract_state.params, is_leaf=lora_lib.is_quantized)[0]:
        if not all(re.search(pattern, param_name(path)) for pattern in patterns):
            continue
        keys = [getattr(k, "key", None) for k in path]
        size = lora_lib.stored_size(leaf)  # a QLoRA kernel's values, not its scales
        total += size
        if routed and "moe" in keys[:-1] and keys[-1] in moe_lib.EXPERT_WEIGHTS:
            total -= size * (routed - moe.top_k) // routed
    return total


def check_freeze(params, config: ml_collections.ConfigDict) -> None:
    """One line if optimizer.freeze matches every param that would train (nothing would; under
    LoRA the base is frozen too, `lora.frozen_regex`) or none (it would do nothing), or
    optimizer.head matches no param that trains (head_learning_rate would train nothing).
    `params`: a model's, unboxed."""
    freeze, head = config.optimizer.get("freeze", ""), config.optimizer.get("head", "")
    names = [param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    frozen = lora_lib.frozen_regex(freeze) if lora_lib.enabled(config) else freeze
    trained = [name for name in names if not (frozen and re.search(frozen, name))]
    base = " (LoRA freezes the base)" if frozen != freeze else ""
    if freeze and not any(re.search(freeze, name) for name in names):
        raise ValueError(f"optimizer.freeze={freeze!r} matches no param: expected a regex over "
                         f"param paths such as {names[0]}")
    if freeze and not trained:
        raise ValueError(f"optimizer.freeze={freeze!r} matches every param that would train"
                         f"{base}, so nothing would train: expected a regex that leaves some out")
    if head and not any(re.search(head, name) for name in names):
        raise ValueError(f"optimizer.head={head!r} matches no param: expected a regex over "
                         f"param paths such as {names[-1]}")
    if head and not any(re.search(head, name) for name in trained):
        raise ValueError(f"optimizer.head={head!r} matches only frozen params{base}, so "
                         "head_learning_rate would train nothing: expected a regex over trained "
                         f"params such as {(trained or names)[-1]}")
