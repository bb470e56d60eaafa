"""Per-chip TPU memory and XLA FLOPs of this project's train step against MaxText's, compiled
ahead of time for the same slice, model, mesh split and batch, at three shapes (`--shape`):

  dense  a Llama-style 1.71B decoder (experiments/llama_1b7.py: 24 x 2048, 16 heads, SwiGLU
         8192, RMSNorm, RoPE, tied 50,304 vocabulary), batch 128 x 2048, FSDP over all chips;
  moe    its Mixtral-style mixture-of-experts version (experiments/mixtral_2b.py: every
         feed-forward 8 SwiGLU experts 5632 wide, top-2, 2.17B active of 7.15B params),
         dropless, expert parallelism 4 x fsdp 4; MaxText's mixtral block with
         `sparse_matmul` / `megablox`, `capacity_factor=-1`, `ici_expert_parallelism=4`;
  long   the 1.71B at 32,768 tokens, batch chips / 4 (4 rows on v5p-32), context parallelism 4
         x fsdp 4: our `sequence` axis (the all_gather strategy, splash per device) against
         MaxText's `ici_context_parallelism=4` (`context_parallel_strategy=all_gather`).

All bfloat16 compute, float32 params and AdamW moments, scanned layers with full remat.

Asked for by name, a model that needs pipeline stages (experiments/llama_70b.py: 80 x 8192, 64 /
8 heads, SwiGLU 28,672, untied 128,256 vocabulary, 70.55B params, batch 128 x 2048):
  fsdp70b     on one slice, fsdp over all chips (does not fit on v5p-32, on either side);
  pipeline    on two slices (`compile_topology_num_slices=2`), stage=2 across them x fsdp
              inside each, 8 microbatches, GPipe; MaxText: `dcn_pipeline_parallelism=2`,
              `num_pipeline_microbatches=8`, 40 layers a stage scanned (`scan_layers_per_stage`);
  circular    the same with 2 repeats (MaxText: `num_pipeline_repeats=2`, 20 layers a stage);
  circular40  40 repeats, one layer a stage and visit (MaxText's default layout).
Results and the buffers behind them: docs/cloud-tpu.md.

    python benchmarks/aot_vs_maxtext.py --maxtext_python=/work/venv-maxtext/bin/python \
        --ours_python=/work/venv-ours312/bin/python [--topology=v5p-32] \
        [--shape=dense,moe,long] [--attention=splash,dense] \
        [--quantization=none,int8] [--dump_dir=DIR [--top_buffers=12]] \
        [--output_dir=DIR [--reuse]]

--quantization=int8 compiles ours with model.quantization="int8" and MaxText with
`quantization=int8 use_qwix_quantization=true` (both Qwix; the int8 rows and ratios read
"dense int8"; docs/performance.md has the table).

Each side compiles in its own process with its own Python (this file run with --side): ours
through `launch.aot` (the topology from `jax.experimental.topologies`, the mesh, shardings and
train step exactly as training builds them); MaxText through its own
`maxtext.trainers.pre_train.train_compile.main`, run unchanged with the overrides of
`maxtext_overrides` (its `jit_and_compile` is wrapped only to keep the compiled object). Both
report XLA's `compiled.memory_analysis()` per chip and `compiled.cost_analysis()`'s FLOPs per
chip (XLA counts a loop body once: both sides scan their layers, so the figure is the step
outside the layers plus one layer, on both sides alike). Attention "splash" is MaxText's
`attention=flash` (its splash kernel on TPU), "dense" its `attention=dot_product`. The total is
arguments + outputs not aliased to them + temporaries + generated code, as `launch.aot` counts
it. A comparison is printed only if both sides ran the same jax, jaxlib and libtpu. With
--output_dir and --reuse a compile whose log there holds a result for the same --topology is
not run again (a log compiled for another topology is compiled anew).

With --dump_dir each compile also dumps XLA's buffer assignment
(DIR/<side>-<topology>-<shape>-<attention>/, `<topology>x2` on two slices)
and the largest buffers live at the temporaries' peak are listed, with the op that made each.

Setup (Python 3.12; MaxText 0.2.5 resolves to jax 0.12.0.1 and libtpu 0.0.52, pinned here so
that both sides match; neither needs a TPU to compile):

    # MaxText in its own venv (about 4 minutes)
    python3.12 -m venv /work/venv-maxtext
    /work/venv-maxtext/bin/pip install "maxtext[tpu]==0.2.5" jax==0.12.0.1 jaxlib==0.12.0.1 \
        libtpu==0.0.52
    # this project beside the same jax (about 2.5 minutes)
    python3.12 -m venv /work/venv-ours312
    /work/venv-ours312/bin/pip install jax==0.12.0.1 jaxlib==0.12.0.1 libtpu==0.0.52 \
        "flax>=0.12,<0.14" "optax>=0.2.6,<0.3" "orbax-checkpoint>=0.11,<0.14" \
        "grain>=0.2.12,<0.3" absl-py ml_collections numpy "sentencepiece>=0.2,<0.3" \
        array_record tqdm tensorboardX matplotlib scikit-learn
    /work/venv-ours312/bin/pip install --no-deps -e .

(`--no-deps` because setup.cfg's jax cap may lag the jax MaxText wants.) One compile takes about
2 to 3.5 minutes (dense, long) or 7 to 9 (moe) and under 2 GiB of RAM on 2 cores; they run one
at a time.

Measured before and after this project's TPU memory work (jax 0.12.0.1, libtpu 0.0.52, MaxText
0.2.5, v5p-32; both sides count 1,713,735,680 params; per chip):

| side | attention | arguments | temporaries | program | total (before) | total (now) |
| --- | --- | --- | --- | --- | --- | --- |
| ours | splash | 1.20 GiB | 5.17 GiB | 0.04 GiB | 7.87 GiB | 6.41 GiB |
| MaxText | flash (splash) | 1.20 GiB | 5.20 GiB | 0.04 GiB | 6.44 GiB | 6.44 GiB |
| ours | dense | 1.20 GiB | 5.19 GiB | 0.04 GiB | 8.84 GiB | 6.43 GiB |
| MaxText | dot_product (dense) | 1.20 GiB | 6.70 GiB | 0.04 GiB | 7.94 GiB | 7.94 GiB |

Ours / MaxText now: 0.996x with splash, 0.809x dense (before: 1.223x, 1.114x). Before, ours
held float32 logits [8, 2048, 50304] (3.07 GiB) at the loss, and float32 [B, N, T, S] scores
(2 GiB, twice) in each layer's dense backward. Now the logits are bfloat16 with the loss's
float32 reductions reading them (`objectives.log_normalizer`), and dense attention keeps one
bfloat16 [B, N, T, S] tensor, the weights, for its backward (`dense_attention.softmax_values`), so
both paths peak at the loss: the bfloat16 logits' gradient and a transposed copy (1.54 GiB
each) and the scanned layers' bfloat16 inputs (1.5 GiB), as MaxText's splash path does. MaxText's
dense path keeps the logits' gradient alive across the layers' backward loop as well.

Re-measured with the three shapes, the dense rows are unchanged to 0.01 GiB; their XLA FLOPs
per chip: ours 1.134e13 with splash (MaxText 1.217e13), 1.246e13 dense (MaxText 1.331e13).

The MoE and long-context shapes (same versions and slice; `--shape=moe,long --dump_dir=DIR`;
per chip; XLA FLOPs as counted above, a Pallas kernel by its own cost estimate):

| shape | side | attention / MoE | arguments | temporaries | program | total | XLA FLOPs |
| --- | --- | --- | --- | --- | --- | --- | --- |
| moe | ours | splash; ragged all-to-all | 4.99 GiB | 12.91 GiB | 0.07 GiB | 17.97 GiB | 4.449e13 |
| moe | MaxText | flash; megablox | 5.00 GiB | 14.01 GiB | 0.07 GiB | 19.07 GiB | 4.532e13 |
| long | ours | splash/device, all_gather | 1.20 GiB | 2.91 GiB | 0.04 GiB | 4.15 GiB | 5.676e12 |
| long | MaxText | flash, all_gather | 1.20 GiB | 2.88 GiB | 0.04 GiB | 4.12 GiB | 6.089e12 |

Both sides count 7,149,946,880 params for moe and 1,713,735,680 for long. Ours' kernels, as
the step compiled them: splash, "ragged all-to-all over expert=4" (moe) and "splash per device,
all_gather over sequence=4" (long).

moe: ours / MaxText 0.942x (-1.10 GiB). Both peak in an MoE layer's backward with the same
worst-case dropless buffers, 131,072 rows (every token of the 4 devices of an expert group, 2
choices each) by 5632 bfloat16 three times (1.38 GiB each) and by 2048 (0.5 GiB each), beside
the logits' gradient (1.54 GiB) and the layers' inputs (1.5 GiB); at its peak MaxText holds
six [131072, 2048]-sized permutation buffers (its sort_activations gathers, custom calls and a
gmm output, 0.5 GiB each) where ours holds four.

long: ours / MaxText 1.007x (+0.03 GiB: temporaries 3,121,037,312 against 3,090,022,400 bytes,
program +2.1 MiB, arguments -1.1 MiB), target not met by 30 MiB. Both peak at the loss on the
same three buffers: the logits' gradient and its copy, bf16[1, 8192, 50304] (786 MiB each),
and the scanned layers' inputs, bf16[24, 1, 8192, 2048] (768 MiB). Beside them ours holds three
bfloat16 casts of stacked weights (48 MiB each; MaxText two), the zig-zag layout's
concatenation bf16[1, 2, 4096, 2048] (32 MiB) and three 16 MiB pieces of its transpose;
MaxText its gathered embedding table bf16[50304, 2048] (196.5 MiB) and an f32[1, 8192, 2048]
(64 MiB). The bytes live at once are fewer on ours (2.61 GiB of its 2.91 GiB allocation;
MaxText 2.78 of 2.88): the difference is in how XLA packs the allocation, not a buffer MaxText
does without. TPU runs now compile with XLA's best-of-both buffer assignment
(`placement.TPU_OPTIONS`): re-measured on 2026-12-02 (jax 0.12.0.1, libtpu 0.0.52), ours' long
row is 3.85 GiB (temporaries 2.61 GiB, the bytes live at the peak) and moe 17.88 GiB
(temporaries 12.82), both below MaxText's. Reproduce (MaxText's side unchanged, so its log can
be reused with --reuse):

    python benchmarks/aot_vs_maxtext.py --maxtext_python=/work/venv-maxtext/bin/python \
        --ours_python=/work/venv-ours312/bin/python --shape=long --output_dir=/tmp/lc_out \
        --dump_dir=/tmp/lc_dump

Before (9.43 GiB: arguments 4.79, temporaries 4.60; XLA FLOPs 9.224e12) ours split weights and
optimizer state over fsdp (and expert) only, 4 ways where MaxText splits them 16 ways over
context x fsdp, and ran the chunked kernel per device, whose K/V gather's transpose gathered
dK / dV for all 4 rows over fsdp before the reduce-scatter over sequence (bf16[4, 32768, 16,
128] twice). Now the rules table maps `embed` to fsdp x expert x sequence (the sequence axis
shards the state as MaxText's context axis does), splash runs per device under the axis, and
the chunked kernel's gather runs per row (`sequence_parallel._gather_rows`). With the chunked
kernel per device instead of splash (`--side=ours --shape=long --attention=chunked`), ours also
compiles to 4.15 GiB (arguments 1.20, temporaries 2.91; XLA FLOPs 5.684e12), where the state
split alone, dK / dV still gathered for all rows, gave 4.58 GiB.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "AOT_VS_MAXTEXT_RESULT "
ATTENTIONS = {"splash": "flash", "dense": "dot_product"}  # ours -> MaxText's `attention`
VERSION_KEYS = ("jax", "jaxlib", "libtpu")
# --quantization -> MaxText's overrides: its Qwix path (`use_qwix_quantization`; its default is
# AQT), as ours runs Qwix (model.quantization, transformer/nn/quantization.py).
QUANTIZATIONS = {"none": [], "int8": ["quantization=int8", "use_qwix_quantization=true"]}


# --- one side, in its own process ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model compiled on both sides: our experiment plus config overrides, and MaxText's
    overrides for the same model, mesh split and global batch (both as functions of the chip
    count)."""

    experiment: str
    attentions: tuple[str, ...]  # the attention paths compared (the first is the default)
    ours: Callable[[int], dict]  # chips -> {dotted config key: value}
    maxtext: Callable[[int], list[str]]  # chips -> MaxText key=value overrides (model, mesh)
    doc: str
    slices: int = 1  # slices of the topology joined over DCN (chips above: of one slice)
    by_default: bool = True  # compiled without --shape (the 70B shapes are asked for by name)


