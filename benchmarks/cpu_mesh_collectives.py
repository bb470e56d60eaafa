"""Do a CPU mesh's collectives stall with many steps in flight? One table, side by side.

XLA:CPU admits 32 executions in flight per device; under jaxlib 0.10.2 a mesh's collectives
deadlocked once a device held more, until the rendezvous aborted the process (40 s by
default; cut to 5 s here, so a stall shows quickly). This script streams a sharded fwd+bwd
(dots, GELU, a norm, an all-gather; the training defaults' XLA options for a step on this
mesh) on forced host devices, in fresh processes, keeping at most N calls unfinished (it
waits for the oldest before dispatching more): N = 31 and 32 around XLA's limit, then 200
through `placement.Placement.paced`, as the training and evaluation steps run on this jax
(one at a time, `placement.Synchronous`, where `placement.CPU_COLLECTIVES_STALL`). It counts
the processes XLA aborted.

    python benchmarks/cpu_mesh_collectives.py --devices=4 --seconds=10 --repeats=3

When a jaxlib runs the 32 row without an abort, `placement.CPU_COLLECTIVES_STALL` can leave
it out.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 4, "forced host devices")
_SECONDS = flags.DEFINE_float("seconds", 10.0, "seconds of streaming per process")
_REPEATS = flags.DEFINE_integer("repeats", 3, "processes per variant")
_CHILD = flags.DEFINE_integer("child", 0, "internal: stream with this many calls unfinished")
_PACED = flags.DEFINE_bool("paced", False, "internal: stream through Placement.paced")

TIMEOUTS = ("--xla_cpu_collective_call_terminate_timeout_seconds=5",
            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=2")


def stream(unfinished: int, seconds: float, paced: bool) -> int:
    """Streams a sharded fwd+bwd keeping at most `unfinished` calls unfinished (through
    `Placement.paced` if `paced`); returns the calls made."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from transformer import configs
    from transformer.training import placement

    config = configs.base_config()
    config.mesh.data = len(jax.devices())
    where = placement.Placement.from_config(config)
    mesh = where.mesh
    rows = NamedSharding(mesh, PartitionSpec("data"))

    def loss(w, x):
        h = jax.nn.gelu(x @ w[0])
        h = h / (1e-6 + jnp.sqrt(jnp.mean(h * h, -1, keepdims=True)))
        everyone = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, PartitionSpec()))
        scores = jnp.einsum("bd,cd->bc", h, everyone)  # all-gathers the other devices' rows
        return jnp.mean(jax.nn.log_softmax(scores)) + jnp.mean(h @ w[1])

    step = jax.jit(jax.value_and_grad(loss), compiler_options=where.compiler_options)
    if paced:
        step = where.paced(step)
    w = (jnp.full((128, 256), 0.01), jnp.full((256, 128), 0.01))
    x = jax.device_put(jnp.ones((64 * len(jax.devices()), 128)), rows)
    pending, calls, start = collections.deque(), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        pending.append(step(w, x))
        calls += 1
        if len(pending) > unfinished:
            jax.block_until_ready(pending.popleft())
    jax.block_until_ready(list(pending))
    return calls


def run_variant(unfinished: int, paced: bool) -> tuple[int, int]:
    """(processes XLA aborted, calls made by the others) over --repeats fresh processes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(
        (os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count="
         f"{_DEVICES.value}", *TIMEOUTS)).strip()}
    aborted, calls = 0, 0
    for _ in range(_REPEATS.value):
        result = subprocess.run([sys.executable, __file__, f"--child={unfinished}",
                                 f"--seconds={_SECONDS.value}", f"--paced={paced}"], env=env,
                                capture_output=True, text=True, timeout=_SECONDS.value + 300)
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
        print(stream(_CHILD.value, _SECONDS.value, _PACED.value))
        return
    import jaxlib.version

    from transformer.training import placement
    print(f"jaxlib {jaxlib.version.__version__}, {_DEVICES.value} CPU devices on "
          f"{os.cpu_count()} cores, {_SECONDS.value:g} s a process, {_REPEATS.value} processes "
          f"a row; rendezvous timeout 5 s\n")
    mode = "one at a time" if placement.CPU_COLLECTIVES_STALL else "asynchronous"
    rows = ((31, False, "31"), (32, False, "32"),
            (200, True, f"200 through Placement.paced ({mode} on this jaxlib)"))
    print("| calls unfinished at most | aborted | calls/s (processes that finished) |")
    print("|---|---:|---:|")
    for unfinished, paced, name in rows:
        aborted, calls = run_variant(unfinished, paced)
        finished = _REPEATS.value - aborted
        rate = f"{calls / (finished * _SECONDS.value):.0f}" if finished else "-"
        print(f"| {name} | {aborted} of {_REPEATS.value} | {rate} |", flush=True)


if __name__ == "__main__":
    app.run(main)
