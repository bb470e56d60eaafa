"""A training's workdir is safe from every other command (issue 43): one training at a time
(train.lock), readers that never clean up a writer's files, a failed save that stops the run
at once, "last good" checkpoints that are good, and starts that change nothing when they fail."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_cli import file_hashes
from test_train import (
    REPO,
    assert_succeeded,
    checkpoint_steps,
    cli_env,
    describe,
    read_metrics,
    run_cli,
    start_cli,
    tiny_flags,
)

from transformer import configs
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import checkpoint_manager, progress
from transformer.training import workdir as workdir_lib


def write_text(path: Path, paragraphs: int = 300, seed: int = 0) -> Path:
    """Play-like text: paragraphs of uneven length (4 to 80 words) from a small vocabulary."""
    rng = np.random.default_rng(seed)
    words = "the king of love and my lord sweet death thou art what say you now good".split()
    path.write_text("\n\n".join(" ".join(rng.choice(words, rng.integers(4, 80)))
                                for _ in range(paragraphs)))
    return path


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_text(tmp_path_factory.mktemp("text") / "play.txt")


def data_flags(text: Path) -> list[str]:
    return [f"--config.data.path={text}", "--config.data.tokenizer=char"]


def train(workdir: Path, text: Path, *flags: str, steps: int = 4, checkpoint_every: int = 2,
          logs: str = "logs"):
    return run_cli("transformer.train", f"--workdir={workdir}", *data_flags(text),
                   *tiny_flags(steps, checkpoint_every=checkpoint_every), *flags,
                   logs=workdir.parent / f"{logs}-{workdir.name}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text) -> Path:
    """A finished 2-step run (`train(workdir, text, steps=2)`): the run most tests start from,
    trained once. Tests that write to it work on a copy (`copy_of`)."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    assert_succeeded(train(workdir, text, steps=2))
    return workdir


def copy_of(trained: Path, workdir: Path) -> Path:
    """The 2-step run copied to `workdir` (as if trained there: no file names its workdir)."""
    shutil.copytree(trained, workdir, symlinks=True)
    return workdir


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(result)
    return lines[0]


# --- the lock ---------------------------------------------------------------------------------


def test_a_second_lock_on_a_workdir_is_refused_naming_the_holder(tmp_path):
    first = workdir_lib.Lock(str(tmp_path / "run")).acquire()
    try:
        with pytest.raises(workdir_lib.WorkdirBusy, match=rf"pid {os.getpid()} on "):
            workdir_lib.Lock(str(tmp_path / "run")).acquire()
    finally:
        first.release()
    workdir_lib.Lock(str(tmp_path / "run")).acquire().release()  # free again


@pytest.mark.slow
def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
    script = ("import sys, time; from transformer.training import workdir; "
              "workdir.Lock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "run")],
                              cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(workdir_lib.WorkdirBusy, match=f"pid {holder.pid} "):
            workdir_lib.Lock(str(tmp_path / "run")).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = workdir_lib.Lock(str(tmp_path / "run")).acquire()  # the kernel dropped its flock
    lock.release()


def test_a_lease_is_refused_while_renewed_and_taken_over_when_stale_or_dead(tmp_path,
                                                                            monkeypatch):
    """The gs:// lock (a lease file with a heartbeat), exercised on a local folder."""
    monkeypatch.setattr(workdir_lib, "SETTLE", 0.0)
    workdir = str(tmp_path / "run")
    first = workdir_lib.Lock(workdir, lease=True).acquire()
    with pytest.raises(workdir_lib.WorkdirBusy, match=r"renewed \d+ s ago"):
        workdir_lib.Lock(workdir, lease=True).acquire()
    first.release()
    assert not (tmp_path / "run" / workdir_lib.LOCK).exists()  # a released lease is removed

    lease = tmp_path / "run" / workdir_lib.LOCK
    stale = {"host": "elsewhere", "pid": 1, "id": "x", "heartbeat": time.time() - 1000}
    lease.write_text(json.dumps(stale))
    workdir_lib.Lock(workdir, lease=True).acquire().release()  # not renewed for 1000 s

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    import socket
    lease.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead), "id": "y",
                                 "heartbeat": time.time()}))
    workdir_lib.Lock(workdir, lease=True).acquire().release()  # fresh, but its pid is gone
    lease.write_text(json.dumps({"host": "elsewhere", "pid": int(dead), "id": "z",
                                 "heartbeat": time.time()}))
    with pytest.raises(workdir_lib.WorkdirBusy):  # another host's pid cannot be checked
        workdir_lib.Lock(workdir, lease=True).acquire()


