"""Ahead-of-time compilation of the sharded train step for a Cloud TPU slice, on any machine.

    python -m launch.aot --config=experiments/<name>.py --topology=v5p-256 [--num_slices=N] \
        [--config.KEY=VALUE ...]

Needs libtpu (`pip install -e ".[tpu]"`, which works without a TPU): the slice's devices come
from `jax.experimental.topologies`, the mesh and shardings from the config exactly as training
makes them, and XLA:TPU compiles the real train step. Prints per-chip memory (arguments,
outputs, temporaries, code) against the chip's HBM, FLOPs per step from XLA's cost analysis,
the attention kernel compiled into the step (with the default "auto": splash where the masks
allow it, since the step is compiled for the topology's TPU devices), and whether it fits;
exits 1 if it does not. `launch.tpu run` runs this before creating machines.
"""

from __future__ import annotations

import dataclasses
import os

# Compiling for TPU needs no TPU: don't take libtpu's single-process lock (a test process or a
# second compile may hold it).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from launch import accelerators  # noqa: E402


@dataclasses.dataclass
class Report:
    accelerator: str  # "v5p-32", or "2 x v5p-32" for two slices
    chips: int
    num_params: int
    active_params: int = 0  # per token (less the experts a token skips); 0: = num_params
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    hbm_bytes: int = 0
    flops_per_chip: float = 0.0
    model_flops: float = 0.0
    attention: tuple[str, ...] = ()  # the attention kernels traced into the step
    moe_dispatch: tuple[str, ...] = ()  # and the MoE layers' dispatch paths
    error: str = ""

    @property
    def total_bytes(self) -> int:
        """Per-chip peak: live arguments (the donated state's outputs reuse them), outputs
        that do not alias, temporaries and the program."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)

    @property
    def fits(self) -> bool:
        return not self.error and self.total_bytes <= self.hbm_bytes


def tpu_topology(accelerator: accelerators.Accelerator, num_slices: int = 1):
    """The devices of `num_slices` x `accelerator` for compiling, without having them."""
    from jax.experimental import topologies

    grid = [int(n) for n in accelerator.topology.split("x")]
    per_host = (2, 2, 1) if accelerator.hosts > 1 else (*grid, 1)[:3]
    megacore = accelerator.generation.cores_per_chip == 2  # one device per chip (v4, v5p)
    # What compiles for a topology cannot be loaded back from JAX's persistent cache (there is
    # no TPU client to load it into: the read warns INVALID_ARGUMENT), so such a process keeps
    # the cache off (JAX decides at a process's first compile: this, when it comes first).
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return topologies.get_topology_desc(
            topology_name=accelerator.topology_name, platform="tpu", num_slices=num_slices,
            chip_config_name="megacore" if megacore else "default",
            chips_per_host_bounds=per_host).devices
    except Exception as error:  # noqa: BLE001 - no libtpu: say how to get it
        raise RuntimeError(f"cannot describe TPU topology {accelerator.topology_name} ({error});"
                           " expected libtpu: pip install -e '.[tpu]'") from None


def batch_spec(config) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of one global batch of the config's objective features (taken from
    the real input pipeline run on a synthetic document)."""
    from transformer.data import chat, pipeline, tokenizers

    if pipeline.objective_for(config) in pipeline.CHAT_OBJECTIVES:
        # packed conversations (chat.PackedRows): next-token features with segments and a mask
        row = {k: np.ones(config.seq_len + 1, np.int32) for k in (
            "tokens", "tokens_segment_ids", "tokens_positions", "tokens_loss_mask")}
        # (as jit takes them: the mask's product is float64 in NumPy, float32 in the step)
        return {name: jax.ShapeDtypeStruct((config.batch_size, *value.shape),
                                           jax.dtypes.canonicalize_dtype(value.dtype))
                for name, value in chat.sft_features(row).items()}
    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=config.data.num_sentinels)
    doc = (np.arange(4 * config.seq_len + 8) % 200 + 10).astype(np.int32)
    dataset = pipeline.make_dataset(
        [doc], objective=pipeline.objective_for(config), tokenizer=tokenizer,
        seq_len=config.seq_len, batch_size=1, seed=0, rows=[0], prefetch=0,
        mlm_rate=config.data.mlm_rate, noise_density=config.data.noise_density,
        mean_span_length=config.data.mean_span_length)
    row = next(iter(dataset))
    return {name: jax.ShapeDtypeStruct((config.batch_size, *value.shape[1:]), value.dtype)
            for name, value in row.items()}


