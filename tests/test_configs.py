"""Config validation: every key of base_config() checked for its meaning with one-line errors
naming the dotted key, every experiment (and sweep variant) still valid, and a bad value
stopping the CLI before it writes a checkpoint."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import inspect
import math
import os

import ml_collections
import pytest
from test_train import REPO, run_cli

from transformer import config_keys, configs, sweep
from transformer.nn.config import TransformerConfig
from transformer.nn.moe import MoEConfig
from transformer.training import checkpoint_manager
from transformer.utils import keys


def _with(overrides: dict) -> ml_collections.ConfigDict:
    """base_config() with dotted-key overrides, rebuilt from a dict as train.setup does (so any
    type gets through, as in a config built from a dict)."""
    tree = configs.base_config().to_dict()
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    return ml_collections.ConfigDict(tree)


def test_the_base_config_is_valid():
    configs.validate_config(configs.base_config(), num_devices=1, num_processes=1)


def _leaves(config, prefix=""):
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict) and key not in ("compiler_options",):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_every_base_config_key_has_a_check():
    """Every key of base_config() is declared (transformer.config_keys, or a model dataclass
    field), so validate_config checks it, and nothing declared is missing from base_config()."""
    leaves = list(_leaves(configs.base_config()))
    unchecked = [key for key in leaves if key not in configs.CHECKS]
    assert not unchecked, f"declare these keys (transformer/config_keys.py): {unchecked}"
    assert sorted(set(configs.CHECKS) - set(leaves)) == []


def test_a_declaration_without_its_meaning_or_check_is_refused_where_it_is_made():
    with pytest.raises(ValueError, match="expected a meaning"):
        keys.Key(1, "", keys.int_(ge=0))
    with pytest.raises(ValueError, match="expected a check"):
        keys.Key(1, "Steps.", None)
    with pytest.raises(ValueError, match="expected a check"):
        keys.Key(1, "Steps.", (lambda v: True, ""))
    with pytest.raises(ValueError, match="expected a meaning"):
        @dataclasses.dataclass(frozen=True)
        class Settings:  # refused as the class is defined (at import)
            width: int = keys.key(4, " ", keys.POSITIVE_INT)
    with pytest.raises(TypeError):
        keys.key(4, "Width.")  # no check


def test_a_model_field_checks_its_value_by_its_declaration():
    """TransformerConfig (and MoEConfig) run each field's declared check when made; the run
    config's check of the same key is that one, with its dotted name."""
    with pytest.raises(ValueError, match=r"^norm_epsilon=0\.0: expected a number > 0$"):
        TransformerConfig(norm_epsilon=0.0)
    with pytest.raises(ValueError, match=r"^moe\.num_shared=-1: expected an int >= 0$"):
        MoEConfig(num_shared=-1)
    with pytest.raises(ValueError, match=r"^model\.norm_epsilon=-1\.0: expected a number > 0$"):
        configs.validate_config(_with({"model.norm_epsilon": -1.0}), num_devices=1,
                                num_processes=1)


def _changed(value):
    return "changed" if value != "changed" else "other"


def test_the_checkpoints_structural_keys_are_the_declared_ones():
    """A resume refuses a change of exactly the keys declared structural (the model's shape,
    the tokenizer, the optimizer's state layout); the others may change."""
    saved = configs.base_config().to_dict()
    for key, declared in config_keys.all_keys().items():
        current = _with({key: _changed(_lookup(saved, key))}).to_dict()
        differences = checkpoint_manager.structural_differences(saved, current)
        assert bool(differences) == declared.structural, (key, differences)


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


