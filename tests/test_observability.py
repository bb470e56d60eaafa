"""What a researcher watches (issue 46): the profiler trace of chosen steps, Weights & Biases
(the real package, offline, read back from its run files) and the goodput breakdown (a slow
input pipeline, a crash and a kill -9 with their resumes)."""

from __future__ import annotations

import glob
import json
import re
import signal
import threading
import time
from pathlib import Path

import jax
import pytest
from test_train import (
    SHAKESPEARE,
    TIMEOUT,
    assert_succeeded,
    checkpoint_steps,
    read_metrics,
    run_cli,
    start_cli,
    tiny_config,
    tiny_flags,
)

from transformer import configs, sweep, train
from transformer.data import inputs
from transformer.training import goodput, profiling, wandb_logging


@pytest.fixture
def wandb():
    """The real package (the `wandb` extra, which CI installs: .ci/run)."""
    return pytest.importorskip("wandb")


# --- profiling ------------------------------------------------------------------------------


def test_the_profile_trace_holds_the_chosen_train_steps(tmp_path, capsys):
    config = tiny_config(steps=3)
    config.profile.update(start_step=2, num_steps=2)
    train.train_and_evaluate(config, str(tmp_path))
    traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1, traces
    assert b"jit_train_step" in Path(traces[0]).read_bytes()  # the jitted step's own name
    assert f"profile: steps 2..3 traced into {tmp_path / 'profile'}" in capsys.readouterr().out


def test_only_process_0_traces_unless_all_hosts(monkeypatch):
    config = tiny_config(steps=6)  # (the window, step 5, inside the run)
    config.profile.num_steps = 1
    assert profiling.Tracer(config, "w").enabled
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert not profiling.Tracer(config, "w").enabled
    config.profile.all_hosts = True
    assert profiling.Tracer(config, "w").enabled
    config.profile.num_steps = 0
    assert not profiling.Tracer(config, "w").enabled


@pytest.mark.parametrize("key, value, message", [
    ("profile.num_steps", -1, "profile.num_steps=-1: expected an int >= 0 (0: no trace)"),
    ("profile.start_step", 0, "profile.start_step=0: expected an int >= 1 (the first traced"),
    ("wandb.mode", "cloud", "wandb.mode='cloud': expected one of ('', 'online', 'offline', "
                            "'disabled')"),
    ("wandb.mode", "offline", "wandb.mode='offline' with wandb.project='': expected a project"),
])
def test_bad_profile_and_wandb_values_get_one_line_errors(key, value, message):
    config = tiny_config()
    group, leaf = key.split(".")
    config[group][leaf] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        configs.validate_config(config)


# --- Weights & Biases -----------------------------------------------------------------------


