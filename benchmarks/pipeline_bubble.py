"""Pipeline step time against microbatches and repeats, on forced CPU devices.

    python benchmarks/pipeline_bubble.py [--devices=8] [--stages=4] [--steps=5]

Trains a small scanned GPT on mesh stage=S x data=devices/S for each (microbatches, repeats)
and prints the measured time per step (median of the steps after the first, which compiles),
the bubble fraction (S-1)/(M*R+S-1) and the collectives XLA emitted for the step (the state is
in train order, as train.py holds it: a circular schedule's layer params stage-major). The
stage=1 row is the same model without a pipeline. On CPU devices that share a few cores the
stages do not run in parallel, so the step time shows the pipeline's overheads (more, smaller
matmuls; the loop; the collectives), not the bubble's idle time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5,
                        help="steps per row, at least 2 (the first, which compiles, is not timed)")
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit(f"--steps={args.steps}: at least 2 (the first step compiles and is not in "
                 "the median)")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import jax
    import numpy as np

    from transformer import configs, train
    from transformer.models import build_model
    from transformer.parallel import pipeline_parallel, sharding
    from transformer.training import optim, placement, state

    S, data = args.stages, args.devices // args.stages
    batch, length = 8 * data * S, 64
    rng = np.random.default_rng(0)
    tokens = rng.integers(7, 256, (batch, length + 1)).astype(np.int32)
    example = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
               "weights": np.ones((batch, length), np.float32),
               "segment_ids": np.ones((batch, length), np.int32),
               "positions": np.tile(np.arange(length, dtype=np.int32), (batch, 1))}
    print(f"{args.devices} CPU devices ({os.cpu_count()} cores), GPT 8 x 128, batch {batch} x "
          f"{length}, mesh stage=S x data={data}")
    print("| stages | microbatches | repeats | bubble | ms/step | collectives |")
    print("| --- | --- | --- | --- | --- | --- |")
    cases = [(1, 1, 1)] + [(S, m, 1) for m in (1, S, 2 * S, 4 * S)] + [(S, S, 2), (S, 2 * S, 2)]
    for stages, microbatches, repeats in cases:
        config = configs.base_config()
        config.update(batch_size=batch, seq_len=length)
        config.model.update(num_layers=8, d_model=128, num_heads=4, d_ff=512, scan_layers=True,
                            vocab_size=256)
        config.mesh.update(data=data, stage=stages)
        devices = jax.devices()[:data * stages]
        model, optimizer = build_model(config.model), optim.make_optimizer(config)
        where = placement.Placement(sharding.make_mesh(config.mesh, devices), batch,
                                    schedule=(microbatches, repeats))
        _, shardings, init = state.initial_state(config, model, where.mesh, example, optimizer)
        step = where.jit_train_step(train.make_train_step(model, config, optimizer), shardings)
        global_batch = where.global_batch(example)
        with where.context():
            text = step.lower(init(jax.random.key(0)), global_batch).compile().as_text()
            current = where.train_order(init(jax.random.key(0)))  # as train.py trains it
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                current, metrics = step(current, global_batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
        counts = {op: text.count(f" {op}(") for op in ("collective-permute", "all-to-all",
                                                       "all-gather", "all-reduce")}
        ops = ", ".join(f"{op} {n}" for op, n in counts.items() if n)
        bubble = pipeline_parallel.bubble_fraction(stages, microbatches, repeats)
        print(f"| {stages} | {microbatches} | {repeats} | {bubble:.0%} | "
              f"{np.median(times[1:]) * 1e3:.0f} | {ops} |", flush=True)


if __name__ == "__main__":
    main()