BAD_VALUES = [
    # top level
    ({"experiment": 3}, "expected a str"),
    ({"seed": -1}, "expected an int in [0, 2**31)"),
    ({"seed": 1.5}, "expected an int"),
    ({"steps": 0}, "expected an int >= 1"),
    ({"batch_size": True}, "expected an int >= 1"),
    ({"seq_len": 1}, "expected an int >= 2"),
    ({"log_every": 0}, "expected an int >= 1"),
    ({"eval_every": -1}, "expected an int >= 1"),
    ({"eval_steps": 0}, "expected an int >= 1"),
    ({"checkpoint_every": 0}, "expected an int >= 1"),
    ({"keep_checkpoints": 0}, "newest checkpoint is always kept"),
    ({"fresh_start": 1}, "expected a bool"),
    ({"model.attention_sinks": "yes"}, "model.attention_sinks='yes': expected a bool"),
    ({"nonfinite": "ignore"}, "one of ('stop', 'skip')"),
    ({"max_nonfinite_skips": -1}, "expected an int >= 0"),
    ({"max_grad_norm": -1.0}, "expected a number >= 0 (0: off)"),
    ({"max_grad_norm": math.nan}, "expected a number >= 0"),
    ({"z_loss": -0.1}, "expected a number >= 0"),
    ({"label_smoothing": 1.0}, "expected a number in [0, 1)"),
    ({"peak_flops_per_device": -1.0}, "expected a number >= 0"),
    ({"init_from": None}, "expected a str"),
    ({"eval_seq_lens": (128, 1)}, "expected a tuple of ints >= 2"),
    ({"compiler_options": {"xla_no_such_option": True}}, "XLA rejects them"),
    # data
    ({"data.path": None}, "expected a str"),
    ({"data.unit": "sentence"}, "one of ('paragraph', 'file', 'stream')"),
    ({"data.validation_fraction": 1.0}, "expected a number in [0, 1)"),
    ({"data.tokenizer": "bpe"}, "one of ('byte', 'char', 'sentencepiece_bpe'"),
    ({"data.vocab_size": -1}, "expected an int >= 0"),
    ({"data.vocab_size": 500}, "expected 0 with data.tokenizer='byte'"),
    ({"data.vocab_size": 100, "data.tokenizer": "sentencepiece_unigram"}, "expected >= 264"),
    ({"data.num_sentinels": -1}, "expected an int >= 0"),
    ({"data.objective": "denoise"}, "expected one of ('next_token'"),
    ({"data.mlm_rate": 0.0}, "expected a number in (0, 1)"),
    ({"data.noise_density": 1.0}, "expected a number in (0, 1)"),
    ({"data.mean_span_length": 0.5}, "expected a number >= 1"),
    ({"data.prefetch": -1}, "expected an int >= 0"),
    ({"data.task": "sentiment", "data.objective": "classification"}, "expected one of"),
    ({"data.num_classes": -2}, "expected an int >= 0"),
    # optimizer
    ({"optimizer.learning_rate": -1.0}, "expected a number > 0"),
    ({"optimizer.learning_rate": 0.0}, "expected a number > 0"),
    ({"optimizer.learning_rate": math.inf}, "expected a number > 0"),
    ({"optimizer.warmup_steps": -5}, "expected an int >= 0"),
    ({"optimizer.warmup_steps": 2.5}, "expected an int >= 0"),
    ({"optimizer.decay": "step"}, "one of ('cosine', 'linear', 'constant', 'wsd', 'inverse_sqrt')"),
    ({"optimizer.min_learning_rate_ratio": 1.5}, "expected a number in [0, 1]"),
    ({"optimizer.b1": 1.5}, "expected a number in [0, 1)"),
    ({"optimizer.b2": -0.1}, "expected a number in [0, 1)"),
    ({"optimizer.weight_decay": -1.0}, "expected a number >= 0"),
    ({"optimizer.grad_clip_norm": -1.0}, "(0: no clipping)"),
    ({"optimizer.grad_accumulation_steps": 0}, "expected an int >= 1"),
    ({"optimizer.freeze": "("}, "expected a regular expression"),
    # a WSD decay of one step never leaves the peak (half to even: 2.5 rounds to 2, 0.5 to 0)
    ({"optimizer.decay_fraction": 0.1, "optimizer.decay": "wsd", "steps": 10,
      "optimizer.warmup_steps": 0}, "a decay of 1 step(s) never leaves the peak"),
    ({"optimizer.decay_fraction": 0.05, "optimizer.decay": "wsd", "steps": 10},
     "a decay of 0 step(s) never leaves the peak"),
    ({"optimizer.head": "[a-"}, "expected a regular expression"),
    ({"optimizer.head_learning_rate": -1.0}, "(0: optimizer.learning_rate)"),
    # mesh
    ({"mesh.data": 0}, "expected a positive int or -1"),
    ({"mesh.tensor": 1.0}, "expected a positive int or -1"),
    # model (the constructors' own checks, named with their dotted key)
    ({"model.vocab_size": -3}, "expected an int >= 0"),
    ({"model.num_classes": -1}, "expected an int >= 0"),
    ({"model.num_heads": 0}, "expected a positive int"),
    ({"model.d_model": -1}, "expected a positive int"),
    ({"model.dropout_rate": 1.5}, "expected a number in [0, 1)"),
    ({"model.position": "relative"}, "expected one of"),
    ({"model.family": "rnn"}, "expected one of"),
    ({"model.dtype": "int8"}, "expected one of ('float32', 'bfloat16', 'float16')"),
    ({"model.dtype": "bfloat61"}, "expected one of ('float32', 'bfloat16', 'float16')"),
    ({"model.param_dtype": "int8"}, "expected one of ('float32', 'bfloat16', 'float16')"),
    ({"model.param_dtype": "float64"}, "expected one of"),
    ({"model.head": "none"}, "expected 'mlm' or 'classify' to train"),
    # what a model family reads (configs._validate_objective, _validate_unread)
    ({"data.num_sentinels": 2, "model.family": "t5", "seq_len": 64},
     "makes 3 noise spans a row (data.noise_density=0.15, data.mean_span_length=3.0), each its "
     "own sentinel: expected data.num_sentinels >= 3"),
    ({"data.objective": "mlm", "model.family": "prefix_lm"},
     "its rows hold no ['prefix_lengths'] for the model to read: expected one of ['prefix_lm', "
     "'classification']"),
    ({"data.objective": "span_corruption", "model.family": "prefix_lm"}, "expected one of"),
    ({"data.objective": "next_token", "model.family": "t5"},
     "expected one of ['span_corruption', 'text2text']"),
    ({"seq_len": 17, "model.family": "vit", "model.image_size": 8, "model.patch_size": 4},
     "a ViT reads 5 tokens an image"),
    ({"seq_len": 17, "model.family": "vit", "model.image_size": 8, "model.pooling": "mean"},
     "expected seq_len=16"),
    ({"model.tie_embeddings": False, "model.family": "bert"}, "expected True"),
    ({"model.tie_embeddings": False, "model.family": "captioner"}, "expected True"),
]