def wandb_records(workdir: Path, runs: int) -> tuple[dict, list[str], list[dict], dict]:
    """What the `runs` offline W&B runs under workdir/wandb/ hold: ({step: {"split/metric":
    value}} from their history, the run ids, their configs, the last summary). Reads the run
    files' records (LevelDB-style log blocks of wandb_internal_pb2.Record), waiting for each
    file's exit record: wandb's service may still be writing the file when finish returns."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + 30
    while True:
        history, ids, config_records, summary, exits = {}, [], [], {}, 0
        for path in sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "*.wandb"))):
            for record in _records(Path(path).read_bytes(), wandb_internal_pb2.Record):
                which = record.WhichOneof("record_type")
                exits += which == "exit"
                if which == "run":
                    ids.append(record.run.run_id)
                    config_records.append({item.key: json.loads(item.value_json)
                                           for item in record.run.config.update})
                elif which == "history":
                    items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                             for item in record.history.item}
                    history.setdefault(record.history.step.num, {}).update(
                        {k: v for k, v in items.items() if not k.startswith("_")})
                elif which == "summary":
                    summary.update({"/".join(item.nested_key) or item.key:
                                    json.loads(item.value_json) for item in record.summary.update})
        if exits >= runs or time.monotonic() > deadline:
            return history, ids, config_records, summary
        time.sleep(0.1)


def _records(data: bytes, record_type):
    """The records of a .wandb file: after its 7-byte header, 32 KiB blocks of chunks (a
    4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last)."""
    position, pending = 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's padding
            position += 32768 - position % 32768
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), \
            data[position + 6]
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = record_type()
            record.ParseFromString(pending)
            pending = b""
            yield record


def metrics_by_step(workdir: Path) -> dict:
    """metrics.jsonl as W&B rows: {step: {"split/metric": value}} (not `elapsed`, which is
    the file's own)."""
    rows = {}
    for record in read_metrics(workdir):
        step, split = record.pop("step"), record.pop("split")
        record.pop("elapsed")
        rows.setdefault(step, {}).update({f"{split}/{k}": v for k, v in record.items()})
    return rows


@pytest.mark.slow
def test_wandb_offline_gets_the_metrics_records_config_and_summary_and_resumes_its_run(
        tmp_path, wandb):
    workdir = tmp_path / "run"
    config = tiny_config(steps=2)
    config.wandb.update(project="transformer-tests", mode="offline")
    first = train.train_and_evaluate(config, str(workdir))["summary"]
    run_id = json.loads((workdir / wandb_logging.ID_FILE).read_text())["id"]
    time.sleep(1.1)  # offline run directories are named by the second they start in
    config.steps = 4  # resumed from step 2
    result = train.train_and_evaluate(config, str(workdir))["summary"]
    history, ids, config_records, summary = wandb_records(workdir, runs=2)
    assert ids == [run_id, run_id]  # the resumed training continued the same W&B run
    assert history == metrics_by_step(workdir)
    assert sorted(history) == [1, 2, 3, 4] and "validation/loss" in history[4]
    assert config.model.vocab_size == 0 < config_records[0]["model"]["vocab_size"]  # resolved
    assert config_records[0]["steps"] == 2 and config_records[1]["steps"] == 4
    assert summary["step"] == 4 and summary["val_loss"] == result["val_loss"]
    assert summary["goodput"]["starts"] == 2 and first["goodput"]["starts"] == 1


def test_a_failing_wandb_is_one_warning_line_and_the_training_completes(tmp_path, monkeypatch,
                                                                         capsys, wandb):
    def broken_init(**kwargs):
        raise RuntimeError("api_key not configured\n(no-tty): call wandb.login")

    monkeypatch.setattr(wandb, "init", broken_init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = tiny_config(steps=2)
    config.wandb.project = "transformer-tests"
    result = train.train_and_evaluate(config, str(tmp_path))
    assert result["summary"]["step"] == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines()
             if "W&B" in line or line.lower().startswith("wandb")]  # wandb's own: "wandb: ..."
    assert lines[0].startswith("W&B: online run ")
    assert lines[1:] == ["warning: W&B: api_key not configured (no-tty): call wandb.login "
                         "(training goes on without W&B)"]


def test_wandb_is_process_0s_and_a_sweep_variant_and_seed_are_its_config_fields(
        tmp_path, monkeypatch):
    config = sweep.apply(tiny_config(), sweep.Variant("lr=0.01/seed_1", {"seed": 1}))
    config.wandb.project = "p"
    arguments = wandb_logging.init_arguments(config, str(tmp_path))
    assert arguments["config"]["variant"] == "lr=0.01" and arguments["config"]["seed"] == 1
    assert arguments["group"] == "lr=0.01" and arguments["resume"] == "allow"
    assert wandb_logging.init_arguments(config, str(tmp_path))["id"] == arguments["id"]
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert wandb_logging.sink(config, str(tmp_path), logger=None) is None


def test_wandb_reads_the_environments_wandb_mode_unless_the_config_names_one(tmp_path,
                                                                            monkeypatch):
    """W&B's own WANDB_MODE was overridden by the config's default "online": a run its user
    switched off (WANDB_MODE=disabled) would have uploaded."""
    config = tiny_config()
    config.wandb.project = "p"
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_logging.init_arguments(config, str(tmp_path))["mode"] == "online"
    for environment, mode in (("offline", "offline"), ("dryrun", "offline"), ("run", "online"),
                              ("disabled", "disabled")):
        monkeypatch.setenv("WANDB_MODE", environment)
        assert wandb_logging.mode(config.wandb) == mode, environment
        assert wandb_logging.enabled(config) == (mode != "disabled"), environment
    assert wandb_logging.sink(config, str(tmp_path), logger=None) is None  # disabled: no sink
    config.wandb.mode = "offline"  # the config's own, over the environment's
    assert wandb_logging.init_arguments(config, str(tmp_path))["mode"] == "offline"
    config.wandb.mode = ""
    monkeypatch.setenv("WANDB_MODE", "cloud")
    with pytest.raises(ValueError, match=re.escape(
            "the environment's WANDB_MODE='cloud': expected one of ('online', 'offline', "
            "'disabled'), or a wandb.mode")):
        configs.validate_config(config)


# --- goodput --------------------------------------------------------------------------------


class Preempted(Exception):
    pass


def slow_training_data(monkeypatch, seconds: float, fail_at: int | None = None):
    """Every training batch takes `seconds` longer to read (the first is the start-up's peek
    at the shapes); batch `fail_at` raises instead, as a crash would."""
    get_dataset = inputs.get_dataset
    read = []

    def slow(batch):
        read.append(1)
        if len(read) == fail_at:
            raise Preempted(f"batch {fail_at}")
        time.sleep(seconds)
        return batch

    def dataset(config, tokenizer, split, **kwargs):
        data = get_dataset(config, tokenizer, split, **kwargs)
        return data.map(slow) if split == "train" else data

    monkeypatch.setattr(inputs, "get_dataset", dataset)


@pytest.mark.slow
def test_goodput_shows_the_slow_input_and_a_crashed_starts_lost_steps(tmp_path, monkeypatch,
                                                                       capsys):
    """Steps 1-3 with every batch 0.3 s late, a crash reading step 4's batch (after the
    checkpoint at step 2), then a resume from step 2 to step 4 with the same slow input."""
    config = tiny_config(steps=4, checkpoint_every=2, eval_every=2)
    slow_training_data(monkeypatch, 0.3, fail_at=5)  # the peek, then steps 1, 2, 3
    with pytest.raises(Preempted):
        train.train_and_evaluate(config, str(tmp_path))
    crashed = json.loads((tmp_path / goodput.LEDGER).read_text())["starts"]
    assert [(s["start_step"], s["step"]) for s in crashed] == [(0, 3)]
    assert crashed[0]["seconds"]["data"] >= 3 * 0.3
    # The waits are not training time: counting two of the three 0.3 s waits would pass 0.6 s,
    # while the tiny steps themselves took up to 0.32 s on a loaded 2-core CI machine.
    assert crashed[0]["seconds"]["productive"] < 2 * 0.3

    slow_training_data(monkeypatch, 0.3)
    result = train.train_and_evaluate(config, str(tmp_path))["summary"]["goodput"]
    starts = json.loads((tmp_path / goodput.LEDGER).read_text())["starts"]
    assert [(s["start_step"], s["step"]) for s in starts] == [(0, 3), (2, 4)]
    assert result["starts"] == 2 and result["steps_recomputed"] == 1  # step 3
    first, second = starts[0]["seconds"], starts[1]["seconds"]
    assert result["data_seconds"] == pytest.approx(first["data"] + second["data"])
    assert result["data_seconds"] >= 5 * 0.3  # steps 1-3, then 3-4
    assert result["startup_seconds"] == pytest.approx(first["startup"])  # the first start's
    step_3 = first["productive"] - dict(map(tuple, starts[0]["marks"]))[2]
    assert result["restarts_seconds"] == pytest.approx(
        second["startup"] + second["compilation"] + step_3)
    assert result["productive_seconds"] == pytest.approx(
        first["productive"] + second["productive"] - step_3)
    assert result["total_seconds"] == pytest.approx(
        sum(first.values()) + sum(second.values()))
    assert result["goodput"] == pytest.approx(result["productive_seconds"] /
                                              result["total_seconds"])
    assert 0 < result["evaluation_seconds"] and 0 < result["checkpoint_seconds"]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"goodput \d+\.\d% of [\d.]+ s over 2 starts: training steps [\d.]+ s, "
                        r"start-up [\d.]+ s, compilation [\d.]+ s, waiting for data [\d.]+ s, "
                        r"evaluation [\d.]+ s, checkpoint saves [\d.]+ s, restarts [\d.]+ s "
                        r"\(1 steps recomputed\), other [\d.]+ s", line), line


