"""Issue 43's smaller cases through the real commands, on one tiny trained run: generate with 0
or a negative count of new tokens and a negative beam size, a partial evaluation beside the whole
split's, metrics printed before a write that fails, and `~` in --workdir."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from absl import flags
from test_train import assert_succeeded, cli_env, describe, run_cli, tiny_flags

from transformer.utils import cli

STEPS = 2


def error_line(result: subprocess.CompletedProcess) -> str:
    """The command's one-line error (stderr's only line)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(result)
    return lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny GPT on the embedded corpus (byte tokenizer), trained for 2 steps."""
    root = tmp_path_factory.mktemp("small_fixes")
    run = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                  f"--workdir={root / 'run'}", *tiny_flags(STEPS), logs=root / "logs")
    assert_succeeded(run)
    return root / "run"


# --- generate -------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_0_new_tokens_prints_the_prompt(workdir, tmp_path):
    for extra in ([], ["--beam_size=2"]):
        result = run_cli("transformer.generate", f"--workdir={workdir}", "--prompt=def f",
                         "--max_new_tokens=0", *extra, logs=tmp_path / "logs")
        assert_succeeded(result)
        assert result.stdout == "def f\n", describe(result)


@pytest.mark.slow
@pytest.mark.parametrize("flag, message", [
    ("--max_new_tokens=-5", "max_new_tokens=-5: expected an int >= 0"),
    ("--beam_size=-1", "beam_size=-1: expected an int >= 0 (0: sampling, no beam search)"),
    # beam search gives one best continuation: it took neither and said nothing
    ('--beam_size=2 --chat=[{"role":"user","content":"hi"}]',
     "--beam_size=2: expected the one best continuation of --prompt (no --chat or"),
    ("--beam_size=2 --num_samples=3", "--beam_size=2: expected the one best continuation"),
])
def test_generate_names_a_negative_count_or_a_combination_it_cannot_honour(workdir, tmp_path,
                                                                          flag, message):
    result = run_cli("transformer.generate", f"--workdir={workdir}", "--prompt=def",
                     *flag.split(), logs=tmp_path / "logs")
    assert result.returncode == 2
    assert error_line(result).startswith(f"error: {message}")


# --- evaluate -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_partial_evaluation_never_overwrites_the_whole_splits_results(workdir, tmp_path):
    whole = workdir / f"eval_{STEPS}.json"
    whole.write_text('{"loss": "the whole split"}')
    result = run_cli("transformer.evaluate", f"--workdir={workdir}", "--eval_steps=1",
                     logs=tmp_path / "logs")
    assert_succeeded(result)
    metrics = json.loads(result.stdout)
    assert json.loads((workdir / f"eval_{STEPS}_steps1.json").read_text()) == metrics
    assert whole.read_text() == '{"loss": "the whole split"}'
    assert result.stderr.strip().splitlines()[-1] == (
        f"wrote {workdir}/eval_{STEPS}_steps1.json (a partial evaluation, --eval_steps=1; the "
        f"whole split's results go to eval_{STEPS}.json)")


@pytest.mark.slow
def test_metrics_that_cannot_be_written_are_printed_first(workdir, tmp_path):
    """A write that fails (here: a directory where the results go; root ignores a read-only
    mode) leaves the metrics on stdout and says so in one line, exit status 1."""
    target = workdir / f"eval_{STEPS}_steps2.json"
    target.mkdir()
    try:
        result = run_cli("transformer.evaluate", f"--workdir={workdir}", "--eval_steps=2",
                         logs=tmp_path / "logs")
    finally:
        target.rmdir()
    assert result.returncode == 1, describe(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"step {STEPS} of {workdir}", f"error: could not write {target} (Is a "
                     "directory); the metrics are above"], describe(result)
    metrics = json.loads(result.stdout)
    assert metrics["step"] == STEPS and metrics["loss"] > 0
    assert not list(workdir.glob("*.tmp*"))


# --- ~ in path flags ------------------------------------------------------------------------


def test_a_leading_tilde_in_a_path_flag_is_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    values = flags.FlagValues()
    for name in ("workdir", "output_dir", "prompt"):
        flags.DEFINE_string(name, None, "", flag_values=values)
    values(["cmd", "--workdir=~/runs/x", "--output_dir=~", "--prompt=~/not/a/path"])
    cli.expand_home(values)
    assert values.workdir == str(tmp_path / "runs" / "x")
    assert values.output_dir == str(tmp_path)
    assert values.prompt == "~/not/a/path"  # not a path flag


@pytest.mark.slow
def test_the_commands_expand_a_tilde_in_workdir(tmp_path):
    """`--workdir=~/x` (a shell leaves `~` after `=` alone) is $HOME/x, never ./~/x."""
    home = tmp_path / "home"
    home.mkdir()
    result = subprocess.run([sys.executable, "-m", "transformer.evaluate", "--workdir=~/x"],
                            cwd=tmp_path, env={**cli_env(), "HOME": str(home)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert error_line(result) == f"error: {str(home / 'x')!r} holds no checkpoints: expected " \
                                 "a training workdir that has saved one"
    assert not (tmp_path / "~").exists()


@pytest.mark.slow
def test_evaluate_reads_a_run_trained_on_more_devices_than_it_has(tmp_path):
    """A run trained on fsdp=2 x tensor=2 (4 devices) evaluates on one device, data parallel,
    with a note: the same loss as on its own mesh (it refused, suggesting a -1 axis that
    evaluate has no flag to set)."""
    workdir = tmp_path / "run"
    mesh = ["--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
    assert_succeeded(run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                             f"--workdir={workdir}", *tiny_flags(STEPS), *mesh,
                             logs=tmp_path / "train", devices=4))
    results = {}
    for devices in (4, 1):
        result = run_cli("transformer.evaluate", f"--workdir={workdir}", "--eval_steps=2",
                         logs=tmp_path / f"eval{devices}", devices=devices)
        assert_succeeded(result)
        results[devices] = json.loads(result.stdout)
        notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
        assert notes == ([] if devices == 4 else [
            "note: the run trained on mesh data=1 x stage=1 x fsdp=2 x expert=1 x sequence=1 x "
            "tensor=2; evaluating data parallel over 1 of the 1 devices here"]), notes
    assert results[1]["loss"] == pytest.approx(results[4]["loss"], rel=1e-5)


def test_a_batch_that_does_not_split_over_this_machines_devices_is_read_data_parallel(
        monkeypatch):
    """Probe p2 of stop 110: a run trained on one device with mesh.data=-1 and batch_size=12,
    evaluated on 8 devices: the -1 axis took all 8, which do not split 12 rows, and evaluate
    failed with JAX's sharding error. It now evaluates data parallel over 6, with the note."""
    from transformer import configs
    from transformer.training import placement

    config = configs.base_config()
    config.batch_size = 12  # mesh.data=-1, the default
    monkeypatch.setattr(placement.jax, "devices", lambda: list(range(8)))
    fitted, devices, note = placement.local_mesh(config, "evaluating")
    assert devices == list(range(6)) and fitted.mesh.data == 6 and fitted.mesh.fsdp == 1
    assert note.endswith("; evaluating data parallel over 6 of the 8 devices here"), note
    config.batch_size = 16
    assert placement.local_mesh(config, "evaluating") == (config, None, None)
