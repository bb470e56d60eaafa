"""The base experiment config: every key an experiment file may set, with its default, and
`validate_config`, which checks a config before anything runs.

Experiment files (`experiments/*.py`) start from `base_config()` and override what they change.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import ml_collections

from transformer import config_keys
from transformer.data import inputs, pipeline, sources, tokenizers
from transformer.models import (
    FAMILIES,
    bert,
    build_model,
    default_model_config,
    family_of,
    transformer_config,
    vision,
)
from transformer.nn import lora as lora_lib
from transformer.nn import sequence_parallel
from transformer.nn.mixers import MIXERS
from transformer.parallel import pipeline_parallel, sharding
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import evaluation, optim, placement, task_eval, wandb_logging
from transformer.utils import cli, fileio
from transformer.utils.keys import Check, dotted


def base_config() -> ml_collections.ConfigDict:
    """Every key an experiment file may set, with its default: the declarations of
    `transformer.config_keys` (the model group's from `transformer.models`)."""
    return config_keys.build(default_model_config())


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


# --- validation: every key's declared check, then the rules joining keys -------------------------

# What every key of base_config() must be, by its dotted path, from its declaration
# (transformer.config_keys). Besides, sharding.mesh_shape checks the mesh, placement asks XLA
# about compiler_options, and building the model checks the rules joining model keys.
CHECKS: dict[str, Check] = {name: declared.check
                            for name, declared in config_keys.all_keys().items()}


_MISSING = object()


def declared_keys() -> set[str]:
    """The dotted keys a run config may hold: `CHECKS`' and the model group's
    (`default_model_config()`, its groups' keys included)."""
    model = dotted(default_model_config(), "model.", empty_groups=True)
    return set(CHECKS) | set(model)


def check_declared(config: ml_collections.ConfigDict) -> None:
    """One line naming the keys of `config` that no declaration has (a misspelling set in an
    experiment file would otherwise be ignored), with the closest declared key where one is
    near. A declared key's value is not looked into (compiler_options is a free-form dict)."""
    declared = declared_keys()

    def known(key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:n]) in declared for n in range(1, len(parts) + 1)) or \
            any(name.startswith(key + ".") for name in declared)  # an emptied declared group

    unknown = [key for key in dotted(config, empty_groups=True) if not known(key)]
    hints = {}
    for key in unknown:
        close = cli.closest(key, declared)  # the one `--config.KEY` typos get
        hints[key] = f"did you mean {close!r}?" if close else "docs/config.md lists them"
    if len(unknown) == 1:
        raise ValueError(f"unknown config key {unknown[0]!r}: expected a declared key "
                         f"({hints[unknown[0]]})")
    if unknown:
        named = ", ".join(f"{key!r} ({hint})" for key, hint in hints.items())
        raise ValueError(f"unknown config keys {named}: expected declared keys")


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
        balanced = evaluation.sequence_balanced(config)
        sequence_parallel.check_length(config.seq_len, mesh_sizes["sequence"],
                                       load_balance=balanced, what="seq_len")
        depth = config.model.get("mtp", {}).get("depth", 0)
        if depth and balanced:
            raise ValueError(f"model.mtp.depth={depth} with mesh.sequence="
                             f"{mesh_sizes['sequence']}: expected model.sequence_load_balance="
                             "False (the modules shift the sequence, which the zig-zag layout "
                             "reorders)")


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
    moe = model.get("moe")
    if moe and moe.get("num_experts") and (moe.get("first_dense_layers")
                                            or moe.get("balance_bias")):
        name = "first_dense_layers" if moe.get("first_dense_layers") else "balance_bias"
        raise ValueError(f"{where} with model.moe.{name}={moe.get(name)!r}: expected one of "
                         "them (the stages run one scanned stack and sow no expert loads)")
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
                    num_processes: int | None = None, files: bool = True,
                    this_backend: bool = True) -> None:
    """Refuses keys no declaration has (`check_declared`), then checks every value against its
    meaning (`CHECKS`, then the rules joining several keys), with one-line errors
    `KEY=VALUE: expected ...`, before anything runs (against this runtime's devices and
    processes, or the given counts). `files=False` leaves out what reads
    the run's files (data, tokenizer, init_from), for a launcher whose run reads them on
    another machine; `this_backend=False` leaves `compiler_options` to the XLA that compiles
    for another accelerator (a TPU's options are unknown to this machine's XLA:CPU)."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    num_processes = jax.process_count() if num_processes is None else num_processes
    check_declared(config)
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
    if this_backend:
        placement.user_compiler_options(config)
    if config.model.get("position") == "learned" and config.seq_len > config.model.max_len:
        raise ValueError(f"seq_len={config.seq_len}: expected <= model.max_len="
                         f"{config.model.max_len}, the learned position table's size")
    _validate_optimizer(config)
    if files:
        _validate_sources(config)
        _validate_tokenizer(config)
        _validate_prepared(config)
        _validate_test_path(config)
        _validate_held_out(config)
        _validate_finetuning(config)
    _validate_objective(config)
    _validate_unread(config)
    lora_lib.validate(config)
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
    _validate_mixers(config, mesh_sizes)
    _validate_effects(config)


def _validate_effects(config: ml_collections.ConfigDict) -> None:
    """Values past the range where they act, refused in one line each (a run never silently
    ignores what it was told). A key that acts only with another one left off is legal in a
    sweep's shared base config: `training.startup.unintended_settings` warns of it instead."""
    model = config.model
    rules = (
        (model.get("sliding_window_pattern", 0) > model.get("num_layers", 0),
         f"model.sliding_window_pattern={model.get('sliding_window_pattern')}: expected <= "
         f"model.num_layers={model.get('num_layers')} (layer P - 1 is the first full one; "
         "past the stack, every layer stays windowed)"),
        ((depth := (model.get("mtp") or {}).get("depth", 0)) >= config.seq_len,
         f"model.mtp.depth={depth}: expected < seq_len={config.seq_len} (module k predicts the "
         "token k + 1 ahead: modules past the row have no targets, and dilute mtp_loss)"),
        (config.profile.num_steps and config.profile.start_step > config.steps,
         f"profile.start_step={config.profile.start_step}: expected <= steps={config.steps} "
         "(no step would be traced)"),
    )
    for bad, message in rules:
        if bad:
            raise ValueError(message)


