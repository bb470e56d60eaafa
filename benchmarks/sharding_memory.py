"""Per-device parameter + optimizer memory of a ~110M-parameter GPT under each mesh.

    python benchmarks/sharding_memory.py [--devices=8]

Forces `--devices` CPU devices, builds the sharded init of the train state (params + AdamW
moments) for each (data, fsdp, tensor) mesh and reads the per-device output bytes from XLA's
compiled memory analysis (nothing is run or trained). FSDP divides the state by the fsdp size;
tensor parallelism divides the matrices it splits; pure data parallelism replicates everything.
"""

from __future__ import annotations

import argparse
import os
import sys


def mesh_shapes(n: int) -> list[tuple[int, int, int]]:
    """The (data, fsdp, tensor) meshes to compare on `n` devices: those of the list below whose
    sizes are all at least 1 and multiply to `n`, each once (pure data parallelism first)."""
    candidates = [(n, 1, 1), (1, n, 1), (2, n // 2, 1), (1, n // 2, 2), (1, 2, n // 2),
                  (2, 2, n // 4), (1, 1, n)]
    return list(dict.fromkeys(shape for shape in candidates
                              if min(shape) >= 1 and shape[0] * shape[1] * shape[2] == n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import jax
    import numpy as np

    from transformer import configs
    from transformer.models import build_model
    from transformer.parallel import sharding
    from transformer.training import optim, state

    n = args.devices
    config = configs.base_config()
    config.model.update(family="gpt", num_layers=12, d_model=768, num_heads=12, d_ff=3072,
                        vocab_size=32768, position="rope", tie_embeddings=True)
    model = build_model(config.model)
    optimizer = optim.make_optimizer(config)
    example = {"inputs": np.zeros((n, 8), np.int32)}
    meshes = mesh_shapes(n)
    header = (f"{'mesh (data,fsdp,tensor)':>24} {'params/device':>14} {'adam/device':>12} "
              f"{'compiled/device':>16} {'vs replicated':>14}")
    print(header)
    print("-" * len(header))
    baseline = None
    for shape in meshes:
        mesh = sharding.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape, strict=True)))
        abstract, shardings, jitted = state.initial_state(config, model, mesh, example,
                                                          optimizer)
        params = sharding.bytes_per_device(abstract.params, shardings.params)
        adam = sharding.bytes_per_device(abstract.opt_state, shardings.opt_state)
        compiled = jitted.lower(jax.random.key(0)).compile().memory_analysis()
        out = compiled.output_size_in_bytes
        baseline = baseline or out
        print(f"{str(shape):>24} {sharding.format_bytes(params):>14} "
              f"{sharding.format_bytes(adam):>12} {sharding.format_bytes(out):>16} "
              f"{baseline / out:>13.2f}x")
    total = sum(x.size for x in jax.tree.leaves(abstract.params))
    print(f"\n{total / 1e6:.1f}M params; {n} devices; float32 params and AdamW moments")


if __name__ == "__main__":
    main()
