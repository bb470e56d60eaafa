"""Expert parallelism on 8 forced CPU devices; prints the results as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/expert_check.py DIR

Run by tests/test_moe.py in a subprocess (the device count is fixed when JAX starts). A GPT
with 8 experts per layer (top-2, a capacity factor that drops tokens) trains a few steps on
meshes with expert = 2, 4, 8, alone and with data / fsdp / tensor; unrolled, scanned with
remat, and dropless (ragged matmuls, on the mesh per device with the rows exchanged along
`expert`, with DeepSeek-V3's sigmoid routing in groups and the balance bias moving each
step; tests/moe_dispatch_check.py checks the dropless layer on more meshes). Per mesh:
the losses and MoE metrics of every step, the largest parameter difference from one device,
how the expert params are laid out, the MoE dispatch path traced, and whether the compiled
step moves tokens with all-to-alls.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from mesh_check import Run, host, max_diff  # tests/, this script's directory

from transformer import configs
from transformer.nn import kernels

BATCH, LENGTH, VOCAB, STEPS = 8, 16, 64, 3
VARIANTS = ("unrolled", "scanned", "dropless", "scanned dropless")
# Each axis beside `expert` once (data x expert: moe_dispatch_check.py), each variant once.
MESHES = {  # name -> (mesh sizes, variant)
    "expert=8": (dict(expert=8), "unrolled"),
    "fsdp=2,expert=4": (dict(fsdp=2, expert=4), "unrolled"),
    "fsdp=2,expert=2,tensor=2": (dict(fsdp=2, expert=2, tensor=2), "unrolled"),
    "fsdp=2,expert=4 scanned": (dict(fsdp=2, expert=4), "scanned"),
    # Dropless: one device sorts tokens for ragged matmuls; a mesh does it per device, in a
    # shard_map exchanging the sorted rows along `expert` (moe.sharded_experts). The one layer
    # on expert=4 alone and beside data / fsdp / tensor / sequence: tests/moe_dispatch_check.py.
    "expert=8 dropless": (dict(expert=8), "dropless"),
    "data=8 dropless": (dict(data=8), "dropless"),
    "fsdp=2,expert=4 scanned dropless": (dict(fsdp=2, expert=4), "scanned dropless"),
}

COLLECTIVES = ("expert=8", "fsdp=2,expert=4 scanned")  # meshes whose compiled HLO is read


def moe_config(mesh: dict, variant: str):
    config = configs.base_config()
    config.update(steps=STEPS, batch_size=BATCH, seq_len=LENGTH)
    config.optimizer.warmup_steps = 1
    config.model.update(family="gpt", num_layers=2, d_model=32, num_heads=4, d_ff=48,
                        vocab_size=VOCAB, position="rope", dropout_rate=0.0,
                        activation="swiglu", use_bias=False)
    config.model.moe.update(num_experts=8, top_k=2, capacity_factor=1.0, num_shared=1)
    if variant.startswith("scanned"):  # every other layer MoE: scanned in groups of 2
        config.model.update(num_layers=4, scan_layers=True, remat_policy="full")
        config.model.moe.every_n_layers = 2
    if variant.endswith("dropless"):  # with DeepSeek-V3's routing and its moving bias
        config.model.moe.update(capacity_factor=0.0, score="sigmoid", n_group=2, topk_group=1,
                                balance_bias=True, bias_update_rate=0.01)
    config.mesh.update({"data": 1, **mesh})
    return config


def batches() -> list[dict[str, np.ndarray]]:
    """Packed rows of uneven documents."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(7, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
        ids = np.ones((BATCH, LENGTH), np.int32)
        ids[::2, 5:] = 2
        ids[1::3, 11:] = 0
        positions = np.where(ids == 2, np.arange(LENGTH) - 5, np.arange(LENGTH))
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                    "weights": (ids > 0).astype(np.float32), "segment_ids": ids,
                    "positions": positions.astype(np.int32)})
    return out


def train(run: Run, state, compiled_text: bool = False) -> tuple[dict, dict, list[str], str]:
    """Steps from `state` (host arrays: the single device's initial state) on the fixed
    batches: (metrics per step, final params, the MoE dispatch paths traced, and with
    `compiled_text` the compiled step's HLO, from the one compile that trains)."""
    state = run.place(state)
    records, step, hlo = [], run.step, ""
    with run.placement.context(), kernels.recording() as chosen:
        if compiled_text:
            step = run.step.lower(state, run.placement.global_batch(batches()[0])).compile()
            hlo = step.as_text()
        for batch in batches():
            state, metrics = step(state, run.placement.global_batch(batch))
            records.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    dispatch = sorted({c for c in chosen if c.startswith("moe dispatch")})
    return records, state.params, dispatch, hlo


def layout(params, variant: str) -> dict:
    moe = params["decoder"]["layers"]["block_1"]["moe"] if variant.startswith("scanned") else \
        params["decoder"]["layers_0"]["moe"]
    return {name: {"spec": str(p.sharding.spec),
                   "shard_shape": list(p.addressable_shards[0].data.shape),
                   "num_shards": len({str(s.index) for s in p.addressable_shards})}
            for name, p in (("wi_gate", moe["wi_gate"]), ("wo", moe["wo"]),
                            ("router", moe["router"]))}


def main() -> None:
    devices = jax.devices()
    assert len(devices) == 8, devices
    results = {}
    singles = {}
    for variant in VARIANTS:
        run = Run(moe_config({}, variant), devices[:1])
        initial = host(run.init(jax.random.key(0)))
        records, final, dispatch, _ = train(run, initial)
        singles[variant] = (initial, records, host(final))
        results[f"single {variant}"] = {"records": records, "dispatch": dispatch}
    for name, (mesh, variant) in MESHES.items():
        initial, _, single_final = singles[variant]
        size = int(np.prod(list(mesh.values())))
        run = Run(moe_config(mesh, variant), devices[:size])
        records, final, dispatch, hlo = train(run, initial, compiled_text=name in COLLECTIVES)
        results[name] = {
            "records": records,
            "dispatch": dispatch,
            "max_param_diff": max_diff(host(final), single_final),
            "layout": layout(final, variant),
            # the balance bias (dropless variants): how far it moved, replicated on the mesh
            "bias_moved": max((float(np.abs(leaf).max()) for path, leaf in
                               jax.tree_util.tree_flatten_with_path(host(final))[0]
                               if "balance_bias" in jax.tree_util.keystr(path)), default=0.0),
        }
        if name in COLLECTIVES:
            results[name]["all_to_all"] = hlo.count("all-to-all")
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
