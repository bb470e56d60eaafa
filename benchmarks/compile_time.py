"""Compile time of the real jitted train step against depth, unrolled vs scanned layers.

    python benchmarks/compile_time.py [--layers=2,12,24] [--repeats=3] [--d_model=256]
        [--heads=4] [--d_ff=1024] [--seq_len=128] [--batch=8] [--vocab=256]

Builds this project's train step (`train.make_train_step` of `experiments/gpt_shakespeare_char.py`
resized to the flags, dropout 0, jitted by `placement.Placement` as `train.py` does) for each depth
in `--layers`, with `scan_layers` False (blocks unrolled as `layers_0..N-1`) and True (one
`nn.scan` over a stacked `layers` axis), and measures the wall time of
`jitted.lower(state, batch)` (tracing + lowering to StableHLO) and of `.compile()` (XLA) on it,
each the best of `--repeats` from a fresh, untraced jitted function. The cells take turns, so
load from other processes hits all alike; the persistent compilation cache is off. Prints a
markdown table and the deepest vs shallowest ratios; the target is that with scanned layers
24 layers lower + compile in <= 1.3x the 2-layer time.

Also runs one step of every compiled function on a random-token batch (the loss must be
finite) and, at the shallowest depth, checks that the scanned and unrolled steps agree on the
same parameters: the unrolled init is converted with `transformer.nn.layers.stack_layers`, and the
loss, gradient norm and updated parameters (unstacked) are compared.

`gpt_config` / `build_train_step` / `random_batch` / `lower_and_compile` are shared with
benchmarks/remat.py (this module defines its flags only when run as a script).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import time
from typing import Any

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TARGET = 1.3  # scanned: deepest compile time <= TARGET x shallowest


@functools.cache
def _experiment():
    spec = importlib.util.spec_from_file_location(
        "gpt_shakespeare_char", os.path.join(ROOT, "experiments", "gpt_shakespeare_char.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Runner:
    """A compiled train step and the state it carries from step to step (it is donated)."""

    def __init__(self, step, compiled):
        import jax

        self.compiled, self.batch = compiled, step.batch
        self.state = jax.tree.map(lambda x: x.copy(), step.state)
        self.loss = float("nan")

    def __call__(self, n: int) -> float:
        """Seconds for `n` steps (the last step's loss is kept)."""
        start = time.perf_counter()
        for _ in range(n):
            self.state, metrics = self.compiled(self.state, self.batch)
        self.loss = float(metrics["loss"])  # waits for the last step
        return time.perf_counter() - start


def gpt_config(*, layers: int, d_model: int, heads: int, d_ff: int, seq_len: int, batch: int,
               vocab: int, scan_layers: bool = False, remat_policy: str = "none"):
    """The shakespeare_char GPT experiment config at this shape, no dropout, float32."""
    config = _experiment().get_config("gpu")
    config.update(batch_size=batch, seq_len=seq_len)
    config.model.update(num_layers=layers, num_heads=heads, d_model=d_model, d_ff=d_ff,
                        max_len=seq_len, vocab_size=vocab, dropout_rate=0.0,
                        attention_dropout_rate=0.0, dtype="float32",
                        scan_layers=scan_layers, remat_policy=remat_policy)
    return config


def random_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """Pipeline features of random tokens, every position weighted, one document per row."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (batch, seq_len)
    return {"inputs": rng.integers(0, vocab, shape, dtype=np.int32),
            "targets": rng.integers(0, vocab, shape, dtype=np.int32),
            "weights": np.ones(shape, np.float32),
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape)}


@dataclasses.dataclass
class TrainStep:
    """A model's train state, a global batch and its jitted train step, as train.py builds them."""

    config: Any
    model: Any
    optimizer: Any
    placement: Any
    state_sharding: Any
    state: Any
    batch: Any
    jitted: Any

    def fresh_jit(self):
        """A new jitted train step (not yet traced, so lowering it times the full trace)."""
        from transformer.train import make_train_step

        with self.placement.context():
            return self.placement.jit_train_step(
                make_train_step(self.model, self.config, self.optimizer),
                self.state_sharding)


def build_train_step(config, features=None, seed: int = 0, devices=None) -> TrainStep:
    """The initialized state and jitted train step of `config` (one experiment config), on all
    (or the given) devices."""
    import jax

    from transformer.models import build_model
    from transformer.training import optim
    from transformer.training import placement as placement_lib
    from transformer.training import state as state_lib

    if features is None:
        features = random_batch(config.batch_size, config.seq_len, config.model.vocab_size)
    model = build_model(config.model)
    optimizer = optim.make_optimizer(config)
    placement = placement_lib.Placement.from_config(config, devices)
    _, state_sharding, jit_init = state_lib.initial_state(config, model, placement.mesh, features,
                                                          optimizer)
    state = jit_init(jax.random.key(seed))
    with placement.context():
        batch = placement.global_batch(features)
    step = TrainStep(config, model, optimizer, placement, state_sharding, state, batch, None)
    step.jitted = step.fresh_jit()
    return step


def lower_and_compile(step: TrainStep, jitted=None):
    """(lower seconds, compile seconds, compiled) of `jitted` (default: a fresh jit) on `step`."""
    jitted = step.fresh_jit() if jitted is None else jitted
    with step.placement.context():
        start = time.perf_counter()
        lowered = jitted.lower(step.state, step.batch)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
    return lowered_at - start, done - lowered_at, compiled


def run_once(compiled, state, batch):
    """One step of `compiled` (donates `state`): (new state, metrics as floats)."""
    import jax

    new_state, metrics = compiled(state, batch)
    return new_state, {k: float(v) for k, v in jax.device_get(metrics).items()}


def check_scan_matches_unrolled(unrolled: TrainStep, scanned: TrainStep, compiled_unrolled,
                                compiled_scanned) -> str:
    """One step of both on the unrolled init (stacked for the scanned one): a report line."""
    import jax
    import numpy as np

    from transformer.nn.layers import stack_layers, unstack_layers
    from transformer.training import state as state_lib

    layers = unrolled.config.model.num_layers
    host = jax.device_get(unrolled.state.params)
    stacked = {**host, "decoder": stack_layers(host["decoder"], layers)}
    if jax.tree.structure(stacked) != jax.tree.structure(scanned.state.params):
        return ("scanned vs unrolled: param layouts differ after stack_layers "
                f"({jax.tree.structure(stacked)} vs {jax.tree.structure(scanned.state.params)})")
    shapes = jax.tree.map(lambda a, b: a.shape == b.shape, stacked, scanned.state.params)
    if not all(jax.tree.leaves(shapes)):
        return "scanned vs unrolled: param shapes differ after stack_layers"
    state_s = state_lib.TrainState(scanned.state.step, stacked, unrolled.optimizer.init(stacked),
                               scanned.state.first_nonfinite_step)
    state_s = jax.device_put(state_s, scanned.state_sharding)
    state_u = jax.tree.map(lambda x: x.copy(), unrolled.state)  # the step donates its input
    new_u, metrics_u = run_once(compiled_unrolled, state_u, unrolled.batch)
    new_s, metrics_s = run_once(compiled_scanned, state_s, scanned.batch)
    params_s = jax.device_get(new_s.params)
    params_s = {**params_s, "decoder": unstack_layers(params_s["decoder"], layers)}
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                         jax.device_get(new_u.params), params_s)
    max_diff = max(jax.tree.leaves(diffs))
    loss_diff = abs(metrics_u["loss"] - metrics_s["loss"])
    norm_diff = abs(metrics_u["grad_norm"] - metrics_s["grad_norm"])
    ok = (loss_diff <= 1e-5 * abs(metrics_u["loss"]) and norm_diff <= 1e-4 * metrics_u["grad_norm"]
          and max_diff <= 1e-5)
    return (f"scanned vs unrolled at {layers} layers, same params (stack_layers of the unrolled "
            f"init): loss {metrics_u['loss']:.6f} vs {metrics_s['loss']:.6f} (|diff| "
            f"{loss_diff:.1e}), grad norm {metrics_u['grad_norm']:.6f} vs "
            f"{metrics_s['grad_norm']:.6f} (|diff| {norm_diff:.1e}), updated params max |diff| "
            f"{max_diff:.1e}: {'MATCH' if ok else 'MISMATCH'}")