@pytest.mark.parametrize("overrides,expected", BAD_VALUES,
                         ids=[",".join(f"{k}={v!r}" for k, v in o.items()) for o, _ in BAD_VALUES])
def test_a_bad_value_is_a_one_line_error_naming_its_dotted_key(overrides, expected):
    """The message starts `KEY=VALUE: expected ...`, KEY being the first override's."""
    key, value = next(iter(overrides.items()))
    with pytest.raises(ValueError) as error:
        configs.validate_config(_with(overrides), num_devices=1, num_processes=1)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{key}="), message
    assert expected in message, message


@pytest.mark.parametrize("overrides", [
    {"optimizer.learning_rate": 1},  # an int for a float key
    {"optimizer.grad_clip_norm": 0},  # no clipping
    {"optimizer.warmup_steps": 0, "optimizer.weight_decay": 0},
    {"optimizer.min_learning_rate_ratio": 1, "optimizer.b1": 0},
    {"optimizer.decay": "wsd", "optimizer.decay_fraction": 0.15, "steps": 10},  # 2 steps
    {"optimizer.decay": "wsd", "optimizer.decay_fraction": 0, "steps": 10},  # no decay
    {"data.validation_fraction": 0, "data.prefetch": 0, "max_nonfinite_skips": 0},
    {"data.tokenizer": "sentencepiece_bpe", "data.vocab_size": 1000},
    {"mesh.data": 1, "mesh.fsdp": -1},
    {"model.dtype": "bfloat16", "model.param_dtype": "float32"},
    {"model.dtype": "float16", "model.param_dtype": "bfloat16"},
    {"model.family": "t5", "seq_len": 64, "data.num_sentinels": 3},
    {"model.family": "vit", "model.image_size": 8, "model.patch_size": 4, "seq_len": 5},
    {"model.family": "prefix_lm", "data.objective": "classification", "data.task": "modules",
     "model.head": "classify", "model.num_classes": 3},
])
def test_edge_values_that_mean_something_are_accepted(overrides):
    configs.validate_config(_with(overrides), num_devices=1, num_processes=1)


# A key no declaration has (a misspelling in an experiment file, which ml_collections takes as
# a new key), refused in one line naming it and the declared key it likely means.
TYPOS = [("evel_every", 5, "eval_every"), ("optimizer.lr", 0.5, "optimizer.learning_rate"),
         ("data.paht", "/nonexistent", "data.path"), ("mesh.fsdpp", 2, "mesh.fsdp"),
         ("model.moe.topk", 2, "model.moe.top_k")]


@pytest.mark.parametrize("key,value,meant", TYPOS, ids=[key for key, _, _ in TYPOS])
def test_an_undeclared_key_is_refused_in_one_line_naming_the_key_it_likely_means(key, value,
                                                                                  meant):
    with pytest.raises(ValueError) as error:
        configs.validate_config(_with({key: value}), num_devices=1, num_processes=1)
    assert str(error.value) == (f"unknown config key {key!r}: expected a declared key (did you "
                                f"mean {meant!r}?)")


