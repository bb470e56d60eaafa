"""Every key of the run config, declared once: its default, its allowed values (the check
`validate_config` runs) and what it means. `configs.base_config()`, `configs.CHECKS` and the
config reference (docs/config.md) derive from these declarations.

The stack's model keys (`model.num_layers`, `model.moe.top_k`, `model.lora.rank`, ...) are
declared on their dataclass fields (`nn.config.TransformerConfig`, `nn.moe.MoEConfig`,
`nn.lora.LoraConfig`); `KEYS` holds the others. A new key gets one line in one of them.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_collections

from transformer.data import pipeline, sources, tokenizers
from transformer.models import MODEL_KEYS, default_model_config, family_of, transformer_config
from transformer.nn.config import TransformerConfig
from transformer.parallel import sharding
from transformer.training import optim, wandb_logging
from transformer.utils.keys import (
    BOOL,
    NO_DEFAULT,
    REGEX,
    STR,
    Key,
    declarations,
    described,
    dotted,
    int_,
    is_int,
    number,
    one_of,
)


def _key(default, meaning: str, check, structural: bool = False, needs=None) -> Key:
    """A run-config key; structural ones (a checkpoint's params or optimizer state depend on
    them) are marked so: a resume must keep them. `needs`: what it acts only with (`Key`)."""
    return Key(default, meaning, check, structural, needs=needs)


def _one_of(setting: str, *values: str):
    """`needs` of a key read only where the optimizer's `setting` is one of `values` (only
    these optimizers, or these schedules, read it)."""
    return (lambda config: config.optimizer[setting] in values,
            f"optimizer.{setting}={values[0]!r}" if len(values) == 1
            else f"optimizer.{setting} in {values}")


_optimizer = functools.partial(_one_of, "name")
_decay = functools.partial(_one_of, "decay")
# b1 and b2: every optimizer's but adafactor's (adafactor_momentum) and sgd's (momentum); muon's
# AdamW steps the params that are no hidden matrices
_ADAM_BETAS = _optimizer("adamw", "lion", "schedule_free_adamw", "muon")


_STAGES = (lambda config: config.mesh.get("stage", 1) > 1, "mesh.stage > 1")


def _tuple_of(test, text: str):
    return (lambda v: isinstance(v, tuple | list) and all(test(x) for x in v)), text


_STRS = _tuple_of(lambda x: isinstance(x, str), "")
_OBJECTIVES = (pipeline.OBJECTIVES + pipeline.TASK_OBJECTIVES + pipeline.IMAGE_OBJECTIVES +
               pipeline.CHAT_OBJECTIVES)

# The run config's keys but the dataclass-declared model keys, in base_config()'s order.
KEYS: dict[str, Key] = {
    # --- top level
    "experiment": _key("base", "The experiment's name; the default workdir is "
                       "`runs/<experiment>`.", STR),
    "seed": _key(0, "Seeds the init, dropout, data order and the sampled validation windows.",
                 (lambda v: is_int(v) and 0 <= v < 2**31, "an int in [0, 2**31)")),
    "steps": _key(1000, "Training steps in all; may change on resume.", int_(ge=1)),
    "batch_size": _key(16, "Global batch size in rows, across all processes.", int_(ge=1)),
    "seq_len": _key(128, "Tokens per row (the model's context during training).", int_(ge=2)),
    "log_every": _key(50, "Steps between progress lines and train records in "
                      "`metrics.jsonl`.", int_(ge=1)),
    "eval_every": _key(250, "Steps between validation evaluations.", int_(ge=1)),
    "eval_steps": _key(20, "Validation batches per evaluation (a fixed seeded sample of the "
                       "windows).", int_(ge=1, note="validation batches at each evaluation")),
    "eval_seq_lens": _key((), "Extra validation lengths evaluated at the end of training "
                          "(length extrapolation), e.g. `(256, 512)`; one the model or mesh "
                          "cannot run at (learned positions past max_len, a length the "
                          "sequence axis does not split) is skipped, and the start says so.",
                          _tuple_of(lambda n: is_int(n) and n >= 2, "a tuple of ints >= 2")),
    # Their family, process count, files and names: task_eval.check, in validate_config.
    "eval_tasks": _key((), "lm-eval tasks scored during training (`training.task_eval`): task "
                       "names or local task YAML files.",
                       described(_STRS, "a tuple of lm-eval task names or task YAML paths")),
    "eval_tasks_every": _key(0, "Steps between task evaluations.",
                             int_(ge=0, note="0: after the last step only")),
    "eval_tasks_limit": _key(0, "Documents scored per task.", int_(ge=0, note="0: every document")),
    "samples": _key(3, "Samples printed at the end of a language model's training run "
                    "(temperature 0.8, top-k 200, each filling the context).",
                    int_(ge=0, note="0: none")),
    "checkpoint_every": _key(500, "Steps between checkpoint saves.", int_(ge=1)),
    "keep_checkpoints": _key(3, "How many of the run's own newest checkpoints are kept.",
                             int_(ge=1, note="the newest checkpoint is always kept")),
    "fresh_start": _key(False, "Set the workdir's old run aside (`checkpoints.set-aside-<time>/`) "
                        "and start at step 0; a one-off.", BOOL),
    "new_data": _key(False, "Resume the checkpoint's params and optimizer on a different data "
                     "stream (data, batch_size, seq_len or seed changed), from that stream's "
                     "start (otherwise a changed stream is refused).", BOOL),
    "nonfinite": _key("stop", "What a NaN/Inf loss or gradient does: `stop` (keep the last good "
                      "checkpoint) or `skip` the update.", one_of(("stop", "skip"))),
    "max_nonfinite_skips": _key(10, "With `nonfinite=\"skip\"`: stop after this many bad steps "
                                "in a row.", int_(ge=0)),
    "max_grad_norm": _key(0.0, "A step whose gradient norm exceeds it counts as bad, like NaN.",
                          number(ge=0, note="0: off")),
    "z_loss": _key(0.0, "Weight of the z-loss, the squared log of the softmax normalizer.",
                   number(ge=0, note="0: off")),
    "label_smoothing": _key(0.0, "Label smoothing of the cross-entropy.", number(ge=0, lt=1)),
    "peak_flops_per_device": _key(
        0.0, "MFU's peak FLOP/s per device; 0: the accelerator's published peak "
        "(metrics.PEAK_FLOPS) or, on CPU, this host's measured float32 matmul peak.",
        number(ge=0, note="0: published or measured")),
    # Which options XLA knows: placement.user_compiler_options, in validate_config.
    "compiler_options": _key({}, "XLA options for the jitted steps on top of the CPU or TPU "
                             "defaults (`placement.compiler_options`), e.g. "
                             "`{'xla_cpu_multi_thread_eigen': False}`; checked by XLA before "
                             "anything compiles (by XLA:TPU when `launch.aot` compiles for a "
                             "TPU, which it does with them).",
                             (lambda v: isinstance(v, dict | ml_collections.ConfigDict),
                              "a dict of XLA option names to values")),
    # Its form and target: fileio.parse_init_from, in validate_config.
    "init_from": _key("", "Fine-tuning: start the params from `WORKDIR`, `WORKDIR@STEP` or "
                      "`hf:DIR` (a Hugging Face save_pretrained directory); \"\": a fresh init.",
                      STR),
    # --- model: the keys outside TransformerConfig, declared beside the families
    # (transformer.models.MODEL_KEYS); the model group brings their defaults (NO_DEFAULT here)
    # but for the vocabulary, which a run takes from its tokenizer
    **{f"model.{name}": dataclasses.replace(declared, default=NO_DEFAULT)
       for name, declared in MODEL_KEYS.items()},
    "model.vocab_size": _key(0, MODEL_KEYS["vocab_size"].meaning,
                             int_(ge=0, note="0: the tokenizer's"), structural=True),
    # --- data (transformer.data): what the run reads and how
    "data.path": _key("", "\"\": the embedded corpus; or a text, Parquet or JSON Lines "
                      "(.jsonl, .jsonl.gz, .jsonl.zst) file, a directory or glob of them, a "
                      "`datasets` save_to_disk directory, a `prepare` output directory or a "
                      "directory of `.bin` token shards.", STR),
    "data.text_field": _key("text", "The field of Parquet, JSON Lines and `datasets` rows that "
                            "holds each document's text.",
                            (lambda v: isinstance(v, str) and bool(v), "a non-empty field name")),
    "data.unit": _key("paragraph", "How text becomes documents: `paragraph` or `file` "
                      "(hash-split, packed with segment ids) or `stream` (each file one token "
                      "stream, windows cross paragraphs, the last `validation_fraction` "
                      "validates).", one_of(sources.UNITS)),
    "data.validation_path": _key("", "Explicit validation text (file, directory or glob): no "
                                 "split is applied to it or to `data.path`.", STR),
    # Exists, and goes with a text objective: configs._validate_test_path.
    "data.test_path": _key("", "Held-out test text, evaluated whole at the end of training and "
                           "by `transformer.evaluate --split=test`; never trained or validated "
                           "on.", STR),
    "data.validation_fraction": _key(0.05, "The share of the text (stream) or of the documents "
                                     "(hash split) that validates.", number(ge=0, lt=1)),
    # Each entry's fields, and data.path alongside: configs._validate_sources.
    "data.sources": _key((), "A weighted mixture instead of `data.path`: one `key=value,...` "
                         "string per source (path and weight required; unit, validation_path, "
                         "name optional). The tokenizer is built on the union of the sources' "
                         "train splits; each validation split is evaluated on its own.",
                         described(_STRS, "a tuple of 'path=...,weight=...' strings (\"()\": "
                                   "data.path alone)")),
    "data.tokenizer": _key("byte", "The tokenizer kind; `hf` loads a Hugging Face "
                           "tokenizer.json.", one_of(tokenizers.KINDS), structural=True),
    # With which kind, and whether it exists: configs._validate_tokenizer.
    "data.tokenizer_path": _key("", "With `tokenizer=\"hf\"`: a tokenizer.json or a directory "
                                "holding one; \"\" with `init_from=\"hf:DIR\"` reads DIR's.", STR),
    "data.vocab_size": _key(0, "SentencePiece vocabulary size.",
                            int_(ge=0, note="0 for byte and char; required for SentencePiece")),
    "data.num_sentinels": _key(tokenizers.NUM_SENTINELS, "T5 sentinel ids appended above the "
                               "vocabulary (or the vocabulary's own `<extra_id_i>`); 0 keeps a "
                               "pretrained vocabulary's size.", int_(ge=0)),
    # Its choices: pipeline.objective_for, in validate_config.
    "data.objective": _key("", "The training objective; \"\": the model family's.",
                           described(STR, f"\"\" or one of {_OBJECTIVES}")),
    "data.mlm_rate": _key(0.15, "MLM: the share of non-special tokens selected (80/10/10).",
                          number(gt=0, lt=1)),
    "data.noise_density": _key(0.15, "Span corruption: the share of tokens in noise spans.",
                               number(gt=0, lt=1)),
    "data.mean_span_length": _key(3.0, "Span corruption: the mean noise span length.",
                                  number(ge=1)),
    "data.prefetch": _key(2, "Batches the input pipeline prepares ahead.",
                          int_(ge=0, note="0: no prefetching")),
    # Labeled tasks (objective "classification" | "text2text"): transformer.data.tasks; its
    # choices are checked by configs._validate_finetuning.
    "data.task": _key("", "A labeled task: `speakers` (play text at `data.path`) or `modules` "
                      "(the embedded corpus); \"\": none.",
                      described(STR, "\"\" or one of ('speakers', 'modules')")),
    "data.num_classes": _key(0, "The task's most frequent labels kept as classes.",
                             int_(ge=0, note="0: all the task's labels; else >= 2")),
    "data.sft_truncate": _key(False, "`objective=\"sft\"`: cut conversations longer than seq_len "
                              "+ 1 tokens (and say how many); False: such a conversation is an "
                              "error.", BOOL),
    # --- optimizer (transformer.training.optim)
    "optimizer.name": _key("adamw", "The update rule (optax's own, `optim.update_rule`); "
                           "structural: a resume keeps the checkpoint's.",
                           one_of(optim.NAMES), structural=True),
    "optimizer.learning_rate": _key(1e-3, "The peak learning rate (under muon: the AdamW "
                                    "part's).", number(gt=0)),
    "optimizer.warmup_steps": _key(100, "Steps of linear warmup to the peak, from 0 (the first "
                                    "update's rate is 0, as in transformers' warmup "
                                    "schedules; at most `steps`: a shorter run warms up over "
                                    "all of its steps).",
                                    int_(ge=0)),
    "optimizer.decay": _key("cosine", "The schedule after the warmup "
                            "(`optim.learning_rate_schedule`); `schedule_free_adamw` takes "
                            "`constant`.", one_of(optim.DECAYS)),
    "optimizer.min_learning_rate_ratio": _key(0.1, "Where cosine, linear and wsd end at "
                                              "`steps`, as a share of the peak (update s "
                                              "applies the rate at s - 1: the last one's is a "
                                              "step above it).", number(ge=0, le=1),
                                              needs=_decay("cosine", "linear", "wsd")),
    "optimizer.decay_fraction": _key(0.2, "wsd: the last share of the steps that decays.",
                                     number(ge=0, le=1, note="wsd: 0 never decays"),
                                     needs=_decay("wsd")),
    "optimizer.decay_shape": _key("linear", "wsd: the shape of the final decay.",
                                  one_of(optim.DECAY_SHAPES), needs=_decay("wsd")),
    "optimizer.b1": _key(0.9, "Adam's (and Lion's, schedule-free's, Muon's AdamW) first-moment "
                         "decay.", number(ge=0, lt=1), needs=_ADAM_BETAS),
    "optimizer.b2": _key(0.99, "Adam's (and Lion's, schedule-free's, Muon's AdamW) second-moment "
                         "decay.", number(ge=0, lt=1), needs=_ADAM_BETAS),
    "optimizer.weight_decay": _key(0.1, "Weight decay, by default decoupled (lr * "
                                   "weight_decay * p a step) and on matrices only (not biases "
                                   "or norm scales, stacked or not: `optim.decay_mask`; T5's "
                                   "relative-position table is an embedding, decayed); "
                                   "schedule_free_adamw decays every param and sgd's is L2; "
                                   "each optimizer's builder in `optim.OPTIMIZERS` says its "
                                   "own.",
                                   number(ge=0)),
    "optimizer.momentum": _key(0.9, "sgd's momentum.", number(ge=0, lt=1, note="0: none"),
                               needs=_optimizer("sgd")),
    "optimizer.nesterov": _key(False, "sgd: Nesterov momentum.", BOOL, needs=_optimizer("sgd")),
    "optimizer.muon_learning_rate": _key(0.02, "muon: the hidden matrices' peak rate (the rest "
                                         "take `learning_rate`).", number(gt=0),
                                         needs=_optimizer("muon")),
    "optimizer.muon_momentum": _key(0.95, "muon's Nesterov momentum (optax.contrib.muon's, "
                                    "bias-corrected as Adam's: its first steps are larger "
                                    "than the uncorrected reference Muon's).",
                                    number(ge=0, lt=1), needs=_optimizer("muon")),
    # adafactor as T5: learning_rate 0.01, decay inverse_sqrt, warmup_steps 10000, weight_decay 0
    "optimizer.adafactor_decay_rate": _key(0.8, "adafactor: second moments decay as 1 - "
                                           "step^-rate.", number(ge=0, le=1),
                                           needs=_optimizer("adafactor")),
    "optimizer.adafactor_clipping_threshold": _key(1.0, "adafactor: update RMS clipping.",
                                                   number(ge=0, note="0: off"),
                                                   needs=_optimizer("adafactor")),
    "optimizer.adafactor_parameter_scale": _key(True, "adafactor: the rate is relative to each "
                                                "param's RMS.", BOOL,
                                                needs=_optimizer("adafactor")),
    "optimizer.adafactor_min_dim_size_to_factor": _key(128, "adafactor: smallest dimension "
                                                       "whose second moments are factored.",
                                                       int_(ge=1), needs=_optimizer("adafactor")),
    "optimizer.adafactor_momentum": _key(0.0, "adafactor's first-moment decay.",
                                         number(ge=0, lt=1, note="0: none"),
                                         needs=_optimizer("adafactor")),
    "optimizer.grad_clip_norm": _key(1.0, "Global-norm gradient clipping.",
                                     number(ge=0, note="0: no clipping")),
    "optimizer.grad_accumulation_steps": _key(1, "Micro-batches per step (the batch is split "
                                              "into them).", int_(ge=1)),
    "optimizer.freeze": _key("", "Regex of param names (`encoder/layers/...`) that stay fixed.",
                             REGEX),
    "optimizer.head": _key("", "Regex of param names trained at `head_learning_rate`.", REGEX),
    "optimizer.head_learning_rate": _key(0.0, "The head's peak rate (under muon: its AdamW "
                                         "part's; its Muon matrices take muon_learning_rate "
                                         "* head_learning_rate / learning_rate).",
                                         number(ge=0, note="0: optimizer.learning_rate"),
                                         needs=(lambda config: bool(config.optimizer.head),
                                                "optimizer.head (a regex)")),
    # --- mesh: devices per axis (sharding.MESH_AXIS_TABLE); sharding.mesh_shape checks the
    # sizes together
    **{f"mesh.{axis.name}": _key(
        axis.default, f"Devices on the `{axis.name}` axis: {axis.doc}.",
        (lambda v: is_int(v) and (v >= 1 or v == -1),
         "a positive int or -1 (-1: the devices the other axes leave)"))
       for axis in sharding.MESH_AXIS_TABLE},
    # --- pipeline: with mesh.stage > 1 (parallel.pipeline_parallel)
    "pipeline.microbatches": _key(1, "With `mesh.stage` > 1: the microbatches each "
                                  "(accumulation) step's rows split into on the pipeline; the "
                                  "bubble is (S-1)/(M*R+S-1).",
                                  int_(ge=1, note="each (accumulation) step's rows split into "
                                       "them"), needs=_STAGES),
    "pipeline.repeats": _key(1, "With `mesh.stage` > 1: > 1 runs the circular schedule, each "
                             "stage holding this many blocks of layers spread through the stack "
                             "(a smaller bubble; needs microbatches >= stages).",
                             int_(ge=1, note="> 1: the circular schedule"), needs=_STAGES),
    # --- profile: a jax.profiler trace (transformer.training.profiling)
    "profile.start_step": _key(5, "The first step traced by `jax.profiler` into "
                               "`WORKDIR/profile/`.",
                               int_(ge=1, note="the first traced step; step 1 compiles")),
    "profile.num_steps": _key(0, "Steps traced.", int_(ge=0, note="0: no trace")),
    "profile.all_hosts": _key(False, "Trace on every host, not process 0 alone.", BOOL),
    # --- wandb: Weights & Biases (transformer.training.wandb_logging), on when project is set
    "wandb.project": _key("", "Weights & Biases project; \"\": no W&B (set, it needs the `wandb` "
                          "extra).", STR),
    "wandb.entity": _key("", "W&B entity (user or team).", STR),
    "wandb.name": _key("", "W&B run name; \"\": the experiment's.", STR),
    "wandb.mode": _key("", "`offline` writes files under `WORKDIR/wandb/`; \"\": W&B's own "
                       "setting, the `WANDB_MODE` environment variable, else `online`.",
                       one_of(("", *wandb_logging.MODES))),
    "wandb.variant": _key("", "Set by `transformer.sweep`: the variant, a W&B config field.",
                          STR),
}


def model_keys() -> dict[str, Key]:
    """The dataclass-declared model keys, `model.` prefixed (`model.moe.top_k`)."""
    return {f"model.{name}": declared for name, declared in declarations(TransformerConfig)}


def all_keys() -> dict[str, Key]:
    """Every declared key of the run config: `KEYS`, then the dataclass-declared model keys."""
    return {**KEYS, **model_keys()}


def _default(declared: Key):
    value = declared.default
    return ml_collections.ConfigDict(dict(value)) if isinstance(value, dict) else value


def build(model_group: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The run config of `KEYS`' defaults, in their order, with `model_group` (the model
    family's defaults) as `model`, over which `KEYS`' model defaults are set."""
    config = ml_collections.ConfigDict()
    for name, declared in KEYS.items():
        *groups, leaf = name.split(".")
        node = config
        for group in groups:
            if group not in node:
                node[group] = model_group if group == "model" else ml_collections.ConfigDict()
            node = node[group]
        if declared.default is not NO_DEFAULT:
            node[leaf] = _default(declared)
    return config