def _llama_1b7(length: int, per_device_batch: float) -> list[str]:
    """MaxText's llama2 decoder block (RMSNorm, SwiGLU, RoPE, no biases) at experiments/
    llama_1b7.py's size."""
    batch = int(per_device_batch) if per_device_batch == int(per_device_batch) \
        else per_device_batch
    return ["decoder_block=llama2", "base_emb_dim=2048", "base_num_query_heads=16",
            "base_num_kv_heads=16", "head_dim=128", "base_mlp_dim=8192",
            "base_num_decoder_layers=24", "vocab_size=50304", "logits_via_embedding=true",
            f"per_device_batch_size={batch}", f"max_target_length={length}"]


def _mixtral_2b(chips: int) -> list[str]:
    """MaxText's mixtral decoder block at experiments/mixtral_2b.py's shape: dropless
    (capacity_factor -1) sparse matmuls (megablox) with expert parallelism 4."""
    overrides = [o for o in _llama_1b7(2048, 128 / chips) if not o.startswith(
        ("decoder_block=", "base_mlp_dim="))]
    return [*overrides, "decoder_block=mixtral", "base_mlp_dim=5632", "base_moe_mlp_dim=5632",
            "num_experts=8", "num_experts_per_tok=2", "sparse_matmul=true", "megablox=true",
            "capacity_factor=-1", "load_balance_loss_weight=0.01", "ici_expert_parallelism=4"]


