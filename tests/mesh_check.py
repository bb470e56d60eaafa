"""Trains a small GPT on several meshes of 8 forced CPU devices; prints the results as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_check.py DIR

Run by tests/test_sharding.py in a subprocess (the device count is fixed when JAX starts).
For each mesh: the loss of every step, the largest parameter difference from the single-device
run, and how a few params are laid out. Then: 2 steps on fsdp=8, a checkpoint, a restore onto 4
devices as data=2 x fsdp=2 and 2 more steps, against 4 uninterrupted steps on fsdp=8.
"""

from __future__ import annotations

import functools
import json
import sys

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np

from transformer import configs, train
from transformer.models import build_model
from transformer.parallel import sharding
from transformer.training import checkpoint_manager, optim, placement, state

MESHES = {"single": None, "8,1,1": (8, 1, 1), "1,8,1": (1, 8, 1), "2,2,2": (2, 2, 2),
          "1,2,4": (1, 2, 4)}
BATCH, LENGTH, VOCAB, STEPS = 8, 16, 64, 4


def small_config(mesh=(1, 1, 1)):
    config = configs.base_config()
    config.update(steps=STEPS, batch_size=BATCH, seq_len=LENGTH)
    config.optimizer.warmup_steps = 1
    config.model.update(family="gpt", num_layers=2, d_model=32, num_heads=4, d_ff=64,
                        vocab_size=VOCAB, position="rope", dropout_rate=0.0)
    config.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    return config


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(7, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                    "weights": np.ones((BATCH, LENGTH), np.float32),
                    "segment_ids": np.ones((BATCH, LENGTH), np.int32),
                    "positions": np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))})
    return out


class Run:
    """A model, its optimizer and jitted step on one mesh."""

    def __init__(self, config, devices):
        self.config = config
        self.model = build_model(config.model)
        self.optimizer = optim.make_optimizer(config)
        group = config.get("pipeline") or {}
        self.placement = placement.Placement(
            sharding.make_mesh(config.mesh, devices), config.batch_size,
            schedule=(group.get("microbatches", 1), group.get("repeats", 1)))
        self.abstract, self.shardings, self.init = state.initial_state(
            config, self.model, self.placement.mesh, batches(1)[0], self.optimizer)
        self.step = self.placement.jit_train_step(
            train.make_train_step(self.model, config, self.optimizer), self.shardings)

    def place(self, state):
        """`state` (host arrays, layer order) laid out on this mesh: another run's initial state
        without compiling this mesh's own init (mesh_check tests that init)."""
        return jax.device_put(state, self.shardings)

    def train(self, state, data):
        """(state, losses): `state` (layer order, donated) trained on `data`, as train.py does
        (in train order between, placement.train_order)."""
        losses = []
        state = self.placement.train_order(state)
        with self.placement.context():
            for batch in data:
                state, metrics = self.step(state, self.placement.global_batch(batch))
                losses.append(float(placement.fetch(metrics)["loss"]))
        return self.placement.layer_order(state), losses


def layout(params) -> dict[str, dict]:
    """Spec and per-device shard shape of a few params."""
    block = params["decoder"]["layers_0"]
    chosen = {"embedding": params["embed"]["embedding"],
              "query": block["self_attention"]["query"], "mlp_wi": block["mlp"]["wi"]}
    return {name: {"spec": str(p.sharding.spec),
                   "shard_shape": list(p.addressable_shards[0].data.shape),
                   "num_shards": len({str(s.index) for s in p.addressable_shards})}
            for name, p in chosen.items()}


def host(params):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)


