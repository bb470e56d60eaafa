"""Int8 quantized training on meshes of 8 forced CPU devices; prints the results as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/quantization_check.py DIR

Run by tests/test_quantization.py in a subprocess (the device count is fixed when JAX starts).
A small GPT with `model.quantization="int8"` trains a few steps on one device and on fsdp=8,
data=2 x tensor=4 and data=2 x fsdp=2 x tensor=2, unrolled and scanned with remat. Per mesh and
variant: the losses of every step and the largest parameter difference from one device; and
how many of the step's dot_generals multiply int8 operands.
"""

from __future__ import annotations

import json
import sys

import jax
from mesh_check import Run, batches, host, max_diff, small_config  # tests/, this directory

MESHES = {"single": None, "fsdp=8": (1, 8, 1), "data=2,tensor=4": (2, 1, 4),
          "2,2,2": (2, 2, 2)}
VARIANTS = ("unrolled", "scanned")


def quantized_config(mesh, variant: str):
    config = small_config(mesh or (1, 1, 1))
    config.model.quantization = "int8"
    if variant == "scanned":
        config.model.update(scan_layers=True, remat_policy="full")
    return config


def main(workdir: str) -> None:
    del workdir
    devices = jax.devices()
    data = batches(4)
    results = {}
    for variant in VARIANTS:
        params, initial = {}, None
        for name, mesh in MESHES.items():  # the meshes start from the single run's state
            run = Run(quantized_config(mesh, variant), devices[:1] if mesh is None else devices)
            if initial is None:
                initial = host(run.init(jax.random.key(0)))
            state, losses = run.train(run.place(initial), data)
            params[name] = host(state.params)
            results[f"{variant} {name}"] = {"losses": losses}
            if name == "2,2,2":
                with run.placement.context():
                    hlo = run.step.lower(state, run.placement.global_batch(data[0])).as_text()
                results[f"{variant} {name}"]["int8_dots"] = sum(
                    "dot_general" in line and "xi8>" in line for line in hlo.splitlines())
        for name in MESHES:
            results[f"{variant} {name}"]["max_param_diff"] = max_diff(params[name],
                                                                     params["single"])
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