LONG = 32_768  # the long-context shape's sequence length
CONTEXT = 4  # and its context (our `sequence`) parallelism

SHAPES = {
    "dense": Shape(
        "llama_1b7", ("splash", "dense"), lambda chips: {},
        lambda chips: _llama_1b7(2048, 128 / chips),
        "Llama-style 1.71B, batch 128 x 2048, fsdp over every chip"),
    "moe": Shape(
        "mixtral_2b", ("splash",), lambda chips: {"mesh.expert": 4, "mesh.fsdp": -1},
        _mixtral_2b,
        "Mixtral-style 8 experts top-2 (2.17B active of 7.15B), dropless, batch 128 x 2048, "
        "expert=4 x fsdp"),
    "long": Shape(
        "llama_1b7", ("splash",),
        lambda chips: {"seq_len": LONG, "model.max_len": LONG, "batch_size": chips // CONTEXT,
                       "mesh.sequence": CONTEXT, "mesh.fsdp": -1},
        lambda chips: [*_llama_1b7(LONG, CONTEXT / chips), f"ici_context_parallelism={CONTEXT}",
                       "context_parallel_strategy=all_gather"],
        f"Llama-style 1.71B at {LONG:,} tokens, batch chips/{CONTEXT}, context (our "
        f"`sequence`) {CONTEXT} x fsdp"),
}