def resolved_config(config, explicit=()):
    """The config a training run would build: its init_from source's architecture (and
    vocabulary) filled in, as `transformer.train` does (`finetune.resolve_init_config`;
    `explicit`: the keys the command line set), and the vocabulary size resolved."""
    from transformer.training import finetune

    config = finetune.resolve_init_config(config, explicit)
    config.model.vocab_size = resolved_vocab_size(config)
    return config


def resolved_vocab_size(config) -> int:
    if config.model.vocab_size:
        return config.model.vocab_size
    from transformer.data import inputs, tokenizers

    if config.data.tokenizer == "byte":
        return tokenizers.build_tokenizer("byte", num_sentinels=config.data.num_sentinels)\
            .vocab_size
    if config.data.tokenizer == "hf":
        try:  # its tokenizer.json, where this machine has it too
            return inputs.get_tokenizer(config).vocab_size
        except (OSError, ValueError):
            pass
    raise ValueError(f"model.vocab_size=0 with data.tokenizer={config.data.tokenizer!r}: "
                     "expected --config.model.vocab_size (the tokenizer is "
                     + ("a file this machine lacks" if config.data.tokenizer == "hf"
                        else "built from the data") + ")")


def _compile(config, devices, accelerator: accelerators.Accelerator):
    """Lowers and compiles the config's train step over `devices`: (compiled, report), with
    compiled None and report.error set if XLA refuses it."""
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    from transformer.configs import validate_config
    from transformer.models import build_model
    from transformer.nn import kernels
    from transformer.parallel import pipeline_parallel, sharding
    from transformer.train import make_train_step
    from transformer.training import metrics, optim, placement, state

    config.model.vocab_size = resolved_vocab_size(config)
    slices = sharding.num_slices(devices)
    processes = accelerator.hosts * slices
    # (the files it reads, on the slice: a gcsfuse mount this machine may lack)
    validate_config(config, len(devices), processes, files=False, this_backend=False)
    model = build_model(config.model)
    optimizer = optim.make_optimizer(config)
    mesh = sharding.make_mesh(config.mesh, devices)
    # the XLA options training compiles with (the TPU defaults, config.compiler_options), judged
    # by XLA:TPU before anything compiles: this machine's XLA cannot judge TPU's
    options = placement.compiler_options(config, mesh)
    batch = batch_spec(config)
    example = {k: np.zeros(v.shape[1:], v.dtype)[None] for k, v in batch.items()}
    abstract, state_sharding, _ = state.initial_state(config, model, mesh, example, optimizer)
    num_params = state.num_params(abstract)
    active = state.active_params(abstract, config)
    batch_sharding = sharding.batch_sharding(mesh)
    state_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_sharding)
    batch_in = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
                for k, v in batch.items()}
    # as training runs it: a circular pipeline's layer params stage-major (placement.train_order;
    # the same as layer order for any other run)
    train_step = pipeline_parallel.reading_stage_major(make_train_step(model, config, optimizer))
    step = jax.jit(train_step, donate_argnums=0,
                   in_shardings=(state_sharding, batch_sharding),
                   out_shardings=(state_sharding, NamedSharding(mesh, PartitionSpec())))
    name = accelerator.name if slices == 1 else f"{slices} x {accelerator.name}"
    report = Report(name, len(devices), num_params, active, hbm_bytes=accelerator.hbm_bytes)
    tokens = config.batch_size * config.seq_len
    report.model_flops = metrics.flops_per_token(config, active) * tokens
    pipeline = config.get("pipeline") or {}
    schedule = (pipeline.get("microbatches", 1), pipeline.get("repeats", 1))
    with (jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES),
          pipeline_parallel.schedule(*schedule), kernels.recording() as chosen):
        lowered = step.lower(state_in, batch_in)
    report.attention, report.moe_dispatch = kernels.split_moe(chosen)
    try:
        return lowered.compile(compiler_options=options), report
    except Exception as error:  # noqa: BLE001 - XLA:TPU refuses programs that exceed HBM
        report.error = str(error).strip().splitlines()[0][:400]
        return None, report


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


