"""Sweeps and length extrapolation: a sweep experiment runs end to end through the CLI (report,
plots, skip when finished), variants are validated up front, and a trained model is evaluated
at longer lengths (RoPE, ALiBi, sinusoidal, T5 buckets) or refuses clearly (learned table).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import forkserver
import pytest

from transformer import evaluate as evaluate_lib
from transformer import sweep
from transformer.configs import base_config

pytestmark = pytest.mark.slow  # end-to-end runs through the CLI

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
TRAIN_LEN, LONG_LEN = 16, 40
POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "t5"]

EXPERIMENT = textwrap.dedent(f"""
    from transformer import sweep
    from transformer.configs import base_config


    def get_config():
        config = base_config()
        config.experiment = "tiny_sweep"
        config.update(steps={STEPS}, batch_size=2, seq_len={TRAIN_LEN}, log_every=1,
                      eval_every={STEPS}, eval_steps=2, checkpoint_every={STEPS},
                      eval_seq_lens=({TRAIN_LEN}, {LONG_LEN}))
        config.model.update(num_layers=1, d_model=32, num_heads=2, d_ff=64,
                            max_len={TRAIN_LEN})
        return config


    def get_sweep():
        return sweep.axis("model.position", {POSITIONS!r})
""")


def run_sweep(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return forkserver.run([sys.executable, "-m", "transformer.sweep", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """(experiment file, sweep workdir, CLI result) of the tiny positional sweep."""
    root = tmp_path_factory.mktemp("sweep")
    experiment = root / "tiny_sweep.py"
    experiment.write_text(EXPERIMENT)
    workdir = root / "runs"
    result = run_sweep(f"--config={experiment}", f"--workdir={workdir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return experiment, workdir, result


def table_rows(report: str, which: int = 0) -> dict[str, dict[str, str]]:
    """The report's `which`-th table (0: the runs' metrics) as {variant: {header: cell}}."""
    blocks = "\n".join(line if line.startswith("|") else "" for line in report.splitlines())
    lines = [block for block in blocks.split("\n\n") if block.strip("\n")][which]
    lines = lines.strip("\n").splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(header, cells, strict=True))
            for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}


def test_a_sweep_trains_every_variant_and_writes_the_report_and_plots(swept):
    import matplotlib.image

    _, workdir, _ = swept
    names = [f"position={p}" for p in POSITIONS]
    for name in names:
        summary = (workdir / name / "summary.json").read_text()
        assert f'"step": {STEPS}' in summary
        assert not list((workdir / name).glob("seed_*"))  # one seed: no seed level
    report = (workdir / "report.md").read_text()
    assert report.splitlines()[2].startswith(f"{len(names)} variants, written ")
    assert "Per seed" not in report and "Not paired over windows" not in report
    # One seed: the window bootstrap is the only interval of a difference from the baseline.
    differences = table_rows(report, 1)
    assert f"## Difference from the baseline `{names[0]}`" in report
    assert differences[names[0]][sweep.WINDOW_COLUMN] == "baseline"
    for name in names[1:]:
        assert differences[name][sweep.WINDOW_COLUMN].endswith(("within noise", "differs"))
    rows = table_rows(report)
    assert sorted(rows) == sorted(names)
    for name, row in rows.items():
        assert row["status"] == "finished"
        assert row["steps"] == str(STEPS)
        assert math.isfinite(float(row["val loss"]))
        assert int(row["params"].replace(",", "")) > 0
        assert f"`model.position={name.split('=')[1]}`" == row["overrides"]
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png", "train_loss_vs_step.png"):
        image = matplotlib.image.imread(workdir / png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0  # something was drawn
        assert f"]({png})" in (workdir / "report.md").read_text()


def test_the_report_has_length_extrapolation_and_learned_positions_stop_at_their_table(swept):
    _, workdir, _ = swept
    rows = table_rows((workdir / "report.md").read_text())
    for name, row in rows.items():
        at_train, at_long = row[f"val loss @{TRAIN_LEN}"], row[f"val loss @{LONG_LEN}"]
        assert math.isfinite(float(at_train))
        if name == "position=learned":
            assert at_long == "-"
        else:
            assert math.isfinite(float(at_long)), name


def test_a_variant_stopped_by_a_signal_stops_the_sweep_with_its_exit_status(swept, tmp_path,
                                                                          monkeypatch):
    """A variant a signal stopped (saved, unfinished) ends the sweep, which exits as training
    does, 128 + the signal (130 for Ctrl-C): a launcher reruns it rather than reading done."""
    import signal

    experiment, _, _ = swept
    configs = sweep.variant_configs(_experiment_config(experiment),
                                    sweep.load_sweep(str(experiment)))
    first = next(iter(configs))
    monkeypatch.setattr(sweep, "_train", lambda names, *_: {name: {
        "summary": {"step": 1}, "signal": signal.SIGINT} for name in names})
    assert sweep.run(configs, str(tmp_path / "sweep")) == 130
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == [first]  # none after it


def test_a_run_another_sweep_trains_is_skipped_and_a_save_in_flight_is_no_checkpoint(
        swept, tmp_path, monkeypatch, capsys):
    """Two sweeps on one workdir: the one that finds a run in use skips it (no error.txt that
    would call it failed). A run killed while writing its first checkpoint has none to resume:
    it is `training` (starts again), not `partial`."""
    from transformer.training.workdir import WorkdirBusy

    experiment, _, _ = swept
    configs = sweep.variant_configs(_experiment_config(experiment),
                                    sweep.load_sweep(str(experiment)))
    monkeypatch.setattr(sweep, "_train", lambda names, *_: {
        name: WorkdirBusy("workdir is in use by another training") for name in names})
    assert sweep.run(configs, str(tmp_path / "sweep")) is None
    assert "skipped: workdir is in use" in capsys.readouterr().out
    assert not list((tmp_path / "sweep").glob("*/error.txt"))

    run = tmp_path / "killed"
    (run / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 6, "loss": 4.2}\n')
    config = next(iter(configs.values()))
    assert sweep.report.status(str(run), config) == "training"


def test_a_finished_sweep_is_skipped_and_launch_commands_carry_the_overrides(swept):
    experiment, workdir, _ = swept
    base = sweep.load_sweep(str(experiment))
    config = _experiment_config(experiment)
    configs = sweep.variant_configs(config, base, only=["position=rope"])
    before = (workdir / "position=rope" / "metrics.jsonl").read_text()
    assert sweep.run(configs, str(workdir)) is None  # finished: skipped, nothing trains
    assert (workdir / "position=rope" / "metrics.jsonl").read_text() == before

    # An edited sweep must not mix two configs under one name: refused before anything trains.
    changed = {name: sweep.apply(config, sweep.Variant(name, {"model.d_model": 64}))
               for name in configs}
    with pytest.raises(ValueError, match=r"'position=rope' .*model.d_model: trained with 32, "
                                         r"now 64"):
        sweep.run(changed, str(workdir))
    assert (workdir / "position=rope" / "metrics.jsonl").read_text() == before
    # A key added to the code after the variant ran is no change at its default (the run had
    # what the default does), and one at another value is.
    record = workdir / "position=rope" / "sweep_config.json"
    saved = json.loads(record.read_text())
    record.write_text(json.dumps({k: v for k, v in saved.items()
                                  if k not in ("model.qk_norm", "z_loss")}))
    assert sweep.changed_settings(str(workdir / "position=rope"), configs["position=rope"]) == []
    newer = sweep.apply(configs["position=rope"], sweep.Variant("q", {"model.qk_norm": True}))
    assert sweep.changed_settings(str(workdir / "position=rope"), newer) == [
        "model.qk_norm: trained with None, now True"]
    record.write_text(json.dumps(saved))

    commands = sweep.launch_commands(str(experiment), {"steps": 10}, base[:2], "gs://b/sweep")
    assert commands[0] == (f"python -m transformer.train --config={experiment} "
                           "--workdir=gs://b/sweep/position=learned --config.steps=10 "
                           "--config.model.position=learned")
    assert len(commands) == 2


def test_launch_commands_parse_back_to_the_variants_tuples():
    """A tuple's strings are quoted: a comma inside one (a data.sources entry) split it and
    the printed command failed to parse (probe p4 of stop 110), and a one-item tuple came back
    as the string '(copy.yaml,)'."""
    import shlex

    from absl import flags
    from ml_collections import config_flags

    tuples = {"data.sources": ("path=a.txt,weight=0.7", "path=b.txt,weight=0.3"),
              "eval_tasks": ("copy.yaml",)}
    [command] = sweep.launch_commands("experiments/gpt_tiny.py", {"optimizer.b2": 0.95},
                                      [sweep.Variant("mix", tuples)], "/w")
    argv = ["train", *(a for a in shlex.split(command)[3:] if not a.startswith("--workdir="))]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    assert values.config.data.sources == tuples["data.sources"]
    assert values.config.eval_tasks == tuples["eval_tasks"]
    assert values.config.optimizer.b2 == 0.95


def test_a_launched_run_is_checked_against_its_checkpoint_and_report_only_checks_too(
        swept, tmp_path):
    """A run a --print_launch command trained has no sweep_config.json: its checkpoint's
    resolved config is what it trained with (the vocabulary size training filled in is no
    change). --report_only refuses runs trained with other settings, or past `steps`."""
    import shutil

    experiment, workdir, _ = swept
    config = _experiment_config(experiment)
    configs = sweep.variant_configs(config, sweep.load_sweep(str(experiment)),
                                    only=["position=rope"])
    launched = tmp_path / "runs" / "position=rope"
    shutil.copytree(workdir / "position=rope", launched)
    (launched / "sweep_config.json").unlink()
    assert sweep.changed_settings(str(launched), configs["position=rope"]) == []
    configs["position=rope"].optimizer.learning_rate = 0.01
    with pytest.raises(ValueError, match=r"'position=rope' .*other settings \("
                                         r"optimizer.learning_rate: trained with 0.001, now "
                                         r"0.01\)"):
        sweep.check_runs(configs, str(tmp_path / "runs"))

    args = [f"--config={experiment}", f"--workdir={workdir}", "--report_only"]
    for flag, error in (
            ("--config.optimizer.learning_rate=0.01", "other settings (optimizer.learning_rate: "
             "trained with 0.001, now 0.01)"),
            ("--config.eval_steps=1", "other settings (eval_steps: trained with 2, now 1)"),
            (f"--config.steps={STEPS - 1}", f"has trained to step {STEPS}, now steps="
             f"{STEPS - 1}: expected steps >= {STEPS} (steps may only grow)")):
        result = run_sweep(*args, flag)
        assert result.returncode == 2, result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: variant 'position=learned' in {workdir} ") and error in lines[0], lines


def _experiment_config(path: Path):
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["get_config"]()


def test_evaluate_reads_a_trained_model_at_longer_lengths(swept):
    _, workdir, _ = swept
    metrics = evaluate_lib.evaluate_workdir(str(workdir / "position=rope"), eval_steps=2,
                                            seq_lens=(TRAIN_LEN, LONG_LEN))
    assert metrics["train_seq_len"] == TRAIN_LEN
    assert set(metrics["by_seq_len"]) == {TRAIN_LEN, LONG_LEN}
    # The training length reproduces the run's own final evaluation (same batches, params).
    records = [json.loads(line) for line in
               (workdir / "position=rope" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["split"] == "validation"][-1]
    assert metrics["by_seq_len"][TRAIN_LEN]["loss"] == pytest.approx(logged["loss"], rel=1e-5)
    at_long = [r for r in records if r["split"] == f"validation@{LONG_LEN}"][-1]
    assert metrics["by_seq_len"][LONG_LEN]["loss"] == pytest.approx(at_long["loss"], rel=1e-5)
    assert math.isfinite(metrics["by_seq_len"][LONG_LEN]["loss"])

    with pytest.raises(ValueError, match=rf"eval_seq_len={LONG_LEN}: .*learned positions for "
                                         rf"{TRAIN_LEN} tokens.*cannot extrapolate"):
        evaluate_lib.evaluate_workdir(str(workdir / "position=learned"),
                                      seq_lens=(TRAIN_LEN, LONG_LEN))
    assert not list((workdir / "position=learned").glob("eval_*len*.json"))


def test_bad_sweeps_fail_before_anything_trains(tmp_path):
    config = base_config()
    with pytest.raises(ValueError, match=r"variant 'x': unknown config key 'model.positon'"):
        sweep.variant_configs(config, sweep.named({"x": {"model.positon": "rope"}}))
    with pytest.raises(ValueError, match=r"variant 'x': model.num_heads='4'"):
        sweep.variant_configs(config, sweep.named({"x": {"model.num_heads": "4"}}))
    with pytest.raises(ValueError, match=r"variant 'bad': .*num_kv_heads=3"):
        sweep.variant_configs(config, sweep.named({"bad": {"model.num_kv_heads": 3}}))
    with pytest.raises(ValueError, match=r"--only \['nope'\]"):
        sweep.variant_configs(config, sweep.axis("seed", [0, 1]), only=["nope"])
    with pytest.raises(ValueError, match="set 'seed' twice"):
        sweep.product(sweep.axis("seed", [0]), sweep.axis("seed", [1]))
    with pytest.raises(ValueError, match="equal length"):
        sweep.zipped(sweep.axis("seed", [0]), sweep.axis("steps", [1, 2]))
    with pytest.raises(ValueError, match="eval_seq_lens"):
        sweep.variant_configs(config, sweep.named({"x": {"eval_seq_lens": (0,)}}))
    assert sweep.product(sweep.axis("seed", [0, 1]), sweep.axis("model.position", ["rope"]))[1] \
        == sweep.Variant("seed=1,position=rope", {"seed": 1, "model.position": "rope"})

    experiment = tmp_path / "no_sweep.py"
    experiment.write_text("from transformer.configs import base_config\n\n"
                          "def get_config():\n    return base_config()\n")
    result = run_sweep(f"--config={experiment}", f"--workdir={tmp_path / 'runs'}")
    assert result.returncode != 0
    assert "expected a get_sweep() function" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_moe_run_reports_its_load_imbalance_over_training_and_last(tmp_path):
    """The worst layer's max/mean tokens per expert, averaged over the logged steps and the
    last: two report columns, present only where every train record has it."""
    import json
    import types

    from transformer.sweeps import report

    records = [{"split": "train", "step": s, "loss": 2.0, "elapsed": s, "moe_imbalance": x}
               for s, x in ((1, 3.0), (2, 2.0), (3, 1.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = report.variant_row("aux_free", types.SimpleNamespace(steps=3), str(tmp_path))
    assert (row["moe_imbalance_mean"], row["moe_imbalance"]) == (2.0, 1.0)
    headers = [header for _, header, _ in report._metric_columns([row])]
    assert "max/mean load, mean over training" in headers and "max/mean load, last" in headers
    dense = report.variant_row("dense", types.SimpleNamespace(steps=3), str(tmp_path / "none"))
    assert "moe_imbalance" not in dense


def test_a_diverged_run_reports_no_accuracy(tmp_path):
    """A NaN validation loss's accuracy (the argmax of NaN logits) reads "-", not 0.000."""
    import json
    import types

    from transformer.sweeps import report

    records = [{"split": "validation", "step": 3, "loss": loss, "accuracy": 0.0, "elapsed": 3}
               for loss in (2.5, float("nan"))]
    for n in (1, 2):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                        for r in records[:n]))
        row = report.variant_row("v", types.SimpleNamespace(steps=3), str(tmp_path))
        assert row["val_accuracy"] == (0.0 if n == 1 else None)


