"""Pretrain, then adapt: labeled tasks and their splits, init_from (workdir and Hugging Face),
frozen and re-weighted parameter groups, the classifier heads, and a pretrain -> fine-tune ->
evaluate run through the CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import forkserver
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from transformer import configs, train
from transformer.configs import base_config
from transformer.data import tasks, tokenizers
from transformer.models import build_model
from transformer.training import finetune, optim
from transformer.utils import fileio

REPO = Path(__file__).resolve().parents[1]
SPEAKERS = ["ROMEO", "JULIET", "NURSE", "FRIAR", "PARIS"]
TINY_MODEL = dict(num_layers=1, d_model=32, num_heads=2, d_ff=64)


def play_text(speeches: int = 400) -> str:
    """Play text in tinyshakespeare's format: speaker k says words that favour k, so the task
    is learnable; speaker frequencies fall off so the class order is known."""
    rng = np.random.default_rng(0)
    words = ["love", "night", "death", "wine", "grace", "cup", "sword", "moon", "ring", "star"]
    lines = []
    for i in range(speeches):
        k = min(int(rng.geometric(0.35)) - 1, len(SPEAKERS) - 1)
        said = [words[2 * k + int(rng.integers(2))] if rng.random() < 0.6
                else words[int(rng.integers(len(words)))] for _ in range(6)]
        lines.append(f"{SPEAKERS[k]}:\n{' '.join(said)} {i}.\n")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def play(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("play") / "play.txt"
    path.write_text(play_text())
    return path


def task_config(path, *, family="bert", objective="classification", steps=4):
    config = base_config()
    config.update(steps=steps, batch_size=4, seq_len=24, log_every=1, eval_every=steps,
                  eval_steps=50, checkpoint_every=steps)
    config.model.update(family=family, head="classify" if family != "t5" else "mlm",
                        **TINY_MODEL)
    if family == "t5":
        config.model.num_decoder_layers = 1
    config.data.update(path=str(path), task="speakers", num_classes=3, objective=objective,
                       validation_fraction=0.15, num_sentinels=0 if family != "t5" else 100)
    return config


# --- tasks ----------------------------------------------------------------------------------


def test_speaker_splits_are_disjoint_stable_and_follow_the_pretraining_split(play):
    task = tasks.make_task("speakers", str(play), 3, 0.15)
    assert task.labels == ("ROMEO", "JULIET", "NURSE")  # the most frequent three, in order
    again = tasks.make_task("speakers", str(play), 3, 0.15)
    assert task.splits == again.splits
    sources = {split: {e.source for e in examples} for split, examples in task.splits.items()}
    assert not sources["train"] & sources["test"] and not sources["validation"] & sources["test"]
    assert not sources["train"] & sources["validation"]
    assert sum(map(len, task.splits.values())) == sum(
        1 for _ in tasks.speaker_speeches(play.read_text())
        if _[0] in task.labels)
    # Test paragraphs are exactly the ones pretraining with the same fraction holds out.
    from transformer.data import sources as sources_lib

    pretrain_validation = {d.text for d in sources_lib.load_documents(
        str(play), "validation", validation_fraction=0.15)}
    assert sources["test"] <= pretrain_validation
    assert not (sources["train"] | sources["validation"]) & pretrain_validation
    assert "train (" in task.balance() and "ROMEO" in task.balance()


def test_task_errors_name_the_bad_value(play):
    with pytest.raises(ValueError, match="data.num_classes=9: the text has only 5 labels"):
        tasks.make_task("speakers", str(play), 9, 0.15)
    with pytest.raises(ValueError, match="expected data.path"):
        tasks.make_task("speakers", "", 3, 0.15)
    with pytest.raises(ValueError, match="data.task='poems'"):
        tasks.make_task("poems", str(play), 3, 0.15)
    config = task_config(play, family="t5")
    with pytest.raises(ValueError, match="data.task='speakers' with data.objective='mlm'"):
        config.data.objective = "mlm"
        configs.validate_config(config)
    config = task_config(play, family="bert", objective="text2text")
    with pytest.raises(ValueError, match="model.family='bert': expected 't5'"):
        configs.validate_config(config)
    # A head of other than the task's classes: labels past it give NaN, classes it has that
    # never occur understate macro-F1.
    from transformer.training import startup

    for wrong in (2, 5):
        config = task_config(play, family="gpt")
        config.model.num_classes = wrong
        with pytest.raises(ValueError, match=rf"model.num_classes={wrong}: the task has 3 "
                                             r"labels: expected 3 \(or 0"):
            startup.resolve(config, None)
    config.model.num_classes = 0
    startup.resolve(config, None)
    assert config.model.num_classes == 3


def test_speakers_of_any_script_or_with_digits_are_read_and_skipped_paragraphs_counted(
        tmp_path):
    """`[A-Z][A-Za-z' .-]*` read ASCII names only: `ÉLISE:` and `CITIZEN2:` were dropped, and
    so were a speech on the name's line and an empty one, without a word."""
    path = tmp_path / "play.txt"
    path.write_text(play_text(60) + "\nÉLISE:\nBonjour mon ami.\n\nCITIZEN2:\nWe are poor.\n"
                    "\nROMEO: same line text\n\nJULIET:\n   \n\nEnter Romeo.\n")
    task = tasks.make_task("speakers", str(path), 0, 0.15)  # 0: every speaker
    assert set(task.labels) == {*SPEAKERS, "ÉLISE", "CITIZEN2"}
    assert sum(map(len, task.splits.values())) == 62  # the 60 speeches are read as before
    assert task.balance().splitlines()[-1] == (
        "skipped 3 of 65 paragraphs as no speech: 2 without a `NAME:` line of their own (the "
        "first: 'ROMEO: same line text'), 1 with an empty speech (the first: 'JULIET:')")
    for lower in ("élise:\nOui.\n", "2CITIZEN:\nAy.\n"):  # not a name: skipped, counted
        assert tasks.speaker_speeches(lower, skipped := []) == [] and len(skipped) == 1


