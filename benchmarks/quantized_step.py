"""Train step time with `model.quantization` "" (float32), "int8" and "fp8" (Qwix).

    python benchmarks/quantized_step.py [--schemes=,int8,fp8] [--steps=10] [--repeats=3]
        [--warmup=2] [--layers=4] [--d_model=128] [--heads=4] [--d_ff=512] [--seq_len=64]
        [--batch=16] [--vocab=256]

The defaults are the small char LM's shape (`transformer.configs.small_char_lm`, the
quantization ablation's model). Builds this project's real jitted train step for each setting
(`compile_time.build_train_step`), warms it up, then the settings take turns `--repeats` times,
`--steps` steps each, and each shows its best run (ms per step) and its ratio to float, so load
from other processes hits all alike. On a CPU quantization is not expected to pay: XLA CPU has
no fast int8 or fp8 matmul, and the step adds the scales' reductions and the casts.
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

_SCHEMES = flags.DEFINE_list("schemes", ["", "int8", "fp8"], "model.quantization values.")
_STEPS = flags.DEFINE_integer("steps", 10, "Train steps per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per setting (the best is shown).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps before timing.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Transformer blocks.")
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")
_D_FF = flags.DEFINE_integer("d_ff", 512, "Feed-forward width.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Context length.")
_BATCH = flags.DEFINE_integer("batch", 16, "Global batch size.")
_VOCAB = flags.DEFINE_integer("vocab", 256, "Vocabulary size.")


def main(argv) -> None:
    del argv
    import jax

    shape = dict(layers=_LAYERS.value, d_model=_D_MODEL.value, heads=_HEADS.value,
                 d_ff=_D_FF.value, seq_len=_SEQ_LEN.value, batch=_BATCH.value,
                 vocab=_VOCAB.value)
    features = random_batch(_BATCH.value, _SEQ_LEN.value, _VOCAB.value)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x {jax.device_count()}; GPT "
          f"{shape}; {_STEPS.value} steps per run, best of {_REPEATS.value}", flush=True)
    runners, compile_s = {}, {}
    for scheme in _SCHEMES.value:
        config = gpt_config(**shape)
        config.model.quantization = scheme
        step = build_train_step(config, features)
        lower_s, comp_s, compiled = lower_and_compile(step)
        compile_s[scheme] = lower_s + comp_s
        runners[scheme] = Runner(step, compiled)
        runners[scheme](max(_WARMUP.value, 1))
    best = {scheme: float("inf") for scheme in runners}
    for _ in range(max(_REPEATS.value, 1)):  # take turns, so load hits every setting alike
        for scheme, runner in runners.items():
            best[scheme] = min(best[scheme], runner(_STEPS.value) / _STEPS.value)
    base = best.get("")
    print("\n| model.quantization | ms/step | vs float | lower + compile s | loss |")
    print("| :--- | ---: | ---: | ---: | ---: |")
    for scheme, runner in runners.items():
        ratio = f"{best[scheme] / base:.2f}x" if base else "-"
        print(f"| {scheme or 'float32'} | {best[scheme] * 1e3:.1f} | {ratio} | "
              f"{compile_s[scheme]:.1f} | {runner.loss:.4f} |")


if __name__ == "__main__":
    app.run(main)