def test_undeclared_keys_are_named_together_and_a_free_form_value_is_not_looked_into():
    config = _with({"optimizer.lr": 0.5, "data.paht": "/nonexistent", "zzz": 1})
    with pytest.raises(ValueError) as error:
        configs.validate_config(config, num_devices=1, num_processes=1)
    assert str(error.value) == ("unknown config keys 'data.paht' (did you mean 'data.path'?), "
                                "'optimizer.lr' (did you mean 'optimizer.learning_rate'?), "
                                "'zzz' (docs/config.md lists them): expected declared keys")
    config = _with({"compiler_options": {"xla_cpu_multi_thread_eigen": False}})
    configs.check_declared(config)  # compiler_options: XLA's option names, checked by XLA


def test_a_t5_is_evaluated_only_at_lengths_its_sentinels_cover():
    """Span corruption at another length makes another number of spans: past the sentinels,
    span i's sentinel would be a real token's id (evaluate --eval_seq_len and the run's
    eval_seq_lens read it silently)."""
    from transformer.training import evaluation, startup

    config = _with({"model.family": "t5", "seq_len": 64, "data.num_sentinels": 3})
    configs.validate_config(config, num_devices=1, num_processes=1)
    evaluation.check_eval_seq_len(config, 64)
    with pytest.raises(ValueError, match=r"^data.num_sentinels=3: span corruption of "
                                         r"eval_seq_len=512 makes 28 noise spans a row .* "
                                         r"expected data.num_sentinels >= 28, or a smaller "
                                         r"eval_seq_len or noise_density$"):
        evaluation.check_eval_seq_len(config, 512)
    assert startup.evaluable(config, 64) and not startup.evaluable(config, 512)


def test_each_objectives_rows_hold_the_features_validation_says():
    """configs.ROW_FEATURES (what a family's features are checked against) against the rows
    the converters make."""
    import numpy as np

    from transformer.data import features, tasks, tokenizers

    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=100)
    tokens = np.arange(10, 10 + 2 * 40, dtype=np.int32).reshape(2, 40)
    batch = {"tokens": tokens, "tokens_segment_ids": np.ones_like(tokens),
             "tokens_positions": np.broadcast_to(np.arange(40), tokens.shape).copy()}
    rows = {"next_token": features.next_token_features(batch)}
    keys = features.sample_keys(np.zeros(2, np.uint32), np.arange(2))
    for objective in ("prefix_lm", "mlm", "span_corruption"):
        rows[objective] = features.keyed_converter(
            objective, tokenizer=tokenizer, mlm_rate=0.15, noise_density=0.15,
            mean_span_length=3.0)(batch, keys)
    rows["classification"] = tasks.classification_features(tokens[0], 1, seq_len=8, cls=False,
                                                           tokenizer=tokenizer, prefix=True)
    rows["text2text"] = tasks.text2text_features(tokens[0], 1, tokens[1, :3], seq_len=8,
                                                 target_len=4, tokenizer=tokenizer)
    assert sorted(rows) == sorted(configs.ROW_FEATURES)
    for objective, row in rows.items():
        assert set(configs.ROW_FEATURES[objective]) <= set(row), objective


# --- every experiment file ----------------------------------------------------------------------

# The arguments each experiment taking one accepts (its config-file suffix, "file.py:ARG").
ARGUMENTS = {
    "gpt_shakespeare_char": ["gpu", "cpu"],
    "bert_finetune_cls": ["modules", "speakers"],
    "gpt_finetune_cls": ["modules", "speakers"],
    "t5_finetune_text2text": ["modules", "speakers"],
    "ablations/pretrain_vs_scratch": [f"{family}{task}" for family in ("bert", "t5", "gpt")
                                      for task in ("", ",speakers")],
    "ablations/hybrids": ["512", "4096"],
    "sft_chat": ["full", "cpu"],
}


def _experiment_files():
    root = os.path.join(REPO, "experiments")
    return sorted(os.path.relpath(p, root)[:-3] for p in glob.glob(f"{root}/**/*.py",
                                                                   recursive=True))