def test_num_classes_0_keeps_every_label_and_1_is_refused(play, tmp_path):
    config = task_config(play)
    config.data.num_classes = 0  # the declared "0: all the task's labels"
    configs.validate_config(config)
    assert set(tasks.task_for(config).labels) == set(SPEAKERS)
    with pytest.raises(ValueError, match=r"data.num_classes=1: expected an int >= 2, or 0 "
                                         r"\(all the task's labels\)$"):
        tasks.make_task("speakers", str(play), 1, 0.15)
    alone = tmp_path / "alone.txt"
    alone.write_text("".join(f"ROMEO:\nline {i}.\n\n" for i in range(40)))
    with pytest.raises(ValueError, match="data.num_classes=0: the text has only 1 labels "
                                         r"\(\['ROMEO'\]...\): expected at least 2$"):
        tasks.make_task("speakers", str(alone), 0, 0.15)


class _Position:
    """A data iterator's position, as the checkpoint manager saves it."""

    def get_state(self) -> dict:
        return {"batch": 1}


def _saved_classifier(workdir: Path, config, *, record: bool = True) -> None:
    """Step 1 of a classifier run as training saves it (its config and data stream), its state
    a stand-in (nothing here restores it); `record=False`: as saved before the data stream
    recorded the class names."""
    from transformer.data import inputs
    from transformer.training import checkpoint_manager

    stream = inputs.data_stream(config)
    if not record:
        del stream[tasks.LABELS]
    manager = checkpoint_manager.Manager(str(workdir), config, stream)
    manager.save(1, {"params": {"w": np.zeros(2, np.float32)}}, _Position())
    manager.close()


def test_a_checkpoint_records_its_class_names_and_other_classes_are_refused(tmp_path):
    """The class ids are the task's labels by frequency, derived from the data each time: with
    80 NURSE speeches added, NURSE became class 0 and `evaluate --split=test` scored the
    model's 0 (trained as ROMEO) as NURSE, saying only that the content fingerprint changed;
    a new_data=True resume and an init_from of the classifier trained on it silently."""
    from transformer import evaluate
    from transformer.data import inputs
    from transformer.hf import export
    from transformer.training import checkpoint, checkpoint_manager

    path, run, old = tmp_path / "play.txt", tmp_path / "cls", tmp_path / "old"
    path.write_text(play_text())
    config = task_config(path, family="gpt")
    config.model.num_classes = 3
    _saved_classifier(run, config)
    _saved_classifier(old, config, record=False)
    trained = ["ROMEO", "JULIET", "NURSE"]
    assert checkpoint.saved_stream(str(run), 1)[tasks.LABELS] == trained
    for workdir in (run, old):  # the same data: resumed as before
        assert checkpoint_manager.Manager(str(workdir), config,
                                          inputs.data_stream(config)).check(1) == []
    path.write_text(play_text() + "".join(f"\nNURSE:\nextra nurse line {i}.\n"
                                          for i in range(200)))
    tasks._cached_task.cache_clear()  # (the process read the task before the data changed)
    now = ["NURSE", "ROMEO", "JULIET"]
    assert list(tasks.task_for(config).labels) == now
    lists = (f"was trained on the classes {trained}, but the task's data now gives {now} (class "
             "i is the i-th name: its class ids would stand for other names)")
    with pytest.raises(ValueError) as error:  # before the restore (a stand-in state)
        evaluate.evaluate_workdir(str(run), split="test")
    assert str(error.value) == f"checkpoint 1 of {run} {lists}: expected the data it was " \
        "trained on (the classes are the task's data.num_classes most frequent labels)"
    stream = inputs.data_stream(config)
    for new_data in (True, False):
        config.new_data = new_data
        with pytest.raises(checkpoint_manager.ConfigMismatch) as error:
            checkpoint_manager.Manager(str(run), config, stream).check(1)
        assert str(error.value) == (
            f"checkpoint {run}/checkpoints/1 {lists}: expected data that gives the same classes "
            "in the same order (new_data=True too); or fine-tune from its pretraining source "
            "in another workdir")
    source = task_config(path, family="gpt")
    source.init_from = str(run)
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(source)
    assert str(error.value) == (
        f"init_from={str(run)!r}: its checkpoint 1, whose class head this run loads, {lists}: "
        "expected a source without a class head (its pretraining run), or data that gives the "
        "same classes in the same order")
    # The export names the trained classes, with no data read (moved away) ...
    config.data.path = str(tmp_path / "moved.txt")
    assert export.task_labels(config, checkpoint.saved_stream(str(run), 1)) == trained
    # ... and a checkpoint saved before the names were recorded reads as it did.
    config.data.path, config.new_data = str(path), True
    assert checkpoint_manager.Manager(str(old), config, stream).check(1) == [
        f"content fingerprint: checkpoint {checkpoint.saved_stream(str(old), 1)['fingerprint']!r}"
        f", config {stream['fingerprint']!r}"]
    evaluate.check_labels(str(old), 1, now)
    source.init_from = str(old)
    assert finetune.resolve_init_config(source).init_from == str(old)


