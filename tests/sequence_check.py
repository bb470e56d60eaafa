"""Sequence parallelism on 8 forced CPU devices; prints the results as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sequence_check.py DIR

Run by tests/test_sequence_parallel.py in a subprocess (the device count is fixed when JAX
starts). Parts:
  attention  the all-gather and ring strategies against dense attention on one device (output
             and q/k/v gradients, plus the T5 bias table's gradient), for causal, packed
             causal, prefix-LM, sliding-window, bottom-right causal (fewer queries than keys)
             and zig-zag (`masks.Permuted`) masks, on sequence = 4 (and 2, 8 for zig-zag),
             the masks that differ by row and the sinks on data x sequence x tensor too;
  training   a few train steps of a GPT (packed rows of uneven documents) and of a prefix LM
             on meshes with sequence = 2, 4, 8, alone and with data / fsdp / tensor, both
             strategies, RoPE, ALiBi, T5 and learned positions: losses and final params
             against one device;
  memory     compiled temp bytes per device of attention fwd + bwd at 4096 tokens against
             the axis size, per strategy;
  reshard    2 steps on sequence=4, a checkpoint, a restore on data=2 x sequence=2 and 2 more
             steps, against 4 uninterrupted steps.
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
from mesh_check import Run, host, max_diff  # tests/, this script's directory

from transformer import configs
from transformer.nn import dense_attention, masks, positions, sequence_parallel
from transformer.parallel import sharding
from transformer.training import checkpoint_manager

BATCH, LENGTH, VOCAB, STEPS = 4, 32, 64, 3


def mesh_of(data=1, fsdp=1, sequence=1, tensor=1, devices=None):
    """A mesh of these sizes over the first data x fsdp x sequence x tensor devices."""
    devices = (devices or jax.devices())[:data * fsdp * sequence * tensor]
    return sharding.make_mesh(dict(data=data, fsdp=fsdp, sequence=sequence, tensor=tensor),
                              devices)


def attention_cases(devices) -> dict[str, float]:
    """Largest |difference| (output, q/k/v and bias-table gradients) from dense on one device."""
    rng = np.random.default_rng(0)
    batch, length, heads, kv_heads, dim = 2, 32, 4, 2, 8
    q = rng.standard_normal((batch, length, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, length, kv_heads, dim)).astype(np.float32)
            for _ in range(2))
    ids = np.array([[1] * 5 + [2] * 19 + [3] * 3 + [0] * 5, [4] * 30 + [0] * 2], np.int32)
    probe = rng.standard_normal(q.shape).astype(np.float32)
    table = rng.standard_normal((8, heads)).astype(np.float32)
    order = jnp.asarray(sequence_parallel.zigzag(length, 4))
    cases = {
        "causal": (masks.Causal(), length),
        "packed": (masks.Causal() & masks.Segment(ids), length),
        "prefix": (masks.PrefixLM(jnp.array([7, 20])), length),
        "window": (masks.SlidingWindow(left=5), length),
        "bottom_right": (masks.Causal(), length // 2),  # 16 queries over 32 keys
        "zigzag": (masks.Permuted(masks.Causal() & masks.Segment(ids), order), length),
        "softcap": (masks.Causal() & masks.Segment(ids), length),  # logits capped at 1.5
        "sinks": (masks.Causal() & masks.Segment(ids), length),  # a sink logit per head
    }
    sink_logits = jnp.array([1.0, -0.5, 2.0, 0.0])

    def run(fn, mask, q_len, sinks=None):
        def loss(q, k, v, table, sinks):
            pos = jnp.arange(length)[None]
            bias = positions.T5BiasFn(pos[:, length - q_len:], pos, table, False, 8, 16,
                                      jnp.dtype(jnp.float32))
            out = fn(q, k, v, mask, bias, sinks=sinks)
            return jnp.sum(out * probe[:, :q_len]), out
        grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
        (_, out), grads = jax.jit(grad)(q[:, :q_len], k, v, table, sinks)
        return jax.device_get((out, grads))

    def dense(q, k, v, mask, bias, softcap=0.0, sinks=None):
        return dense_attention.dot_product_attention(
            q, k, v, mask, bias.table(bias.q_BT, bias.kv_BS), softcap=softcap, sinks=sinks)

    results = {}
    # data x sequence x tensor for the masks that differ by row (rows split over data) and the
    # sinks (split with the heads over tensor); the others on sequence=4.
    composite = {"packed", "prefix", "zigzag", "sinks"}
    for name, (mask, q_len) in cases.items():
        softcap = 1.5 if name == "softcap" else 0.0
        sinks = sink_logits if name == "sinks" else None
        want = run(functools.partial(dense, softcap=softcap), mask, q_len, sinks)
        for strategy in sequence_parallel.STRATEGIES:
            fn = functools.partial(sequence_parallel.attention, strategy=strategy, q_chunk=8,
                                   kv_chunk=8, softcap=softcap)
            meshes = [{"sequence": 4}] + [{"data": 2, "sequence": 2, "tensor": 2}] * (
                name in composite)
            extra = [{"sequence": 2}, {"sequence": 8}] if name == "zigzag" else []
            for sizes in meshes + extra:
                with jax.set_mesh(mesh_of(**sizes, devices=devices)), nn.logical_axis_rules(
                        sharding.LOGICAL_AXIS_RULES):
                    got = run(fn, mask, q_len, sinks)
                key = f"{name}/{strategy}/" + ",".join(f"{a}={n}" for a, n in sizes.items())
                results[key] = max_diff(got, want)
    return results


def training_config(family, mesh, strategy="all_gather", balance=True, position="rope",
                    knobs=None):
    config = configs.base_config()
    config.update(steps=STEPS, batch_size=BATCH, seq_len=LENGTH)
    config.optimizer.warmup_steps = 1
    config.model.update(family=family, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                        d_ff=64, vocab_size=VOCAB, position=position, dropout_rate=0.0,
                        sequence_parallel=strategy, sequence_load_balance=balance)
    # A key bias shifts every logit of a row alike, so without RoPE its exact gradient is 0 and
    # Adam turns float noise (1e-9, different on every mesh) into full-size updates.
    config.model.qkv_bias = position == "rope"
    config.model.update(knobs or {})
    config.mesh.update(mesh)
    return config


def training_batches(family: str) -> list[dict[str, np.ndarray]]:
    """Packed rows of uneven documents (per-document positions) for the GPT; prefix-LM rows with
    per-row prefixes for the prefix LM."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(STEPS + 1):
        tokens = rng.integers(7, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                 "weights": np.ones((BATCH, LENGTH), np.float32)}
        lengths = [[3, 20, 9], [32], [17, 10], [1, 1, 25]]
        segments, positions_ = np.zeros((BATCH, LENGTH), np.int32), np.zeros_like(
            batch["inputs"])
        for row, docs in enumerate(lengths):
            start = 0
            for doc, size in enumerate(docs, 1):
                segments[row, start:start + size] = doc
                positions_[row, start:start + size] = np.arange(size)
                start += size
        batch["weights"] = (segments > 0).astype(np.float32)
        batch["segment_ids"], batch["positions"] = segments, positions_
        if family == "prefix_lm":
            batch["prefix_lengths"] = np.array([5, 0, 16, 31], np.int32)
            batch["segment_ids"] = np.ones((BATCH, LENGTH), np.int32)
            batch["positions"] = np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))
            batch["weights"] = (np.arange(LENGTH)[None] >= batch["prefix_lengths"][:, None]
                                ).astype(np.float32)
        out.append(batch)
    return out


