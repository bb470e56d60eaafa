"""The base experiment config: every key an experiment file may set, with its default.

Experiment files (`experiments/*.py`) start from `base_config()` and override what they change.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from transformer import sharding
from transformer.models import default_model_config


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
    config.checkpoint_every = 500
    config.keep_checkpoints = 3
    config.fresh_start = False  # True: set the workdir's checkpoints aside and start at step 0
    config.nonfinite = "stop"  # NaN/Inf loss or grads: stop (keep the last good checkpoint) | skip
    config.max_nonfinite_skips = 10  # with "skip": stop after this many bad steps in a row
    config.max_grad_norm = 0.0  # > 0: a step whose gradient norm exceeds it is bad like NaN
    config.z_loss = 0.0
    config.label_smoothing = 0.0
    config.peak_flops_per_device = 0.0  # for MFU in the logs; 0: measure a float32 matmul
    # XLA options for the jitted steps, on top of train.compiler_options' CPU defaults,
    # e.g. {'xla_cpu_multi_thread_eigen': False}.
    config.compiler_options = ml_collections.ConfigDict()
    # Fine-tuning: start params from "WORKDIR", "WORKDIR@STEP" or "hf:DIR" (transformer.finetune).
    config.init_from = ""

    config.model = default_model_config()
    config.model.vocab_size = 0  # 0: the tokenizer's vocabulary size

    config.data = ml_collections.ConfigDict()
    config.data.path = ""  # "": the embedded corpus; or a text file, directory or glob
    config.data.unit = "paragraph"  # how text files are cut into documents: paragraph | file
    config.data.validation_fraction = 0.05
    config.data.tokenizer = "byte"  # byte | char | sentencepiece_bpe | sentencepiece_unigram
    config.data.vocab_size = 0  # SentencePiece vocabulary size (required for SentencePiece)
    config.data.num_sentinels = 100
    config.data.objective = ""  # "": the model family's (next_token, prefix_lm, mlm, ...)
    config.data.mlm_rate = 0.15
    config.data.noise_density = 0.15
    config.data.mean_span_length = 3.0
    config.data.prefetch = 2
    # Labeled tasks (objective "classification" | "text2text"): transformer.data.tasks.
    config.data.task = ""  # speakers (play text at data.path) | modules (the embedded corpus)
    config.data.num_classes = 0  # the task's most frequent labels kept as classes

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.learning_rate = 1e-3
    config.optimizer.warmup_steps = 100
    config.optimizer.decay = "cosine"  # cosine | linear | constant
    config.optimizer.min_learning_rate_ratio = 0.1
    config.optimizer.b1 = 0.9
    config.optimizer.b2 = 0.99
    config.optimizer.weight_decay = 0.1
    config.optimizer.grad_clip_norm = 1.0
    config.optimizer.grad_accumulation_steps = 1
    config.optimizer.freeze = ""  # regex of param names ("encoder/layers/...") that stay fixed
    config.optimizer.head = ""  # regex of param names trained at head_learning_rate
    config.optimizer.head_learning_rate = 0.0  # 0: optimizer.learning_rate

    # Devices per mesh axis (transformer.sharding.MESH_AXIS_TABLE); -1: all remaining devices.
    config.mesh = ml_collections.ConfigDict(
        {axis.name: axis.default for axis in sharding.MESH_AXIS_TABLE})
    return config


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