def test_an_exported_classifier_takes_its_tasks_label_names(play, tmp_path, capsys):
    from transformer.hf import export

    config = task_config(play)
    assert export.task_labels(config) == ["ROMEO", "JULIET", "NURSE"]
    config.model.head = "mlm"  # no class head: no names
    assert export.task_labels(config) is None
    config = task_config(play)
    config.data.path = str(tmp_path / "moved.txt")
    assert export.task_labels(config) is None  # exported elsewhere: LABEL_i, and a warning
    message = capsys.readouterr().err
    assert message.startswith(f"warning: data.path={config.data.path!r}: the classifier's "
                              "label names ") and message.count("\n") == 1
    assert message.endswith("id2label stays LABEL_0, LABEL_1, ...\n")


def test_evaluation_batches_read_every_example_once(play):
    config = task_config(play)
    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=0)
    batches = list(tasks.make_dataset(config, tokenizer, "test", num_epochs=1, shuffle=False))
    test = tasks.task_for(config).splits["test"]
    assert sum(float(b["weights"].sum()) for b in batches) == len(test)
    labels = np.concatenate([b["targets"][b["weights"] > 0] for b in batches])
    assert labels.tolist() == [e.label for e in test]


def test_training_reads_every_example_once_per_epoch_in_a_new_order(play):
    config = task_config(play)
    config.update(batch_size=1, seq_len=80)  # long enough for every speech
    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=0)
    train_split = tasks.task_for(config).splits["train"]
    n = len(train_split)
    iterator = iter(tasks.make_dataset(config, tokenizer, "train"))
    epochs = [[next(iterator)["inputs"][0].tobytes() for _ in range(n)] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == len(
        {e.text for e in train_split})
    assert epochs[0] != epochs[1]


# --- loading params -------------------------------------------------------------------------


def test_match_reports_loaded_new_and_dropped_and_rejects_mismatches():
    source = {"embed/embedding": (10, 4), "encoder/layers/w": (2, 4, 4), "mlm_bias": (10,)}
    target = {"embed/embedding": (10, 4), "encoder/layers/w": (2, 4, 4), "classifier/w": (4, 3)}
    report = finetune.match(source, target, "src")
    assert (report.loaded, report.new, report.dropped) == (
        ["embed/embedding", "encoder/layers/w"], ["classifier/w"], ["mlm_bias"])
    with pytest.raises(ValueError, match=r"param embed/embedding has shape \(10, 4\) there but "
                                         r"\(12, 4\)"):
        finetune.match(source, {**target, "embed/embedding": (12, 4)}, "src")
    unrolled = {"embed/embedding": (10, 4), "encoder/layers_0/w": (4, 4)}
    with pytest.raises(ValueError, match="num_layers and model.scan_layers"):
        finetune.match(source, unrolled, "src")
    tuned = {**target, "classifier/bias": (3,), "classifier/kernel": (4, 3)}  # a 3-class run
    with pytest.raises(ValueError, match=r"^init_from src: its class head classifier/bias has 3 "
                                         r"classes but this run's has 5 \(model.num_classes"):
        finetune.match(tuned, {**tuned, "classifier/bias": (5,), "classifier/kernel": (4, 5)},
                       "src")


@pytest.mark.slow
def test_init_from_a_hugging_face_bert_loads_the_converted_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformer.hf import convert

    hf = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=24))
    hf.save_pretrained(tmp_path)
    model_config, converted = convert.from_hf(hf.config, hf.state_dict())
    model_config.update(head="classify", num_classes=3)
    model = build_model(model_config)
    fresh = nn.unbox(jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))[
        "params"])
    shardings = jax.tree.map(lambda x: x.sharding, fresh)
    params, report = finetune.load_params(f"hf:{tmp_path}", fresh, shardings)
    flat, source = finetune._flat(params), finetune._flat(converted)
    assert report.loaded and all(np.array_equal(flat[k], source[k]) for k in report.loaded)
    assert sorted(report.new) == sorted(k for k in flat if k.startswith(("pooler", "classifier")))
    assert all(k.startswith("mlm") for k in report.dropped)
    fresh_flat = finetune._flat(fresh)
    assert all(np.array_equal(flat[k], fresh_flat[k]) for k in report.new)