# (family, strategy, mesh, load balance, positions[, model knobs]): every axis size, alone and
# beside data / fsdp / tensor, each strategy, both decoder families, one run without the zig-zag
# layout, each kind of positions (RoPE unless named), and the attention / block knobs (learned
# positions with Gemma 2's). Each strategy on every axis size: the attention cases above.
GEMMA2_KNOBS = dict(qk_norm=True, attention_softcap=2.0, final_logit_softcap=5.0,
                    sliding_window=8, sliding_window_pattern=2, norm_placement="sandwich")
OLMO2_KNOBS = dict(qk_norm=True, qk_norm_scope="projection", norm_placement="post_sublayer")
TRAINING = [
    ("gpt", "all_gather", {"data": 2, "sequence": 4}, True, "rope"),
    ("gpt", "ring", {"sequence": 8}, True, "rope"),
    ("gpt", "ring", {"fsdp": 2, "sequence": 2, "tensor": 2}, True, "rope"),
    ("gpt", "ring", {"sequence": 4}, False, "rope"),
    ("gpt", "ring", {"sequence": 4}, True, "alibi"),
    ("gpt", "all_gather", {"data": 2, "sequence": 4}, True, "t5"),
    ("prefix_lm", "all_gather", {"fsdp": 2, "sequence": 4}, True, "rope"),
    ("gpt", "ring", {"data": 2, "sequence": 4}, True, "learned", GEMMA2_KNOBS),
    ("gpt", "all_gather", {"sequence": 4, "tensor": 2}, True, "rope", OLMO2_KNOBS),
    ("prefix_lm", "ring", {"sequence": 2, "tensor": 2}, True, "rope", dict(parallel_block=True)),
]