def test_a_damaged_summary_is_named_in_one_line(tmp_path):
    """A summary.json cut short (an interrupted copy, a full disk) names its file; json's own
    message named no run."""
    from transformer.sweeps import report

    (tmp_path / "summary.json").write_text('{"steps": 3, "final_loss": 2.')
    with pytest.raises(ValueError, match=r"summary\.json: not JSON \(") as error:
        report.read_summary(str(tmp_path))
    assert str(tmp_path) in str(error.value) and "\n" not in str(error.value)


def _lr_runs(**learning_rates: float) -> dict:
    """{name: config} of tiny runs that differ in their learning rate, as a sweep gives them."""
    config = base_config()
    config.update(steps=3, batch_size=2, seq_len=16)
    return sweep.variant_configs(config, sweep.named(
        {name: {"optimizer.learning_rate": lr} for name, lr in learning_rates.items()}))


def _finish(runs: dict, workdir: Path, outcome) -> None:
    variants = [sweep.Variant(name, {"optimizer.learning_rate": config.optimizer.learning_rate})
                for name, config in runs.items()]
    sweep.finish(runs, runs, variants, str(workdir), "Sweep: t", 1, None, outcome)


def _fake_train(trained: list, during=None, fail=()):
    """A stand-in for sweep._train: records (name, learning rate), calls `during(name)` as
    each run trains (another command starting meanwhile), and finishes the run (its
    summary.json) or raises FloatingPointError for the names in `fail`."""
    def train(names, configs, workdir, explicit):
        results = {}
        for name in names:
            trained.append((name, configs[name].optimizer.learning_rate))
            if during:
                during(name)
            if name in fail:
                results[name] = FloatingPointError("loss became NaN at step 2")
                continue
            summary = {"step": configs[name].steps, "final_loss": 4.0}
            (Path(workdir) / name / "summary.json").write_text(json.dumps(summary))
            results[name] = {"summary": summary}
        return results
    return train