def idle_settings(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
    """(`KEY=VALUE`, what it needs) of each key set off its default that acts only with
    another setting the config leaves off: a key declared with `needs` (`utils.keys.Key`; the
    keys of a model group whose class says `NEEDS`, as `model.moe.*` without experts).

    >>> from transformer.models import default_model_config
    >>> config = build(default_model_config())
    >>> config.optimizer.update(decay_shape="cosine")
    >>> config.model.moe.top_k = 1
    >>> idle_settings(config)
    [("optimizer.decay_shape='cosine'", "optimizer.decay='wsd'"), \
('model.moe.top_k=1', 'model.moe.num_experts > 0')]
    """
    flat, model_defaults = dotted(config), default_model_config()
    out = [(f"{name}={flat[name]!r}", key.needs[1]) for name, key in KEYS.items()
           if key.needs and name in flat and not key.needs[0](config) and flat[name] != (
               model_defaults[name[len("model."):]] if key.default is NO_DEFAULT
               else key.default)]
    if family_of(config).reads is not None:  # (its unread keys: startup.unread_settings)
        return out
    stack = transformer_config(config.model)
    cross = family_of(config).decoding == "encoder_decoder"  # (multi-head cross-attention)
    return out + [(f"model.{name}={value!r}", needs)
                  for name, (value, needs) in stack.idle_keys(cross).items()]