def max_diff(a, b) -> float:
    """Max |a - b| over the leaves of two pytrees of the same structure (host copies)."""
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def splash_on_meshes(devices) -> dict[str, dict]:
    """Splash (Pallas interpret mode) shard_mapped over meshes vs the dense reference on one
    device: forward and q/k/v gradients, packed causal rows, GQA; plus a whole GPT's loss and
    gradients with `attention_impl="splash"` on data=2 x fsdp=2 x tensor=2."""
    from transformer.nn import dense_attention, kernels, masks

    rng = np.random.default_rng(0)
    batch, length, heads, kv_heads, dim = 4, 128, 4, 2, 16
    q = rng.standard_normal((batch, length, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, length, kv_heads, dim)).astype(np.float32)
            for _ in range(2))
    ids = np.repeat(np.array([[1] * 50 + [2] * 70 + [0] * 8]), batch, 0).astype(np.int32)
    ids[1, :30] = 3
    mask = masks.Segment(ids) & masks.Causal()
    probe = rng.standard_normal(q.shape).astype(np.float32)

    def loss_and_grads(fn, sinks):  # with sinks [N]: their gradient too
        return jax.jit(jax.value_and_grad(
            lambda q, k, v, mask, sinks: jnp.sum(fn(q, k, v, mask, sinks=sinks) * probe),
            argnums=(0, 1, 2) if sinks is None else (0, 1, 2, 4)))

    out = {}
    meshes = {"2,2,2": (2, 2, 2), "4,1,2": (4, 1, 2), "2,2,2 sinks": (2, 2, 2)}
    for name, shape in meshes.items():
        sinks = jnp.array([1.0, -0.5, 2.0, 0.0]) if "sinks" in name else None
        want = jax.device_get(loss_and_grads(dense_attention.dot_product_attention, sinks)(
            q, k, v, mask, sinks))
        mesh = sharding.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape, strict=True)),
                                  devices)
        fn = functools.partial(kernels.splash_attention, block_size=128, interpret=True)
        with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
            got = jax.device_get(loss_and_grads(fn, sinks)(q, k, v, mask, sinks))
            jaxpr = jax.make_jaxpr(functools.partial(fn, sinks=sinks))(q, k, v, mask).jaxpr
        specs = [str(e.params["out_specs"]) for e in jaxpr.eqns
                 if e.primitive.name == "shard_map"]
        out[name] = {"out_specs": specs, "max_diff": max_diff(got, want)}

    # The whole model: same params, same batch; splash on the mesh vs dense on one device.
    config = small_config((2, 2, 2))
    config.model.position = "learned"
    config.seq_len = config.model.max_len = length
    data = {"inputs": rng.integers(7, VOCAB, (BATCH, length)).astype(np.int32),
            "segment_ids": np.ones((BATCH, length), np.int32),
            "positions": np.tile(np.arange(length, dtype=np.int32), (BATCH, 1))}
    params = host(build_model(config.model).init(jax.random.key(0), data["inputs"])["params"])
    results = {}
    for impl in ("dense", "splash"):
        config.model.attention_impl = impl
        model = build_model(config.model)

        def loss(params, model=model):
            logits = model.apply({"params": params}, data["inputs"],
                                 segment_ids=data["segment_ids"], positions=data["positions"])
            return jnp.mean(jnp.sum(logits * logits, -1))

        if impl == "dense":  # one device, no mesh
            results[impl] = jax.device_get(jax.jit(jax.value_and_grad(loss))(params))
            continue
        with jax.set_mesh(sharding.make_mesh(config.mesh, devices)), nn.logical_axis_rules(
                sharding.LOGICAL_AXIS_RULES):
            results[impl] = jax.device_get(jax.jit(jax.value_and_grad(loss))(params))
    out["gpt_2,2,2"] = {"max_diff": max_diff(results["splash"], results["dense"])}
    return out


# Token mixers (model.layer_types / attention_kind) on a mesh: one scanned, rematerialised
# hybrid stack with a layer of each (MLA the full attention), one compile per mesh for all.
MIXERS = {"layer_types": "mamba2,conv,linear_attention,full_attention", "num_layers": 4,
          "attention_kind": "mla", "mamba2.head_dim": 8, "mamba2.state_size": 8,
          "mamba2.chunk_size": 4, "mla.kv_lora_rank": 16, "mla.qk_nope_head_dim": 8,
          "mla.qk_rope_head_dim": 4, "mla.v_head_dim": 8, "linear_attention.key_head_dim": 8,
          "linear_attention.chunk_size": 4, "scan_layers": True, "remat_policy": "full"}