def _validate_mixers(config: ml_collections.ConfigDict, mesh_sizes: dict[str, int]) -> None:
    """The token mixers of `model.layer_types`: each one's refusal (`Mixer.refuses`: a kernel, a
    mesh axis) as one line; recurrent layers only in the causal decoder LM (gpt), the stack
    whose every token reads only earlier ones."""
    if not config.model.get("layer_types") and config.model.get("attention_kind", "mha") == "mha":
        return
    if (reads := family_of(config).reads) is not None and "layer_types" not in reads:
        return  # a family without token-mixer layers (the LSTM): its start warns of the keys
    stack = transformer_config(config.model)
    types = dict.fromkeys(stack.layer_type(i) for i in range(stack.num_layers))
    recurrent = [name for name in types if MIXERS[name].decode_state == "recurrent state"]
    if recurrent and config.model.family != "gpt":
        raise ValueError(f"model.layer_types={config.model.layer_types!r}: {recurrent[0]} layers "
                         f"with model.family={config.model.family!r}: expected family 'gpt' "
                         "(a recurrent layer reads tokens in order; this family's are not causal)")
    for name in types:
        if (reason := MIXERS[name].refuses(stack, mesh_sizes)) is not None:
            raise ValueError(reason)


# The model features each text objective's rows hold (transformer.data.features; data.tasks for
# the labeled ones, whose classification rows hold prefix_lengths where the family reads them).
ROW_FEATURES = {
    "next_token": ("inputs", "segment_ids", "positions"),
    "prefix_lm": ("inputs", "segment_ids", "positions", "prefix_lengths"),
    "mlm": ("inputs", "segment_ids", "positions"),
    "span_corruption": ("encoder_inputs", "decoder_inputs"),
    "classification": ("inputs", "segment_ids", "positions", "prefix_lengths"),
    "text2text": ("encoder_inputs", "encoder_segment_ids", "decoder_inputs"),
}


def _validate_objective(config: ml_collections.ConfigDict) -> None:
    """A text objective whose rows hold every feature the family reads; span corruption with a
    sentinel id for each noise span of a row."""
    objective, family = pipeline.objective_for(config), family_of(config)
    data = config.data
    if objective in ROW_FEATURES:
        needs = set(family.inputs + family.features)
        if missing := sorted(needs - set(ROW_FEATURES[objective])):
            able = [name for name, row in ROW_FEATURES.items() if needs <= set(row) and (
                name in pipeline.OBJECTIVES or name in family.objectives)]
            raise ValueError(f"data.objective={objective!r} with model.family={family.name!r}: "
                             f"its rows hold no {missing} for the model to read: expected one "
                             f"of {able}")
    if objective == "span_corruption":
        pipeline.check_span_sentinels(data, config.seq_len)