def _load(name: str):
    path = os.path.join(REPO, "experiments", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_experiment_{name.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_experiment_taking_an_argument_lists_its_choices_here():
    taking = [name for name in _experiment_files()
              if inspect.signature(_load(name).get_config).parameters]
    assert sorted(taking) == sorted(ARGUMENTS)


@pytest.mark.parametrize("name,args", [(name, args) for name in _experiment_files()
                                       for args in ([(a,) for a in ARGUMENTS[name]]
                                                    if name in ARGUMENTS else [()])])
def test_every_experiment_and_sweep_variant_validates(name, args):
    """Every key each sets is declared, and every value valid. init_from names a pretraining
    workdir that need not exist here: that check reads the disk, not the config."""
    module = _load(name)
    config = module.get_config(*args)
    config.init_from = ""
    if config.data.tokenizer == "hf" and not config.data.tokenizer_path:
        config.data.tokenizer = "byte"  # the hf tokenizer comes from init_from's directory too
    configs.validate_config(config, num_devices=1, num_processes=1)
    if hasattr(module, "get_sweep"):
        for variant in module.get_sweep():
            configs.validate_config(sweep.apply(config, variant), num_devices=1,
                                    num_processes=1)
        # get_seeds() and get_baseline(), where given, are valid and name a variant
        _, baseline = sweep.load_options(os.path.join(REPO, "experiments", f"{name}.py"))
        sweep.check_baseline(baseline, [variant.name for variant in module.get_sweep()])


@pytest.mark.parametrize("typo, meant", [
    ("optimizer.lr", "optimizer.learning_rate"), ("learning_rate", "optimizer.learning_rate"),
    ("model.act", "model.activation"), ("model.dropout", "model.dropout_rate"),
    ("vocab_size", "data.vocab_size or model.vocab_size"), ("train_steps", "steps"),
    ("model.n_head", "model.num_heads"), ("model.n_layers", "model.num_layers"),
    ("model.kv_heads", "model.num_kv_heads"), ("data.tokeniser", "data.tokenizer"),
    ("model.moe.num_expert", "model.moe.num_experts"), ("modle.d_model", "model.d_model"),
    ("batchsize", "batch_size"), ("optimizer.wd", "optimizer.weight_decay"),
])
def test_a_mistyped_key_gets_the_key_meant(typo, meant):
    """`--config.KEY` typos and experiment files' unknown keys are answered with the declared
    key meant, its own group first (model.act was answered with an optimizer key whose
    initials it is, model.dropout with lora.dropout, vocab_size with batch_size)."""
    from transformer.utils import cli, keys

    assert cli.closest(typo, keys.dotted(configs.base_config().to_dict())) == meant


def test_a_bad_hybrids_length_is_named_before_it_divides():
    """hybrids.py's argument that is no int >= 2 is refused in one line by the file, before
    1024 // length divides by it (`:0` was a ZeroDivisionError)."""
    assert _load("ablations/hybrids").get_config("4096").batch_size == 1
    for argument, shown in (("0", "0"), ("-64", "-64"), ("4k", "'4k'")):
        with pytest.raises(ValueError) as error:
            _load("ablations/hybrids").get_config(argument)
        assert str(error.value) == f"seq_len={shown}: expected an int >= 2 (config file argument)"


# --- through the CLI ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_rejects_a_bad_value_before_writing_a_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    result = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                     f"--workdir={workdir}", "--config.optimizer.learning_rate=-1",
                     logs=tmp_path / "logs")
    assert result.returncode != 0
    assert "optimizer.learning_rate" in result.stderr
    assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


def test_the_cpu_benchmarks_time_the_gpu_recipe_without_dropout_in_float32():
    """benchmarks/compile_time.py's `gpt_config` (train_throughput, remat, compile_time) takes
    the shapes of the GPU recipe, but what nanoGPT's side runs on CPU: no dropout of any kind,
    float32. The recipe's own dropout and bfloat16 must not leak in."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from compile_time import gpt_config

    recipe = _load("gpt_shakespeare_char").get_config("gpu").model
    assert recipe.dropout_rate and recipe.attention_dropout_rate and recipe.dtype == "bfloat16"
    model = gpt_config(layers=2, d_model=64, heads=2, d_ff=256, seq_len=32, batch=2,
                       vocab=65).model
    assert (model.dropout_rate, model.attention_dropout_rate, model.dtype) == (
        0.0, 0.0, "float32")
    assert (model.use_bias, model.activation, model.tie_embeddings) == (
        recipe.use_bias, recipe.activation, recipe.tie_embeddings)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["model.dtype=int8", "model.param_dtype=bfloat61"])
def test_the_cli_names_a_dtype_it_cannot_compute_in(flag, tmp_path):
    result = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                     f"--workdir={tmp_path / 'run'}", f"--config.{flag}", logs=tmp_path / "logs")
    key, value = flag.split("=")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {key}={value!r}: expected one of ('float32', 'bfloat16', 'float16')"]
    assert not (tmp_path / "run").exists()
