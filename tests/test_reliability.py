"""Issue 23's cases through the real CLI: no setting destroys a run's checkpoints, no run
silently continues on different data or settings, and bad input stops the run before its first
step, touching nothing already saved (every file's hash is compared before and after)."""

from __future__ import annotations

import shutil

import pytest
from test_cli import file_hashes
from test_train import (
    SHAKESPEARE,
    assert_succeeded,
    checkpoint_steps,
    read_metrics,
    run_cli,
    tiny_flags,
)

from transformer.data import prepare, tokenizers

pytestmark = pytest.mark.slow  # 21 runs of the CLI


def train(workdir, *flags, steps=4, logs=None):
    return run_cli("transformer.train", f"--workdir={workdir}",
                   *tiny_flags(steps, checkpoint_every=2), *flags,
                   logs=logs or workdir.parent / f"logs-{workdir.name}")


def error_line(result) -> str:
    """The CLI's one-line error: stderr's only line (transformer.utils.cli)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny run on Shakespeare (char tokenizer) trained to step 4, checkpoints 2 and 4."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    assert_succeeded(train(workdir, f"--config.data.path={SHAKESPEARE}",
                           "--config.data.tokenizer=char"))
    assert checkpoint_steps(workdir) == [2, 4]
    return workdir


@pytest.fixture
def run_copy(finished, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    return workdir


SAME_DATA = (f"--config.data.path={SHAKESPEARE}", "--config.data.tokenizer=char")


@pytest.mark.parametrize("flags, message", [
    # Resuming on something else than the checkpoint's data stream.
    (("--config.data.path=", "--config.data.tokenizer=char", "--config.steps=6"),
     "was trained on another data stream: data.path: checkpoint"),
    ((*SAME_DATA, "--config.batch_size=4", "--config.steps=6"),
     "another data stream: batch_size: checkpoint 2, config 4"),
    ((*SAME_DATA, "--config.seq_len=32", "--config.steps=6"),
     "another data stream: seq_len: checkpoint 16, config 32"),
    ((*SAME_DATA, "--config.seed=1", "--config.steps=6"), "seed: checkpoint 0, config 1"),
    # Another model or tokenizer.
    ((*SAME_DATA[:1], "--config.data.tokenizer=byte", "--config.steps=6"),
     "data.tokenizer: checkpoint 'char', config 'byte'"),
    # steps below the latest checkpoint.
    ((*SAME_DATA, "--config.steps=2"), "steps=2: "),
    # Values that made training go wrong, or deleted every checkpoint.
    ((*SAME_DATA, "--config.keep_checkpoints=0"),
     "keep_checkpoints=0: expected an int >= 1 (the newest checkpoint is always kept)"),
    ((*SAME_DATA, "--config.optimizer.learning_rate=-1"),
     "optimizer.learning_rate=-1.0: expected a number > 0"),
    ((*SAME_DATA, "--config.optimizer.grad_clip_norm=-1"),
     "optimizer.grad_clip_norm=-1.0: expected a number >= 0 (0: no clipping)"),
    ((*SAME_DATA, "--config.optimizer.b1=1.5"), "optimizer.b1=1.5: expected a number in [0, 1)"),
    ((*SAME_DATA, "--config.optimizer.warmup_steps=-5"),
     "optimizer.warmup_steps=-5: expected an int >= 0"),
    ((*SAME_DATA, "--config.optimizer.weight_decay=-1"),
     "optimizer.weight_decay=-1.0: expected a number >= 0"),
    ((*SAME_DATA, "--config.data.unit=sentence"),
     "data.unit='sentence': expected one of ('paragraph', 'file', 'stream')"),
    ((*SAME_DATA, "--config.eval_steps=0"), "eval_steps=0: expected an int >= 1"),
], ids=["data_path", "batch_size", "seq_len", "seed", "tokenizer", "steps_below_latest",
        "keep_checkpoints_0", "negative_lr", "negative_clip", "b1", "warmup", "weight_decay",
        "unit", "eval_steps_0"])
def test_a_refused_resume_changes_nothing(run_copy, flags, message):
    before = file_hashes(run_copy)
    result = train(run_copy, *flags)
    assert result.returncode == 2  # bad usage or config
    assert message in error_line(result), result.stderr[-3000:]
    assert "step 5" not in result.stdout
    assert file_hashes(run_copy) == before


@pytest.mark.parametrize("data, flags, message", [
    ("shakespeare", ("--config.data.unit=file",),
     "the validation split of {path} is empty (1 documents, validation_fraction=0.05)"),
    ("shakespeare", ("--config.data.validation_fraction=0.0",),
     "the validation split of {path} is empty (913 documents, validation_fraction=0.0)"),
    ("one_line", (), "the validation split of {path} is empty (1 documents"),
    ("prepared_char", ("--config.data.tokenizer=byte",),
     "data.tokenizer='byte': the prepared data '{path}' was tokenized with 'char': expected "
     "data.tokenizer='char'"),
], ids=["unit_file", "no_validation_fraction", "one_line_file", "prepared_char_as_byte"])
def test_data_errors_stop_the_run_before_anything_is_written(tmp_path, data, flags, message):
    """Each of these trained until the first evaluation before, and lost that training."""
    path = {"shakespeare": SHAKESPEARE, "one_line": tmp_path / "one.txt",
            "prepared_char": tmp_path / "prepared"}[data]
    (tmp_path / "one.txt").write_text("To be, or not to be, that is the question.\n")
    if data == "prepared_char":
        prepare.prepare(str(path), str(SHAKESPEARE), tokenizer="char")
    workdir = tmp_path / "run"
    result = train(workdir, f"--config.data.path={path}", *flags)
    assert result.returncode == 2
    assert message.format(path=path) in error_line(result), result.stderr[-3000:]
    assert not workdir.exists()


def test_rerunning_a_finished_run_is_a_no_op(run_copy):
    before = file_hashes(run_copy)
    result = train(run_copy, *SAME_DATA)
    assert_succeeded(result)
    assert "already finished at step 4" in result.stdout
    assert file_hashes(run_copy) == before


def test_new_data_continues_the_params_on_a_fresh_stream_and_says_so(run_copy):
    result = train(run_copy, *SAME_DATA, "--config.seq_len=32", "--config.new_data=True",
                   steps=6)
    assert_succeeded(result)
    assert "new_data: step 4's params continue on a new data stream" in result.stdout
    records = [r for r in read_metrics(run_copy) if r["split"] == "new_data"]
    assert records == [{"step": 4, "split": "new_data", "elapsed": records[0]["elapsed"],
                        "changes": ["seq_len: checkpoint 16, config 32"]}]
    # Resuming again with new_data still set continues the (now saved) stream: no new record.
    assert_succeeded(train(run_copy, *SAME_DATA, "--config.seq_len=32",
                           "--config.new_data=True", steps=8))
    assert [r["step"] for r in read_metrics(run_copy) if r["split"] == "new_data"] == [4]


def test_keep_checkpoints_never_deletes_what_the_run_did_not_write(run_copy):
    """Resuming with keep_checkpoints=1 keeps the workdir's steps 2 and 4 and only the newest of
    the steps it writes itself."""
    result = train(run_copy, *SAME_DATA, "--config.keep_checkpoints=1", steps=8)
    assert_succeeded(result)
    assert checkpoint_steps(run_copy) == [2, 4, 8]


def test_a_failed_run_leaves_no_tokenizer_for_the_next_run(tmp_path):
    """A run that fails before its first checkpoint (here: at step 1, non-finite loss from a
    learning rate that explodes) saves no tokenizer, so the rerun on fixed data builds its own
    from that data."""
    workdir = tmp_path / "run"
    unknown = tmp_path / "other.txt"
    # (400 distinct paragraphs of 20 characters, each character in 39 of them: the held-out
    # ones hold none the train split lacks)
    unknown.write_text("".join(f"{chr(0x4e00 + i % 20) * 30}{chr(0x4e00 + i // 20)}\n\n"
                               for i in range(400)))
    failed = train(workdir, f"--config.data.path={unknown}", "--config.data.tokenizer=char",
                   "--config.max_grad_norm=1e-9")
    assert failed.returncode == 1 and "NaN/Inf" in error_line(failed)  # a runtime failure
    assert not (workdir / "tokenizer").exists() and checkpoint_steps(workdir) == []
    assert_succeeded(train(workdir, *SAME_DATA))
    tokenizer = tokenizers.load_tokenizer(str(workdir / "tokenizer"))
    assert tokenizers.UNK_ID not in tokenizer.encode(SHAKESPEARE.read_text())