@pytest.mark.parametrize("cause", [errno.EACCES, errno.EROFS], ids=["EACCES", "EROFS"])
def test_a_workdir_that_cannot_be_written_is_one_line_of_bad_usage(tmp_path, monkeypatch,
                                                                    cause):
    """A read-only workdir (empty, or a finished run resumed) or a read-only disk: one line
    naming it, exit 2, not `[Errno 13] Permission denied: '.../train.lock'` and exit 1. (The
    tests run as root, which the kernel lets write anywhere: the refusal is made here.)"""
    from transformer.utils import cli

    workdir, real_open = tmp_path / "run", os.open
    workdir.mkdir()
    lock_path = str(workdir / workdir_lib.LOCK)

    def refusing(path, *args, **kwargs):
        if os.fspath(path) == lock_path:
            raise (PermissionError if cause == errno.EACCES else OSError)(
                cause, os.strerror(cause), lock_path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(workdir_lib.NotWritable) as refused:
        workdir_lib.hold(str(workdir))
    assert str(refused.value) == (
        f"workdir={workdir} is not writable ({os.strerror(cause)}: {lock_path}): expected a "
        "directory this user can write (a training keeps its train.lock, checkpoints and logs "
        "there)")
    assert isinstance(refused.value, cli.USAGE_ERRORS)  # exit 2
    assert list(workdir.iterdir()) == []


def test_a_failed_start_removes_only_a_workdir_it_made(tmp_path):
    made = workdir_lib.Lock(str(tmp_path / "new")).acquire()
    made.release(failed=True)
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("mine")
    existing = workdir_lib.Lock(str(tmp_path / "old")).acquire()
    existing.release(failed=True)
    assert (tmp_path / "old" / "notes.txt").read_text() == "mine"


# --- readers beside a training ----------------------------------------------------------------


@pytest.mark.slow
def test_readers_beside_a_training_never_fail_it_and_never_fail(tmp_path, text):
    """A training saving every step while generate, evaluate, visualize and export read its
    workdir in turn, then SIGTERM (the training runs until every reader has read):
    the training stops with every step it trained saved and logged, and every read succeeds,
    names the step it read, and leaves no traceback of a read that a deleted step cut short."""
    workdir = tmp_path / "run"
    trainer = start_cli("transformer.train", f"--workdir={workdir}", *data_flags(text),
                        *tiny_flags(10_000, checkpoint_every=1), "--config.keep_checkpoints=2",
                        # GPT-2's shape, which export writes as GPT2LMHeadModel
                        "--config.model.position=learned", "--config.model.max_len=64",
                        logs=tmp_path / "logs-train")
    readers = [("transformer.generate", ["--max_new_tokens=4", "--prompt=the"]),
               ("transformer.evaluate", ["--eval_steps=1"]),
               ("transformer.visualize", ["--text=the king"]),
               ("transformer.export", [f"--output={tmp_path}/hf"])]
    reads = []
    try:
        while not checkpoint_steps(workdir):
            assert trainer.process.poll() is None, describe(trainer.wait())
            time.sleep(0.2)
        for index, (module, flags) in enumerate(readers):
            assert trainer.process.poll() is None, describe(trainer.wait())
            reads.append(run_cli(module, f"--workdir={workdir}", *flags,
                                 logs=tmp_path / f"logs-read{index}"))
        assert trainer.process.poll() is None, "the training ended before the last reader did"
        trainer.process.send_signal(signal.SIGTERM)
        stopped = trainer.wait()
        assert stopped.returncode == 143, describe(stopped)  # saved, unfinished
    finally:
        if trainer.process.poll() is None:
            trainer.process.kill()
            trainer.process.wait()
    for (module, _), result in zip(readers, reads, strict=True):
        assert_succeeded(result)
        assert "Traceback" not in result.stderr, describe(result)  # nothing a cut-off read left
        if module != "transformer.visualize":  # (its paths name the step: attention/stepN-...)
            named = result.stdout if module == "transformer.export" else result.stderr
            assert re.search(rf"^step \d+ of {re.escape(str(workdir))}", named, re.M), \
                describe(result)
    stopped_at = json.loads((workdir / "summary.json").read_text())["step"]
    train_steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
    assert train_steps == list(range(1, stopped_at + 1))
    assert checkpoint_steps(workdir)[-1] == stopped_at


@pytest.mark.slow
def test_readers_leave_a_step_being_written_alone(tmp_path, trained):
    """A step still being written (Orbax's temporary directory) survives every way of reading
    the workdir; a training's Manager would have cleaned it up."""
    workdir = copy_of(trained, tmp_path / "run")
    writing = workdir / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
    (writing / "state").mkdir(parents=True)
    step, config = checkpoint_lib.saved_run(str(workdir))
    assert step == 2 and config.steps == 2
    saved = checkpoint_lib.restore_params(str(workdir))
    assert saved.step == 2
    checkpoint_lib.params_metadata(str(workdir))
    assert writing.is_dir()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == \
        ["2", writing.name]


def test_a_listing_that_races_a_save_is_read_again(tmp_path, trained, monkeypatch):
    """Orbax lists a workdir's steps, then checks each: beside a training that saves and
    deletes a step every step (keep_checkpoints=1) a listing can come back empty. The readers
    list again rather than report "no complete checkpoint"."""
    workdir = copy_of(trained, tmp_path / "run")
    real, empty = checkpoint_lib._reader, iter(range(3))

    def racing(*args, **kwargs):
        reader = real(*args, **kwargs)
        if next(empty, None) is not None:
            reader.all_steps = lambda: []
        return reader

    monkeypatch.setattr(checkpoint_lib, "_reader", racing)
    assert checkpoint_lib.saved_run(str(workdir))[0] == 2


def test_evaluate_names_the_step_it_read(tmp_path, trained, capsys):
    """`step N of DIR` on stderr, once the step is read (as generate and export say it): beside
    a training that deletes steps it may not be the newest when evaluate started."""
    from transformer import evaluate as evaluate_lib

    workdir = copy_of(trained, tmp_path / "run")
    metrics = evaluate_lib.evaluate_workdir(str(workdir), eval_steps=1, say_step=True)
    assert metrics["step"] == 2
    assert capsys.readouterr().err.splitlines() == [f"step 2 of {workdir}"]


def in_flight_transfer():
    """A tensorstore transfer awaited on an event loop that then closed, as Orbax's loop closes
    when a read fails with others still in flight; `finish()` completes it."""
    import asyncio

    import tensorstore as ts

    promise, transfer = ts.Promise.new()
    loop = asyncio.new_event_loop()

    async def await_it():
        waiting = transfer.__await__()
        return waiting, next(waiting)

    held = [loop.run_until_complete(await_it())]  # the await, suspended, and its future
    loop.close()

    def finish():
        promise.set_result(b"")  # its callback finds the loop closed
        held.clear()
    return finish


def test_a_read_cut_off_by_a_deleted_step_leaves_stderr_quiet(tmp_path, trained, monkeypatch,
                                                              capfd, caplog):
    """A training deleting the step being read (keep_checkpoints=1) cuts the read short:
    tensorstore reports each transfer still in flight ("Event loop is closed", once Orbax's
    loop has closed; 38 tracebacks under one evaluate in a probe), and Orbax warns that the
    step's metadata does not exist. The reader reads the then-newest step and prints neither;
    a step that is there without its metadata is still warned of."""
    from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata

    workdir = copy_of(trained, tmp_path / "run")
    steps = workdir / "checkpoints"
    shutil.copytree(steps / "2", steps / "1")  # an older step to fall back to
    # Python's own hook, which prints; and the absl logger as a fresh process has it
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    absl = logging.getLogger("absl")
    monkeypatch.setattr(absl, "filters", [f for f in absl.filters
                                          if f is not checkpoint_lib._not_a_deleted_step])
    caplog.set_level(logging.INFO)
    metadata = orbax_metadata.metadata_store(enable_write=False)

    def read(step: int) -> int:
        if step == 2:  # deleted (as Orbax deletes: one rename) while it was read
            finish = in_flight_transfer()
            (steps / "deleted").mkdir()
            (steps / "2").rename(steps / "deleted" / "2")
            assert metadata.read(steps / "2" / checkpoint_lib.STEP_RECORD) is None
            finish()
            raise FileNotFoundError(steps / "2" / "state")
        return step

    assert checkpoint_lib.read_newest(str(workdir), None, read) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warned, warned

    (steps / "1" / checkpoint_lib.STEP_RECORD).unlink()  # there, without its metadata
    assert metadata.read(steps / "1" / checkpoint_lib.STEP_RECORD) is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"Metadata file does not exist: {steps / '1' / checkpoint_lib.STEP_RECORD}"]