# --- init_from a workdir: the source's architecture ------------------------------------------


@pytest.fixture(scope="module")
def gpt_base(tmp_path_factory) -> Path:
    """A 2-step gpt_tiny workdir whose activation and norm_epsilon, keys that change no param's
    shape, are not gpt_tiny's."""
    from test_train import tiny_config

    workdir = tmp_path_factory.mktemp("gpt_base") / "run"
    config = tiny_config()
    assert (config.model.activation, config.model.norm_epsilon) != ("relu", 1e-3)
    config.model.update(activation="relu", norm_epsilon=1e-3)
    train.train_and_evaluate(config, str(workdir))
    return workdir


@pytest.mark.slow
def test_init_from_a_workdir_takes_its_architecture_and_refuses_a_contradicting_flag(
        gpt_base, tmp_path, capsys):
    from test_train import run_cli, tiny_config, tiny_flags

    from transformer.training import checkpoint

    config = tiny_config(init_from=str(gpt_base))
    resolved = finetune.resolve_init_config(config, explicit={"model.num_layers"})  # the same
    assert (resolved.model.activation, resolved.model.norm_epsilon) == ("relu", 1e-3)
    for key, value, says in [("activation", "gelu_tanh", "'relu'"),
                             ("norm_epsilon", 1e-5, "0.001")]:
        with pytest.raises(ValueError) as error:
            finetune.resolve_init_config(config, explicit={f"model.{key}"})
        assert str(error.value) == \
            f"model.{key}={value!r}: {gpt_base}@2's saved config says {says}"
    # A run from it trains the source's model (train.setup resolves), every param loaded.
    train.train_and_evaluate(config, str(tmp_path / "run"))
    count = len(checkpoint.params_metadata(str(gpt_base))[1])
    assert f"@2: loaded {count} params; new 0; dropped 0" in capsys.readouterr().out
    saved = checkpoint.saved_run(str(tmp_path / "run"))[1].model
    assert (saved.activation, saved.norm_epsilon) == ("relu", 1e-3)
    result = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                     f"--config.init_from={gpt_base}", *tiny_flags(2),
                     "--config.model.norm_epsilon=0.01", f"--workdir={tmp_path / 'bad'}",
                     logs=tmp_path / "logs")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        f"error: model.norm_epsilon=0.01: {gpt_base}@2's saved config says 0.001"
    assert not (tmp_path / "bad").exists()


def test_a_fine_tune_resumes_its_own_architecture_whatever_its_source_holds_now(tmp_path):
    """A fine-tune's saved config names init_from=DIR, not the step it loaded, and every start
    re-read DIR's latest config: the source retrained since with another num_layers made the
    unchanged relaunch fail ("model.num_layers: checkpoint 2, config 3"). A run resuming from
    its own checkpoints resolves against its latest one; a fresh start, against the source."""
    from test_train import tiny_config

    from transformer.training import checkpoint

    source, run = tmp_path / "source", tmp_path / "run"
    train.train_and_evaluate(tiny_config(), str(source))
    train.train_and_evaluate(tiny_config(init_from=str(source)), str(run))
    mine = tiny_config().model
    retrained = tiny_config(fresh_start=True)
    retrained.model.update(num_layers=mine.num_layers + 1, activation="relu")
    train.train_and_evaluate(retrained, str(source))
    result = train.train_and_evaluate(tiny_config(init_from=str(source), steps=4), str(run))
    assert result["summary"]["step"] == 4
    saved = checkpoint.saved_run(str(run))[1].model
    assert (saved.num_layers, saved.activation) == (mine.num_layers, mine.activation)
    relu = tiny_config(init_from=str(source))
    relu.model.activation = "relu"
    with pytest.raises(ValueError, match=re.escape(
            f"model.activation='relu': this run's own checkpoint {run}@4's saved config says "
            f"{mine.activation!r}")):
        finetune.resolve_init_config(relu, {"model.activation"}, str(run))
    resolved = finetune.resolve_init_config(tiny_config(init_from=str(source), fresh_start=True),
                                            workdir=str(run))
    assert (resolved.model.num_layers, resolved.model.activation) == (mine.num_layers + 1, "relu")