def test_a_second_sweep_with_other_settings_on_the_workdir_mixes_nothing(tmp_path, monkeypatch,
                                                                         capsys):
    """Sweep B (b's learning rate edited) starts on A's workdir while A trains a, and trains b
    first: A then skips b, saying why, instead of reporting it under A's settings, and its
    report is refused as --report_only's would be; b's record keeps B's settings."""
    workdir, trained = tmp_path / "sweep", []
    runs_a, runs_b = _lr_runs(a=1e-3, b=2e-3), _lr_runs(b=5e-2)

    def sweep_b(name):
        if name == "a":
            assert sweep.run(runs_b, str(workdir)) is None

    monkeypatch.setattr(sweep, "_train", _fake_train(trained, during=sweep_b))
    assert sweep.run(runs_a, str(workdir)) == sweep.FAILED
    assert trained == [("a", 1e-3), ("b", 5e-2)]  # A trained no b of its own
    out = capsys.readouterr().out
    assert (f"[2/2] b: skipped: variant 'b' in {workdir} was trained with other settings "
            "(optimizer.learning_rate: trained with 0.05, now 0.002)") in out
    assert json.loads((workdir / "b" / "sweep_config.json").read_text())[
        "optimizer.learning_rate"] == 0.05
    with pytest.raises(ValueError, match=r"variant 'b' .*other settings \(optimizer"
                                         r".learning_rate: trained with 0.05, now 0.002\)"):
        _finish(runs_a, workdir, sweep.FAILED)
    assert not (workdir / "report.md").exists()
    _finish(runs_b, workdir, None)  # B's report: b, under the settings it trained with
    assert "`optimizer.learning_rate=0.05`" in (workdir / "report.md").read_text()