MIXER_BLOCKS = {"mamba2": ("block_0", "mamba2"), "conv": ("block_1", "conv"),
                "linear_attention": ("block_2", "linear_attention"),
                "mla": ("block_3", "self_attention")}


def mixers_on_meshes(devices) -> dict[str, dict]:
    """Per token mixer (`MIXERS`' layers): 3 steps on data=2 x fsdp=2 x tensor=2 (every axis a
    param or the batch is split over) against one device (the losses, the largest difference
    of the mixer's params), and its params' specs. The tensor=4 split of the heads: `MESHES`
    (softmax attention)."""
    runs = {}
    for mesh in (None, (2, 2, 2)):
        config = small_config(mesh or (1, 1, 1))
        config.steps = 3
        for key, value in MIXERS.items():
            group, _, leaf = key.rpartition(".")
            (config.model[group] if group else config.model)[leaf] = value
        run = Run(config, devices[:1] if mesh is None else devices)
        state, losses = run.train(run.init(jax.random.key(0)), batches(3))
        runs[mesh] = losses, state.params["decoder"]["layers"]
    single, (losses, sharded) = runs[None], runs[(2, 2, 2)]
    out = {}
    for name, (block, mixer) in MIXER_BLOCKS.items():
        params = sharded[block][mixer]
        out[f"{name} 2,2,2"] = {
            "losses": losses, "single": single[0],
            "specs": {k: str(v.sharding.spec) for k, v in params.items()
                      if hasattr(v, "sharding")},
            "max_param_diff": max_diff(host(params), host(single[1][block][mixer]))}
    return out


def main(workdir: str) -> None:
    devices = jax.devices()
    data = batches(STEPS)
    results, runs = {}, {}
    reference = None
    for name, mesh in MESHES.items():
        run = Run(small_config(mesh or (1, 1, 1)), devices[:1] if mesh is None else devices)
        state, losses = run.train(run.init(jax.random.key(0)), data)
        runs[name] = run, state, losses
        params = host(state.params)
        if reference is None:
            reference = params
        results[name] = {"losses": losses, "max_param_diff": max_diff(params, reference),
                         "layout": layout(state.params)}

    # Save on fsdp=8 (the run above, 2 steps of it again), restore on 4 devices as data=2 x
    # fsdp=2, continue.
    fsdp8, uninterrupted, uninterrupted_losses = runs["1,8,1"]
    config = fsdp8.config
    state, first = fsdp8.train(fsdp8.init(jax.random.key(0)), data[:2])
    iterator = iter(grain.MapDataset.range(10).to_iter_dataset())
    manager = checkpoint_manager.Manager(workdir, config)
    manager.save(2, state, iterator)
    manager.close()
    config4 = small_config((2, 2, 1))
    run4 = Run(config4, devices[:4])
    manager = checkpoint_manager.Manager(workdir, config4)
    restored = manager.restore(2, run4.abstract, run4.shardings)
    manager.close()
    restored_layout = layout(restored.params)
    restored, second = run4.train(restored, data[2:])
    results["reshard"] = {"losses": first + second, "uninterrupted": uninterrupted_losses,
                          "max_param_diff": max_diff(host(restored.params),
                                                     host(uninterrupted.params)),
                          "layout": restored_layout,
                          "devices": len(restored.params["embed"]["embedding"].sharding
                                         .device_set)}

    results["splash"] = splash_on_meshes(devices)
    results["mixers"] = mixers_on_meshes(devices)

    # A global batch the data-parallel size (here 4 x 2) does not divide: one-line error.
    bad = small_config((4, 2, 1))
    bad.batch_size = 12
    try:
        configs.validate_config(bad)
        results["batch_error"] = None
    except ValueError as error:
        results["batch_error"] = str(error)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
