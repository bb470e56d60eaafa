"""Streams 200 evaluation steps of a data=2 x fsdp=2 x tensor=2 mesh of 8 forced CPU devices
before reading any; prints the results as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/stream_check.py DIR

Run by tests/test_sharding.py in a subprocess, and by CI's newest-jax tier: the steps are
independent, as an evaluation's batches are. Under jaxlib before 0.12 XLA:CPU's collectives
deadlock past 32 executions in flight on a device and the process aborts, so there a CPU mesh
runs its steps one at a time (placement.Synchronous); from jaxlib 0.12 they run
asynchronously, and this is where CI streams them. All 200 must finish with the same sums.
Without the wrapper under jax 0.10.2 this check aborted in 2 of 2 runs (64 steps streamed
after training, as mesh_check once did, finished once: hence 200).
"""

from __future__ import annotations

import json
import sys

import jax
from mesh_check import Run, batches, small_config

from transformer.training import evaluation, placement

CALLS = 200


def main(_workdir: str) -> None:
    devices = jax.devices()
    run = Run(small_config((2, 2, 2)), devices)
    params = run.init(jax.random.key(0)).params
    evaluate = run.placement.jit_eval_step(evaluation.make_eval_step(run.model, run.config),
                                           run.shardings.params)
    with run.placement.context():
        batch = run.placement.global_batch(batches(1)[0])
        streamed = [evaluate(params, batch) for _ in range(CALLS)]
    sums = [{k: v.tolist() for k, v in placement.fetch(s).items()} for s in streamed]
    single = Run(small_config(), devices[:1]).placement
    print(json.dumps({"calls": len(sums), "alike": all(s == sums[0] for s in sums),
                      "single_waits": single.synchronous}))


if __name__ == "__main__":
    main(sys.argv[1])