def _validate_unread(config: ml_collections.ConfigDict) -> None:
    """Settings a family's model never reads, refused where they would claim what it does not
    do: a ViT's seq_len other than its token count (read only by the logs' tokens/s and MFU,
    which count seq_len tokens an image), an untied output head where the head always ties."""
    model, family = config.model, family_of(config)
    if family is vision.VIT and config.seq_len != (tokens := vision.image_tokens(model)):
        raise ValueError(f"seq_len={config.seq_len}: a ViT reads {tokens} tokens an image "
                         f"(model.image_size={model.image_size}, patch_size={model.patch_size}, "
                         f"pooling={model.pooling!r}): expected seq_len={tokens}")
    # (Refused here, not by build_model: a checkpoint saved with the key still loads.)
    if not model.get("tie_embeddings", True) and family in (bert.BERT, vision.CAPTIONER):
        raise ValueError(f"model.tie_embeddings=False with model.family={family.name!r}: "
                         "expected True (its output head always reads the token embedding)")


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
    optimizer.warmup_steps). muP's per-group learning rates are Adam's: an Adam-like optimizer.
    No gradient accumulation where a family's rows interact in its loss (CLIP)."""
    opt = config.optimizer
    if config.model.get("parametrization", "standard") == "mup" and \
            opt.get("name", "adamw") not in optim.ADAM_LIKE:
        raise ValueError(f"optimizer.name={opt.name!r} with model.parametrization='mup': "
                         f"expected one of {optim.ADAM_LIKE} (muP's learning rates here are "
                         "Adam's)")
    if opt.grad_accumulation_steps > 1 and family_of(config).rows_interact:
        raise ValueError(f"optimizer.grad_accumulation_steps={opt.grad_accumulation_steps} "
                         f"with model.family={config.model.family!r}: expected 1 (its loss "
                         "compares the batch's rows with each other; a micro-batch would "
                         "compare fewer, another objective)")
    optim.check_schedule(opt, config.steps)
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


def _validate_held_out(config: ml_collections.ConfigDict) -> None:
    """data.validation_path and data.test_path (a mixture source's validation_path) must hold
    none of the training files (data.path's, every mixture source's path's): they would be
    trained on."""
    mixture = sources.parse_sources(config.data.get("sources") or ())
    held = [(f"data.{key}", config.data.get(key, "")) for key in ("validation_path", "test_path")]
    held += [(f"data.sources {s.name!r}: validation_path", s.validation_path) for s in mixture]
    trained = [("data.path", config.data.path)]
    trained += [(f"data.sources {s.name!r}: path", s.path) for s in mixture]

    def text(path: str) -> bool:  # (prepared data and token shards are not listed as files)
        return bool(path) and not inputs.token_shard_dir(path) and \
            not os.path.isfile(os.path.join(path, "prepare.json"))

    _warn_shared_sources(mixture, text)
    for key, held_out in held:
        for trains, path in trained:
            if text(path) and held_out and (file := sources.shared_file(path, held_out)):
                raise ValueError(f"{key}={held_out!r}: {file} is also a training file, of "
                                 f"{trains}={path!r}: expected held-out files apart from the "
                                 "training files (point the path at the train files alone, "
                                 "e.g. a glob)")


def _warn_shared_sources(mixture: list[sources.MixtureSource], text) -> None:
    """A warning naming two mixture sources that read one file (`web/*.parquet`, `web/a.parquet`;
    repeating a file may be meant, to weight it up)."""
    for k, a in enumerate(mixture):
        for b, key in ((b, key) for b in mixture[k + 1:] for key in ("path", "validation_path")):
            pair = getattr(a, key), getattr(b, key)
            if not (text(pair[0]) and text(pair[1]) and (file := sources.shared_file(*pair))):
                continue
            whole = [s.name for s in (a, b) if s.validation_path]  # the others split by hash
            what = "its tokens count twice in `validation`" if key != "path" else \
                "it trains in both (at their combined rate)" + (
                    ", and its validation rows count twice in `validation`" if not whole else
                    f", and {whole[0]!r} trains on the rows the other validates on"
                    if len(whole) == 1 else "")
            cli.warn_once(f"data.sources {a.name!r} and {b.name!r} both read {file} (their "
                          f"{key}): {what}: if not meant, point the paths at disjoint files")


