"""Every command through its real CLI: bad input is one line on stderr (`error: ...`), with exit
status 2 for usage/config errors and 1 for runtime failures, and nothing in the workdir changes;
--verbose shows the traceback; a successful CPU run's stderr is free of libtpu's probe warnings
and of shutdown noise."""

from __future__ import annotations

import glob
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import REPO, cli_env, describe, run_cli, tiny_flags

ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio", "/dev/nvidia*", "/dev/kfd")

pytestmark = pytest.mark.slow  # every test runs a command line


def file_hashes(directory: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `directory` ({} if it does not exist), but
    train.lock, which every training start rewrites with its pid (transformer.training.workdir)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "train.lock"}


def assert_one_line_error(result: subprocess.CompletedProcess, status: int, *words: str):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == status, describe(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(result)
    for word in words:
        assert word in lines[0], describe(result)
    assert "Traceback" not in result.stderr


# (module, args (WORKDIR, FILE: paths in tmp_path), exit status, words in the error line)
CASES = {
    "unknown_key": ("transformer.train", ["--workdir=WORKDIR", "--config.modle=x"], 2,
                    ["unknown key 'modle' in --config.modle: did you mean --config.model?"]),
    # ConfigDict names only the missing part: the message names the whole override
    "unknown_nested_key": ("transformer.train", ["--workdir=WORKDIR",
                                                 "--config.optimizer.learnin_rate=1"], 2,
                           ["unknown key 'learnin_rate' in --config.optimizer.learnin_rate: "
                            "did you mean --config.optimizer.learning_rate?"]),
    "unknown_group_in_a_key": ("transformer.train", ["--workdir=WORKDIR",
                                                     "--config.modle.d_model=64"], 2,
                               ["unknown key 'modle' in --config.modle.d_model: "
                                "did you mean --config.model.d_model?"]),
    # a dict-valued key holds no keys to override one by one: it is given whole
    "key_under_a_dict": ("transformer.train",
                         ["--config=experiments/gpt_tiny.py", "--workdir=WORKDIR",
                          "--config.compiler_options.xla_cpu_multi_thread_eigen=False"], 2,
                         ["in --config.compiler_options.xla_cpu_multi_thread_eigen: "
                          "compiler_options takes a whole dict (--config.compiler_options="
                          "\"{'xla_cpu_multi_thread_eigen': False}\")"]),
    # the override named is the one that fails, not the first with the key in its path
    "unknown_key_after_a_valid_one": ("transformer.train",
                                      ["--workdir=WORKDIR", "--config.model.d_model=64",
                                       "--config.optimizer.d_model=1"], 2,
                                      ["unknown key 'd_model' in --config.optimizer.d_model"]),
    "unknown_negated_key": ("transformer.train", ["--workdir=WORKDIR", "--noconfig.foo"], 2,
                            ["unknown key 'foo' in --noconfig.foo"]),
    # ml_collections resolves every override's parents before any leaf: sources fails first
    "key_under_a_tuple": ("transformer.train",
                          ["--workdir=WORKDIR", "--config.optimizer.learning_rate.x=1",
                           "--config.data.sources.x.weight=1"], 2,
                          ["--config.data.sources.x.weight: data.sources is a tuple: give it "
                           "whole (--config.data.sources=\"(...)\")"]),
    "key_under_a_float": ("transformer.train",
                          ["--workdir=WORKDIR", "--config.optimizer.learning_rate.x=1"], 2,
                          ["--config.optimizer.learning_rate.x: optimizer.learning_rate is a "
                           "float, with no keys"]),
    # the hint comes from every key of the config: a leaf's initials, or its name elsewhere
    "unknown_key_by_its_initials": ("transformer.train",
                                    ["--workdir=WORKDIR", "--config.optimizer.lr=1e-3"], 2,
                                    ["error: unknown key 'lr' in --config.optimizer.lr: did you "
                                     "mean --config.optimizer.learning_rate?"]),
    "unknown_key_of_another_group": ("transformer.train",
                                     ["--workdir=WORKDIR", "--config.learning_rate=1e-3"], 2,
                                     ["error: unknown key 'learning_rate' in "
                                      "--config.learning_rate: did you mean "
                                      "--config.optimizer.learning_rate?"]),
    # an index is no key (ml_collections cannot even parse the path)
    "index_under_a_tuple": ("transformer.train",
                            ["--workdir=WORKDIR", "--config.eval_seq_lens.0=64"], 2,
                            ["error: --config.eval_seq_lens.0: eval_seq_lens is a tuple: give "
                             "it whole (--config.eval_seq_lens=\"(...)\")"]),
    "index_under_a_group": ("transformer.train", ["--workdir=WORKDIR", "--config.model.moe.0=1"],
                            2, ["error: unknown key '0' in --config.model.moe.0"]),
    "float_for_an_int": ("transformer.train", ["--workdir=WORKDIR", "--config.steps=1.5"], 2,
                         ["error: flag --config.steps=1.5: expected an int"]),
    "unknown_flag": ("transformer.train", ["--workdir=WORKDIR", "--nosuchflag"], 2,
                     ["nosuchflag"]),
    "missing_config_train": ("transformer.train", ["--config=nope.py", "--workdir=WORKDIR"], 2,
                             ["--config=nope.py", "No such file"]),
    "missing_config_sweep": ("transformer.sweep", ["--config=nope.py", "--workdir=WORKDIR"], 2,
                             ["--config=nope.py", "No such file"]),
    "bad_value": ("transformer.train", ["--workdir=WORKDIR", "--config.steps=0"], 2,
                  ["steps=0", "expected"]),
    "wrong_type": ("transformer.train", ["--workdir=WORKDIR", "--config.steps=abc"], 2,
                   ["--config.steps=abc"]),
    "workdir_is_a_file": ("transformer.train", ["--workdir=FILE", "--config.steps=1"], 2,
                          ["workdir=", "is a regular file, expected a directory"]),
    "evaluate_no_checkpoints": ("transformer.evaluate", ["--workdir=WORKDIR"], 2,
                                ["holds no checkpoints"]),
    "evaluate_no_batches": ("transformer.evaluate", ["--workdir=WORKDIR", "--eval_steps=0"], 2,
                            ["eval_steps=0: expected an int >= 1"]),
    "only_without_baseline": ("transformer.sweep", ["--config=experiments/ablations/mtp.py",
                                                    "--workdir=WORKDIR", "--only=depth_1"], 2,
                              ["--only=depth_1 leaves out the baseline 'depth_0'"]),
    # absl sets --report_only and would drop "false": every CLI refuses a stray argument
    "stray_argument": ("transformer.sweep", ["--config=experiments/ablations/mtp.py",
                                             "--workdir=WORKDIR", "--report_only", "false"], 2,
                       ["unexpected arguments ['false']: expected only flags"]),
    "generate_no_checkpoints": ("transformer.generate", ["--workdir=WORKDIR"], 2,
                                ["holds no checkpoints"]),
    "visualize_no_checkpoints": ("transformer.visualize", ["--workdir=WORKDIR", "--text=hi"], 2,
                                 ["holds no checkpoints"]),
    "report_only_missing_workdir": ("transformer.sweep",
                                    ["--config=experiments/ablations/mtp.py",
                                     "--workdir=WORKDIR/nope", "--report_only"], 2,
                                    ["--report_only", "nope is not a directory"]),
    "aot_no_slices": ("launch.aot", ["--config=experiments/gpt_tiny.py", "--topology=v5p-8",
                                     "--num_slices=0"], 2, ["--num_slices=0", "expected"]),
    "prepare_missing_input": ("transformer.data.prepare",
                              ["--output_dir=WORKDIR/prepared", "--input=WORKDIR/nope.txt"], 2,
                              ["nope.txt", "no such file"]),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_and_changes_nothing(name, tmp_path):
    module, args, status, words = CASES[name]
    workdir, file = tmp_path / "workdir", tmp_path / "file"
    file.write_text("not a directory\n")
    if module != "transformer.train" or name == "workdir_is_a_file":
        workdir.mkdir()  # an existing workdir whose files must stay as they are
        (workdir / "notes.txt").write_text("keep me\n")
    before = file_hashes(tmp_path / "workdir"), file.read_bytes()
    args = [a.replace("WORKDIR", str(workdir)).replace("FILE", str(file)) for a in args]
    result = run_cli(module, *args, logs=tmp_path / "logs")
    assert_one_line_error(result, status, *words)
    assert (file_hashes(tmp_path / "workdir"), file.read_bytes()) == before


@pytest.mark.parametrize("module, flag", [
    ("transformer.train", "--help"), ("transformer.evaluate", "--help"),
    ("transformer.generate", "--help"), ("transformer.export", "--help"),
    ("transformer.sweep", "--help"), ("transformer.visualize", "--helpfull")])
def test_help_exits_0(module, flag, tmp_path):
    """absl's help flags print the help, then exit 1, which the commands document as a runtime
    failure: asking for help succeeds. A misspelled flag beside it is still bad usage (2)."""
    result = run_cli(module, flag, logs=tmp_path / "logs")
    assert result.returncode == 0, describe(result)
    assert "--workdir" in result.stdout and "error:" not in result.stderr, describe(result)
    result = run_cli(module, "--help=false", "--nosuchflag", logs=tmp_path / "logs")
    assert_one_line_error(result, 2, "nosuchflag")


def test_the_whole_dict_an_unknown_key_error_suggests_is_accepted(tmp_path):
    """The form the `key_under_a_dict` error gives parses: the run gets as far as validation."""
    result = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                     f"--workdir={tmp_path / 'workdir'}", "--config.steps=0",
                     "--config.compiler_options={'xla_cpu_multi_thread_eigen': False}",
                     logs=tmp_path / "logs")
    assert_one_line_error(result, 2, "steps=0: expected")


def test_verbose_shows_the_traceback(tmp_path):
    result = run_cli("transformer.train", "--config.modle=x", "--verbose",
                     f"--workdir={tmp_path / 'workdir'}", logs=tmp_path / "logs")
    assert result.returncode != 0, describe(result)
    assert "Traceback (most recent call last)" in result.stderr, describe(result)
    assert not (tmp_path / "workdir").exists()


def test_a_tiny_cpu_run_has_a_quiet_stderr(tmp_path):
    """No libtpu probe warnings (JAX_PLATFORMS unset, as a user runs it) and no exceptions
    ignored at interpreter exit; the end-of-run samples print (`samples`, 2 here)."""
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"}
    result = subprocess.run(
        [sys.executable, "-m", "transformer.train", "--config=experiments/gpt_tiny.py",
         f"--workdir={tmp_path / 'workdir'}", *tiny_flags(2), "--config.samples=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, describe(result)
    samples = result.stdout.split("samples (temperature 0.8, top-k 200, prompt ")[1]
    assert samples.splitlines().count("---") == 2, describe(result)
    if not any(glob.glob(d) for d in ACCELERATOR_DEVICES):  # a TPU/GPU machine may log more
        assert "Failed to find host bounds" not in result.stderr, describe(result)
        assert "INVALID_ARGUMENT" not in result.stderr, describe(result)
    assert "Exception ignored" not in result.stderr, describe(result)
    assert "AttributeError" not in result.stderr, describe(result)
    assert "Traceback" not in result.stderr, describe(result)


def test_a_runtime_failure_exits_1(tmp_path):
    """NaN loss (a huge learning rate) stops the run: one line naming the step, exit 1."""
    result = run_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                     f"--workdir={tmp_path / 'workdir'}", *tiny_flags(4),
                     "--config.optimizer.learning_rate=1e30", logs=tmp_path / "logs")
    assert_one_line_error(result, 1, "NaN/Inf", "at step")


def test_a_failure_raised_while_ctrl_c_unwinds_is_the_interrupt(tmp_path):
    """A second Ctrl-C can land inside a checkpoint write; the `finally` that waits for the
    write then reports it cut short (`... failed (RuntimeError: the write did not complete)`).
    That is the interrupt, not a disk fault: exit 130 with the documented line."""
    script = tmp_path / "interrupted.py"
    script.write_text(
        "from transformer.utils import cli\n"
        "def cut_short():\n"
        "    raise RuntimeError('writing checkpoint step 3 failed')\n"
        "def main(argv):\n"
        "    try:\n"
        "        raise KeyboardInterrupt\n"
        "    finally:\n"
        "        try:\n"
        "            cut_short()\n"
        "        except RuntimeError as error:\n"
        "            raise ValueError('wrapped') from error\n"
        "cli.run(main)\n")
    result = subprocess.run([sys.executable, str(script)], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 130, describe(result)
    assert result.stderr.strip().splitlines()[-1] == "error: interrupted", describe(result)


def test_a_config_override_of_none_sets_none_where_the_key_allows_it():
    """`--config.KEY=None`: ml_collections parsed it by the value's type (float("None") for
    model.init_std=0.02, int("None") for the num_kv_heads placeholder) and refused it; the keys
    whose values include None take it, and the others are refused by their own check."""
    from absl import flags
    from ml_collections import config_flags

    from transformer import configs
    from transformer.utils import cli

    cli._none_overrides()
    values, argv = flags.FlagValues(), [
        "prog", f"--config={REPO / 'experiments' / 'gpt_tiny.py'}",
        "--config.model.init_std=None", "--config.model.num_kv_heads=None",
        "--config.model.qkv_bias=None", "--config.model.d_model=None",
        "--config.model.num_heads=2", "--config.data.tokenizer=None"]
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    model = values.config.model
    assert (model.init_std, model.num_kv_heads, model.qkv_bias, model.num_heads) == (
        None, None, None, 2)
    assert values.config.data.tokenizer is None
    for refused in (r"data\.tokenizer=None: expected one of", r"model\.d_model=None: expected a "
                    "positive int"):
        with pytest.raises(ValueError, match=refused):
            configs.validate_config(values.config, num_devices=1, num_processes=1, files=False)
        values.config.data.tokenizer = "byte"