def test_a_run_from_a_workdir_takes_its_tokenizers_sentinel_count(gpt_base):
    """The run reads text with the source's tokenizer, so data.num_sentinels is its count (a
    T5 from a 3-sentinel workdir checked its spans against the default 100); a different count
    set on the command line is refused."""
    from test_train import tiny_config

    from transformer.data import tokenizers

    own = tokenizers.load_tokenizer(str(gpt_base / "tokenizer")).num_sentinels
    config = tiny_config(init_from=str(gpt_base))
    config.data.num_sentinels = own + 3  # an experiment file's value
    assert finetune.resolve_init_config(config).data.num_sentinels == own
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(config, explicit={"data.num_sentinels"})
    assert str(error.value) == (
        f"data.num_sentinels={own + 3}: the tokenizer of init_from={str(gpt_base)!r}, which the "
        f"run reads text with, has {own}: expected data.num_sentinels={own}")


def _save_then_delete(steps: Path, step: int) -> None:
    """What a training saving every step with keep_checkpoints=1 does to a reader of `step`:
    it saves a newer step (written aside, renamed into place) and deletes `step` (one rename
    into checkpoints/deleted/)."""
    newer = steps / f"{step + 2}.orbax-checkpoint-tmp-1"
    shutil.copytree(steps / str(step), newer)
    newer.rename(steps / str(step + 2))
    (steps / "deleted").mkdir(exist_ok=True)
    (steps / str(step)).rename(steps / "deleted" / str(step))


@pytest.mark.parametrize("orbax_says", [None, "Found incomplete checkpoint at {}."])
def test_init_from_a_training_workdir_reads_metadata_and_params_of_one_step(
        gpt_base, tmp_path, monkeypatch, orbax_says):
    """A fine-tune beside a training that saves every step (keep_checkpoints=1): the step
    init_from chose was deleted between reading its params' metadata and its params, and
    Orbax failed (a missing step, "Found incomplete checkpoint", a missing file or a truncated
    read). Both are read again, together, from the then-newest step, which the report names;
    a given @STEP deleted so is one line naming it."""
    from transformer.training import checkpoint

    source = tmp_path / "source"
    shutil.copytree(gpt_base, source)
    saved = checkpoint.restore_params(str(source))
    real, reads = checkpoint.read_params, []

    def racing(workdir, step, *args, **kwargs):
        if not reads:  # the first read: the training moves on meanwhile
            _save_then_delete(source / "checkpoints", step)
            if orbax_says:
                reads.append(step)
                raise ValueError(orbax_says.format(source / "checkpoints" / str(step)))
        reads.append(step)
        return real(workdir, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "read_params", racing)
    fresh = jax.tree.map(jnp.zeros_like, saved.params)
    shardings = jax.tree.map(lambda a: a.sharding, saved.params)
    params, report = finetune.load_params(str(source), fresh, shardings)
    assert reads == [2, 4] and report.source == f"{source}@4" and not report.new
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                     jax.tree.leaves(saved.params), strict=True))
    reads.clear()
    with pytest.raises(ValueError, match=rf"^step=4: checkpoint 4 of {re.escape(str(source))} "
                                         r"was deleted while it was read \(.*\): expected a "
                                         r"step it keeps, or no step \(the newest\)$"):
        finetune.load_params(f"{source}@4", fresh, shardings)


def test_a_step_deleted_while_the_steps_are_listed_is_listed_again(gpt_base, monkeypatch):
    """Orbax's CheckpointManager lists the steps as it opens, reading each one's record (or,
    without it, its folder's time): a step deleted meanwhile made a fine-tune's whole error
    "[Errno 2] No such file or directory: '.../checkpoints/889'". Readers open it again."""
    from transformer.training import checkpoint

    real, opened = checkpoint.ocp.CheckpointManager, []

    def racing(directory, *args, **kwargs):
        opened.append(directory)
        if len(opened) == 1:
            raise FileNotFoundError(2, "No such file or directory", f"{directory}/1")
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(checkpoint.ocp, "CheckpointManager", racing)
    assert checkpoint.complete_steps(str(gpt_base)) == [2] and len(opened) == 2


def test_a_step_deleted_while_its_config_is_read_gives_way_and_the_source_is_never_skipped(
        gpt_base, tmp_path, monkeypatch):
    """Orbax says "Found incomplete checkpoint" (a ValueError) of a step deleted while it
    reads it: the fine-tune's start exited 2, or, worse, read it as no source at all and built
    the experiment's model rather than the source's (another activation here). The config is
    read from the then-newest step; an error left names init_from."""
    from test_train import tiny_config

    from transformer.training import checkpoint

    source = tmp_path / "source"
    shutil.copytree(gpt_base, source)
    steps = source / "checkpoints"
    real = checkpoint._reader

    def racing(*args, **kwargs):
        reader = real(*args, **kwargs)
        restore = reader.restore

        def deleting(step, *more, **kwargs):
            if step == 2 and not (steps / "4").exists():
                _save_then_delete(steps, 2)
                raise ValueError(f"Found incomplete checkpoint at {steps / '2'}.")
            return restore(step, *more, **kwargs)

        reader.restore = deleting
        return reader

    monkeypatch.setattr(checkpoint, "_reader", racing)
    config = tiny_config(init_from=str(source))
    assert finetune.resolve_init_config(config).model.activation == "relu"  # the source's
    assert (steps / "4").exists() and not (steps / "2").exists()

    def damaged(*args):
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    monkeypatch.setattr(checkpoint, "saved_run", damaged)
    with pytest.raises(ValueError, match=rf"^init_from='{re.escape(str(source))}': Expecting"):
        finetune.resolve_init_config(config)


