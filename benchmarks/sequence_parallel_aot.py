"""Per-chip memory of a long-context GPT on a TPU slice against the `sequence` mesh axis, compiled
ahead of time on this machine (needs libtpu: `pip install -e ".[tpu]"`; no TPU).

    python benchmarks/sequence_parallel_aot.py [--config=experiments/gpt_1b.py]
        [--topology=v5p-32] [--seq_len=32768] [--tokens=524288] [--sequence=1,2,4,8]
        [--strategies=all_gather,ring] [--impls=chunked,auto]

For each strategy and `mesh.sequence` size, compiles the experiment's real train step (as
`launch.aot` does) at `--seq_len` with the same global tokens per step (`--tokens`: batch =
tokens / seq_len rows) and fsdp over the chips the sequence axis leaves, and prints arguments,
temporaries and the total per chip against the chip's HBM. sequence=1 runs the kernel "auto"
picks (splash on TPU). Larger axes run each `--impls` value of `model.attention_impl` per device
inside the strategy: "chunked", or "auto", which on TPU is splash per device under the
all-gather strategy (the ring runs chunked either way, so it gets the chunked row only). The
attention column is the run's kernel line. A configuration XLA refuses (or whose batch does
not split) is a row with the reason.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "experiments/gpt_1b.py", "Experiment file.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p-32", "TPU slice type.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32768, "Context length.")
_TOKENS = flags.DEFINE_integer("tokens", 524288, "Global tokens per step.")
_SEQUENCE = flags.DEFINE_list("sequence", ["1", "2", "4", "8"], "mesh.sequence sizes.")
_STRATEGIES = flags.DEFINE_list("strategies", ["all_gather", "ring"], "Strategies.")
_IMPLS = flags.DEFINE_list("impls", ["chunked", "auto"],
                           "model.attention_impl values under the sequence axis.")


def main(argv) -> None:
    del argv
    import importlib.util

    import jax

    from launch import accelerators, aot
    from transformer.parallel.sharding import format_bytes

    accelerator = accelerators.parse(_TOPOLOGY.value)
    devices = aot.tpu_topology(accelerator)
    spec = importlib.util.spec_from_file_location("experiment", _CONFIG.value)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    batch = _TOKENS.value // _SEQ_LEN.value
    print(f"{_CONFIG.value} at {_SEQ_LEN.value:,} tokens x {batch} rows on {accelerator.name} "
          f"({accelerator.chips} chips, {format_bytes(accelerator.hbm_bytes)} HBM each); "
          f"jax {jax.__version__}")
    print("| mesh | strategy | attention | arguments | temporaries | total per chip | fits |")
    print("| :--- | :--- | :--- | ---: | ---: | ---: | :--- |")
    for size in map(int, _SEQUENCE.value):
        for strategy in _STRATEGIES.value if size > 1 else _STRATEGIES.value[:1]:
            # one device's block: splash ("auto"); the ring runs chunked whatever is asked
            impls = ["auto"] if size == 1 else ["chunked"] if strategy == "ring" else _IMPLS.value
            for impl in impls:
                config = module.get_config()
                config.update(seq_len=_SEQ_LEN.value, batch_size=batch)
                config.model.update(max_len=_SEQ_LEN.value, sequence_parallel=strategy,
                                    attention_impl=impl)
                config.mesh.update(data=1, fsdp=-1, sequence=size)
                _row(config, devices, accelerator, size, strategy if size > 1 else "-")


def _row(config, devices, accelerator, size: int, strategy: str) -> None:
    from launch import aot
    from transformer.parallel.sharding import format_bytes

    mesh = f"fsdp={accelerator.chips // size} x sequence={size}"
    try:
        report = aot.compile_train_step(config, devices, accelerator, flops=False)
    except ValueError as error:  # the batch or the length does not split
        print(f"| {mesh} | {strategy} | | | | | no: {error} |")
        return
    if report.error:
        print(f"| {mesh} | {strategy} | | | | | no: {report.error[:120]} |")
        return
    print(f"| {mesh} | {strategy} | {', '.join(report.attention)} | "
          f"{format_bytes(report.argument_bytes)} | {format_bytes(report.temp_bytes)} | "
          f"{format_bytes(report.total_bytes)} | {'yes' if report.fits else 'no'} |", flush=True)

if __name__ == "__main__":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)