def _define_flags() -> None:
    flags.DEFINE_list("layers", ["2", "12", "24"], "Depths to compile.")
    flags.DEFINE_integer("repeats", 3, "Lower + compile runs per cell (the best is shown).")
    flags.DEFINE_integer("d_model", 256, "Model width.")
    flags.DEFINE_integer("heads", 4, "Attention heads.")
    flags.DEFINE_integer("d_ff", 1024, "Feed-forward width.")
    flags.DEFINE_integer("seq_len", 128, "Context length.")
    flags.DEFINE_integer("batch", 8, "Global batch size.")
    flags.DEFINE_integer("vocab", 256, "Vocabulary size.")


def main(argv) -> None:
    del argv
    FLAGS = flags.FLAGS
    import jax
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    depths = sorted({int(n) for n in FLAGS.layers})
    shape = dict(d_model=FLAGS.d_model, heads=FLAGS.heads, d_ff=FLAGS.d_ff,
                 seq_len=FLAGS.seq_len, batch=FLAGS.batch, vocab=FLAGS.vocab)
    features = random_batch(FLAGS.batch, FLAGS.seq_len, FLAGS.vocab)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x {jax.device_count()}; GPT "
          f"d_model {shape['d_model']}, {shape['heads']} heads, d_ff {shape['d_ff']}, seq_len "
          f"{shape['seq_len']}, batch {shape['batch']}, vocab {shape['vocab']}; best of "
          f"{FLAGS.repeats} per cell", flush=True)

    cells = [(layers, scan) for layers in depths for scan in (False, True)]
    steps = {cell: build_train_step(gpt_config(layers=cell[0], scan_layers=cell[1], **shape),
                                    features) for cell in cells}
    # Round-robin over the cells, so load from other processes hits every cell alike.
    times = {cell: (float("inf"), float("inf")) for cell in cells}
    compiled = {}
    for _ in range(max(FLAGS.repeats, 1)):
        for cell in cells:
            lower_s, compile_s, compiled[cell] = lower_and_compile(steps[cell])
            times[cell] = (min(times[cell][0], lower_s), min(times[cell][1], compile_s))

    notes = []
    for layers, scan in cells:
        name = "scanned" if scan else "unrolled"
        step = steps[layers, scan]
        params = sum(p.size for p in jax.tree.leaves(step.state.params))
        state = jax.tree.map(lambda x: x.copy(), step.state)  # the step donates its input
        _, metrics = run_once(compiled[layers, scan], state, step.batch)
        finite = bool(np.isfinite(metrics["loss"]))
        lower_s, compile_s = times[layers, scan]
        print(f"  {layers:>3} layers {name:>8}: {params / 1e6:.2f}M params, lower "
              f"{lower_s:.2f} s, compile {compile_s:.2f} s, one step loss "
              f"{metrics['loss']:.4f} ({'finite' if finite else 'NOT FINITE'})", flush=True)
        if not finite:
            notes.append(f"{layers} layers {name}: loss {metrics['loss']} is not finite")
    low = depths[0]
    notes.append(check_scan_matches_unrolled(steps[low, False], steps[low, True],
                                             compiled[low, False], compiled[low, True]))

    print()
    print("| layers | unrolled lower s | unrolled compile s | scanned lower s | "
          "scanned compile s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for layers in depths:
        (ul, uc), (sl, sc) = times[layers, False], times[layers, True]
        print(f"| {layers} | {ul:.2f} | {uc:.2f} | {sl:.2f} | {sc:.2f} |")
    high = depths[-1]
    ratio = lambda scan, i: times[high, scan][i] / times[low, scan][i]
    print(f"| {high} vs {low} layers | {ratio(False, 0):.2f}x | {ratio(False, 1):.2f}x | "
          f"{ratio(True, 0):.2f}x | {ratio(True, 1):.2f}x |")
    total = lambda layers, scan: sum(times[layers, scan])
    unrolled_ratio = total(high, False) / total(low, False)
    scanned_ratio = total(high, True) / total(low, True)
    print(f"\nlower + compile, {high} vs {low} layers: unrolled {total(high, False):.2f} / "
          f"{total(low, False):.2f} s = {unrolled_ratio:.2f}x; scanned {total(high, True):.2f} / "
          f"{total(low, True):.2f} s = {scanned_ratio:.2f}x")
    holds = scanned_ratio <= TARGET
    print(f"target (scanned: {high} layers lower + compile <= {TARGET}x {low} layers): "
          f"{scanned_ratio:.2f}x -> {'HOLDS' if holds else 'DOES NOT HOLD'} (XLA compile "
          f"alone: {ratio(True, 1):.2f}x)")
    for note in notes:
        print(note)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