def test_context_extension_sets_rope_frequencies_over_the_source(gpt_base, tmp_path, capsys,
                                                                  caplog):
    """RoPE's frequency keys (finetune.ROPE_SETTINGS) change no param: a run from a workdir
    takes its own from the command line or the experiment file (position interpolation to a
    longer seq_len), every param loaded; a key that changes the params is still refused."""
    from test_train import tiny_config

    from transformer.training import checkpoint

    config = tiny_config(init_from=str(gpt_base), seq_len=32)
    config.model.update(rope_scale=2.0, rope_scaling="yarn", rope_original_max_len=16,
                        rope_theta=5e5)
    flags = {"model.rope_scale", "model.rope_scaling", "model.rope_original_max_len"}
    for explicit in (flags, set()):  # set on the command line, or in the experiment file
        caplog.clear()
        resolved = finetune.resolve_init_config(config, explicit=explicit)
        # said, not silent (an experiment file's value over the source's above all)
        assert "model.rope_scale=2.0, where " in caplog.text and "(context extension)" in \
            caplog.text
        assert (resolved.model.rope_scale, resolved.model.rope_scaling,
                resolved.model.rope_original_max_len, resolved.model.rope_theta) == \
            (2.0, "yarn", 16, 5e5)
        assert resolved.model.activation == "relu"  # the rest is still the source's
    config.model.rope_fraction = 0.5
    with pytest.raises(ValueError, match=r"^model.rope_fraction=0.5: .*@2's saved config says"):
        finetune.resolve_init_config(config, explicit={"model.rope_fraction"})
    config.model.rope_fraction = 1.0
    config.model.update(rope_scaling="linear", rope_theta=10000.0)
    train.train_and_evaluate(finetune.resolve_init_config(config), str(tmp_path / "long"))
    count = len(checkpoint.params_metadata(str(gpt_base))[1])
    assert f"@2: loaded {count} params; new 0; dropped 0" in capsys.readouterr().out
    assert checkpoint.saved_run(str(tmp_path / "long"))[1].model.rope_scale == 2.0
    # A run from the extended model, setting none, keeps its source's scaling.
    again = finetune.resolve_init_config(tiny_config(init_from=str(tmp_path / "long")))
    assert (again.model.rope_scale, again.model.activation) == (2.0, "relu")


@pytest.mark.slow
def test_a_gpt_pretrained_with_mtp_fine_tunes_without_its_modules(tmp_path):
    """The MTP modules are a pretraining head: a classifier, a prefix LM or a run setting
    model.mtp.depth=0 drops them (reported dropped); a decoder LM run keeps them."""
    from test_train import tiny_config

    from transformer.training import checkpoint

    base = tmp_path / "mtp"
    config = tiny_config()
    config.model.mtp.depth = 1
    train.train_and_evaluate(config, str(base))
    source = {k: m.shape for k, m in checkpoint.params_metadata(str(base))[1].items()}
    mtp = sorted(k for k in source if k.startswith("mtp_0/"))
    assert any("/layers_0/" in k for k in mtp)
    classify = tiny_config("gpt_finetune_cls", init_from=str(base))
    cases = [(classify, set()), (tiny_config("prefix_lm", init_from=str(base)), set()),
             (tiny_config(init_from=str(base)), {"model.mtp.depth"})]
    cases[2][0].model.mtp.depth = 0
    for run, explicit in cases:
        resolved = finetune.resolve_init_config(run, explicit=explicit)
        assert resolved.model.mtp.depth == 0, resolved.model.family
        resolved.model.update(num_classes=3, vocab_size=source["embed/embedding"][0])
        configs.validate_config(resolved, num_devices=1, num_processes=1, files=False)
        model = build_model(resolved.model)
        target = finetune._flat(nn.unbox(jax.eval_shape(
            model.init, jax.random.key(0), np.zeros((1, 8), np.int32))["params"]))
        report = finetune.match(source, {k: v.shape for k, v in target.items()}, "src")
        assert [k for k in report.dropped if k.startswith("mtp_")] == mtp
    kept = finetune.resolve_init_config(tiny_config(init_from=str(base)))
    assert kept.model.mtp.depth == 1


