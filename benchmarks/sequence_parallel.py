"""Sequence parallelism on 8 forced CPU devices: train-step time and per-device memory by strategy.

    python benchmarks/sequence_parallel.py [--lengths=4096,8192,16384] [--steps=3]
        [--layers=2] [--d_model=256] [--heads=4]

Sets `--xla_force_host_platform_device_count=8` itself (before JAX starts). For each length,
trains a GPT (`benchmarks/compile_time.gpt_config` at the flags' shape, batch 1, RoPE, chunked
attention, causal) with the real jitted train step on three meshes: one device (the reference),
sequence=8 with the all-gather strategy and sequence=8 with the ring (both load-balanced).
Prints per device the compiled memory (XLA's memory analysis: arguments + temporaries) and the
best step time of `--steps`. The arguments are mostly the train state, which splits over the
sequence axis as over `fsdp` (docs/scaling-out.md), so the sequence=8 rows hold a fraction of
the one-device row's arguments.

The 8 devices share this machine's cores, so the step times only compare the strategies with
each other (their communication is a memory copy here); the memory column is what each device
of a real mesh would hold.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

_LENGTHS = flags.DEFINE_list("lengths", ["4096", "8192", "16384"], "Sequence lengths.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per cell (best shown).")
_LAYERS = flags.DEFINE_integer("layers", 2, "GPT layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "GPT width.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")

DEVICES = 8


def measure(length: int, mesh: dict, strategy: str, devices) -> dict:
    from compile_time import build_train_step, gpt_config, lower_and_compile

    config = gpt_config(layers=_LAYERS.value, d_model=_D_MODEL.value, heads=_HEADS.value,
                        d_ff=4 * _D_MODEL.value, seq_len=length, batch=1, vocab=256)
    config.model.update(position="rope", attention_impl="chunked", sequence_parallel=strategy)
    config.mesh.update(data=1, fsdp=1, tensor=1, **mesh)
    step = build_train_step(config, devices=devices)
    _, _, compiled = lower_and_compile(step, step.jitted)
    memory = compiled.memory_analysis()
    state, best = step.state, float("inf")
    with step.placement.context():
        for _ in range(_STEPS.value + 1):  # the first one warms up
            start = time.perf_counter()
            state, metrics = compiled(state, step.batch)
            metrics["loss"].block_until_ready()
            best = min(best, time.perf_counter() - start)
    return {"args": memory.argument_size_in_bytes, "temp": memory.temp_size_in_bytes,
            "ms": best * 1e3, "loss": float(metrics["loss"])}


def main(argv) -> None:
    del argv
    import jax

    from transformer.parallel.sharding import format_bytes

    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices on {os.cpu_count()} cores; "
          f"GPT {_LAYERS.value} layers x {_D_MODEL.value} wide, {_HEADS.value} heads, batch 1, "
          "causal, chunked attention")
    print("| tokens | mesh | strategy | ms/step | arguments/device | temporaries/device | loss |")
    print("| ---: | :--- | :--- | ---: | ---: | ---: | ---: |")
    everything = jax.devices()
    cells = [("1 device", "-", {}, "all_gather", everything[:1]),
             (f"sequence={DEVICES}", "all_gather", {"sequence": DEVICES}, "all_gather",
              everything),
             (f"sequence={DEVICES}", "ring", {"sequence": DEVICES}, "ring", everything)]
    for length in map(int, _LENGTHS.value):
        for label, name, mesh, strategy, devices in cells:
            row = measure(length, mesh, strategy, devices)
            print(f"| {length:,} | {label} | {name} | {row['ms']:,.0f} | "
                  f"{format_bytes(row['args'])} | {format_bytes(row['temp'])} | "
                  f"{row['loss']:.4f} |", flush=True)


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)
