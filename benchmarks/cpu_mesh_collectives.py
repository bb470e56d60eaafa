"""Do a CPU mesh's collectives stall with many steps in flight? One table, side by side.

XLA:CPU runs the devices of one process on shared thread pools; their collectives meet in a
rendezvous that aborts the process when it times out (40 s by default; cut to 5 s here, so a
stall shows quickly). This script streams a sharded fwd+bwd (dots, GELU, a norm, an
all-gather; the training defaults' XLA options for a step on this mesh) on forced host
devices, in fresh processes: 40 calls dispatched before waiting for them, then one call at a
time as the training steps run on a CPU mesh (`placement.Synchronous`). It counts the
processes XLA aborted.

    python benchmarks/cpu_mesh_collectives.py --devices=4 --seconds=20 --repeats=3

A stress test: no abort in a few minutes is not a proof, but the stalls it shows with calls in
flight are the ones that aborted a 4-device CLIP run in CI (tests/test_vision.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 4, "forced host devices")
_SECONDS = flags.DEFINE_float("seconds", 20.0, "seconds of streaming per process")
_REPEATS = flags.DEFINE_integer("repeats", 3, "processes per variant")
_CHILD = flags.DEFINE_integer("child", 0, "internal: stream with this many calls in flight")

TIMEOUTS = ("--xla_cpu_collective_call_terminate_timeout_seconds=5",
            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=2")


def stream(in_flight: int, seconds: float) -> int:
    """Streams a sharded fwd+bwd, `in_flight` calls before waiting; returns the calls made."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from transformer import configs
    from transformer.parallel import sharding
    from transformer.training import placement

    config = configs.base_config()
    config.mesh.data = len(jax.devices())
    mesh = sharding.make_mesh(config.mesh)
    rows = NamedSharding(mesh, PartitionSpec("data"))

    def loss(w, x):
        h = jax.nn.gelu(x @ w[0])
        h = h / (1e-6 + jnp.sqrt(jnp.mean(h * h, -1, keepdims=True)))
        everyone = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, PartitionSpec()))
        scores = jnp.einsum("bd,cd->bc", h, everyone)  # all-gathers the other devices' rows
        return jnp.mean(jax.nn.log_softmax(scores)) + jnp.mean(h @ w[1])

    step = jax.jit(jax.value_and_grad(loss),
                   compiler_options=placement.compiler_options(config, mesh))
    if in_flight == 1:
        step = placement.Synchronous(step)
    w = (jnp.full((128, 256), 0.01), jnp.full((256, 128), 0.01))
    x = jax.device_put(jnp.ones((64 * len(jax.devices()), 128)), rows)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        jax.block_until_ready([step(w, x) for _ in range(in_flight)])
        calls += in_flight
    return calls


def run_variant(in_flight: int) -> tuple[int, int]:
    """(processes XLA aborted, calls made by the others) over --repeats fresh processes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(
        (os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count="
         f"{_DEVICES.value}", *TIMEOUTS)).strip()}
    aborted, calls = 0, 0
    for _ in range(_REPEATS.value):
        result = subprocess.run([sys.executable, __file__, f"--child={in_flight}",
                                 f"--seconds={_SECONDS.value}"], env=env, capture_output=True,
                                text=True, timeout=_SECONDS.value + 300)
        if result.returncode == 0:
            calls += int(result.stdout.split()[-1])
        elif "Termination timeout" in result.stderr:
            aborted += 1
        else:  # not a stalled rendezvous: say what it was
            raise RuntimeError(result.stderr[-2000:])
    return aborted, calls


def main(argv) -> None:
    del argv
    if _CHILD.value:
        print(stream(_CHILD.value, _SECONDS.value))
        return
    print(f"{_DEVICES.value} CPU devices on {os.cpu_count()} cores, {_SECONDS.value:g} s a "
          f"process, {_REPEATS.value} processes a row; rendezvous timeout 5 s\n")
    print("| calls in flight | aborted | calls/s (processes that finished) |")
    print("|---|---:|---:|")
    for in_flight, name in ((40, "40"), (1, "1 (placement.Synchronous)")):
        aborted, calls = run_variant(in_flight)
        finished = _REPEATS.value - aborted
        rate = f"{calls / (finished * _SECONDS.value):.0f}" if finished else "-"
        print(f"| {name} | {aborted} of {_REPEATS.value} | {rate} |", flush=True)


if __name__ == "__main__":
    app.run(main)