@pytest.mark.slow
def test_a_lora_run_on_a_workdir_trains_and_is_refused_as_an_init_from(gpt_base, tmp_path):
    """A LoRA run's checkpoints hold its adapters only: as init_from it is refused in one line
    saying so and how to get a model to start from, before a model is built."""
    from test_train import tiny_config

    from transformer.training import checkpoint

    config = tiny_config(init_from=str(gpt_base))
    config.model.lora.rank = 2
    train.train_and_evaluate(config, str(tmp_path / "lora"))
    assert checkpoint.saved_run(str(tmp_path / "lora"))[1].model.activation == "relu"
    source = str(tmp_path / "lora")
    says = (f"init_from={source!r}: {source}@2 is a LoRA run, whose checkpoints hold its "
            "adapters only, not a model to start from: expected a full checkpoint, e.g. the "
            f"merged model (python -m transformer.export --workdir={source} --output=DIR "
            "--merge_lora, then init_from=hf:DIR)")
    with pytest.raises(ValueError) as error:
        finetune.resolve_init_config(tiny_config(init_from=source))
    assert str(error.value) == says
    with pytest.raises(ValueError) as error:  # an in-process load, without the config step
        finetune.load_params(source, {}, {})
    assert str(error.value) == says


# --- optimizer groups -----------------------------------------------------------------------


def test_frozen_params_stay_and_the_head_trains_at_its_own_rate():
    config = base_config()
    config.optimizer.update(freeze="^embed/", head="^classifier/", head_learning_rate=1e-2,
                            learning_rate=1e-3, warmup_steps=0, decay="constant",
                            weight_decay=0.0, grad_clip_norm=0.0)
    params = {"embed": {"w": np.ones((3, 2), np.float32)},
              "encoder": {"w": np.ones((2, 2), np.float32)},
              "classifier": {"w": np.ones((2, 2), np.float32)}}
    tx = optim.make_optimizer(config)
    grads = jax.tree.map(np.ones_like, params)
    updates, _ = jax.jit(lambda grads, params: tx.update(grads, tx.init(params), params))(
        grads, params)
    updates = jax.tree.map(np.asarray, updates)
    # Adam's first step moves each param by about its learning rate.
    assert float(np.abs(updates["embed"]["w"]).max()) == 0.0
    np.testing.assert_allclose(updates["encoder"]["w"], -1e-3, rtol=1e-3)
    np.testing.assert_allclose(updates["classifier"]["w"], -1e-2, rtol=1e-3)
    with pytest.raises(ValueError, match=r"optimizer.freeze='\(': expected a regular"):
        config.optimizer.freeze = "("
        configs.validate_config(config)


def test_the_gpt_classifier_reads_the_last_real_token():
    config = base_config().model
    config.update(family="gpt", head="classify", num_classes=3, vocab_size=40, **TINY_MODEL)
    model = build_model(config)
    tokens = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 9, 9]])
    segments = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    forward = jax.jit(lambda t, s=None: model.apply({"params": params}, t, segment_ids=s))
    apply = lambda *args: np.asarray(forward(*args))
    logits = apply(tokens, segments)
    assert logits.shape == (2, 3)
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-6)  # padding never read
    shorter = apply(tokens[:, :3])
    np.testing.assert_allclose(shorter[0], logits[0], atol=1e-5)


def test_a_prefix_lm_classifier_reads_the_whole_text_as_its_prefix(play):
    """Its rows say the whole real text is the prefix (read bidirectionally): its loss, which
    needs prefix_lengths, runs on them."""
    from transformer.models import family_of

    config = task_config(play, family="prefix_lm")
    configs.validate_config(config, num_devices=1, num_processes=1)
    tokenizer = tokenizers.build_tokenizer("byte", num_sentinels=0)
    batch = next(iter(tasks.make_dataset(config, tokenizer, "train")))
    assert batch["prefix_lengths"].tolist() == batch["segment_ids"].sum(1).tolist()
    config.model.update(num_classes=3, vocab_size=tokenizer.vocab_size)
    model, family = build_model(config.model), family_of(config)
    params = jax.jit(model.init)(jax.random.key(0), batch["inputs"])["params"]
    loss, _ = jax.jit(lambda p, b: family.loss_and_metrics(model, config, p, b))(params, batch)
    assert np.isfinite(float(loss))


# --- end to end -----------------------------------------------------------------------------


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    result = forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def restored_params(workdir: Path) -> dict:
    step = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    with ocp.CheckpointManager(workdir / "checkpoints", item_handlers={
            "state": ocp.PyTreeCheckpointHandler()}) as manager:
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))
    return finetune._flat(state["state"]["params"])