def test_a_settings_record_another_sweep_wrote_first_is_kept_and_refuses(tmp_path,
                                                                         monkeypatch):
    """B records b's settings between A's check and A's own record (both unfinished, neither
    yet holding b's lock): A's record does not replace B's, and A refuses b rather than
    train it under B's record."""
    workdir, trained = tmp_path / "sweep", []
    runs_a, runs_b = _lr_runs(b=2e-3), _lr_runs(b=5e-2)
    record = workdir / "b" / "sweep_config.json"
    link = os.link

    def b_first(source, target):
        record.write_text(json.dumps(sweep._as_json(runs_b["b"])))
        link(source, target)

    monkeypatch.setattr(os, "link", b_first)
    monkeypatch.setattr(sweep, "_train", _fake_train(trained))
    assert sweep.run(runs_a, str(workdir)) == sweep.FAILED
    assert trained == []
    assert json.loads(record.read_text())["optimizer.learning_rate"] == 0.05
    assert sorted(p.name for p in (workdir / "b").iterdir()) == ["sweep_config.json"]


def test_a_settings_record_without_hard_links_is_created_readable_by_others(tmp_path,
                                                                            monkeypatch):
    """Where the filesystem has no hard links (gcsfuse: EPERM), the record is created
    exclusively instead (the sweep failed before training anything); either way it is the
    user's umask's file, as the run's others (it was owner-only)."""
    import errno

    workdir, trained = tmp_path / "sweep", []
    runs = _lr_runs(a=1e-3)

    def no_links(source, target):
        raise PermissionError(errno.EPERM, "Operation not permitted", source, target)

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(sweep, "_train", _fake_train(trained))
    old = os.umask(0o022)
    try:
        assert sweep.run(runs, str(workdir)) is None
    finally:
        os.umask(old)
    assert trained == [("a", 1e-3)]
    record = workdir / "a" / "sweep_config.json"
    assert json.loads(record.read_text())["optimizer.learning_rate"] == 1e-3
    assert record.stat().st_mode & 0o777 == 0o644
    assert not [p.name for p in (workdir / "a").iterdir() if p.name.startswith(".")]


