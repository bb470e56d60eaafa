"""Params and optimizer memory of full fine-tuning vs LoRA vs QLoRA on experiments/llama_1b7.py.

    python benchmarks/lora_memory.py [--devices=8] [--rank=16] [--config=experiments/llama_1b7.py]

Forces `--devices` CPU devices as one fsdp axis (the experiment's mesh), lays out the train
state (params + AdamW moments) of each setting with `jax.eval_shape` (nothing is allocated or
trained) and prints, per device: the params' bytes, the optimizer state's bytes, and the params
in all and trainable. LoRA targets attention's q/k/v/out and the MLP's kernels (the default
`model.lora.targets`); QLoRA also keeps those base kernels in int8 (`model.lora.base_quantization`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def _experiment(path: str):
    spec = importlib.util.spec_from_file_location("experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--config", default=os.path.join(root, "experiments", "llama_1b7.py"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, root)

    import numpy as np

    from transformer.models import build_model
    from transformer.nn import lora
    from transformer.parallel import sharding
    from transformer.training import optim, state

    settings = [("full fine-tune", 0, ""), (f"LoRA r={args.rank}", args.rank, ""),
                (f"QLoRA r={args.rank} (int8 base)", args.rank, "int8")]
    base = _experiment(args.config)
    base.mesh.update(data=1, fsdp=args.devices, tensor=1)
    print(f"{base.experiment}: {args.devices} devices (fsdp={args.devices}), params "
          f"{base.model.param_dtype}, AdamW; per device:")
    print("| setting | params | trainable | params bytes | optimizer bytes | together |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rank, quantization in settings:
        config = base.copy_and_resolve_references()
        config.model.lora.update(rank=rank, base_quantization=quantization)
        model = build_model(config.model)
        optimizer = optim.make_optimizer(config)
        mesh = sharding.make_mesh(config.mesh)
        example = {"inputs": np.zeros((args.devices, 8), np.int32)}
        abstract, shardings, _ = state.initial_state(config, model, mesh, example, optimizer)
        total, trainable = lora.counts(abstract.params)
        trainable = trainable if rank else total
        params = sharding.bytes_per_device(abstract.params, shardings.params)
        opt = sharding.bytes_per_device(abstract.opt_state, shardings.opt_state)
        f = sharding.format_bytes
        print(f"| {name} | {total:,} | {trainable:,} ({100 * trainable / total:.2f}%) | "
              f"{f(params)} | {f(opt)} | {f(params + opt)} |")


if __name__ == "__main__":
    main()