def _validate_prepared(config: ml_collections.ConfigDict) -> None:
    """Prepared data (data.path, a mixture source) fixed its unit, validation split and text
    field when it was prepared: a setting given otherwise is refused in one line. A value left
    at its default reads as unset (the prepared one applies, as it always has), except a unit
    that is "stream" on one side only: training reads ArrayRecord documents as one stream or as
    documents by data.unit, so that one must be said. (Its tokenizer's settings are checked
    where the tokenizer is loaded: tokenizers.check_settings.)"""
    keys = config_keys.all_keys()
    entries = sources.parse_sources(config.data.get("sources") or ())
    runs = zip(entries, inputs.source_configs(config).values(), strict=True) if entries \
        else [(None, config)]
    for entry, one in runs:
        if not (fixed := inputs.prepared_settings(one)):
            continue
        if entry:  # its own unit / text_field (the run's may be meant for its text sources)
            chosen = {key: getattr(entry, key) for key in ("unit", "text_field")
                      if getattr(entry, key)}
        else:
            chosen = {key: one.data.get(key) for key in ("unit", "validation_fraction",
                                                         "text_field")
                      if one.data.get(key) != keys[f"data.{key}"].default}
        if fixed["format"] == "array_record" and \
                (fixed["unit"] == "stream") != (one.data.unit == "stream"):
            chosen["unit"] = one.data.unit
        for key, value in chosen.items():
            if fixed[key] is None or value == fixed[key]:
                continue
            where = f"data.sources {entry.name!r}: " if entry else "data."
            set_it = f"{key}={fixed[key]} in its entry" if entry else \
                f"--config.data.{key}={fixed[key]}"
            raise ValueError(f"{where}{key}={value!r}: the prepared data {one.data.path!r} was "
                             f"prepared with {key}={fixed[key]!r}: expected {set_it}")


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
    for p in paths:
        inputs.check_finished(p)
    shard_dirs = [p for p in paths if inputs.token_shard_dir(p)]
    if shard_dirs and kind != "hf":
        raise ValueError(f"data.path={shard_dirs[0]!r} holds token shards (*.bin): expected "
                         "data.tokenizer='hf' with the tokenizer they were written with "
                         "(data.tokenizer_path)")
    if config.data.path in shard_dirs and config.data.get("validation_path"):
        raise ValueError(f"data.validation_path={config.data.validation_path!r} with the token "
                         f"shards at data.path={config.data.path!r}: expected '' (their "
                         "*val*.bin files are the validation split)")
    if config.data.get("validation_path") and config.data.path and os.path.isfile(
            os.path.join(config.data.path, "prepare.json")):
        raise ValueError(f"data.validation_path={config.data.validation_path!r} with the prepared "
                         f"data at data.path={config.data.path!r}: expected '' (it holds its own "
                         "validation split, prepare's --validation_fraction)")
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
    # Labeled tasks and images need a family built for them (a text objective's rows: checked
    # by _validate_objective against what the family reads).
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
        if kind == "workdir":  # a workdir with that checkpoint, or an error naming init_from
            try:
                checkpoint_lib.saved_run(path, step)
            except (FileNotFoundError, ValueError) as error:
                raise type(error)(f"init_from={config.init_from!r}: {error}") from None
        elif not fileio.path(path).joinpath("config.json").is_file():
            peft = fileio.path(path).joinpath("adapter_config.json").is_file()
            raise FileNotFoundError(f"init_from={config.init_from!r}: expected a save_pretrained "
                                    "directory with config.json" + (lora_lib.PEFT_FOLDER * peft))
        else:
            lora_lib.check_not_peft(path)  # (transformers would apply a peft adapter beside it)
            if fileio.path(path).joinpath("tokenizer.json").is_file() and \
                    config.data.tokenizer != "hf":
                # Its weights read its own tokenizer's ids; no other tokenizer's mean the same.
                raise ValueError(f"data.tokenizer={config.data.tokenizer!r}: init_from="
                                 f"{config.init_from!r} comes with its Hugging Face tokenizer: "
                                 "expected data.tokenizer='hf'")