def test_a_sweep_with_a_failed_run_writes_its_report_then_fails(tmp_path, monkeypatch, capsys):
    """A run that fails (NaN) is in the report, and then the sweep fails (exit status 1, as
    docs/experiments.md says of every command); a run another command holds is no failure."""
    from transformer.training.workdir import WorkdirBusy

    workdir, trained = tmp_path / "sweep", []
    runs = _lr_runs(a=1e-3, boom=1e12)
    monkeypatch.setattr(sweep, "_train", _fake_train(trained, fail={"boom"}))
    outcome = sweep.run(runs, str(workdir))
    assert outcome == sweep.FAILED
    with pytest.raises(RuntimeError, match=r"^1 of 2 runs failed \(boom\) in .*error.txt"):
        _finish(runs, workdir, outcome)
    report = (workdir / "report.md").read_text()
    assert "FloatingPointError: loss became NaN" in report
    assert table_rows(report)["boom"]["status"] == "failed"

    capsys.readouterr()
    monkeypatch.setattr(sweep, "_train", lambda names, *_: {
        name: WorkdirBusy("workdir is in use by another training") for name in names})
    outcome = sweep.run(runs, str(workdir))
    assert outcome is None and "boom: skipped: workdir is in use" in capsys.readouterr().out
    _finish(runs, workdir, outcome)  # no error: the command holding it reports it