def _stack_depths(model) -> dict[str, int]:
    """The model's layer stacks and their depths (T5 has an encoder and a decoder stack; a
    depth of None is num_layers)."""
    from transformer.models import family_of

    return {key: model.get(key) or model.num_layers for key in family_of(model).stacks}


def _layer_unit(model) -> tuple[int, int]:
    """(dense, unit): a stack's first `moe.first_dense_layers` layers, which scan apart, and
    the layers that repeat identically after them, the scan's `layer_period` (MoE layers
    every n, the layer types' pattern: their lcm)."""
    from transformer.models import transformer_config

    stack = transformer_config(model)
    return (stack.moe.first_dense_layers if stack.moe.num_experts else 0), stack.layer_period


def compile_train_step(config, devices, accelerator: accelerators.Accelerator,
                       flops: bool = True) -> Report:
    """Compiles the config's train step over `devices`: the per-chip memory and FLOPs report
    (`flops=False`: memory only, one compile).

    XLA's cost analysis counts a loop body once, so for a scanned layer stack
    (`model.scan_layers`) the FLOPs come from small unrolled compiles instead: stacks of one
    unit give the cost outside the repeating layers, one more unit in a stack its cost, and
    these extrapolate exactly to the config's depths. The unit is the scan's group of
    `layer_period` layers (MoE every n layers, a layer-type pattern: groups are identical);
    the first dense layers (moe.first_dense_layers) stay in every stack, counted once.
    """
    from transformer.models import transformer_config

    compiled, report = _compile(config, devices, accelerator)
    if compiled is None:
        return report
    memory = compiled.memory_analysis()
    report.argument_bytes = memory.argument_size_in_bytes
    report.output_bytes = memory.output_size_in_bytes
    report.alias_bytes = memory.alias_size_in_bytes
    report.temp_bytes = memory.temp_size_in_bytes
    report.code_bytes = memory.generated_code_size_in_bytes
    report.flops_per_chip = _flops(compiled)
    # (A pipeline needs scanned layers: its FLOPs stay XLA's count, loop bodies counted once.)
    if config.model.scan_layers and flops and not _pipelined(config):
        depths = _stack_depths(config.model)
        dense, unit = _layer_unit(config.model)
        # the pattern's shortest period: "full_attention*4" would not divide a 1-layer unit
        pattern = {"layer_types": ",".join(transformer_config(config.model).layer_pattern)}

        def unrolled_flops(**layers):
            shallow = config.copy_and_resolve_references()
            shallow.model.update({**{k: dense + unit for k in depths}, **layers,
                                  **(pattern if config.model.get("layer_types") else {}),
                                  "scan_layers": False})
            return _flops(_compile(shallow, devices, accelerator)[0])

        base = unrolled_flops()  # dense + unit layers a stack; the others' cost is per unit
        units = {key: (depth - dense) // unit - 1 for key, depth in depths.items()}
        report.flops_per_chip = base + sum(
            n * (unrolled_flops(**{key: dense + 2 * unit}) - base)
            for key, n in units.items() if n)
    return report


def _pipelined(config) -> bool:
    return config.mesh.get("stage", 1) > 1


def format_report(report: Report, config) -> str:
    from transformer.parallel.sharding import describe_mesh, format_bytes, mesh_shape

    m = config.model
    mesh = describe_mesh(mesh_shape(config.mesh, report.chips))
    active = (f" ({report.active_params:,} active per token)"
              if report.active_params and report.active_params != report.num_params else "")
    lines = [f"{config.experiment}: {m.family}, {report.num_params:,} params{active}, "
             f"{m.num_layers} layers x {m.d_model} wide, batch {config.batch_size} x "
             f"{config.seq_len}, on {report.accelerator} ({report.chips} chip"
             f"{'s' if report.chips > 1 else ''}), mesh {mesh}"]
    if report.error:
        return "\n".join(lines + [f"does not fit: XLA refused to compile it: {report.error}"])
    rows = [("arguments (state + batch)", report.argument_bytes),
            ("outputs not aliased", report.output_bytes - report.alias_bytes),
            ("temporaries", report.temp_bytes), ("program", report.code_bytes),
            ("total per chip", report.total_bytes), ("HBM per chip", report.hbm_bytes)]
    lines += [f"  {name:<28}{format_bytes(value):>12}" for name, value in rows]
    lines.append(f"  {'use of HBM':<28}{report.total_bytes / report.hbm_bytes:>12.1%}")
    dense, unit = _layer_unit(m)
    how = (f"XLA cost analysis of {dense + unit}- and {dense + 2 * unit}-layer unrolled stacks, "
           "extrapolated"
           if config.model.scan_layers else "XLA cost analysis")
    if config.model.scan_layers and set(_stack_depths(m).values()) == {dense + unit}:
        how = "XLA cost analysis of the stack unrolled"  # one unit deep: nothing to extrapolate
    if _pipelined(config):
        how = "XLA cost analysis of the pipeline, its loop bodies counted once: too low"
    if (accumulation := config.optimizer.grad_accumulation_steps) > 1:  # (a lax.scan)
        how += (f"; its loop over {accumulation} accumulated micro-batches counted once: about "
                f"{accumulation}x too low")
    lines.append(f"FLOPs per step: {report.flops_per_chip:.3e} per chip ({how}), "
                 f"{report.flops_per_chip * report.chips:.3e} in all; model FLOPs "
                 f"{report.model_flops:.3e} (6N per token + attention, without remat). XLA "
                 "counts a loop body once, also of the loops it makes itself (e.g. collective "
                 "matmuls on large slices), so its figure can be low" + (
                     "; and splash's attention is not in it (a Pallas kernel that gives XLA no "
                     "cost estimate counts 0)" if any("splash" in k for k in report.attention)
                     else ""))
    kernel = ", ".join(report.attention) or "none (no attention layer)"
    lines.append(f"attention kernel compiled into the step: {kernel} (model.attention_impl="
                 f"{m.attention_impl!r})")
    if report.moe_dispatch:  # e.g. "moe dispatch: ragged all-to-all over expert=4"
        lines.append(f"{', '.join(report.moe_dispatch)} (compiled into the step)")
    lines.append("fits" if report.fits else "does not fit in HBM")
    return "\n".join(lines)


def main(argv) -> int:
    from absl import flags, logging

    del argv
    logging.set_verbosity(logging.WARNING)
    FLAGS = flags.FLAGS
    if FLAGS.num_slices < 1:
        raise ValueError(f"--num_slices={FLAGS.num_slices}: expected an int >= 1")
    accelerator = accelerators.parse(FLAGS.topology, "--topology")
    from ml_collections import config_flags

    from transformer.configs import validate_config

    config = resolved_config(FLAGS.config, config_flags.get_override_values(FLAGS["config"]))
    # Every value, before libtpu starts: one device per chip (megacore, or one core a chip).
    validate_config(config, accelerator.chips * FLAGS.num_slices,
                    accelerator.hosts * FLAGS.num_slices, files=False, this_backend=False)
    # Off a TPU VM, libtpu looks for this VM's accelerator type and workers and prints five
    # lines of warnings when there are none; the topology it compiles for is named explicitly.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    devices = tpu_topology(accelerator, FLAGS.num_slices)
    report = compile_train_step(config, devices, accelerator)
    print(format_report(report, config))
    return 0 if report.fits else 1


if __name__ == "__main__":
    from absl import flags
    from ml_collections import config_flags

    from launch import run_cli

    config_flags.DEFINE_config_file("config", None, "Experiment file.", lock_config=False)
    flags.mark_flag_as_required("config")
    flags.DEFINE_string("topology", None, "TPU slice type, e.g. v5p-32 or v6e-8.",
                        required=True)
    flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN.")

    run_cli(main)