def training(devices) -> dict[str, dict]:
    results, reference = {}, {}
    for family, strategy, mesh, balance, position, *knobs in TRAINING:
        data = training_batches(family)[:STEPS]
        knobs = knobs[0] if knobs else {}
        key = (family, position, json.dumps(knobs))
        if key not in reference:
            single = Run(training_config(family, {}, position=position, knobs=knobs),
                         devices[:1])
            initial = single.init(jax.random.key(0))
            start = host(initial)  # the mesh runs start from it: no sharded init to compile
            state, losses = single.train(initial, data)
            reference[key] = losses, host(state.params), start
        want_losses, want, start = reference[key]
        run = Run(training_config(family, mesh, strategy, balance, position, knobs), devices)
        state, losses = run.train(run.place(start), data)
        name = ",".join(f"{axis}={size}" for axis, size in mesh.items())
        suffix = ("" if balance else "/unbalanced") + "".join(f"/{k}" for k in knobs)
        results[f"{family}/{strategy}/{name}/{position}{suffix}"] = {
            "losses": losses, "want": want_losses,
            "max_param_diff": max_diff(host(state.params), want)}
    return results


def memory(devices) -> dict[str, list[int]]:
    """Temp bytes per device of causal attention fwd + bwd at 16k tokens (K and V 16 MiB each,
    256-token tiles), by axis size 1, 2, 4, 8."""
    shape = (1, 16384, 4, 64)
    args = [jax.ShapeDtypeStruct(shape, jnp.float32)] * 3
    out = {}
    for strategy in sequence_parallel.STRATEGIES:
        sizes = []
        for n in (1, 2, 4, 8):
            def loss(q, k, v, strategy=strategy):
                out = sequence_parallel.attention(q, k, v, masks.Causal(), strategy=strategy,
                                                  q_chunk=256, kv_chunk=256)
                return jnp.sum(out)
            with jax.set_mesh(mesh_of(sequence=n, devices=devices)), nn.logical_axis_rules(
                    sharding.LOGICAL_AXIS_RULES):
                compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
            sizes.append(int(compiled.memory_analysis().temp_size_in_bytes))
        out[strategy] = sizes
    out["rows"] = rows_memory(devices)
    return out


def rows_memory(devices) -> list[int]:
    """Temp bytes per device of all-gather attention fwd + bwd at 4k tokens, one row per device:
    [sequence=4 with 1 row, data=2 x sequence=4 with 2 rows]. Equal when K / V are gathered and
    dK / dV reduce-scattered for each device's own row only."""
    sizes = []
    for data in (1, 2):
        args = [jax.ShapeDtypeStruct((data, 4096, 4, 64), jnp.float32)] * 3
        mesh = mesh_of(data=data, sequence=4, devices=devices)
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            sharding.BATCH_AXES, "sequence"))

        def loss(q, k, v):
            return jnp.sum(sequence_parallel.attention(q, k, v, masks.Causal(), q_chunk=256,
                                                       kv_chunk=256))
        with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(split,) * 3)
            sizes.append(int(step.lower(*args).compile().memory_analysis().temp_size_in_bytes))
    return sizes


def reshard(devices, workdir) -> dict:
    data = training_batches("gpt")
    config = training_config("gpt", {"sequence": 4}, "ring")
    run = Run(config, devices[:4])
    uninterrupted, want = run.train(run.init(jax.random.key(0)), data[:4])
    state, first = run.train(run.init(jax.random.key(0)), data[:2])
    manager = checkpoint_manager.Manager(workdir, config)
    manager.save(2, state, iter(grain.MapDataset.range(10).to_iter_dataset()))
    manager.close()
    config2 = training_config("gpt", {"data": 2, "sequence": 2}, "all_gather")
    run2 = Run(config2, devices[:4])
    manager = checkpoint_manager.Manager(workdir, config2)
    restored = manager.restore(2, run2.abstract, run2.shardings)
    manager.close()
    restored, second = run2.train(restored, data[2:4])
    return {"losses": first + second, "want": want,
            "max_param_diff": max_diff(host(restored.params), host(uninterrupted.params))}


def errors() -> dict[str, str]:
    out = {}
    config = training_config("gpt", {"sequence": 8})
    config.seq_len = 40  # 40 is not a multiple of 2 x 8 chunks
    try:
        configs.validate_config(config)
    except ValueError as error:
        out["seq_len"] = str(error)
    return out


def main(workdir: str) -> None:
    devices = jax.devices()
    results = {"attention": attention_cases(devices), "training": training(devices),
               "memory": memory(devices), "reshard": reshard(devices, workdir),
               "errors": errors()}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