@pytest.mark.slow
def test_pretrain_then_fine_tune_a_frozen_encoder_then_evaluate_through_the_cli(play, tmp_path):
    pretrained = tmp_path / "pretrained"
    config = configs.experiment("bert_mlm")  # the architecture bert_finetune_cls.py starts from
    config.update(steps=2, batch_size=4, seq_len=24, log_every=1, eval_every=2, eval_steps=1,
                  checkpoint_every=2)
    config.model.update(**TINY_MODEL)
    config.data.update(path=str(play), validation_fraction=0.15)
    train.train_and_evaluate(config, str(pretrained))
    source = restored_params(pretrained)

    finetuned = tmp_path / "finetuned"
    flags = [f"--config.{k}={v}" for k, v in dict(
        steps=4, batch_size=4, seq_len=24, log_every=1, eval_every=4, eval_steps=50,
        checkpoint_every=4).items()]
    flags += [f"--config.model.{k}={v}" for k, v in TINY_MODEL.items()]
    result = cli("transformer.train", "--config=experiments/bert_finetune_cls.py:speakers",
                 f"--workdir={finetuned}", f"--config.init_from={pretrained}",
                 f"--config.data.path={play}", "--config.data.num_classes=3",
                 "--config.optimizer.freeze=^(encoder|embed|type_embed)/", *flags)
    assert "init_from" in result.stdout and "loaded" in result.stdout
    assert ("dropped 5 (mlm_bias, mlm_dense/bias, mlm_dense/kernel, mlm_norm/bias, "
            "mlm_norm/scale)") in result.stdout
    tuned = restored_params(finetuned)
    frozen = [k for k in tuned if k.startswith(("encoder/", "embed/", "type_embed/"))]
    assert frozen and all(np.array_equal(tuned[k], source[k]) for k in frozen)
    assert {k for k in tuned if k not in source} == {
        "classifier/bias", "classifier/kernel", "pooler/bias", "pooler/kernel"}
    assert (finetuned / "tokenizer").is_dir()  # the pretraining tokenizer, saved with the run
    summary = json.loads((finetuned / "summary.json").read_text())
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and "test_macro_f1" in summary

    result = cli("transformer.evaluate", f"--workdir={finetuned}", "--split=test")
    metrics = json.loads((finetuned / "eval_4_test.json").read_text())
    assert metrics["labels"] == ["ROMEO", "JULIET", "NURSE"]
    confusion = np.array(metrics["confusion"])
    assert confusion.sum() == len(tasks.make_task("speakers", str(play), 3, 0.15).splits["test"])
    assert metrics["accuracy"] == pytest.approx(np.trace(confusion) / confusion.sum())
    assert metrics["accuracy"] == pytest.approx(summary["test_accuracy"])
    assert (finetuned / "confusion_4_test.png").read_bytes()[:4] == b"\x89PNG"
    assert "true \\ predicted" in result.stdout
    # Exported, the classifier names its classes as the task does (not LABEL_0, ...).
    transformers = pytest.importorskip("transformers")
    from transformer import export

    export.export_workdir(str(finetuned), str(tmp_path / "hf"))
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert exported.architectures == ["BertForSequenceClassification"]
    assert exported.id2label == {0: "ROMEO", 1: "JULIET", 2: "NURSE"}
    assert exported.label2id == {"ROMEO": 0, "JULIET": 1, "NURSE": 2}


@pytest.mark.slow
def test_t5_text_to_text_scores_exact_match_and_ranks_the_class_names(play, tmp_path):
    config = task_config(play, family="t5", objective="text2text", steps=2)
    result = train.train_and_evaluate(config, str(tmp_path / "t5_text2text"))
    summary = result["summary"]
    test = tasks.task_for(config).splits["test"]
    assert summary["test_num_examples"] == len(test)
    assert 0.0 <= summary["test_exact_match"] <= 1.0 and 0.0 <= summary["test_macro_f1"] <= 1.0
    # The rank-classification accuracy is the share of test names scored highest: recompute it.
    model, params, tokenizer = result["model"], result["state"].params, result["tokenizer"]
    names, target_len = tasks.label_names(tasks.task_for(config), tokenizer)
    rows = [tasks.text2text_features(tokenizer.encode(e.text), c, name, seq_len=config.seq_len,
                                     target_len=target_len, tokenizer=tokenizer)
            for e in test for c, name in enumerate(names)]  # [example, class] flattened
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    @jax.jit  # one compile: op by op, the T5 forward is ~150 small ones
    def name_scores(params, batch):
        logits = model.apply({"params": params}, batch["encoder_inputs"],
                             batch["decoder_inputs"],
                             encoder_segment_ids=batch["encoder_segment_ids"])
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None],
                                        -1)[..., 0]
        return (log_probs * batch["weights"]).sum(-1)

    scores = np.asarray(name_scores(params, batch)).reshape(len(test), len(names))
    right = int(np.sum(np.argmax(scores, -1) == np.array([e.label for e in test])))
    assert summary["test_accuracy"] == pytest.approx(right / len(test))
    assert fileio.parse_init_from("x@2") == ("workdir", "x", 2)


def test_launch_aot_compiles_the_init_from_sources_architecture(gpt_base):
    """`python -m launch.aot` checks the model training would build: a fine-tuning config's
    init_from source's architecture and vocabulary, not the experiment file's defaults."""
    from test_train import tiny_config

    from launch import aot
    from transformer.training import checkpoint as checkpoint_lib

    config = tiny_config(init_from=str(gpt_base))
    config.model.vocab_size = 0
    resolved = aot.resolved_config(config)
    assert (resolved.model.activation, resolved.model.norm_epsilon) == ("relu", 1e-3)
    saved = checkpoint_lib.saved_run(str(gpt_base))[1]
    assert resolved.model.vocab_size == saved.model.vocab_size > 0
