"""Trains a small scanned GPT pipelined over several meshes of 8 forced CPU devices, and on one
device; prints the results as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/pipeline_check.py DIR

Run by tests/test_pipeline_parallel.py in a subprocess (the device count is fixed when JAX
starts). For each mesh and schedule: the loss of every step, the largest parameter difference
from the single-device run, whether the layer params are split over `stage`.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from mesh_check import Run, batches, host, max_diff, small_config

STEPS = 3
# name: (mesh, microbatches, repeats, other settings)
MESHES = {
    "stage=2": ({"stage": 2}, 2, 1, {}),
    "stage=4": ({"stage": 4}, 4, 1, {}),
    "stage=2 x data=2 x fsdp=2": ({"stage": 2, "data": 2, "fsdp": 2}, 2, 1, {}),
    "stage=2 x tensor=4": ({"stage": 2, "tensor": 4}, 4, 1, {}),
    "stage=4 x data=2": ({"stage": 4, "data": 2}, 4, 1, {}),
    "stage=2 x data=2 x fsdp=2, circular": ({"stage": 2, "data": 2, "fsdp": 2}, 2, 2, {}),
    "stage=2 x fsdp=2 x tensor=2, circular": ({"stage": 2, "fsdp": 2, "tensor": 2}, 4, 2, {}),
    "stage=4, circular": ({"stage": 4}, 4, 2, {}),
    "stage=2 x fsdp=2, circular, remat dots": ({"stage": 2, "fsdp": 2}, 4, 2,
                                               {"model.remat_policy": "dots"}),
    "stage=2 x data=2, accumulation 2, remat": (
        {"stage": 2, "data": 2}, 2, 1, {"optimizer.grad_accumulation_steps": 2,
                                        "model.remat_policy": "full"}),
}
# Dropless experts; the load-balance loss (E sum_e f_e P_e over the whole batch) is not a mean
# over rows, so a microbatch's differs: weight 0 here. The z-loss is a mean over tokens: it
# comes back from the pipeline averaged over microbatches, and must equal the whole batch's.
MOE = {"model.moe.num_experts": 4, "model.moe.capacity_factor": 0.0,
       "model.moe.load_balance_loss": 0.0, "model.moe.router_z_loss": 0.1}
# ... and a multi-token prediction module, whose MoE layer sits outside the stages: the z-loss
# is the mean over all 9 MoE layers, the stages' 8 counting 8 times.
MOE_MTP = {**MOE, "model.mtp.depth": 1}
# LoRA adapters on a frozen base, targeted by a regex naming the stack: a stage's blocks apply
# on their own, and their paths must still read decoder/layers/... (`lora.applied_at`).
LORA = {"model.lora.rank": 4,
        "model.lora.targets": r"^decoder/layers/(self_attention/(query|value)|mlp/wo)$"}


def pipeline_config(mesh: dict, microbatches: int, repeats: int, settings: dict):
    config = small_config()
    config.model.update(num_layers=8, scan_layers=True)
    config.mesh.update({"data": 1, **mesh})
    config.pipeline.update(microbatches=microbatches, repeats=repeats)
    config.update_from_flattened_dict(settings)
    return config


def train(config, steps: int = STEPS, start=None):
    """(params, losses, whether the layers split over stage, the initial state) after `steps`
    steps from `start` (another run's initial state, host arrays) or, without one, from this
    mesh's own sharded init."""
    devices = jax.devices()[:int(np.prod(list(config.mesh.values())))]
    run = Run(config, devices)
    initial = run.init(jax.random.key(0)) if start is None else run.place(start)
    start = host(initial) if start is None else start  # before train donates it
    state, losses = run.train(initial, batches(steps))
    specs = [p.sharding.spec for p in jax.tree.leaves(state.params["decoder"]["layers"])]
    split = all(spec and "stage" in str(spec[0]) for spec in specs)
    return host(state.params), losses, split, start


def main() -> None:
    results, starts = {}, {}
    references = {"single": {}, "moe single": MOE, "moe mtp single": MOE_MTP, "lora single": LORA}
    for name, settings in references.items():
        params, losses, _, starts[name] = train(pipeline_config({}, 1, 1, settings))
        results[name] = {"losses": losses, "params": params}
    cases = {**MESHES, "moe stage=2 x expert=2": ({"stage": 2, "expert": 2}, 2, 1, MOE),
             "moe mtp stage=2": ({"stage": 2}, 2, 1, MOE_MTP),
             "lora stage=2": ({"stage": 2}, 2, 1, LORA)}
    for name, case in cases.items():
        reference = name.split(" stage")[0] + " single" if name.startswith(("moe", "lora")) \
            else "single"
        # The meshes start from the single run's state, but for accumulation (its optimizer
        # state differs) and the dropout run below, which compile their own sharded init.
        start = None if "accumulation" in name else starts[reference]
        params, losses, split, _ = train(pipeline_config(*case), start=start)
        results[name] = {"losses": losses, "stage_sharded": split,
                         "max_param_diff": max_diff(params, results[reference]["params"])}
    _, losses, _, _ = train(pipeline_config({"stage": 2}, 2, 1, {"model.dropout_rate": 0.1}),
                         steps=4)
    results["dropout stage=2"] = {"losses": losses}
    lora_dropout = {**LORA, "model.lora.dropout": 0.1}
    _, losses, _, _ = train(pipeline_config({"stage": 2}, 2, 1, lora_dropout),
                            start=starts["lora single"])
    results["lora dropout stage=2"] = {"losses": losses}
    for reference in references:
        del results[reference]["params"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()  # (argv[1], the directory tests pass, is unused: nothing is written)