def test_an_unreadable_newest_step_is_one_line_naming_it(tmp_path, trained):
    """A reader does not pass over a damaged step as training does (it reads what is there):
    it names the step, the cause, and how to read another, in one short line; init_from names
    itself in a bad step's error."""
    workdir = copy_of(trained, tmp_path / "run")
    # Every data file cut to its first bytes: cut to half, the params' chunks could all lie in
    # the halves kept (the async writes order them), and the read passed (CI, once).
    for f in (workdir / "checkpoints" / "2" / "state" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(f.read_bytes()[:16])
    with pytest.raises(RuntimeError) as error:
        checkpoint_lib.restore_params(str(workdir))
    message = str(error.value)
    assert message.startswith(f"checkpoint 2 of {workdir} cannot be read (") and \
        message.endswith("(read an older step: --step=STEP, or init_from=WORKDIR@STEP)")
    assert "\n" not in message and len(message) < 600, message
    config = configs.experiment("gpt_tiny")
    config.init_from = f"{trained}@9"
    with pytest.raises(ValueError, match=rf"^init_from='{trained}@9': step=9: expected one of "
                                         r"the saved steps \[2\]"):
        configs.validate_config(config)


# --- two trainings ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_training_on_a_workdir_is_refused_and_the_first_is_untouched(tmp_path, text):
    workdir, steps = tmp_path / "run", 40
    first = start_cli("transformer.train", f"--workdir={workdir}", *data_flags(text),
                      *tiny_flags(steps, checkpoint_every=5), logs=tmp_path / "logs-first")
    while not (workdir / "metrics.jsonl").exists() and first.process.poll() is None:
        time.sleep(0.1)
    second = train(workdir, text, steps=steps, checkpoint_every=5, logs="second")
    assert second.returncode == 1, describe(second)
    line = error_line(second)
    assert f"workdir={workdir} is in use by another training (pid {first.process.pid} " in line
    assert_succeeded(first.wait())
    train_steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
    assert train_steps == list(range(1, steps + 1))  # every record of the first run is there
    assert (workdir / "summary.json").exists()
    assert_succeeded(train(workdir, text, steps=steps, checkpoint_every=5, logs="after"))


# --- bad steps, bad saves, bad starts ---------------------------------------------------------


DIVERGING = ("--config.optimizer.learning_rate=1e6", "--config.optimizer.warmup_steps=1")


@pytest.mark.slow
def test_a_checkpoint_whose_params_gave_nan_is_not_the_last_good_one(tmp_path, text):
    """At learning rate 1e6 the params of step B-1 are finite (~1e6) and step B's loss is NaN,
    and the params before them, finite too, give losses of ~1e12 (nonfinite.Watch): all are
    set aside, and the message names a checkpoint whose params evaluate to a sane loss."""
    workdir = tmp_path / "run"
    result = train(workdir, text, *DIVERGING, steps=8, checkpoint_every=1)
    assert result.returncode == 1, describe(result)
    line = error_line(result)
    bad = int(re.search(r"became NaN/Inf at step (\d+) \(batch", line).group(1))
    good = int(re.search(r"the last good checkpoint is step (\d+) ", line).group(1))
    assert bad >= 3 and "blown up" in line, line
    moved = list(range(good + 1, bad))
    assert f"moved checkpoint(s) {moved}, whose params led to it, to {workdir}/checkpoints" \
        f".nonfinite; the last good checkpoint is step {good} ({workdir}/checkpoints/{good})" \
        in line, line
    assert checkpoint_steps(workdir)[-1] == good
    assert sorted(int(p.name.split("-")[0])
                  for p in (workdir / "checkpoints.nonfinite").iterdir()) == moved
    evaluated = run_cli("transformer.evaluate", f"--workdir={workdir}", "--eval_steps=1",
                        logs=tmp_path / "logs-eval")
    assert_succeeded(evaluated)
    loss = json.loads((workdir / f"eval_{good}_steps1.json").read_text())["loss"]
    first = next(r["loss"] for r in read_metrics(workdir) if r["split"] == "train")
    assert np.isfinite(loss) and loss < 3 * first, (loss, first)


@pytest.mark.slow
def test_a_run_that_diverged_keeping_no_checkpoint_is_set_aside_not_overwritten(tmp_path,
                                                                                text):
    """A run whose every checkpoint blew up keeps none in checkpoints/: a relaunch is refused
    in one line before it touches a file (it trained from step 0 over the diverged run's
    records, cutting metrics.jsonl and merging goodput), and fresh_start=True sets the whole
    run aside, the non-finite steps with it (it moved nothing: there was no checkpoint)."""
    workdir = tmp_path / "run"
    diverging = ("--config.optimizer.learning_rate=1e4", "--config.optimizer.grad_clip_norm=0",
                 "--config.optimizer.warmup_steps=0")
    result = train(workdir, text, *diverging, steps=8, checkpoint_every=1)
    assert result.returncode == 1 and "no good checkpoint is left: none was saved before it" \
        in error_line(result), describe(result)
    assert checkpoint_steps(workdir) == [] and list((workdir / "checkpoints.nonfinite").iterdir())
    before = file_hashes(workdir)
    relaunched = train(workdir, text, steps=4, logs="relaunched")
    assert relaunched.returncode == 2, describe(relaunched)
    assert re.fullmatch(rf"error: workdir='{workdir}': its run diverged and kept no good "
                        rf"checkpoint \({workdir}/checkpoints\.nonfinite holds \[.*\]\): "
                        "expected fresh_start=True to set that run aside and start over, or "
                        "another workdir", error_line(relaunched))
    assert file_hashes(workdir) == before
    assert_succeeded(train(workdir, text, "--config.fresh_start=True", steps=4, logs="fresh"))
    (aside,) = workdir.glob("checkpoints.set-aside-*")
    assert {"checkpoints.nonfinite", "metrics.jsonl", "goodput.json", "tensorboard"} <= {
        p.name for p in aside.iterdir()} and not (workdir / "checkpoints.nonfinite").exists()
    moved = file_hashes(aside)
    assert all(moved[name] == before[name] for name in before if name.startswith((
        "metrics.jsonl", "goodput.json", "tensorboard/", "checkpoints.nonfinite/"))), moved
    assert [r["step"] for r in read_metrics(workdir) if r["split"] == "train"] == [1, 2, 3, 4]
    assert json.loads((workdir / "summary.json").read_text())["goodput"]["starts"] == 1


@pytest.mark.slow
def test_skipped_steps_set_aside_the_checkpoints_saved_while_skipping(tmp_path, text):
    """Under nonfinite='skip' the params stay those of the step before the skips began: that
    checkpoint and every one saved while skipping are set aside, and the blown-up ones before
    them; what is left is good, or the message says the good ones were deleted."""
    workdir = tmp_path / "run"
    result = train(workdir, text, *DIVERGING, "--config.nonfinite=skip",
                   "--config.max_nonfinite_skips=2", steps=12, checkpoint_every=1)
    assert result.returncode == 1, describe(result)
    line = error_line(result)
    began = int(re.search(r"3 steps in a row \(from step (\d+)\) had NaN/Inf gradients",
                          line).group(1))
    first = int(re.search(r"moved checkpoint\(s\) \[(\d+),", line).group(1))
    moved = list(range(first, began + 2))  # the stop comes before step began+2 saves
    assert first <= began - 1 and f"moved checkpoint(s) {moved}" in line, line
    left = checkpoint_steps(workdir)
    if left:
        assert f"the last good checkpoint is step {first - 1}" in line and left[-1] == first - 1
    else:  # keep_checkpoints=3 deleted the good ones while the blown-up ones were saved
        assert "no good checkpoint is left: this run deleted the older ones [1" in line, line


def with_file_limit(kib: int, command: list[str]) -> list[str]:
    """`command` run with files limited to `kib` KiB (bash's `ulimit -f`, RLIMIT_FSIZE), so
    writing a bigger one fails as on a full disk (EFBIG; Python ignores SIGXFSZ). Through bash,
    not a preexec_fn: forking this multithreaded (JAX) process to run Python could deadlock."""
    return ["bash", "-c", f'ulimit -f {kib} && exec "$@"', "bash", *command]


@pytest.mark.slow
def test_a_failed_save_stops_the_run_at_once_with_one_line(tmp_path, text):
    workdir = tmp_path / "run"
    assert_succeeded(train(workdir, text, steps=6, checkpoint_every=2))
    # A save writes ~150 KB of arrays in data files whose number and sizes vary from run to run,
    # and ~25 KB files (_METADATA, _sharding) of the same size every time: a 16 KB limit fails
    # every save, while the run's other files stay under it until well past step 10.
    limit = 16 * 1024  # bytes
    small = [workdir / "metrics.jsonl", *(workdir / "tensorboard").rglob("*.tfevents.*")]
    assert all(f.stat().st_size < limit // 2 for f in small), [f.stat().st_size for f in small]
    command = [sys.executable, "-m", "transformer.train", f"--workdir={workdir}",
               *data_flags(text), *tiny_flags(40, checkpoint_every=10)]
    before = file_hashes(workdir / "checkpoints")
    # Without the tests' XLA compilation cache, whose entries would hit the limit too.
    env = {**cli_env(), "JAX_COMPILATION_CACHE_DIR": ""}
    result = subprocess.run(with_file_limit(limit // 1024, command), cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, describe(result)
    line = error_line(result)
    assert line.startswith(f"error: writing checkpoint step 10 to {workdir}/checkpoints failed "
                           "(File too large); the complete checkpoints [2, 4, 6] are intact"), line
    after = file_hashes(workdir / "checkpoints")
    assert {k: v for k, v in after.items() if k.split("/")[0] in "246"} == before
    logged = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
    # Found by the first step after the write failed (each step asks, without waiting), and at
    # the latest by the next save: a fast machine may train steps 11-19 before the write fails.
    assert max(logged) <= 20, f"training went on after the next save at step 20: {logged}"
    # The steps trained while the write ran are named (the step found stops before its log).
    stopped = re.search(r"; the run stopped at step (\d+): a checkpoint is written while "
                        r"training goes on, and the write failed after steps? 11", line)
    assert stopped is None and max(logged) in (19, 20) or int(stopped[1]) == max(logged) + 1, \
        (line, logged)
    assert not (workdir / "checkpoints" / "20").exists()


def test_a_failed_saves_error_is_the_one_reported_where_closing_after_it_fails_too(
        tmp_path, monkeypatch):
    """Probe p7 of stop 110: on a full disk, closing the logger after the failed save (its
    TensorBoard flush, on the same disk) raised in the run's cleanup, and the run's one line
    was that error ("error: [Errno 28] No space left on device"), not the save's."""
    from test_train import tiny_config

    from transformer import train
    from transformer.training import checkpoint_manager, metrics

    def full(self, step, *args):
        raise checkpoint_manager.WriteError(f"writing checkpoint step {step} failed (No space "
                                            "left on device)")

    def flush_fails(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_manager.Manager, "save", full)
    monkeypatch.setattr(metrics.MetricsLogger, "close", flush_fails)
    with pytest.raises(checkpoint_manager.WriteError, match="^writing checkpoint step 2 failed"):
        train.train_and_evaluate(tiny_config(steps=2), str(tmp_path / "run"))


def test_a_failed_background_write_is_found_by_the_next_check_not_the_next_save(tmp_path):
    """The per-step check (train.loop calls it after every step) raises as soon as the
    background write has failed, without waiting for one still in progress."""
    import ml_collections

    class Iterator:
        def get_state(self):
            return {"position": 3}

    manager = checkpoint_manager.Manager(str(tmp_path), ml_collections.ConfigDict({"seed": 0}),
                                         None)
    manager.save(2, {"w": np.ones(4, np.float32)}, Iterator())
    manager.check_for_errors()  # the write succeeded (or is still running): nothing raised
    manager._manager.wait_until_finished()
    manager.save(4, {"w": np.ones(4, np.float32)}, Iterator())

    def failed():
        raise OSError(27, "File too large")
    manager._manager.wait_until_finished = failed
    manager._manager.is_saving_in_progress = lambda: False
    with pytest.raises(checkpoint_manager.WriteError, match=r"step 4 .* failed \(File too large\); "
                       r"the complete checkpoints \[2(, 4)?\] are intact"):
        manager.check_for_errors()


@pytest.mark.slow
def test_init_from_over_another_runs_checkpoints_is_refused(tmp_path, text, trained):
    base, workdir = trained, copy_of(trained, tmp_path / "run")
    before = file_hashes(workdir)
    result = train(workdir, text, f"--config.init_from={base}", steps=4)
    assert result.returncode == 2, describe(result)
    assert error_line(result) == (
        f"error: init_from='{base}': {workdir} already holds checkpoint 2 (trained from "
        "init_from=''): expected no init_from to resume it, fresh_start=True to set it "
        "aside and start from init_from, or another workdir")
    assert file_hashes(workdir) == before
    # A fine-tune relaunched with its own command resumes; without its init_from it is refused.
    tuned = tmp_path / "tuned"
    assert_succeeded(train(tuned, text, f"--config.init_from={base}", steps=2))
    result = train(tuned, text, steps=4)
    assert result.returncode == 2 and error_line(result).endswith(
        f"(trained from init_from='{base}'): expected init_from='{base}' to resume it, "
        "fresh_start=True to set it aside and start from init_from, or another workdir"), \
        describe(result)
    assert_succeeded(train(tuned, text, f"--config.init_from={base}", steps=4))
    assert checkpoint_steps(tuned) == [2, 4]


@pytest.mark.slow
def test_a_failed_init_from_leaves_no_workdir(tmp_path, text, trained):
    base = trained
    workdir = tmp_path / "new"
    result = train(workdir, text, f"--config.init_from={base}", "--config.model.d_model=48",
                   steps=2)
    assert result.returncode == 2, describe(result)
    assert f"model.d_model=48: {base}@2's saved config says 32" in error_line(result)
    assert not workdir.exists()


@pytest.mark.slow
def test_fresh_start_with_an_init_from_that_fails_changes_nothing(tmp_path, text, trained):
    base, workdir = trained, tmp_path / "run"
    assert_succeeded(train(workdir, text, "--config.model.d_model=48", steps=2))
    before = file_hashes(workdir)
    result = train(workdir, text, "--config.fresh_start=True", f"--config.init_from={base}",
                   "--config.model.d_model=48", steps=2, logs="fresh")
    assert result.returncode == 2, describe(result)
    assert f"model.d_model=48: {base}@2's saved config says 32" in error_line(result)
    assert file_hashes(workdir) == before and not list(workdir.glob("checkpoints.set-aside-*"))


def test_fresh_start_that_fails_to_build_changes_nothing(tmp_path, text, trained,
                                                         monkeypatch):
    """The set-aside comes after every check and after the model builds: a start that fails in
    the last of them (past validate_config, which a bad value never gets beyond) leaves the
    previous run where it was."""
    from test_train import tiny_config

    from transformer import train as train_lib

    workdir = copy_of(trained, tmp_path / "run")
    before = file_hashes(workdir)

    def does_not_build(*args, **kwargs):
        raise RuntimeError("the model does not build")

    monkeypatch.setattr(train_lib, "initial_state", does_not_build)
    config = tiny_config(steps=2, fresh_start=True)
    config.data.update(path=str(text), tokenizer="char")
    with pytest.raises(RuntimeError, match="the model does not build"):
        train_lib.train_and_evaluate(config, str(workdir))
    assert file_hashes(workdir) == before and not list(workdir.glob("checkpoints.set-aside-*"))


@pytest.mark.slow
def test_fresh_start_with_a_bad_value_changes_nothing(tmp_path, text, trained):
    workdir = copy_of(trained, tmp_path / "run")
    before = file_hashes(workdir)
    result = train(workdir, text, "--config.fresh_start=True", "--config.model.dtype=int8",
                   steps=2, logs="bad")
    assert result.returncode == 2, describe(result)
    assert "model.dtype='int8': expected one of" in error_line(result)
    assert file_hashes(workdir) == before and not list(workdir.glob("checkpoints.set-aside-*"))
    assert_succeeded(train(workdir, text, steps=4, logs="resumed"))  # still resumes from 2
    assert [r["step"] for r in read_metrics(workdir) if r["split"] == "train"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_fresh_start_sets_the_whole_previous_run_aside(tmp_path, text, trained):
    workdir = copy_of(trained, tmp_path / "run")
    # Named here, not read from checkpoint_lib.RUN_FILES: a name dropped there must fail this.
    records = ("metrics.jsonl", "summary.json", "tensorboard", "tokenizer", "val_windows.npz",
               "goodput.json", "eval_2.json", "eval_2_len64_test.json", "confusion_2_test.png",
               "attention")
    # what evaluate and visualize write of the old run's checkpoints
    for name in records[6:9]:
        (workdir / name).write_text(f"the old run's {name}")
    (workdir / "attention" / "2").mkdir(parents=True)
    (workdir / "attention" / "2" / "attention.npz").write_bytes(b"maps")
    old = {name: file_hashes(workdir / name) if (workdir / name).is_dir() else
           (workdir / name).read_bytes() for name in records}
    assert_succeeded(train(workdir, text, "--config.fresh_start=True", steps=2, logs="fresh"))
    (aside,) = workdir.glob("checkpoints.set-aside-*")
    assert sorted(p.name for p in aside.iterdir()) == sorted(["2", *records])
    for name, content in old.items():
        moved = aside / name
        assert (file_hashes(moved) if moved.is_dir() else moved.read_bytes()) == content, name
    events = list((workdir / "tensorboard").rglob("*"))
    assert events and all(p.stat().st_mtime >= aside.stat().st_mtime for p in events)
    steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
    assert steps == [1, 2]
    assert json.loads((workdir / "summary.json").read_text())["step"] == 2


def test_a_refused_resume_on_the_embedded_corpus_says_it_is_this_pythons_text():
    """The default corpus (data.path '') is the running Python's docs and standard library: a
    checkpoint trained under another Python has another fingerprint (a probe: 3.11's run
    resumed under 3.12). The refusal says why, not just two hashes; a file's changed
    content keeps the bare fingerprints."""
    import platform

    from transformer.data import inputs

    stream = inputs.data_stream(configs.experiment("gpt_tiny"))
    assert stream["data"]["path"] == ""
    other = format(int(stream["fingerprint"], 16) ^ 1, "016x")  # another Python's corpus
    other_python = {**stream, "fingerprint": other}
    bare = f"content fingerprint: checkpoint {other!r}, config {stream['fingerprint']!r}"
    assert checkpoint_manager.stream_differences(other_python, stream) == [
        f"{bare} (data.path is empty: the embedded corpus, which is the running Python's own "
        "documentation and standard library, and differs between Python versions; this is "
        f"Python {platform.python_version()}: resume under the Python that trained it)"]
    a_file = {**stream, "data": {**stream["data"], "path": "/data/play.txt"}}
    assert checkpoint_manager.stream_differences({**a_file, "fingerprint": other}, a_file) == \
        [bare]


def test_a_path_moved_with_the_same_fingerprint_is_named_but_no_stream_difference():
    """A data.path or data.validation_path that changed while its content fingerprint did not
    is the same data moved: no difference (the resume goes on), but `moved_data` names it, as
    the fingerprint does not read a file's middle. Not a path that stayed, one whose content
    changed (a difference), or a key an older checkpoint lacks. The runtime record that a
    checkpoint's stream holds is no difference either."""
    from transformer.data import inputs

    stream = inputs.data_stream(configs.experiment("gpt_tiny"))
    saved = {**stream, "data": {**stream["data"], "path": "/data/a.txt",
                                "validation_path": "/data/v.txt"},
             "fingerprint": "f0", "validation_fingerprint": "v0",
             checkpoint_lib.RUNTIME: checkpoint_lib.runtime()}
    moved = {**saved, "data": {**saved["data"], "path": "/mnt/a.txt",
                               "validation_path": "/mnt/v.txt"}}
    del moved[checkpoint_lib.RUNTIME]  # (a run's own stream, as `Manager.check` compares)
    assert checkpoint_manager.stream_differences(saved, moved) == []
    note = (" (the same names, sizes and ends: read as the same data moved; an edit in the "
            "middle of a file is not detected)")
    assert checkpoint_manager.moved_data(saved, moved) == [
        f"data.path '/data/a.txt' -> '/mnt/a.txt'{note}",
        f"data.validation_path '/data/v.txt' -> '/mnt/v.txt'{note}"]
    assert checkpoint_manager.moved_data(saved, saved) == []
    edited = {**moved, "fingerprint": "f1"}
    assert checkpoint_manager.stream_differences(saved, edited) == [
        "data.path: checkpoint '/data/a.txt', config '/mnt/a.txt'",
        "content fingerprint: checkpoint 'f0', config 'f1'"]
    assert checkpoint_manager.moved_data(saved, edited) == [
        f"data.validation_path '/data/v.txt' -> '/mnt/v.txt'{note}"]
    older = {**saved, "data": {k: v for k, v in saved["data"].items()
                               if k != "validation_path"}}
    del older["validation_fingerprint"]
    plain = {**older, "data": {**older["data"], "validation_path": ""}}
    assert checkpoint_manager.moved_data(older, plain) == []


# --- a signal during the last step --------------------------------------------------------------


def test_a_summary_without_the_after_training_evaluations_is_not_finished(tmp_path):
    """A signal during the last step saves it and writes summary.json at the last step, but
    the after-training evaluations (test split, eval_seq_lens) never ran: the rerun must run
    them, not call the run finished; the stopped run exits as stopped. A summary written
    before the key existed is finished."""
    from transformer.training import startup

    config = configs.base_config()
    config.steps = 4
    summary = tmp_path / "summary.json"
    for written, finished in (({"step": 4, "after_training": False}, False),
                              ({"step": 4, "after_training": True}, True),
                              ({"step": 4}, True),  # an older version's
                              ({"step": 2, "after_training": False}, False)):
        summary.write_text(json.dumps(written))
        if finished:
            with pytest.raises(startup.Finished, match="already finished at step 4"):
                startup.check_finished(config, str(tmp_path), 4)
        else:
            startup.check_finished(config, str(tmp_path), 4)
        assert progress.unfinished(written, config.steps) is not finished


@pytest.mark.slow
def test_a_signal_during_the_last_step_leaves_the_final_evaluations_to_the_rerun(tmp_path,
                                                                                 monkeypatch):
    """SIGTERM during the last (only) step: the step is saved, summary.json says the
    after-training evaluations did not run and the exit status is a stopped run's; the rerun
    runs them (validation at eval_seq_lens) and only then is the run finished."""
    from transformer import train
    from transformer.training import startup

    config = configs.base_config()
    config.update(steps=1, batch_size=2, seq_len=16, eval_every=100, eval_steps=1,
                  checkpoint_every=1, samples=0, eval_seq_lens=(32,),
                  peak_flops_per_device=1e11)
    config.model.update(num_layers=1, d_model=16, num_heads=2, d_ff=32, position="rope",
                        vocab_size=0)
    config.data.tokenizer = "byte"
    loop = train.loop

    def signalled(run, peak):  # as train_to_end's handler does, before the step ends
        run.signal = signal.SIGTERM
        return loop(run, peak)

    with monkeypatch.context() as patched:
        patched.setattr(train, "loop", signalled)
        stopped = train.train_and_evaluate(config.copy_and_resolve_references(), str(tmp_path))
    assert stopped["summary"]["step"] == 1 and not stopped["summary"]["after_training"]
    assert "val_loss@32" not in stopped["summary"]
    assert progress.unfinished(stopped["summary"], 1)  # exit 143: a launcher reruns it
    rerun = train.train_and_evaluate(config.copy_and_resolve_references(), str(tmp_path))
    assert rerun["summary"]["after_training"] and "val_loss@32" in rerun["summary"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["after_training"] and saved["val_loss@32"] == rerun["summary"]["val_loss@32"]
    with pytest.raises(startup.Finished):
        train.setup(config.copy_and_resolve_references(), str(tmp_path))


def test_an_orbax_read_closed_unfinished_prints_nothing_and_other_unraisables_do():
    """Probe p7 of stop 110: an export beside a training that deleted the step it read printed
    ~190 lines of Orbax's per-array read coroutines, collected unfinished (their GeneratorExit
    re-raised as "Encountered error while reading array index"); CI's log showed them too."""
    import types

    from transformer.training import checkpoint

    seen = []
    quiet = checkpoint._quiet_closed_loop(seen.append)

    async def _read_array_index_and_device_put():
        pass

    coroutine = _read_array_index_and_device_put()
    coroutine.close()
    error = Exception("Encountered error while reading array index (0,) for ...")
    error.__cause__ = GeneratorExit()
    quiet(types.SimpleNamespace(exc_type=Exception, exc_value=error, object=coroutine))
    assert seen == []
    for other in (Exception("a real error"), ValueError("no GeneratorExit cause")):
        unraisable = types.SimpleNamespace(exc_type=type(other), exc_value=other,
                                           object=coroutine)
        quiet(unraisable)
        assert seen[-1] is unraisable