def _llama_70b(per_device_batch: int) -> list[str]:
    """MaxText's llama2 decoder at experiments/llama_70b.py's shape."""
    return ["decoder_block=llama2", "base_emb_dim=8192", "base_num_query_heads=64",
            "base_num_kv_heads=8", "head_dim=128", "base_mlp_dim=28672",
            "base_num_decoder_layers=80", "vocab_size=128256", "logits_via_embedding=false",
            f"per_device_batch_size={per_device_batch}", "max_target_length=2048"]


def _maxtext_pipeline(chips: int, repeats: int) -> list[str]:
    """The 70B, batch 128 x 2048, on PIPELINE_SLICES slices of `chips` with MaxText's pipeline:
    `dcn_pipeline_parallelism` stages across the slices, PIPELINE_MICROBATCHES microbatches,
    `repeats` (its layers per stage then 80 / (stages x repeats), scanned within a stage as
    ours are)."""
    return [*_llama_70b(128 // (chips * PIPELINE_SLICES)),
            f"dcn_pipeline_parallelism={PIPELINE_SLICES}",
            f"num_pipeline_microbatches={PIPELINE_MICROBATCHES}",
            f"num_pipeline_repeats={repeats}",
            f"num_layers_per_pipeline_stage={80 // (PIPELINE_SLICES * repeats)}",
            "scan_layers_per_stage=true"]


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The pipeline's idle fraction: (stages - 1) / (microbatches x repeats + stages - 1).

    >>> round(bubble(2, 8), 4), round(bubble(2, 8, 2), 4)
    (0.1111, 0.0588)
    """
    return (stages - 1) / (microbatches * repeats + stages - 1)


PIPELINE_SLICES = 2  # the pipeline shapes: stages across this many slices (stage = slices)
PIPELINE_MICROBATCHES = 8


def _pipeline(repeats: int) -> Shape:
    return Shape(
        "llama_70b", ("splash",),
        lambda chips: {"mesh.stage": PIPELINE_SLICES, "mesh.fsdp": -1,
                       "pipeline.microbatches": PIPELINE_MICROBATCHES,
                       "pipeline.repeats": repeats},
        lambda chips: _maxtext_pipeline(chips, repeats),
        f"Llama-style 70.55B, batch 128 x 2048, on {PIPELINE_SLICES} slices: stage="
        f"{PIPELINE_SLICES} across them (DCN) x fsdp inside each, {PIPELINE_MICROBATCHES} "
        f"microbatches, repeats {repeats} (bubble "
        f"{bubble(PIPELINE_SLICES, PIPELINE_MICROBATCHES, repeats):.1%})",
        slices=PIPELINE_SLICES, by_default=False)


SHAPES["pipeline"] = _pipeline(1)  # GPipe
SHAPES["circular"] = _pipeline(2)  # the circular schedule
# one layer per stage and visit, MaxText's default layout (num_layers_per_pipeline_stage=1)
SHAPES["circular40"] = _pipeline(40)
SHAPES["fsdp70b"] = Shape(  # the same model on one slice, fsdp only: does not fit
    "llama_70b", ("splash",), lambda chips: {},
    lambda chips: _llama_70b(128 // chips),
    "Llama-style 70.55B, batch 128 x 2048, fsdp over one slice's chips", by_default=False)


def chip_count(topology: str) -> int:
    """Chips of a slice name: v4 and v5p count TensorCores (two a chip)."""
    return int(topology.rsplit("-", 1)[1]) // (2 if topology.startswith(("v4", "v5p")) else 1)


def maxtext_overrides(topology: str, attention: str, shape: str = "dense",
                      quantization: str = "none") -> list[str]:
    """MaxText `key=value` overrides for `shape` on `topology` with our `attention` path."""
    return [f"compile_topology={topology}",
            f"compile_topology_num_slices={SHAPES[shape].slices}",
            *SHAPES[shape].maxtext(chip_count(topology)), *QUANTIZATIONS[quantization],
            f"attention={ATTENTIONS[attention]}", "remat_policy=full", "scan_layers=true",
            "dtype=bfloat16", "weight_dtype=float32", "ici_fsdp_parallelism=-1",
            "dataset_type=synthetic", "enable_checkpointing=false", "run_name=aot_vs_maxtext",
            f"base_output_directory={tempfile.gettempdir()}/aot_vs_maxtext"]


def ours_config(topology: str, attention: str, shape: str = "dense",
                quantization: str = "none"):
    """Our config for `shape`: the experiment with the shape's overrides and `attention`."""
    sys.path.insert(0, ROOT)
    from transformer import configs

    config = configs.experiment(SHAPES[shape].experiment)
    for key, value in SHAPES[shape].ours(chip_count(topology)).items():
        *groups, name = key.split(".")
        target = config
        for group in groups:
            target = target[group]
        target[name] = value
    config.model.attention_impl = attention
    config.model.quantization = "" if quantization == "none" else quantization
    return config


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for key, dists in (("jax", ["jax"]), ("jaxlib", ["jaxlib"]),
                       ("libtpu", ["libtpu", "libtpu-nightly"]), ("flax", ["flax"]),
                       ("maxtext", ["maxtext"])):
        for dist in dists:
            try:
                versions[key] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            versions[key] = ""
    versions["python"] = sys.version.split()[0]
    return versions


def _memory(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    return {"argument_bytes": stats.argument_size_in_bytes,
            "output_bytes": stats.output_size_in_bytes,
            "alias_bytes": stats.alias_size_in_bytes,
            "temp_bytes": stats.temp_size_in_bytes,
            "code_bytes": stats.generated_code_size_in_bytes, "flops": _flops(compiled)}


def _flops(compiled) -> float:
    """XLA's cost analysis of the step (a scanned stack's loop body counted once, on both
    sides alike)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", 0.0))


def compile_ours(topology: str, attention: str, shape: str, quantization: str) -> dict:
    config = ours_config(topology, attention, shape, quantization)
    import transformer
    from launch import accelerators, aot

    print(f"transformer from {transformer.__file__}", flush=True)

    accelerator = accelerators.parse(topology)
    # aot._compile, not compile_train_step: the same compile without its FLOP extrapolation.
    devices = aot.tpu_topology(accelerator, SHAPES[shape].slices)
    compiled, report = aot._compile(config, devices, accelerator)
    result = {"num_params": report.num_params, "error": report.error,
              "kernels": [*report.attention, *report.moe_dispatch]}
    if compiled is not None:
        result.update(_memory(compiled))
    return result


def compile_maxtext(topology: str, attention: str, shape: str, quantization: str) -> dict:
    import jax
    import maxtext.utils.globals as maxtext_globals
    from flax import nnx
    from maxtext.trainers.pre_train import train_compile

    captured = {}
    jit_and_compile = train_compile.jit_and_compile

    def capture(func, args, *rest, **kwargs):
        captured["state"] = args[0]
        captured["compiled"] = jit_and_compile(func, args, *rest, **kwargs)
        return captured["compiled"]

    train_compile.jit_and_compile = capture
    argv = ["train_compile", os.path.join(maxtext_globals.MAXTEXT_CONFIGS_DIR, "base.yml"),
            *maxtext_overrides(topology, attention, shape, quantization)]
    try:
        train_compile.main(argv)
    except Exception as error:  # noqa: BLE001 - report XLA's refusal (e.g. out of HBM) as ours
        if "compiled" in captured or "state" not in captured:
            raise
        result = {"error": str(error).strip().splitlines()[0][:400]}
    else:
        result = {"error": "", **_memory(captured["compiled"])}
    _, params, _ = nnx.split(captured["state"]["model"], nnx.Param, ...)
    result["num_params"] = int(sum(leaf.size for leaf in jax.tree.leaves(params)))
    return result


def run_side(side: str, topology: str, attention: str, shape: str,
             quantization: str = "none") -> None:
    # Compiling needs no TPU: don't take libtpu's single-process lock, which another compile
    # on this host may hold (MaxText's side would fail on it).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    start = time.time()
    result = (compile_ours if side == "ours" else compile_maxtext)(topology, attention, shape,
                                                                  quantization)
    result.update(side=side, shape=shape, attention=attention, topology=topology,
                  quantization=quantization,
                  seconds=round(time.time() - start, 1), versions=_versions())
    print(MARKER + json.dumps(result, sort_keys=True), flush=True)


# --- the comparison (pure: tested with canned output) ----------------------------------------


def parse_result(output: str) -> dict:
    """The result a side's process printed (its last MARKER line) from all it printed."""
    lines = [line for line in output.splitlines() if line.startswith(MARKER)]
    if not lines:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise ValueError(f"no {MARKER.strip()} line in the output; its end:\n{tail}")
    return json.loads(lines[-1][len(MARKER):])


def total_bytes(result: dict) -> int:
    """Per-chip peak as launch.aot counts it: arguments, outputs not aliased to them,
    temporaries and the program."""
    return (result["argument_bytes"] + result["output_bytes"] - result["alias_bytes"]
            + result["temp_bytes"] + result["code_bytes"])


def version_mismatch(results: list[dict]) -> str:
    """'' if every result ran the same jax, jaxlib and libtpu; otherwise what differs."""
    seen = {key: sorted({r["versions"].get(key, "") for r in results}) for key in VERSION_KEYS}
    return "; ".join(f"{key}: {' vs '.join(v or '(none)' for v in values)}"
                     for key, values in seen.items() if len(values) > 1)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _key(result: dict) -> tuple[str, str]:
    """(shape, attention) of a result; the shape reads e.g. "dense int8" when quantized."""
    quantization = result.get("quantization", "none")
    shape = result.get("shape", "dense")
    return (shape if quantization == "none" else f"{shape} {quantization}"), result["attention"]


def format_table(results: list[dict]) -> str:
    """Markdown table of every result (ours and MaxText per shape and attention path), then
    ours/MaxText per shape and path."""
    label = {"ours": "ours", "maxtext": "MaxText"}
    lines = ["| shape | side | attention | params | arguments | outputs not aliased | "
             "temporaries | program | total per chip | XLA FLOPs per chip |", "|" + " --- |" * 10]
    for r in results:
        shape, attention = _key(r)
        if r["side"] == "maxtext":
            attention = f"{ATTENTIONS[attention]} ({attention})"
        elif r.get("kernels"):
            attention = "; ".join(r["kernels"])
        if r.get("error"):
            lines.append(f"| {shape} | {label[r['side']]} | {attention} | {r['num_params']:,} | "
                         f"does not compile: {r['error']} ||||||")
            continue
        flops = f"{r['flops']:.3e}" if r.get("flops") else "-"
        lines.append(
            f"| {shape} | {label[r['side']]} | {attention} | {r['num_params']:,} | "
            f"{_gib(r['argument_bytes'])} | {_gib(r['output_bytes'] - r['alias_bytes'])} | "
            f"{_gib(r['temp_bytes'])} | {_gib(r['code_bytes'])} | {_gib(total_bytes(r))} | "
            f"{flops} |")
    lines.append("")
    for shape, attention in dict.fromkeys(_key(r) for r in results):
        pair = {r["side"]: r for r in results if _key(r) == (shape, attention)}
        if set(pair) != {"ours", "maxtext"} or any(r.get("error") for r in pair.values()):
            continue
        ours, theirs = pair["ours"], pair["maxtext"]
        ratio = total_bytes(ours) / total_bytes(theirs)
        diff = total_bytes(ours) - total_bytes(theirs)
        flops = (f", XLA FLOPs {ours['flops'] / theirs['flops']:.3f}x"
                 if ours.get("flops") and theirs.get("flops") else "")
        lines.append(f"{shape} / {attention}: ours / MaxText total {ratio:.3f}x "
                     f"({'+' if diff >= 0 else '-'}{_gib(abs(diff))}), temporaries "
                     f"{ours['temp_bytes'] / theirs['temp_bytes']:.3f}x{flops}; target ours <= "
                     f"MaxText: {'met' if ratio <= 1 else 'not met'}")
    return "\n".join(lines)


# --- the buffers live at the temporaries' peak (from an XLA dump) ----------------------------

_ALLOCATION = re.compile(r"^allocation \d+: size (\d+)(, color \d+)?.*?(preallocated-temp)?:$")
_VALUE = re.compile(r"^ value: <\d+ (\S+?)(\{[^}]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")
_RANGE = re.compile(r"^\s+(\S+?)(\{[^}]*\})?:(\d+)-(\d+)$")
_SEQUENCE = re.compile(r"^\s+(\d+):(\S+)$")
_OP_NAME = re.compile(r"^\s*(?:ROOT )?%?(\S+) = .*?metadata=\{[^}]*?op_name=\"([^\"]*)\"")
_OPERAND = re.compile(r"^\s*(?:ROOT )?%?(\S+) = \S+ ([\w-]+)\(%?([^,)\s]+)")


@dataclasses.dataclass
class Buffer:
    name: str  # HLO value: instruction{tuple index}
    size: int
    offset: int
    shape: str
    op_name: str = ""


def temp_buffers(buffer_assignment: str) -> tuple[int, list[Buffer]]:
    """(size, values) of the largest preallocated-temp allocation in the default memory space
    (no color) of an XLA `*buffer-assignment.txt`: the temporaries memory_analysis reports."""
    best, current = (0, []), None
    for line in buffer_assignment.splitlines():
        allocation = _ALLOCATION.match(line)
        if allocation:
            current = None
            if allocation.group(3) and not allocation.group(2):
                current = (int(allocation.group(1)), [])
                if current[0] > best[0]:
                    best = current
            continue
        value = _VALUE.match(line) if current is not None else None
        if value:
            current[1].append(Buffer(value.group(1) + (value.group(2) or "{}"),
                                     int(value.group(3)), int(value.group(4)), value.group(5)))
    return best


def live_ranges(live_range: str) -> tuple[dict[str, tuple[int, int]], dict[int, str]]:
    """From an XLA `*live-range.txt`: each value's [start, end] in the flattened schedule, and
    the schedule (time -> instruction)."""
    ranges, sequence, section = {}, {}, ""
    for line in live_range.splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and " " not in stripped:
            section = stripped[:-1]
            continue
        if section == "InstructionSequence" and (match := _SEQUENCE.match(line)):
            sequence[int(match.group(1))] = match.group(2)
        elif section == "BufferLiveRange" and (match := _RANGE.match(line)):
            ranges[match.group(1) + (match.group(2) or "{}")] = (int(match.group(3)),
                                                                 int(match.group(4)))
    return ranges, sequence


def op_names(hlo: str) -> dict[str, str]:
    """Instruction -> the JAX op that made it (its metadata op_name), from HLO text; for one
    XLA added without metadata (a layout copy), its opcode and first operand."""
    names = {}
    for line in hlo.splitlines():
        if match := _OP_NAME.match(line):
            names[match.group(1)] = match.group(2)
        elif match := _OPERAND.match(line):
            names[match.group(1)] = f"{match.group(2)} of {match.group(3)}"
    return names


def _union(intervals) -> int:
    total, end = 0, -1
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


@dataclasses.dataclass
class Peak:
    time: int
    instruction: str
    live_bytes: int  # bytes of the temp allocation in use at `time`
    allocation_bytes: int
    buffers: list[Buffer]  # live at `time`, largest first, one per (offset, size)


def peak_buffers(buffer_assignment: str, live_range: str, hlo: str = "") -> Peak:
    """The point of the schedule where the most temp bytes are live, and the buffers live then."""
    size, values = temp_buffers(buffer_assignment)
    ranges, sequence = live_ranges(live_range)
    values = [v for v in values if v.name in ranges]
    starts, ends = {}, {}
    for v in values:
        start, end = ranges[v.name]
        starts.setdefault(start, []).append(v)
        ends.setdefault(end + 1, []).append(v)
    active: dict[str, Buffer] = {}
    best = (-1, 0)
    for t in sorted(set(starts) | set(ends)):
        for v in ends.get(t, ()):
            active.pop(v.name, None)
        for v in starts.get(t, ()):
            active[v.name] = v
        used = _union((v.offset, v.offset + v.size) for v in active.values())
        if used > best[0]:
            best = (used, t)
    used, t = best
    names = op_names(hlo) if hlo else {}
    live, regions = [], set()
    for v in sorted((v for v in values if ranges[v.name][0] <= t <= ranges[v.name][1]),
                    key=lambda v: (-v.size, v.name)):
        if (v.offset, v.size) in regions:
            continue
        regions.add((v.offset, v.size))
        v.op_name = names.get(v.name.split("{")[0], "")
        live.append(v)
    instruction = sequence.get(t, "")
    return Peak(t, instruction, max(used, 0), size, live)


def format_peak(peak: Peak, top: int, hlo: str = "") -> str:
    names = op_names(hlo) if hlo else {}
    at = names.get(peak.instruction, "")
    lines = [f"peak at schedule step {peak.time} ({peak.instruction}"
             f"{': ' + at if at else ''}): {_gib(peak.live_bytes)} live of the "
             f"{_gib(peak.allocation_bytes)} temp allocation"]
    for v in peak.buffers[:top]:
        shape = v.shape.split("{")[0] if not v.shape.startswith("(") else v.shape[:60]
        lines.append(f"  {v.size / 2**20:9.1f} MiB  {shape:<28} {v.name:<36} {v.op_name}")
    rest = sum(v.size for v in peak.buffers[top:])
    if rest:
        lines.append(f"  {rest / 2**20:9.1f} MiB  in the {len(peak.buffers) - top} smaller ones")
    return "\n".join(lines)


def dump_files(directory: str) -> dict[str, str]:
    """The train step's buffer assignment, live ranges and optimized HLO in an XLA dump."""
    found = {}
    for name in sorted(os.listdir(directory)):
        if "jit_train_step" not in name:
            continue
        for key, suffix in (("buffer_assignment", "after_optimizations-buffer-assignment.txt"),
                            ("live_range", "after_optimizations-live-range.txt"),
                            ("hlo", "after_optimizations.txt")):
            if name.endswith(suffix):
                found[key] = os.path.join(directory, name)
    return found


# --- the driver ------------------------------------------------------------------------------


def _run(python: str, side: str, shape: str, attention: str, log_dir: str,
         dump_dir: str, quantization: str = "none") -> dict:
    env = dict(os.environ)
    topology = flags.FLAGS.topology
    name = run_name(side, shape, attention, quantization, topology)
    if dump_dir:
        target = os.path.join(dump_dir, name)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={target} "
                            "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*")
    command = [python, os.path.abspath(__file__), f"--side={side}",
               f"--topology={topology}", f"--shape={shape}",
               f"--attention={attention}", f"--quantization={quantization}"]
    log = os.path.join(log_dir, f"{name}.log")
    # A log from before the names held the topology is reused only if its result's matches.
    legacy = os.path.join(log_dir, f"{run_name(side, shape, attention, quantization)}.log")
    for candidate in dict.fromkeys((log, legacy)) if flags.FLAGS.reuse else ():
        if not os.path.exists(candidate):
            continue
        with open(candidate) as f:
            output = f.read()
        if MARKER not in output:
            continue
        result = parse_result(output)
        if reusable(result, topology):
            print(f"{side} / {shape} / {attention}: the result in {candidate}", flush=True)
            return result
        print(f"{side} / {shape} / {attention}: not reusing {candidate} (compiled for "
              f"{result.get('topology', 'an unknown topology')}, not {topology})", flush=True)
    print(f"compiling {side} / {shape} / {attention} ({log}) ...", flush=True)
    with open(log, "w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                       check=False)
    with open(log) as f:
        result = parse_result(f.read())
    print(f"  {result['seconds']:.0f} s", flush=True)
    return result


def run_name(side: str, shape: str, attention: str, quantization: str = "none",
             topology: str = "") -> str:
    """A compile's log and dump name: `side-topology-shape-attention` (the topology followed by
    `xN` on N slices), then `-int8` when quantized. Without a topology, the name logs had
    before it was part of it (`side-shape-attention`)."""
    where = ""
    if topology:
        slices = SHAPES[shape].slices if shape in SHAPES else 1
        where = f"{topology}{f'x{slices}' if slices > 1 else ''}-"
    return (f"{side}-{where}{shape}-{attention}"
            + ("" if quantization == "none" else f"-{quantization}"))


def reusable(result: dict, topology: str) -> bool:
    """Whether a result read from a log was compiled for `topology` (--reuse takes only those)."""
    return result.get("topology") == topology


def plan(shapes: list[str], attentions: list[str]) -> list[tuple[str, str]]:
    """The (shape, attention) pairs to compile: each shape's paths, only those in
    `attentions` if given (a shape with none of them left out); a one-line error for a name
    that is not a shape or path."""
    unknown = [s for s in shapes if s not in SHAPES] + [a for a in attentions
                                                        if a not in ATTENTIONS]
    if unknown:
        raise app.UsageError(f"{', '.join(unknown)}: expected shapes from {', '.join(SHAPES)}"
                             f" and attentions from {', '.join(ATTENTIONS)}")
    return [(shape, attention) for shape in shapes for attention in SHAPES[shape].attentions
            if not attentions or attention in attentions]


def main(argv) -> None:
    del argv
    FLAGS = flags.FLAGS
    if FLAGS.side:
        run_side(FLAGS.side, FLAGS.topology, FLAGS.attention[0], FLAGS.shape[0],
                 FLAGS.quantization[0])
        return
    if not FLAGS.maxtext_python:
        raise app.UsageError("--maxtext_python is required (see the module docstring)")
    runs = plan(FLAGS.shape, FLAGS.attention)
    unknown = [q for q in FLAGS.quantization if q not in QUANTIZATIONS]
    if unknown:
        raise app.UsageError(f"--quantization={','.join(unknown)}: expected from "
                             f"{', '.join(QUANTIZATIONS)}")
    log_dir = FLAGS.output_dir or tempfile.mkdtemp(prefix="aot_vs_maxtext_")
    os.makedirs(log_dir, exist_ok=True)
    results = []
    for shape, attention in runs:
        for quantization in FLAGS.quantization:
            for side, python in (("ours", FLAGS.ours_python),
                                 ("maxtext", FLAGS.maxtext_python)):
                results.append(_run(python, side, shape, attention, log_dir, FLAGS.dump_dir,
                                    quantization))
    for r in results:
        v = r["versions"]
        print(f"{r['side']:>8} / {_key(r)[0]} / {r['attention']}: jax {v['jax']}, jaxlib "
              f"{v['jaxlib']}, libtpu {v['libtpu']}, flax {v['flax']}, python {v['python']}"
              + (f", maxtext {v['maxtext']}" if r["side"] == "maxtext" else ""))
    mismatch = version_mismatch(results)
    if mismatch:
        sys.exit(f"not comparable: the sides ran different versions ({mismatch})")
    print(f"\nper chip on {FLAGS.topology}:\n")
    for shape in dict.fromkeys(shape for shape, _ in runs):
        print(f"  {shape}: {SHAPES[shape].doc}")
    print("\n" + format_table(results))
    if FLAGS.dump_dir:
        for r in results:
            name = run_name(r["side"], r["shape"], r["attention"],
                            r.get("quantization", "none"), r.get("topology", FLAGS.topology))
            directory = os.path.join(FLAGS.dump_dir, name)
            files = dump_files(directory) if os.path.isdir(directory) else {}
            if len(files) < 3:  # (a result reused from a log may have no dump)
                print(f"\n{name}: no buffer assignment in the dump")
                continue
            text = {key: open(path).read() for key, path in files.items()}
            peak = peak_buffers(text["buffer_assignment"], text["live_range"], text["hlo"])
            print(f"\n{name}: " + format_peak(peak, FLAGS.top_buffers, text["hlo"]))


def _define_flags() -> None:
    flags.DEFINE_string("maxtext_python", None,
                        "Python of a venv with MaxText (see the docstring).")
    flags.DEFINE_string("ours_python", sys.executable,
                        "Python with this project and MaxText's jax, jaxlib and libtpu.")
    flags.DEFINE_string("topology", "v5p-32", "TPU slice to compile for.")
    flags.DEFINE_list("shape", [s for s in SHAPES if SHAPES[s].by_default],
                      f"Shapes to compare: {', '.join(SHAPES)}.")
    flags.DEFINE_list("attention", [], f"Attention paths ({', '.join(ATTENTIONS)}); default: "
                      "each shape's (dense: both; moe and long: splash).")
    flags.DEFINE_list("quantization", ["none"], "Compute settings to compare: none (bfloat16) "
                      "and/or int8 (ours model.quantization=int8; MaxText quantization=int8 "
                      "through Qwix).")
    flags.DEFINE_string("dump_dir", "", "Dump XLA's buffer assignment here and list the top "
                        "buffers at the temporaries' peak.")
    flags.DEFINE_integer("top_buffers", 12, "Buffers listed per compile with --dump_dir.")
    flags.DEFINE_string("output_dir", "", "Keep each compile's log here (default: a temp dir).")
    flags.DEFINE_bool("reuse", False, "Take a compile's result from its log in --output_dir "
                      "where one for the same --topology is there (compile the rest).")
    flags.DEFINE_enum("side", None, ["ours", "maxtext"], "Internal: compile one side in this "
                      "process and print its result line.")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
