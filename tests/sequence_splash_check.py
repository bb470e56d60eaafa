"""Splash under the `sequence` axis (Pallas interpret mode) on 8 forced CPU devices; prints the
results as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sequence_splash_check.py DIR

Run by tests/test_sequence_parallel.py in a subprocess. Parts:
  attention  `sequence_parallel.splash_attention` against the chunked kernel under the same
             axis (`sequence_parallel.attention`) and dense attention on one device: output
             and q/k/v gradients, packed causal rows (segment ids, padding), sequence 2 and 4,
             zig-zag on and off, a sliding window with soft-capped logits, and data x sequence
             x tensor;
  model      a packed GPT's loss and parameter gradients with `attention_impl="splash"` on
             sequence 2 and 4 (zig-zag on and off) against `"chunked"` on the same mesh and
             dense on one device, with the kernel line each run recorded;
  fallbacks  the kernel lines where splash was asked for but cannot run (ring, prefix LM,
             ALiBi): chunked per device, and why.
"""

from __future__ import annotations

import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from mesh_check import max_diff  # tests/, this script's directory

from transformer import configs
from transformer.models import build_model
from transformer.nn import dense_attention, kernels, masks, sequence_parallel
from transformer.parallel import sharding

LENGTH = 512  # per-device blocks of 128 (splash's smallest) at sequence=4


def mesh_of(devices, **sizes):
    full = {**dict(data=1, fsdp=1, sequence=1, tensor=1), **sizes}
    return sharding.make_mesh(full, devices[:int(np.prod(list(full.values())))])


def packed_ids(batch: int) -> np.ndarray:
    """Uneven documents; row 0 ends in 32 padding positions (id 0)."""
    ids = np.full((batch, LENGTH), 4, np.int32)
    ids[0] = [1] * 100 + [2] * 300 + [3] * 80 + [0] * 32
    return ids


def value_and_grads(fn, q, k, v, probe, devices=None, sizes=None):
    """(output, (dq, dk, dv)) of sum(fn(q, k, v) * probe), on one device or on a mesh."""
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * probe), out
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    if sizes is None:
        (_, out), grads = grad(q, k, v)
    else:
        with jax.set_mesh(mesh_of(devices, **sizes)), nn.logical_axis_rules(
                sharding.LOGICAL_AXIS_RULES):
            (_, out), grads = grad(q, k, v)
    return jax.device_get((out, grads))


def attention_cases(devices) -> dict[str, dict[str, float]]:
    """Largest |difference| of (output, dq, dk, dv): splash vs chunked under the axis, and
    splash vs dense on one device. With zig-zag the inputs are laid out as the models lay them
    out (`to_zigzag`) and the mask is `masks.Permuted`; the reference is laid out likewise."""
    rng = np.random.default_rng(0)
    batch, heads, kv_heads, dim = 2, 4, 2, 32
    q = rng.standard_normal((batch, LENGTH, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, LENGTH, kv_heads, dim)).astype(np.float32)
            for _ in range(2))
    probe = rng.standard_normal(q.shape).astype(np.float32)
    packed = masks.Causal() & masks.Segment(jnp.asarray(packed_ids(batch)))
    window = packed & masks.SlidingWindow(left=100)
    cases = [  # name, mesh sizes, zig-zag, mask, softcap
        ("packed", {"sequence": 2}, True, packed, 0.0),
        ("packed", {"sequence": 4}, True, packed, 0.0),
        ("packed", {"sequence": 4}, False, packed, 0.0),
        ("window_softcap", {"sequence": 2}, True, window, 2.0),
        ("packed", {"data": 2, "sequence": 2, "tensor": 2}, True, packed, 0.0),
    ]
    results = {}
    for name, sizes, zigzag, mask, softcap in cases:
        n = sizes["sequence"]
        order = sequence_parallel.zigzag(LENGTH, n) if zigzag else np.arange(LENGTH)
        lay = lambda x, order=order: x[:, order]
        laid = masks.Permuted(mask, jnp.asarray(order), zigzag_shards=n) if zigzag else mask
        want = value_and_grads(lambda q, k, v, mask=mask, softcap=softcap:
                               dense_attention.dot_product_attention(q, k, v, mask,
                                                                     softcap=softcap),
                               q, k, v, probe)
        want = jax.tree.map(lay, want)
        inputs = (*map(lay, (q, k, v)), lay(probe), devices, sizes)
        splash = value_and_grads(lambda q, k, v, laid=laid, softcap=softcap:
                                 sequence_parallel.splash_attention(
                                     q, k, v, laid, softcap=softcap, interpret=True), *inputs)
        chunked = value_and_grads(lambda q, k, v, laid=laid, softcap=softcap:
                                  sequence_parallel.attention(q, k, v, laid, softcap=softcap,
                                                              q_chunk=128, kv_chunk=128),
                                  *inputs)
        key = f"{name}/{'zigzag' if zigzag else 'contiguous'}/" + ",".join(
            f"{a}={s}" for a, s in sizes.items())
        results[key] = {"vs_chunked": max_diff(splash, chunked),
                        "vs_one_device": max_diff(splash, want)}
        print(key, results[key], file=sys.stderr, flush=True)
    return results


