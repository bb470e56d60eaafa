"""The base experiment config: every key an experiment file may set, with its default, and
`validate_config`, which checks a config before anything runs.

Experiment files (`experiments/*.py`) start from `base_config()` and override what they change.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections

from transformer.data import inputs, pipeline, sources, tokenizers
from transformer.models import FAMILIES, build_model, default_model_config, family_of
from transformer.nn import lora, sequence_parallel
from transformer.parallel import pipeline_parallel, sharding
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import optim, placement, task_eval, wandb_logging
from transformer.utils import fileio


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.experiment = "base"
    config.seed = 0
    config.steps = 1000
    config.batch_size = 16  # global, across all processes
    config.seq_len = 128
    config.log_every = 50
    config.eval_every = 250
    config.eval_steps = 20
    # Extra validation lengths at the end of training (length extrapolation), e.g. (256, 512).
    config.eval_seq_lens = ()
    # lm-eval tasks (names or local YAML files) scored during training (training.task_eval)
    config.eval_tasks = ()
    config.eval_tasks_every = 0  # steps between scorings (0: after the last step only)
    config.eval_tasks_limit = 0  # documents per task (0: all)
    config.checkpoint_every = 500
    config.keep_checkpoints = 3
    config.fresh_start = False  # True: set the workdir's checkpoints aside and start at step 0
    # True: resume the checkpoint's params and optimizer on a different data stream (data,
    # batch_size, seq_len or seed changed), from that stream's start; False refuses.
    config.new_data = False
    config.nonfinite = "stop"  # NaN/Inf loss or grads: stop (keep the last good checkpoint) | skip
    config.max_nonfinite_skips = 10  # with "skip": stop after this many bad steps in a row
    config.max_grad_norm = 0.0  # > 0: a step whose gradient norm exceeds it is bad like NaN
    config.z_loss = 0.0
    config.label_smoothing = 0.0
    # MFU's peak per device; 0: the published peak of the accelerator (metrics.PEAK_FLOPS) or,
    # on CPU, this host's measured float32 matmul peak
    config.peak_flops_per_device = 0.0
    # XLA options for the jitted steps, on top of placement.compiler_options' CPU defaults,
    # e.g. {'xla_cpu_multi_thread_eigen': False}.
    config.compiler_options = ml_collections.ConfigDict()
    # Fine-tuning: start params from "WORKDIR", "WORKDIR@STEP" or "hf:DIR" (training.finetune).
    config.init_from = ""

    config.model = default_model_config()
    config.model.vocab_size = 0  # 0: the tokenizer's vocabulary size

    config.data = data_config()
    config.optimizer = optimizer_config()

    # Devices per mesh axis (sharding.MESH_AXIS_TABLE); -1: all remaining devices.
    config.mesh = ml_collections.ConfigDict(
        {axis.name: axis.default for axis in sharding.MESH_AXIS_TABLE})

    config.pipeline = pipeline_config()
    config.profile, config.wandb = profile_config(), wandb_config()
    return config


def pipeline_config() -> ml_collections.ConfigDict:
    """base_config's pipeline group, used with mesh.stage > 1 (parallel.pipeline_parallel):
    the microbatches each (accumulation) step's rows split into, and repeats > 1 for the
    circular schedule (each stage holds that many blocks of layers spread through the stack;
    a smaller bubble)."""
    return ml_collections.ConfigDict({"microbatches": 1, "repeats": 1})


def data_config() -> ml_collections.ConfigDict:
    """config.data: what the run reads and how (transformer.data)."""
    data = ml_collections.ConfigDict()
    data.path = ""  # "": the embedded corpus; or a text file, directory or glob
    # How text is cut: paragraph | file (documents, hash-split) | stream (each file one stream,
    # windows cross paragraphs; validation is the last validation_fraction of the text).
    data.unit = "paragraph"
    # Explicit validation text (file, directory or glob): no split is applied to it or data.path.
    data.validation_path = ""
    # Held-out test text (file, directory or glob), evaluated whole at the end of training and by
    # `transformer.evaluate --split=test`; never trained or validated on.
    data.test_path = ""
    data.validation_fraction = 0.05
    # A weighted mixture instead of data.path (which stays ""): one "key=value,..." string per
    # source, path and weight required, unit / validation_path / name optional, e.g.
    # ("path=web.txt,weight=0.7", "path=code/,weight=0.3,unit=file"). The tokenizer is built on
    # the union of the sources' train splits; each validation split is evaluated on its own.
    data.sources = ()
    # byte | char | sentencepiece_bpe | sentencepiece_unigram | hf (a Hugging Face tokenizer.json)
    data.tokenizer = "byte"
    # data.tokenizer="hf": a tokenizer.json or a directory holding one (e.g. a save_pretrained
    # directory); "" with init_from="hf:DIR" reads DIR's.
    data.tokenizer_path = ""
    data.vocab_size = 0  # SentencePiece vocabulary size (required for SentencePiece)
    data.num_sentinels = 100
    data.objective = ""  # "": the model family's (next_token, prefix_lm, mlm, ...)
    data.mlm_rate = 0.15
    data.noise_density = 0.15
    data.mean_span_length = 3.0
    data.prefetch = 2
    # Labeled tasks (objective "classification" | "text2text"): transformer.data.tasks.
    data.task = ""  # speakers (play text at data.path) | modules (the embedded corpus)
    data.num_classes = 0  # the task's most frequent labels kept as classes
    data.sft_truncate = False  # sft: cut conversations over seq_len + 1 tokens (or fail)
    return data


def profile_config() -> ml_collections.ConfigDict:
    """base_config's profile group: a jax.profiler trace of steps start_step .. start_step +
    num_steps - 1 (step 1 compiles) into WORKDIR/profile/, on process 0 or on every host
    (transformer.training.profiling)."""
    return ml_collections.ConfigDict(
        {"start_step": 5, "num_steps": 0, "all_hosts": False})  # num_steps 0: no trace


def wandb_config() -> ml_collections.ConfigDict:
    """base_config's wandb group: Weights & Biases (transformer.training.wandb_logging, the `wandb`
    extra), on when project is set."""
    return ml_collections.ConfigDict(
        {"project": "", "entity": "", "name": "",  # name "": the experiment's
         "mode": "online",  # online | offline (files in WORKDIR/wandb/) | disabled
         "variant": ""})  # set by transformer.sweep: the variant, a W&B config field


def optimizer_config() -> ml_collections.ConfigDict:
    """base_config's optimizer group (transformer.training.optim reads it)."""
    optimizer = ml_collections.ConfigDict()
    # adamw | adafactor | lion | muon | sgd | schedule_free_adamw (optim.update_rule); a resume
    # keeps the checkpoint's
    optimizer.name = "adamw"
    optimizer.learning_rate = 1e-3
    optimizer.warmup_steps = 100
    # cosine | linear | constant | wsd | inverse_sqrt (optim.learning_rate_schedule);
    # schedule_free_adamw takes constant
    optimizer.decay = "cosine"
    optimizer.min_learning_rate_ratio = 0.1
    optimizer.decay_fraction = 0.2  # wsd: the last fraction of the steps decays
    optimizer.decay_shape = "linear"  # wsd: linear | cosine | 1-sqrt
    optimizer.b1 = 0.9
    optimizer.b2 = 0.99
    optimizer.weight_decay = 0.1
    optimizer.momentum = 0.9  # sgd (0: none)
    optimizer.nesterov = False  # sgd
    optimizer.muon_learning_rate = 0.02  # muon's hidden matrices (the rest: learning_rate)
    optimizer.muon_momentum = 0.95  # muon (Nesterov)
    # adafactor (T5: learning_rate 0.01, decay inverse_sqrt, warmup_steps 10000, weight_decay 0)
    optimizer.adafactor_decay_rate = 0.8  # second moments decay as 1 - step^-rate
    optimizer.adafactor_clipping_threshold = 1.0  # update RMS clipping (0: off)
    optimizer.adafactor_parameter_scale = True  # learning rate relative to param RMS
    optimizer.adafactor_min_dim_size_to_factor = 128
    optimizer.adafactor_momentum = 0.0  # 0: none
    optimizer.grad_clip_norm = 1.0
    optimizer.grad_accumulation_steps = 1
    optimizer.freeze = ""  # regex of param names ("encoder/layers/...") that stay fixed
    optimizer.head = ""  # regex of param names trained at head_learning_rate
    optimizer.head_learning_rate = 0.0  # 0: optimizer.learning_rate
    return optimizer


