"""Memory and speed of the train step under each rematerialization policy, unrolled and scanned.

    python benchmarks/remat.py [--policies=none,full,dots,dots_no_batch] [--scan=both]
        [--steps=5] [--repeats=3] [--warmup=2] [--layers=6] [--d_model=384] [--heads=6]
        [--d_ff=1536] [--seq_len=256] [--batch=8] [--vocab=256]

For each `remat_policy` of `transformer.nn.config.REMAT_POLICIES` (`none` = no remat), with
`scan_layers` False and/or True (`--scan=both|false|true`), builds this project's real jitted
train step (the shakespeare_char GPT of `experiments/gpt_shakespeare_char.py` at the flags'
shape, dropout 0; see `compile_time.build_train_step`), compiles it once and reads XLA's
`compiled.memory_analysis()`: `temp_size_in_bytes` (the scratch buffers live during the step,
where saved activations go: what remat trades for recompute), and the argument / output /
aliased (donated state) sizes. Then times the step on a random-token batch: after `--warmup`
steps the configurations take turns `--repeats` times, `--steps` steps each, and each shows its
best run (ms per step), so load from other processes hits all alike. Ratios are against `none`
with the same `scan_layers`. A configuration that fails to build, compile or run is reported as
an error row.
"""

from __future__ import annotations

from absl import app, flags
from compile_time import (
    Runner,
    build_train_step,
    gpt_config,
    lower_and_compile,
    random_batch,
)

_POLICIES = flags.DEFINE_list("policies", None, "Remat policies (default: all REMAT_POLICIES).")
_SCAN = flags.DEFINE_enum("scan", "both", ["both", "false", "true"], "scan_layers to run.")
_STEPS = flags.DEFINE_integer("steps", 5, "Train steps per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per configuration (the best is shown).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps before timing.")
_LAYERS = flags.DEFINE_integer("layers", 6, "Transformer blocks.")
_D_MODEL = flags.DEFINE_integer("d_model", 384, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 6, "Attention heads.")
_D_FF = flags.DEFINE_integer("d_ff", 1536, "Feed-forward width.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Context length.")
_BATCH = flags.DEFINE_integer("batch", 8, "Global batch size.")
_VOCAB = flags.DEFINE_integer("vocab", 256, "Vocabulary size.")

MiB = 1024 * 1024


def _error(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 160 else text[:157] + "..."


def main(argv) -> None:
    del argv
    import jax
    import numpy as np

    from transformer.nn.config import REMAT_POLICIES

    policies = _POLICIES.value or list(REMAT_POLICIES)
    for policy in policies:
        if policy not in REMAT_POLICIES:
            raise app.UsageError(f"--policies: {policy!r} is not one of {list(REMAT_POLICIES)}")
    scans = {"both": (False, True), "false": (False,), "true": (True,)}[_SCAN.value]
    shape = dict(layers=_LAYERS.value, d_model=_D_MODEL.value, heads=_HEADS.value,
                 d_ff=_D_FF.value, seq_len=_SEQ_LEN.value, batch=_BATCH.value,
                 vocab=_VOCAB.value)
    features = random_batch(_BATCH.value, _SEQ_LEN.value, _VOCAB.value)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x {jax.device_count()}; GPT "
          f"{shape['layers']} layers, d_model {shape['d_model']}, {shape['heads']} heads, d_ff "
          f"{shape['d_ff']}, seq_len {shape['seq_len']}, batch {shape['batch']}, vocab "
          f"{shape['vocab']}; {_STEPS.value} steps per run, best of {_REPEATS.value}",
          flush=True)

    cells = [(scan, policy) for scan in scans for policy in policies]
    runners, memory, compile_s, errors = {}, {}, {}, {}
    for cell in cells:
        scan, policy = cell
        try:
            step = build_train_step(gpt_config(scan_layers=scan, remat_policy=policy, **shape),
                                    features)
            lower_s, comp_s, compiled = lower_and_compile(step)
            memory[cell] = compiled.memory_analysis()
            compile_s[cell] = lower_s + comp_s
            runner = Runner(step, compiled)
            runner(max(_WARMUP.value, 1))
            if not np.isfinite(runner.loss):
                raise FloatingPointError(f"loss {runner.loss} after warm-up")
            runners[cell] = runner
            m = memory[cell]
            print(f"  scan={scan!s:<5} {policy:>13}: lower + compile {compile_s[cell]:.1f} s, "
                  f"temp {m.temp_size_in_bytes / MiB:.1f} MiB, loss {runner.loss:.4f}",
                  flush=True)
        except Exception as exc:  # reported as an error row, the others still run
            errors[cell] = _error(exc)
            print(f"  scan={scan!s:<5} {policy:>13}: ERROR {errors[cell]}", flush=True)

    best = {cell: float("inf") for cell in runners}
    for _ in range(max(_REPEATS.value, 1)):  # take turns, so load hits every cell alike
        for cell, runner in runners.items():
            best[cell] = min(best[cell], runner(_STEPS.value) / _STEPS.value)

    print()
    print("| scan_layers | remat_policy | temp MiB | temp vs none | argument MiB | output MiB | "
          "aliased MiB | ms/step | step vs none | lower + compile s | loss |")
    print("| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cell in cells:
        scan, policy = cell
        if cell in errors:
            print(f"| {scan} | {policy} | ERROR: {errors[cell].replace('|', '/')} "
                  "| | | | | | | | |")
            continue
        m, base = memory[cell], (scan, "none")
        temp_ratio = (f"{m.temp_size_in_bytes / memory[base].temp_size_in_bytes:.2f}x"
                      if base in memory and memory[base].temp_size_in_bytes else "-")
        step_ratio = f"{best[cell] / best[base]:.2f}x" if base in best else "-"
        print(f"| {scan} | {policy} | {m.temp_size_in_bytes / MiB:.1f} | {temp_ratio} | "
              f"{m.argument_size_in_bytes / MiB:.1f} | {m.output_size_in_bytes / MiB:.1f} | "
              f"{m.alias_size_in_bytes / MiB:.1f} | {best[cell] * 1e3:.1f} | {step_ratio} | "
              f"{compile_s[cell]:.1f} | {runners[cell].loss:.4f} |")
    print("\ntemp = XLA temp buffers of the compiled step (activations saved for the backward "
          "pass and scratch); argument/output include the train state (params + AdamW moments), "
          "aliased = donated state reused for the output. loss = after the last timed step.")
    if errors:
        print(f"{len(errors)} configuration(s) failed: " +
              "; ".join(f"scan={s} {p}" for s, p in errors))


if __name__ == "__main__":
    app.run(main)
