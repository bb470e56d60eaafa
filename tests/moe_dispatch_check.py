"""Dropless MoE dispatch on a mesh, one layer on 8 forced CPU devices; prints JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_dispatch_check.py DIR

Run by tests/test_moe.py in a subprocess. One gated MoE layer (8 experts, top-2,
capacity_factor=0; DeepSeek-V3's sigmoid scores in 2 groups with the balance bias, and
gpt-oss's biases and clamped SwiGLU, all params perturbed so each is in play) against the
same layer on one device (the single-device ragged path): per
mesh the dispatch path it compiled, the largest output and gradient differences. Also the
exchange by `jax.lax.ragged_all_to_all` (which XLA:CPU cannot compile) with that primitive
emulated from its documented semantics, and the compiled temporary bytes of the sharded path
at T and 4T tokens per row (and of the capacity path with T slots, for contrast).
"""

from __future__ import annotations

import json
import math
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn import kernels, moe
from transformer.parallel import sharding

E, K, D, F, B, T = 8, 2, 16, 24, 8, 8
MESHES = ["expert=4", "data=2,expert=4", "fsdp=2,expert=4",
          "expert=4,tensor=2", "fsdp=2,expert=2,tensor=2", "expert=2,sequence=2,data=2",
          "data=8", "fsdp=2,sequence=2,tensor=2"]


def layer(capacity_factor: float = 0.0) -> moe.MoEFeedForward:
    return moe.MoEFeedForward(num_experts=E, d_ff=F, top_k=K, capacity_factor=capacity_factor,
                              gated=True, activation=nn.silu, score="sigmoid", groups=2,
                              top_groups=1, balance_bias=True, use_bias=True, swiglu_limit=2.0)


def loss(params, x, capacity_factor=0.0):
    y, routing = layer(capacity_factor).apply(params, x)
    return jnp.sum(y * jnp.sin(x)) + routing.load_balance, y


def sizes(name: str) -> dict:
    return {"data": 1, **{a: int(n) for a, n in (p.split("=") for p in name.split(","))}}


def on_mesh(name: str, params, x, capacity_factor=0.0, compile_only=False):
    """(value, output, grads) of `loss` on the mesh `name`, and the dispatch path traced;
    `compile_only`: the compiled step's temporary bytes instead."""
    mesh_sizes = sizes(name)
    mesh = sharding.make_mesh(mesh_sizes, jax.devices()[:math.prod(mesh_sizes.values())])
    shardings = sharding.logical_shardings(params, mesh)
    params = jax.device_put(nn.unbox(params), shardings)
    x = jax.device_put(x, sharding.batch_sharding(mesh))
    step = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, capacity_factor), has_aux=True))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            kernels.recording() as chosen:
        if compile_only:
            memory = step.lower(params, x).compile().memory_analysis()
            return memory.temp_size_in_bytes, chosen
        (value, y), grads = step(params, x)
    return (value, y, grads), chosen


def diffs(got, want) -> dict:
    (value, y, grads), (value0, y0, grads0) = got, want
    return {"loss": float(value), "loss_diff": abs(float(value) - float(value0)),
            "output_diff": float(jnp.max(jnp.abs(y - y0))),
            "grad_diff": max(float(jnp.max(jnp.abs(a - b))) for a, b in
                             zip(jax.tree.leaves(grads), jax.tree.leaves(grads0), strict=True))}


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from all-gathers (one slice
    per peer): what every peer sends here lands at the offset the sender names."""
    del recv_sizes, axis_index_groups
    here = jax.lax.axis_index(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name)
    operands, starts, counts, targets = map(gather, (operand, input_offsets, send_sizes,
                                                     output_offsets))
    i = jnp.arange(operand.shape[0])
    for source in range(operands.shape[0]):
        rows = jnp.minimum(starts[source, here] + i, operand.shape[0] - 1)
        where = jnp.where(i < counts[source, here], targets[source, here] + i, output.shape[0])
        output = output.at[where].set(operands[source][rows], mode="drop")
    return output


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    params = layer().init(jax.random.key(0), x)
    noise = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(noise), p.shape), params)
    (value, y), grads = jax.value_and_grad(loss, has_aux=True)(nn.unbox(params), x)
    single = (value, y, nn.unbox(grads))
    results = {}
    for name in MESHES:
        got, chosen = on_mesh(name, params, x)
        results[name] = {"dispatch": chosen, **diffs(got, single)}
    # The ragged exchange, as it compiles on GPU and TPU, with the primitive emulated.
    real_kernels, real_ragged = moe.kernels, jax.lax.ragged_all_to_all
    moe.kernels = types.SimpleNamespace(record=kernels.record, target_platform=lambda: "gpu")
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    try:
        for name in ("expert=4", "data=2,expert=2,tensor=2"):
            got, chosen = on_mesh(name, params, x)
            results[f"{name} emulated ragged"] = {"dispatch": chosen, **diffs(got, single)}
    finally:
        moe.kernels, jax.lax.ragged_all_to_all = real_kernels, real_ragged
    memory = {}
    for capacity_factor, path in ((0.0, "sharded"), (E / K, "capacity")):  # E / K: T slots
        for tokens in (64, 256):
            xt = jax.random.normal(jax.random.key(2), (B, tokens, D))
            temp, chosen = on_mesh("expert=4", params, xt, capacity_factor, compile_only=True)
            memory[f"{path} T={tokens}"] = {"temp_bytes": temp, "dispatch": chosen}
    results["memory"] = memory
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