def small_char_lm() -> ml_collections.ConfigDict:
    """The small character-level GPT the ablations in experiments/ablations/ vary: 4 layers,
    128 wide, 4 heads, context 64, on the embedded corpus; about a minute on a 2-core CPU."""
    config = base_config()
    config.experiment = "small_char_lm"
    config.update(steps=600, batch_size=16, seq_len=64, log_every=25, eval_every=100,
                  eval_steps=40, checkpoint_every=300, keep_checkpoints=1)
    config.model.update(family="gpt", num_layers=4, d_model=128, num_heads=4, d_ff=512,
                        position="rope", max_len=64, norm="layernorm", norm_placement="pre",
                        activation="gelu", tie_embeddings=True, use_bias=False, init_std=0.02,
                        dropout_rate=0.0)
    config.data.tokenizer = "char"
    config.data.num_sentinels = 0
    config.optimizer.update(learning_rate=2e-3, warmup_steps=50)
    return config


EXPERIMENTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "experiments")


def experiment(name: str, *args) -> ml_collections.ConfigDict:
    """`get_config(*args)` of experiments/<name>.py: fine-tuning experiments start from their
    pretraining experiment, so the model they load into has the same architecture."""
    path = os.path.join(EXPERIMENTS_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"experiment {name!r}: expected {path}")
    spec = importlib.util.spec_from_file_location(f"_experiment_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*args)


def finetune_task(config: ml_collections.ConfigDict, task: str) -> None:
    """Points a fine-tuning config at a labeled task (transformer.data.tasks): "modules" (the
    embedded corpus: which of 8 standard-library modules a paragraph comes from) or "speakers"
    (which of the 8 most frequent speakers says a speech; play text given by data.path).
    Splits of 15% test and 15% validation: pretrain with the same data.validation_fraction so
    that pretraining never reads a test paragraph."""
    if task not in ("modules", "speakers"):
        raise ValueError(f"task={task!r}: expected 'modules' or 'speakers'")
    config.data.update(task=task, num_classes=8, validation_fraction=0.15)
    config.update(log_every=25, eval_every=100, eval_steps=100, checkpoint_every=500,
                  keep_checkpoints=1)


# --- validation: one table of what every key means ----------------------------------------------

# A check: (test of one value, what the value is expected to be). `test` never raises.
Check = tuple[Callable[[Any], bool], str]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """Ints count as numbers (ml_collections may give an int for a float key); bools do not."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and \
        math.isfinite(value)


def _bounded(kind: str, is_kind, ge=None, gt=None, le=None, lt=None, note: str = "") -> Check:
    """`kind` ("an int" | "a number") within the given bounds: "a number > 0", "an int >= 1",
    or with two bounds an interval, "a number in [0, 1)"."""
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else ""
    high = f"{le}]" if le is not None else f"{lt})" if lt is not None else ""
    if low and high:
        text = f"{kind} in {low}, {high}"
    else:
        text = kind + "".join(f" {op} {bound}" for op, bound in
                              ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if bound is not None)

    def test(v):
        return is_kind(v) and (ge is None or v >= ge) and (gt is None or v > gt) and \
            (le is None or v <= le) and (lt is None or v < lt)

    return test, text + (f" ({note})" if note else "")


def _int(note: str = "", **bounds) -> Check:
    return _bounded("an int", _is_int, note=note, **bounds)


def _number(note: str = "", **bounds) -> Check:
    return _bounded("a number", _is_number, note=note, **bounds)


def _one_of(choices: Sequence[str]) -> Check:
    return (lambda v: isinstance(v, str) and v in choices), f"one of {tuple(choices)}"


def _regex(value) -> bool:
    try:
        re.compile(value)
    except (re.error, TypeError):
        return False
    return True


# The float dtypes the models compute in and keep params in (float64 needs jax_enable_x64).
DTYPES = ("float32", "bfloat16", "float16")
_STR: Check = (lambda v: isinstance(v, str), "a str")
_BOOL: Check = (lambda v: isinstance(v, bool), "a bool")
_REGEX: Check = (lambda v: isinstance(v, str) and _regex(v),
                 "a regular expression of param names (\"\": none)")

# What every key of base_config() must be, by its dotted path; a new key gets its line here.
# Not listed: mesh.* (sharding.mesh_shape checks it), compiler_options (placement asks XLA) and
# the model keys that building the model checks. Rules joining keys follow in validate_config.
CHECKS: dict[str, Check] = {
    "experiment": _STR,  # names the default workdir, runs/<experiment>
    "seed": (lambda v: _is_int(v) and 0 <= v < 2**31, "an int in [0, 2**31)"),
    "steps": _int(ge=1),
    "batch_size": _int(ge=1),
    "seq_len": _int(ge=2),
    "log_every": _int(ge=1),
    "eval_every": _int(ge=1),
    "eval_steps": _int(ge=1, note="validation batches at each evaluation"),
    "checkpoint_every": _int(ge=1),
    "keep_checkpoints": _int(ge=1, note="the newest checkpoint is always kept"),
    "fresh_start": _BOOL,
    "new_data": _BOOL,
    "nonfinite": _one_of(("stop", "skip")),
    "max_nonfinite_skips": _int(ge=0),
    "max_grad_norm": _number(ge=0, note="0: off"),
    "z_loss": _number(ge=0, note="0: off"),
    "label_smoothing": _number(ge=0, lt=1),
    "peak_flops_per_device": _number(ge=0, note="0: published or measured"),
    "eval_seq_lens": (lambda v: isinstance(v, tuple | list) and
                      all(_is_int(n) and n >= 2 for n in v), "a tuple of ints >= 2"),
    # Their family, process count, files and names: task_eval.check, in validate_config.
    "eval_tasks": (lambda v: isinstance(v, tuple | list) and all(isinstance(x, str) for x in v),
                   "a tuple of lm-eval task names or task YAML paths"),
    "eval_tasks_every": _int(ge=0, note="0: after the last step only"),
    "eval_tasks_limit": _int(ge=0, note="0: every document"),
    "init_from": _STR,  # its form and target: fileio.parse_init_from, below
    "data.path": _STR,
    "data.unit": _one_of(sources.UNITS),
    "data.validation_path": _STR,
    "data.test_path": _STR,  # exists, and goes with a text objective: _validate_test_path
    "data.validation_fraction": _number(ge=0, lt=1),
    # Each entry's fields, and data.path alongside: _validate_sources.
    "data.sources": (lambda v: isinstance(v, tuple | list) and all(isinstance(x, str) for x in v),
                     "a tuple of 'path=...,weight=...' strings (\"()\": data.path alone)"),
    "data.tokenizer": _one_of(tokenizers.KINDS),
    "data.tokenizer_path": _STR,  # with which kind, and whether it exists: _validate_tokenizer
    "data.vocab_size": _int(ge=0, note="0 for byte and char; required for SentencePiece"),
    "data.num_sentinels": _int(ge=0),
    "data.objective": _STR,  # its choices: pipeline.objective_for, below
    "data.mlm_rate": _number(gt=0, lt=1),
    "data.noise_density": _number(gt=0, lt=1),
    "data.mean_span_length": _number(ge=1),
    "data.prefetch": _int(ge=0, note="0: no prefetching"),
    "data.task": _STR,  # its choices: _validate_finetuning
    "data.num_classes": _int(ge=0, note="0: the task's"),
    "data.sft_truncate": _BOOL,
    "optimizer.name": _one_of(optim.NAMES),
    "optimizer.learning_rate": _number(gt=0),
    "optimizer.warmup_steps": _int(ge=0),
    "optimizer.decay": _one_of(optim.DECAYS),
    "optimizer.min_learning_rate_ratio": _number(ge=0, le=1),
    "optimizer.decay_fraction": _number(ge=0, le=1, note="wsd: 0 never decays"),
    "optimizer.decay_shape": _one_of(optim.DECAY_SHAPES),
    "optimizer.b1": _number(ge=0, lt=1),
    "optimizer.b2": _number(ge=0, lt=1),
    "optimizer.weight_decay": _number(ge=0),
    "optimizer.momentum": _number(ge=0, lt=1, note="0: none"),
    "optimizer.nesterov": _BOOL,
    "optimizer.muon_learning_rate": _number(gt=0),
    "optimizer.muon_momentum": _number(ge=0, lt=1),
    "optimizer.adafactor_decay_rate": _number(ge=0, le=1),
    "optimizer.adafactor_clipping_threshold": _number(ge=0, note="0: off"),
    "optimizer.adafactor_parameter_scale": _BOOL,
    "optimizer.adafactor_min_dim_size_to_factor": _int(ge=1),
    "optimizer.adafactor_momentum": _number(ge=0, lt=1, note="0: none"),
    "optimizer.grad_clip_norm": _number(ge=0, note="0: no clipping"),
    "optimizer.grad_accumulation_steps": _int(ge=1),
    "model.lora.rank": _int(ge=0, note="0: no adapters, the whole model trains"),
    "model.lora.alpha": _number(gt=0),
    "model.lora.targets": (lambda v: isinstance(v, str) and bool(v) and _regex(v),
                           "a regular expression of kernel param names"),
    "model.lora.dropout": _number(ge=0, lt=1),
    "model.lora.base_quantization": _one_of(lora.BASE_QUANTIZATIONS),
    "optimizer.freeze": _REGEX,
    "optimizer.head": _REGEX,
    "optimizer.head_learning_rate": _number(ge=0, note="0: optimizer.learning_rate"),
    # The model keys its constructors leave unchecked (the family picks the constructor).
    "model.family": _one_of(tuple(FAMILIES)),
    "model.vocab_size": _int(ge=0, note="0: the tokenizer's"),
    "model.num_classes": _int(ge=0, note="0: the task's"),
    "model.dtype": _one_of(DTYPES),  # compute
    "model.param_dtype": _one_of(DTYPES),
    "model.quantization": _one_of(("", "int8", "fp8")),  # transformer.nn.quantization.SCHEMES
    "model.quantize_head": _BOOL,
    "pipeline.microbatches": _int(ge=1, note="each (accumulation) step's rows split into them"),
    "pipeline.repeats": _int(ge=1, note="> 1: the circular schedule"),
    "profile.start_step": _int(ge=1, note="the first traced step; step 1 compiles"),
    "profile.num_steps": _int(ge=0, note="0: no trace"),
    "profile.all_hosts": _BOOL,
    "wandb.project": _STR,  # "": no W&B; set, it needs the wandb package: wandb_logging.check
    "wandb.entity": _STR,
    "wandb.name": _STR,
    "wandb.mode": _one_of(wandb_logging.MODES),
    "wandb.variant": _STR,
}
# Keys whose values are checked by code they belong to (called from validate_config).
CHECKED_ELSEWHERE = ("compiler_options", "mesh", "model")


_MISSING = object()


def _lookup(config: ml_collections.ConfigDict, key: str):
    """config["a.b"] for a dotted key, or `_MISSING` (an older config without the key)."""
    value = config
    for part in key.split("."):
        if part not in value:
            return _MISSING
        value = value[part]
    return value


def check_sequence_split(config: ml_collections.ConfigDict, mesh_sizes: dict[str, int]) -> None:
    """One-line error unless seq_len splits over mesh.sequence (decoder LMs lay it out in
    2 x sequence chunks for load balancing, see `transformer.nn.sequence_parallel`)."""
    if mesh_sizes["sequence"] > 1:
        balanced = (family_of(config.model).decoding in ("causal", "prefix")
                    and config.model.get("sequence_load_balance", True))
        sequence_parallel.check_length(config.seq_len, mesh_sizes["sequence"],
                                       load_balance=balanced, what="seq_len")


def _validate_lora(config: ml_collections.ConfigDict) -> None:
    """LoRA adapts a pretrained base (init_from), which its checkpoints name; QLoRA is LoRA's."""
    group = config.model.get("lora") or {}
    if group.get("rank") and not config.get("init_from"):
        raise ValueError(f"model.lora.rank={group.rank}: expected init_from (a pretrained "
                         "workdir or hf:DIR) for the adapters' frozen base")
    if group.get("base_quantization") and not group.get("rank"):
        raise ValueError(f"model.lora.base_quantization={group.base_quantization!r}: expected "
                         "model.lora.rank > 0 (QLoRA quantizes LoRA's frozen base)")


def check_pipeline(config: ml_collections.ConfigDict, mesh_sizes: dict[str, int]) -> None:
    """One-line errors for a pipeline (mesh.stage > 1) that cannot run: another family than
    the decoder LMs, unscanned layers, a sequence axis or an attention-bias position, layer
    groups that stages x repeats do not divide, microbatches that do not divide a data-parallel
    shard's rows (`pipeline_parallel.check`)."""
    stages = mesh_sizes.get("stage", 1)
    if stages == 1:
        return
    model, family = config.model, family_of(config.model).name
    where = f"mesh.stage={stages}"
    if family not in pipeline_parallel.FAMILIES:
        raise ValueError(f"{where}: pipeline parallelism supports model.family "
                         f"{' or '.join(pipeline_parallel.FAMILIES)}, not {family!r}")
    if not model.get("scan_layers"):
        raise ValueError(f"{where}: expected model.scan_layers=True (stages split the scanned "
                         "layer stack)")
    if mesh_sizes.get("sequence", 1) > 1:
        raise ValueError(f"{where} with mesh.sequence={mesh_sizes['sequence']}: expected one "
                         "of them")
    if model.get("position") in ("alibi", "t5"):
        raise ValueError(f"{where} with model.position={model.position!r}: expected positions "
                         "without an attention bias")
    stack = family_of(config.model).build(model_for_checks(config)).config
    groups = stack.num_layers // stack.layer_period
    rows = (config.batch_size // config.optimizer.grad_accumulation_steps
            // sharding.data_parallel_size(mesh_sizes))
    pipeline_parallel.check(stages=stages, microbatches=config.pipeline.microbatches,
                            repeats=config.pipeline.repeats, layer_groups=groups,
                            shard_rows=rows)


def model_for_checks(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """config.model with its class count filled (0: the task's, known once its data is read)."""
    model = ml_collections.ConfigDict(config.model.to_dict())
    model.num_classes = model.num_classes or 1
    return model


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None,
                    num_processes: int | None = None) -> None:
    """Checks every value against its meaning (`CHECKS`, then the rules joining several keys),
    with one-line errors `KEY=VALUE: expected ...`, before anything runs (against this
    runtime's devices and processes, or the given counts)."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    num_processes = jax.process_count() if num_processes is None else num_processes
    for key, (test, expected) in CHECKS.items():
        value = _lookup(config, key)
        if value is not _MISSING and not test(value):
            raise ValueError(f"{key}={value!r}: expected {expected}")
    mesh_sizes = sharding.mesh_shape(config.mesh, num_devices)
    sharding.check_batch_split(config.batch_size, mesh_sizes,
                               accumulation=config.optimizer.grad_accumulation_steps,
                               processes=num_processes)
    check_sequence_split(config, mesh_sizes)
    check_pipeline(config, mesh_sizes)
    placement.user_compiler_options(config)
    if config.model.get("position") == "learned" and config.seq_len > config.model.max_len:
        raise ValueError(f"seq_len={config.seq_len}: expected <= model.max_len="
                         f"{config.model.max_len}, the learned position table's size")
    _validate_sources(config)
    _validate_optimizer(config)
    _validate_tokenizer(config)
    _validate_test_path(config)
    _validate_finetuning(config)
    _validate_lora(config)
    task_eval.check(config, family_of(config).decoding, num_processes)
    wandb_logging.check(config)
    model = model_for_checks(config)
    try:
        build_model(model)  # validates the architecture (TransformerConfig) up front
    except ValueError as error:  # "num_heads=0: ..." -> "model.num_heads=0: ..."
        name = str(error).split("=", 1)[0].split(":", 1)[0]
        if name.split(".")[0] in config.model:
            raise ValueError(f"model.{error}") from None
        raise


def _validate_sources(config: ml_collections.ConfigDict) -> None:
    """A mixture (data.sources): every entry well formed (`sources.parse_sources`: weights
    finite and > 0, units known, paths present), data.path and data.validation_path left empty
    (each source has its own), and a text pretraining objective."""
    specs = config.data.get("sources") or ()
    if not specs:
        return
    sources.parse_sources(specs)
    for key in ("path", "validation_path"):
        if config.data.get(key):
            raise ValueError(f"data.{key}={config.data[key]!r}: expected '' with data.sources "
                             f"(each source has its own {key})")
    if (objective := pipeline.objective_for(config)) not in pipeline.OBJECTIVES:
        raise ValueError(f"data.sources with data.objective={objective!r}: expected a text "
                         f"pretraining objective {pipeline.OBJECTIVES}")


def _validate_optimizer(config: ml_collections.ConfigDict) -> None:
    """schedule_free_adamw replaces the decay: optimizer.decay must be "constant" (its warmup is
    optimizer.warmup_steps). muP's per-group learning rates are Adam's: an Adam-like optimizer."""
    opt = config.optimizer
    adam_like = ("adamw", "lion", "schedule_free_adamw")
    if config.model.get("parametrization", "standard") == "mup" and \
            opt.get("name", "adamw") not in adam_like:
        raise ValueError(f"optimizer.name={opt.name!r} with model.parametrization='mup': "
                         f"expected one of {adam_like} (muP's learning rates here are Adam's)")
    if opt.get("name") == "schedule_free_adamw" and opt.decay != "constant":
        raise ValueError(f"optimizer.decay={opt.decay!r} with optimizer.name="
                         "'schedule_free_adamw': expected 'constant' (schedule-free needs no "
                         "decay; its warmup is optimizer.warmup_steps)")


def _validate_test_path(config: ml_collections.ConfigDict) -> None:
    """data.test_path: text that exists, for a single-source text pretraining run (a labeled
    task holds out its own test split)."""
    path = config.data.get("test_path", "")
    if not path:
        return
    if config.data.get("sources"):
        raise ValueError(f"data.test_path={path!r} with data.sources: expected '' (a mixture "
                         "has no test split)")
    text = pipeline.OBJECTIVES + pipeline.CHAT_OBJECTIVES
    if (objective := pipeline.objective_for(config)) not in text:
        raise ValueError(f"data.test_path={path!r} with data.objective={objective!r}: expected "
                         f"a text pretraining objective or 'sft' {text} (labeled tasks hold "
                         "out their own test split)")
    data_path = config.data.path
    if data_path and (inputs.token_shard_dir(data_path) or
                      os.path.isfile(os.path.join(data_path, "prepare.json"))):
        raise ValueError(f"data.test_path={path!r} with the token shards at data.path="
                         f"{data_path!r}: expected text data.path (shards hold no test split)")
    sources._files(path)  # exists, or a one-line error (an empty split: startup.check_splits)


def _validate_tokenizer(config: ml_collections.ConfigDict) -> None:
    """data.vocab_size against data.tokenizer: byte and char derive their size, SentencePiece
    needs one. Neither matters when the tokenizer is loaded instead (from a prepared data.path,
    as inputs.get_tokenizer does, or from the init_from workdir)."""
    init_from = config.get("init_from", "")
    kind, size = config.data.tokenizer, config.data.vocab_size
    path = config.data.get("tokenizer_path", "")
    if path and kind != "hf":
        raise ValueError(f"data.tokenizer_path={path!r} with data.tokenizer={kind!r}: expected "
                         "data.tokenizer='hf' (a Hugging Face tokenizer.json) or no path")
    if path and not (fileio.path(path).is_file() or
                     fileio.path(path).joinpath("tokenizer.json").is_file()):
        raise FileNotFoundError(f"data.tokenizer_path={path!r}: expected a Hugging Face "
                                "tokenizer.json or a directory holding one")
    paths = [config.data.path] + [s.path for s in
                                  sources.parse_sources(config.data.get("sources") or ())]
    shard_dirs = [p for p in paths if inputs.token_shard_dir(p)]
    if shard_dirs and kind != "hf":
        raise ValueError(f"data.path={shard_dirs[0]!r} holds token shards (*.bin): expected "
                         "data.tokenizer='hf' with the tokenizer they were written with "
                         "(data.tokenizer_path)")
    if config.data.path in shard_dirs and config.data.get("validation_path"):
        raise ValueError(f"data.validation_path={config.data.validation_path!r} with the token "
                         f"shards at data.path={config.data.path!r}: expected '' (their "
                         "*val*.bin files are the validation split)")
    if any(os.path.isfile(os.path.join(p, "prepare.json")) for p in paths) or (
            init_from and fileio.parse_init_from(init_from)[0] == "workdir"):
        return
    if kind == "hf":
        hf_dir = fileio.parse_init_from(init_from)[1] if init_from.startswith("hf:") \
            else ""
        if not path and not (hf_dir and fileio.path(hf_dir).joinpath("tokenizer.json").is_file()):
            raise ValueError("data.tokenizer='hf' without data.tokenizer_path: expected a "
                             "tokenizer.json path, or init_from='hf:DIR' with DIR/tokenizer.json")
        if size:
            raise ValueError(f"data.vocab_size={size}: expected 0 with data.tokenizer='hf', "
                             "whose vocabulary is the tokenizer's")
    if kind in ("byte", "char") and size:
        raise ValueError(f"data.vocab_size={size}: expected 0 with data.tokenizer={kind!r}, "
                         "which derives its own size")
    minimum = tokenizers.NUM_SPECIAL + 256 + 1
    if kind.startswith("sentencepiece") and size < minimum:
        raise ValueError(f"data.vocab_size={size}: expected >= {minimum} with data.tokenizer="
                         f"{kind!r} (7 specials + 256 byte pieces + characters and merges)")


def _validate_finetuning(config: ml_collections.ConfigDict) -> None:
    """One-line errors for labeled-task, image and init_from settings."""
    objective, family = pipeline.objective_for(config), family_of(config)
    task = config.data.get("task", "")
    if objective in pipeline.TASK_OBJECTIVES:
        from transformer.data import tasks

        if task not in tasks.TASKS:
            raise ValueError(f"data.task={task!r}: data.objective={objective!r} expected one "
                             f"of {tasks.TASKS}")
    # Labeled tasks and images need a family built for them; text pretraining objectives
    # (next_token, prefix_lm, mlm, span_corruption) run on every text family.
    special = pipeline.TASK_OBJECTIVES + pipeline.IMAGE_OBJECTIVES + pipeline.CHAT_OBJECTIVES
    if (objective in special or family.objective in special) and \
            objective not in family.objectives:
        able = [name for name, f in FAMILIES.items() if objective in f.objectives]
        raise ValueError(f"data.objective={objective!r} with model.family={family.name!r}: "
                         f"expected {' or '.join(map(repr, able))}")
    if config.model.get("head") == "none":  # an imported base model (convert.from_hf)
        raise ValueError("model.head='none': expected 'mlm' or 'classify' to train (head 'none' "
                         "gives an imported base model's last-layer vectors, with no loss)")
    if objective == "classification" and not family.classifier(config.model):
        raise ValueError(f"data.objective='classification' with model.head="
                         f"{config.model.head!r}: expected head 'classify'")
    if task and objective not in pipeline.TASK_OBJECTIVES:
        raise ValueError(f"data.task={task!r} with data.objective={objective!r}: expected "
                         f"objective 'classification' or 'text2text'")
    if config.get("init_from"):
        kind, path, step = fileio.parse_init_from(config.init_from)
        if kind == "workdir":
            checkpoint_lib.saved_run(path, step)  # a workdir with that checkpoint, or an error
        elif not fileio.path(path).joinpath("config.json").is_file():
            raise FileNotFoundError(f"init_from={config.init_from!r}: expected a save_pretrained "
                                    "directory with config.json")
        elif fileio.path(path).joinpath("tokenizer.json").is_file() and \
                config.data.tokenizer != "hf":
            # Its weights read the ids of its own tokenizer; no other tokenizer's ids mean the same.
            raise ValueError(f"data.tokenizer={config.data.tokenizer!r}: init_from="
                             f"{config.init_from!r} comes with its Hugging Face tokenizer: "
                             "expected data.tokenizer='hf'")