def model_config(mesh: dict, impl: str, balance: bool = True):
    config = configs.base_config()
    config.update(batch_size=2, seq_len=LENGTH)
    config.model.update(family="gpt", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                        d_ff=128, vocab_size=64, max_len=LENGTH, position="rope",
                        dropout_rate=0.0, attention_impl=impl, sequence_load_balance=balance)
    config.mesh.update(mesh)
    return config


def model_cases(devices) -> dict[str, dict]:
    """A packed GPT's loss and parameter gradients: splash under the axis vs chunked under it
    and vs dense on one device; the kernel lines each compile recorded."""
    rng = np.random.default_rng(1)
    ids = packed_ids(2)
    positions = np.zeros_like(ids)
    for row in range(2):
        for doc in np.unique(ids[row]):
            where = ids[row] == doc
            positions[row, where] = np.arange(where.sum())
    data = {"inputs": rng.integers(1, 64, ids.shape).astype(np.int32), "segment_ids": ids,
            "positions": positions}

    params = build_model(model_config({}, "dense").model).init(
        jax.random.key(0), data["inputs"])["params"]

    def loss_and_grads(config, mesh_devices=None):
        model = build_model(config.model)

        def loss(params):
            logits = model.apply({"params": params}, data["inputs"],
                                 segment_ids=data["segment_ids"], positions=data["positions"])
            return jnp.mean(jnp.sum(logits.astype(jnp.float32) ** 2, -1))
        step = jax.jit(jax.value_and_grad(loss))
        with kernels.recording() as chosen:
            if mesh_devices is None:
                result = step(params)
            else:
                with jax.set_mesh(sharding.make_mesh(config.mesh, mesh_devices)), \
                        nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
                    result = step(params)
        return jax.device_get(result), sorted(set(chosen))

    want, _ = loss_and_grads(model_config({}, "dense"))
    results = {}
    for n, balance in ((2, True), (4, True), (4, False)):
        mesh = {"data": 1, "sequence": n}
        got = {impl: loss_and_grads(model_config(mesh, impl, balance), devices[:n])
               for impl in ("splash", "chunked")}
        key = f"sequence={n}/{'zigzag' if balance else 'contiguous'}"
        results[key] = {"vs_chunked": max_diff(got["splash"][0], got["chunked"][0]),
                        "vs_one_device": max_diff(got["splash"][0], want),
                        "loss": float(got["splash"][0][0]), "want_loss": float(want[0]),
                        "kernels": got["splash"][1]}
        print(key, results[key], file=sys.stderr, flush=True)
    return results


def fallbacks(devices) -> dict[str, list[str]]:
    """The kernel lines (traced, not compiled) where splash was asked for under the axis but
    cannot run: the ring strategy, a prefix LM, ALiBi."""
    out = {}
    tokens = np.ones((2, LENGTH), np.int32)
    for name, knobs in {"ring": dict(sequence_parallel="ring"), "prefix_lm": dict(
            family="prefix_lm"), "alibi": dict(position="alibi")}.items():
        config = model_config({"data": 1, "sequence": 2}, "splash")
        config.model.update(knobs)
        model = build_model(config.model)
        kwargs = {"prefix_lengths": np.array([5, 9], np.int32)} if name == "prefix_lm" else {}
        with kernels.recording() as chosen, jax.set_mesh(sharding.make_mesh(
                config.mesh, devices[:2])), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
            jax.jit(lambda tokens, model=model, kwargs=kwargs: model.init(
                jax.random.key(0), tokens, **kwargs)).lower(tokens)
        out[name] = sorted(set(chosen))
    return out


def main(workdir: str) -> None:
    del workdir
    devices = jax.devices()
    print(json.dumps({"attention": attention_cases(devices), "model": model_cases(devices),
                      "fallbacks": fallbacks(devices)}))


if __name__ == "__main__":
    main(sys.argv[1])