@pytest.mark.slow
def test_goodput_totals_add_a_killed_start_and_its_recomputed_steps(tmp_path):
    """The CLI killed by SIGKILL a few steps after a checkpoint (every 10 steps), then rerun
    to 5 steps further."""
    workdir = tmp_path / "run"
    args = [f"--workdir={workdir}", f"--config.data.path={SHAKESPEARE}",
            "--config.data.tokenizer=char", *tiny_flags(400, checkpoint_every=10)]
    ledger = workdir / goodput.LEDGER
    first = start_cli("transformer.train", *args, logs=tmp_path / "first")
    watchdog = threading.Timer(TIMEOUT, first.process.kill)
    watchdog.start()
    try:
        while first.process.poll() is None:
            step = json.loads(ledger.read_text())["starts"][0]["step"] if ledger.exists() else 0
            if checkpoint_steps(workdir) and step >= 13 and 3 <= step % 10 <= 6:
                break
            time.sleep(0.005)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
    finally:
        watchdog.cancel()
    killed = json.loads(ledger.read_text())["starts"]
    assert len(killed) == 1 and 13 <= killed[0]["step"] < 400, killed
    rerun = run_cli("transformer.train", *args, f"--config.steps={killed[0]['step'] + 5}",
                    logs=tmp_path / "second")
    assert_succeeded(rerun)
    summary = json.loads((workdir / "summary.json").read_text())["goodput"]
    starts = json.loads(ledger.read_text())["starts"]
    assert starts[0] == killed[0]  # the killed start's record is kept as it was
    lost = killed[0]["step"] - starts[1]["start_step"]  # trained again from the checkpoint
    assert summary["starts"] == 2 and summary["steps_recomputed"] == lost > 0
    assert summary["total_seconds"] == pytest.approx(
        sum(sum(s["seconds"].values()) for s in starts))
    assert summary["restarts_seconds"] > starts[1]["seconds"]["startup"]
    assert re.search(r"^goodput [\d.]+% of [\d.]+ s over 2 starts: .* restarts [\d.]+ s "
                     rf"\({lost} steps recomputed\)", rerun.stdout, re.M), rerun.stdout[-3000:]
