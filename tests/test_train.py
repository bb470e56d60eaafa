"""The training loop end to end: every experiment through the CLI, exact resume after SIGTERM,
config errors, evaluation of a saved run, structural restore checks, NaN handling and gradient
accumulation.

Subprocesses run the real CLI (`python -m transformer.train`). They inherit the test session's
XLA_FLAGS (tests/conftest.py: -O0 codegen, about half the compile time), which change no loop or
checkpoint logic; the runs that are compared bitwise all use them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import forkserver
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from transformer import configs, train
from transformer import evaluate as evaluate_lib
from transformer.training import checkpoint_manager, optim, placement, progress, run_eval
from transformer.training import metrics as metrics_lib
from transformer.utils import hostmem

REPO = Path(__file__).resolve().parents[1]
# An excerpt of tiny Shakespeare shipped with the tests (tests/data/README.md).
SHAKESPEARE = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
TIMEOUT = 300
TINY_MODEL = dict(num_layers=1, d_model=32, num_heads=2, d_ff=64)
# The MFU peak of the tiny runs: measuring the CPU's (metrics.cpu_peak, a 2048^2 matmul at every
# start) costs each run a second. tests/test_metrics.py tests the measurement, and the
# experiments' runs below measure it as a run does by default.
PEAK = 1e11


# --- helpers --------------------------------------------------------------------------------


def experiment_config(name: str, *args):
    """get_config(*args) of experiments/<name>.py."""
    spec = importlib.util.spec_from_file_location(f"experiment_{name}",
                                                  REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*args)


def tiny_config(name: str = "gpt_tiny", *, steps: int = 2, **overrides):
    """An experiment shrunk to seconds: the same overrides as `tiny_flags`."""
    config = experiment_config(name)
    config.update(steps=steps, batch_size=2, seq_len=16, log_every=1, eval_every=steps,
                  eval_steps=1, checkpoint_every=steps, peak_flops_per_device=PEAK)
    config.update(**overrides)
    config.model.update(**TINY_MODEL)
    return config


def tiny_flags(steps: int, *, checkpoint_every: int | None = None, family: str = "gpt",
               measure_peak: bool = False, samples: bool = False):
    """`tiny_config`'s overrides as flags; `measure_peak`: MFU against the CPU's measured peak,
    as runs do by default (else against `PEAK`); `samples`: the end-of-run samples, as runs
    print by default (the experiments' runs here print them)."""
    # (a ViT's seq_len is its image's token count, which validation checks; CLIP's and the
    # captioner's holds their longest caption, which the data checks)
    flags = [f"--config.steps={steps}", "--config.batch_size=2",
             *([] if family in ("vit", "clip", "captioner") else ["--config.seq_len=16"]),
             "--config.log_every=1",
             f"--config.eval_every={steps}", "--config.eval_steps=1",
             f"--config.checkpoint_every={checkpoint_every or steps}",
             *([] if samples else ["--config.samples=0"])]
    if not measure_peak:
        flags.append(f"--config.peak_flops_per_device={PEAK}")
    flags += [f"--config.model.{key}={value}" for key, value in TINY_MODEL.items()]
    if family == "t5":
        flags.append("--config.model.num_decoder_layers=1")
    return flags


def cli_env(devices: int | None = None) -> dict[str, str]:
    """A subprocess's environment: this session's (with its XLA_FLAGS, tests/conftest.py) on
    CPU, and `devices` forced host devices if given."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    if devices:
        env["XLA_FLAGS"] = " ".join((env.get("XLA_FLAGS", ""),
                                     f"--xla_force_host_platform_device_count={devices}")).strip()
    return env


@dataclasses.dataclass
class CliRun:
    """A CLI subprocess whose stdout/stderr go to files (so it never blocks on a full pipe)."""

    args: list[str]
    process: subprocess.Popen
    stdout_path: Path
    stderr_path: Path

    def wait(self, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
        try:
            returncode = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        return subprocess.CompletedProcess(
            self.args, returncode, self.stdout_path.read_text(errors="replace"),
            self.stderr_path.read_text(errors="replace"))


def start_cli(module: str, *args: str, logs: Path, devices: int | None = None) -> CliRun:
    """Starts `python -m <module> <args>` from the repo root (on `devices` forced CPU devices
    if given); output goes to files in `logs`."""
    logs.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", module, *args]
    stdout_path, stderr_path = logs / "stdout.txt", logs / "stderr.txt"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        process = forkserver.Popen(command, cwd=REPO, env=cli_env(devices), stdout=stdout,
                                   stderr=stderr, stdin=subprocess.DEVNULL)
    return CliRun(command, process, stdout_path, stderr_path)


def run_cli(module: str, *args: str, logs: Path,
            devices: int | None = None) -> subprocess.CompletedProcess:
    return start_cli(module, *args, logs=logs, devices=devices).wait()


def describe(result: subprocess.CompletedProcess) -> str:
    # A crashed process's stderr ends with faulthandler's list of extension modules (several
    # KB), after the Python stacks that say where it crashed: it is dropped. XLA's fatal
    # lines (F1203 12:00:00 ... Check failed, a rendezvous's timeout) come first.
    stderr = re.sub(r"\nExtension modules: [^\n]*", "\n[extension modules]", result.stderr)
    fatal = "".join(f"{line}\n" for line in re.findall(r"^F\d{4} .*$", stderr, re.M)[:4])
    return (f"{' '.join(map(str, result.args))}\nexit code {result.returncode}\n{fatal}"
            f"--- stdout (tail) ---\n{result.stdout[-2000:]}\n"
            f"--- stderr (tail) ---\n{stderr[-6000:]}")


def assert_succeeded(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, describe(result)


def read_metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def train_losses(workdir: Path) -> dict[int, float]:
    """step -> logged train loss; fails if a step was logged twice (i.e. trained twice)."""
    steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
    assert len(steps) == len(set(steps)), f"train steps logged more than once: {steps}"
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if r["split"] == "train"}


def checkpoint_steps(workdir: Path) -> list[int]:
    """The complete checkpoints (Orbax renames a step's tmp directory to `<step>` at commit)."""
    directory = workdir / "checkpoints"  # created with the first checkpoint
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def load_state(workdir: Path, step: int) -> dict:
    """The saved train state of a checkpoint, restored without a target, as numpy arrays."""
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(workdir / "checkpoints" / str(step) / "state")
    return jax.device_get(state)


def flat(tree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def all_finite(tree) -> bool:
    return all(np.isfinite(leaf).all() for leaf in flat(tree).values())


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` with its size and modification time, but train.lock, which
    every training start rewrites with its pid (transformer.training.workdir)."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "train.lock"}


# --- 1. every experiment through the CLI ----------------------------------------------------

EXPERIMENT_STEPS = 2
EXPERIMENTS = [
    "gpt_tiny.py",
    # Its samples' prompt, the first line of the shipped excerpt's validation split, is 29
    # tokens: train.main cuts it to half the context (seq_len=16) instead of failing the run.
    "gpt_shakespeare_char.py:cpu",
    "bert_mlm.py",
    "t5_span.py",
    "prefix_lm.py",
    "lstm_lm.py",
    "gpt_finetune_cls.py",
    "vit_digits.py",
    "caption_digits.py",
]
_EXPERIMENT_TEST = "test_every_experiment_runs_end_to_end_through_the_cli"


def _launch_experiment(spec: str, root: Path) -> tuple[Path, CliRun]:
    name = spec.split(".py")[0]
    config = experiment_config(name, *spec.split(":")[1:])
    workdir = root / name / "workdir"
    args = [f"--config=experiments/{spec}", f"--workdir={workdir}",
            *tiny_flags(EXPERIMENT_STEPS, family=config.model.family, measure_peak=True,
                        samples=True)]
    if name == "gpt_shakespeare_char":
        args.append(f"--config.data.path={SHAKESPEARE}")
    if "finetune" in name:  # from scratch: the pretraining run is not there
        args.append("--config.init_from=")
    return workdir, start_cli("transformer.train", *args, logs=root / name)


@pytest.fixture(scope="module")
def experiment_runs(request, tmp_path_factory):
    """spec -> (workdir, finished CliRun result): the experiments every selected test of this
    module needs are started together at first use (they overlap on the 2 cores)."""
    root = tmp_path_factory.mktemp("experiments")
    runs: dict[str, tuple[Path, CliRun]] = {}

    def launch(spec: str) -> None:
        if spec not in runs:
            runs[spec] = _launch_experiment(spec, root)

    for item in request.session.items:
        if "experiment_runs" in getattr(item, "fixturenames", ()):
            callspec = getattr(item, "callspec", None)
            launch(callspec.params["spec"] if item.originalname == _EXPERIMENT_TEST
                   else "gpt_tiny.py")

    def finished(spec: str) -> tuple[Path, subprocess.CompletedProcess]:
        launch(spec)
        workdir, run = runs[spec]
        # All of them share 2 cores (and a CI machine's other load): a hang, not a slow
        # start, is what the timeout is for.
        return workdir, run.wait(TIMEOUT * max(1, len(runs) // 2))

    yield finished
    for _, run in runs.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("spec", EXPERIMENTS)
def test_every_experiment_runs_end_to_end_through_the_cli(experiment_runs, spec):
    workdir, result = experiment_runs(spec)
    assert_succeeded(result)
    assert (workdir / "checkpoints" / str(EXPERIMENT_STEPS)).is_dir(), describe(result)
    records = read_metrics(workdir)
    train_records = [r for r in records if r["split"] == "train"]
    validation = [r for r in records if r["split"] == "validation"]
    assert [r["step"] for r in train_records] == list(range(1, EXPERIMENT_STEPS + 1))
    assert [r["step"] for r in validation] == [EXPERIMENT_STEPS]
    for record in train_records + validation:
        assert math.isfinite(record["loss"]), record
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["step"] == EXPERIMENT_STEPS
    assert summary["val_loss"] == validation[-1]["loss"]
    # tiny steps' scratch memory stays under glibc's 32 MB: no allocator line
    assert "host allocator" not in result.stdout, describe(result)
    if spec == "gpt_tiny.py":  # samples=3, the default
        assert result.stdout.splitlines().count("---") == 3, describe(result)


# --- 2. SIGTERM, then exact resume ----------------------------------------------------------


# A mixture of experts (4 experts, top-2, tokens dropped at capacity 1) in the one layer.
MOE_FLAGS = ["--config.model.moe.num_experts=4", "--config.model.moe.capacity_factor=1.0"]


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_the_resumed_run_is_bitwise_identical(tmp_path):
    """One run is stopped by SIGTERM mid-way and rerun to the end; another runs uninterrupted.
    Both must end with the same bits in every array of the train state, and log the same
    loss at every step (each step trained once overall). SIGTERM comes right after step 2 is
    reported, so the run normally stops at step 2 or 3: a checkpoint only the signal writes
    (checkpoint_every is 4). The model has a mixture of experts (its router's metrics resume
    too); a dense one resumes through the same loop (kill -9 in tests/test_faults.py)."""
    steps = 6

    def args(workdir: Path) -> list[str]:
        # Dropout on, so the per-step RNG must be resumed exactly too.
        return ["--config=experiments/gpt_tiny.py", f"--workdir={workdir}",
                *tiny_flags(steps, checkpoint_every=4), "--config.model.dropout_rate=0.1",
                *MOE_FLAGS]

    reference_dir, resumed_dir = tmp_path / "uninterrupted", tmp_path / "resumed"
    reference = start_cli("transformer.train", *args(reference_dir), logs=tmp_path / "ref")
    try:
        _interrupt_resume_and_compare(args, steps, reference, reference_dir, resumed_dir,
                                      tmp_path)
        # the router's metrics are logged, and resumed exactly too
        moe = lambda workdir: {r["step"]: (r["moe_load_balance"], r["moe_dropped"])
                               for r in read_metrics(workdir) if r["split"] == "train"}
        assert moe(resumed_dir) == moe(reference_dir)
        assert all(dropped > 0 for _, dropped in moe(reference_dir).values())
        summary = json.loads((reference_dir / "summary.json").read_text())
        assert summary["active_params"] < summary["num_params"]
    finally:
        if reference.process.poll() is None:
            reference.process.kill()
            reference.process.wait()


def _interrupt_resume_and_compare(args, steps, reference, reference_dir, resumed_dir,
                                  tmp_path):

    # The interrupted run: SIGTERM as soon as step 2 is reported.
    with open(tmp_path / "interrupted_stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "transformer.train", *args(resumed_dir)], cwd=REPO,
            env=cli_env(), stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
            text=True, errors="replace")
    watchdog = threading.Timer(TIMEOUT, process.kill)
    watchdog.start()
    lines, signalled = [], False
    try:
        for line in process.stdout:
            lines.append(line)
            if not signalled and line.startswith("step 2/"):
                process.send_signal(signal.SIGTERM)
                signalled = True
        process.wait()
    finally:
        watchdog.cancel()
    (tmp_path / "interrupted_stdout.txt").write_text("".join(lines))
    interrupted = subprocess.CompletedProcess(
        process.args, process.returncode, "".join(lines),
        (tmp_path / "interrupted_stderr.txt").read_text(errors="replace"))
    assert signalled, describe(interrupted)
    assert interrupted.returncode == 143, describe(interrupted)  # 128 + SIGTERM: unfinished
    assert "signal" in interrupted.stdout, describe(interrupted)
    stopped_at = json.loads((resumed_dir / "summary.json").read_text())["step"]
    assert 2 <= stopped_at < steps, describe(interrupted)
    assert max(checkpoint_steps(resumed_dir)) == stopped_at, (
        f"stopped at step {stopped_at} but saved {checkpoint_steps(resumed_dir)}")
    assert sorted(train_losses(resumed_dir)) == list(range(1, stopped_at + 1))

    assert_succeeded(run_cli("transformer.train", *args(resumed_dir), logs=tmp_path / "rerun"))
    assert_succeeded(reference.wait())

    assert checkpoint_steps(resumed_dir)[-1] == checkpoint_steps(reference_dir)[-1] == steps
    expected, actual = flat(load_state(reference_dir, steps)), flat(load_state(resumed_dir, steps))
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value, err_msg=key)
    assert train_losses(resumed_dir) == train_losses(reference_dir)
    assert sorted(train_losses(reference_dir)) == list(range(1, steps + 1))
    validation = lambda workdir: [(r["step"], r["loss"]) for r in read_metrics(workdir)
                                  if r["split"] == "validation"]
    assert validation(resumed_dir) == validation(reference_dir)


# --- 3. config errors -----------------------------------------------------------------------


@pytest.mark.slow
def test_config_errors_are_rejected_before_anything_is_written(tmp_path):
    cases = {"unknown_key": ("--config.model.num_layer=3", "num_layer"),
             "wrong_type": ("--config.steps=abc", "steps")}
    runs = {name: start_cli("transformer.train", "--config=experiments/gpt_tiny.py",
                            f"--workdir={tmp_path / name / 'workdir'}", flag,
                            logs=tmp_path / name)
            for name, (flag, _) in cases.items()}
    for name, (_, key) in cases.items():
        result = runs[name].wait()
        assert result.returncode != 0, describe(result)
        assert key in result.stderr, describe(result)
        assert not (tmp_path / name / "workdir").exists(), describe(result)

    # An XLA option this jaxlib does not know: named, before the workdir is written.
    workdir = tmp_path / "bad_option"
    with pytest.raises(ValueError, match=r"compiler_options=.*xla_cpu_no_such_flag.*XLA "
                                         r"rejects") as error:
        train.train_and_evaluate(tiny_config(compiler_options={"xla_cpu_no_such_flag": 1}),
                                 str(workdir))
    assert "\n" not in str(error.value)
    assert not workdir.exists()

    # A value only the model checks: a one-line error before even the workdir (and the
    # tokenizer a later run would silently reuse from it) is written.
    workdir = tmp_path / "bad_value"
    with pytest.raises(ValueError, match=r"position='rotary': expected one of") as error:
        train.train_and_evaluate(tiny_config(model=dict(position="rotary")), str(workdir))
    assert "\n" not in str(error.value)
    assert not workdir.exists(), sorted(p.name for p in workdir.iterdir())


def test_compiler_options_default_per_platform_and_config_options_extend_them(capsys):
    from transformer.parallel import sharding

    config = tiny_config()
    mesh = sharding.make_mesh(config.mesh)
    # under glibc malloc, scratch heaps it keeps
    glibc = placement.GLIBC_CPU_OPTIONS if hostmem.allocator() == "glibc" else {}
    assert placement.compiler_options(config, mesh) == {**placement.CPU_OPTIONS, **glibc}
    config.model.dtype = "bfloat16"
    config.compiler_options = {"xla_cpu_multi_thread_eigen": False}
    assert placement.compiler_options(config, mesh) == {**placement.CPU_OPTIONS, **glibc,
                                                        "xla_cpu_multi_thread_eigen": False}
    # A default a newer jaxlib no longer knows is dropped with a warning, not an error.
    assert placement._accepted((("xla_cpu_renamed_in_some_release", True),)) == {}
    assert "xla_cpu_renamed_in_some_release" in capsys.readouterr().err


# --- 4. evaluation of a saved run -----------------------------------------------------------


@pytest.mark.slow
def test_evaluate_restores_a_saved_workdir(experiment_runs, tmp_path):
    workdir, result = experiment_runs("gpt_tiny.py")
    assert_succeeded(result)
    evaluation = run_cli("transformer.evaluate", f"--workdir={workdir}", "--eval_steps=1",
                         logs=tmp_path)
    assert_succeeded(evaluation)
    metrics = json.loads(evaluation.stdout[evaluation.stdout.index("{"):])
    assert metrics["step"] == EXPERIMENT_STEPS
    assert math.isfinite(metrics["loss"])
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]), rel=1e-6)
    # The same first validation batch as the run's own evaluation of that step: same params.
    logged = [r for r in read_metrics(workdir) if r["split"] == "validation"][-1]
    assert logged["step"] == EXPERIMENT_STEPS
    assert metrics["loss"] == pytest.approx(logged["loss"], rel=1e-5)
    assert json.loads((workdir / f"eval_{EXPERIMENT_STEPS}_steps1.json").read_text()) == metrics

    with pytest.raises(ValueError, match=re.escape(f"[{EXPERIMENT_STEPS}]")) as error:
        evaluate_lib.evaluate_workdir(str(workdir), step=999)
    assert "999" in str(error.value)
    (tmp_path / "not_a_run").mkdir()
    with pytest.raises(FileNotFoundError):
        evaluate_lib.evaluate_workdir(str(tmp_path / "not_a_run"))
    (tmp_path / "no_complete_checkpoint" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):
        evaluate_lib.evaluate_workdir(str(tmp_path / "no_complete_checkpoint"))


@pytest.mark.slow
def test_restore_params_reads_the_saved_params_into_the_given_mesh(experiment_runs):
    """Params only: bitwise the checkpoint's, laid out on the mesh given (or the run's)."""
    from transformer.parallel import sharding
    from transformer.training import checkpoint as checkpoint_lib

    workdir, result = experiment_runs("gpt_tiny.py")
    assert_succeeded(result)
    saved = load_state(workdir, EXPERIMENT_STEPS)["params"]
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    restored = checkpoint_lib.restore_params(str(workdir), mesh=mesh)
    assert restored.step == EXPERIMENT_STEPS and restored.config.experiment == "gpt_tiny"
    assert flat(jax.device_get(restored.params)).keys() == flat(saved).keys()
    for name, value in flat(jax.device_get(restored.params)).items():
        np.testing.assert_array_equal(value, flat(saved)[name], err_msg=name)
    assert all(leaf.sharding.mesh == mesh for leaf in jax.tree.leaves(restored.params))
    with pytest.raises(ValueError, match=re.escape("expected one of the saved steps")):
        checkpoint_lib.restore_params(str(workdir), step=EXPERIMENT_STEPS + 1)


# --- 5. structural restore check ------------------------------------------------------------


@pytest.mark.slow
def test_generate_cli_continues_a_prompt_from_a_saved_workdir(experiment_runs, tmp_path):
    """The generation CLI loads the latest checkpoint and tokenizer: greedy decoding of a GPT
    equals the library call on the same params; a T5 run answers with beam search."""
    from transformer import generate

    workdir, result = experiment_runs("gpt_tiny.py")
    assert_succeeded(result)
    run = run_cli("transformer.generate", f"--workdir={workdir}", "--prompt=def",
                  "--temperature=0", "--max_new_tokens=6", logs=tmp_path)
    assert_succeeded(run)
    model, params, tokenizer, config = generate.load_workdir(str(workdir))
    expected = generate.sample_texts(model, params, tokenizer, config, num_samples=1,
                                     prompt="def", temperature=0.0, max_new_tokens=6)[0]
    assert expected.strip() and expected in run.stdout
    workdir, result = experiment_runs("t5_span.py")
    assert_succeeded(result)
    beam = run_cli("transformer.generate", f"--workdir={workdir}", "--prompt=import os",
                   "--beam_size=2", "--max_new_tokens=4", logs=tmp_path)
    assert_succeeded(beam)


@pytest.mark.slow
def test_restore_names_structural_differences(experiment_runs):
    workdir, result = experiment_runs("gpt_tiny.py")
    assert_succeeded(result)
    before = snapshot(workdir)
    config = tiny_config(steps=EXPERIMENT_STEPS)
    config.model.num_layers = 2
    with pytest.raises(ValueError, match="model.num_layers: checkpoint 1, config 2") as error:
        train.train_and_evaluate(config, str(workdir))
    assert ";" not in str(error.value), "only num_layers differs from the CLI run's config"
    assert snapshot(workdir) == before


@pytest.mark.slow
def test_a_refused_resume_names_model_optimizer_and_stream_differences_at_once(
        experiment_runs):
    """Structural and data-stream differences are one error, not one per try."""
    workdir, result = experiment_runs("gpt_tiny.py")
    assert_succeeded(result)
    before = snapshot(workdir)
    config = tiny_config(steps=EXPERIMENT_STEPS, batch_size=4)
    config.model.num_layers = 2
    config.optimizer.name = "sgd"
    with pytest.raises(ValueError) as error:
        train.train_and_evaluate(config, str(workdir))
    message = str(error.value)
    assert "\n" not in message
    for difference in ("model.num_layers: checkpoint 1, config 2",
                       "optimizer.name: checkpoint 'adamw', config 'sgd'",
                       "another data stream: batch_size: checkpoint 2, config 4"):
        assert difference in message, message
    assert snapshot(workdir) == before


@pytest.mark.slow
def test_a_layout_changing_setting_is_refused_with_advice_that_works(experiment_runs):
    """nonfinite="skip" wraps the optimizer state: the refusal points to init_from in another
    workdir (init_from into the checkpoint's own workdir is refused)."""
    workdir, result = experiment_runs("gpt_tiny.py")
    assert_succeeded(result)
    before = snapshot(workdir)
    config = tiny_config(steps=EXPERIMENT_STEPS, nonfinite="skip")
    with pytest.raises(ValueError, match=r"laid out otherwise .*nonfinite: checkpoint 'stop', "
                                         r"config 'skip'.* with init_from in another workdir$"):
        train.train_and_evaluate(config, str(workdir))
    assert snapshot(workdir) == before


def test_loss_and_step_settings_changed_on_resume_are_announced():
    """label_smoothing, z_loss and max_grad_norm change what a step optimizes or applies, and
    eval_steps which validation windows a val loss averages (it changed silently): a resume
    announces them like a changed learning rate; steps and logging are bookkeeping."""
    saved = configs.base_config().to_dict()
    current = {**saved, "label_smoothing": 0.1, "z_loss": 1e-4, "max_grad_norm": 5.0,
               "eval_steps": (saved["eval_steps"] or 0) + 5, "steps": saved["steps"] + 10,
               "log_every": 7, "eval_every": 3}
    assert checkpoint_manager.compute_changes(saved, current) == [
        "label_smoothing: checkpoint 0.0, config 0.1",
        "max_grad_norm: checkpoint 0.0, config 5.0",
        "z_loss: checkpoint 0.0, config 0.0001",
        f"eval_steps: checkpoint {saved['eval_steps']!r}, config {current['eval_steps']!r}"]
    assert checkpoint_manager.layout_changes(saved, current) == []  # none is refused


def _with_model(name: str = "lstm_lm", **model) -> dict:
    config = tiny_config(name)
    config.model.update(**model)
    return config.to_dict()


def test_a_resume_leaves_out_the_model_keys_its_family_never_reads():
    """An LSTM never reads num_heads, MoE or attention settings (its start warns they change
    nothing): changing one neither blocks its resume nor is announced; a key it reads still
    is, and so is another family (then every key counts)."""
    saved = _with_model()
    unread = _with_model(num_heads=4, position="none", attention_impl="cudnn",
                        moe={**saved["model"]["moe"], "num_experts": 4})
    assert checkpoint_manager.structural_differences(saved, unread) == []
    assert checkpoint_manager.compute_changes(saved, unread) == []
    assert checkpoint_manager.structural_differences(saved, _with_model(num_layers=2)) == [
        "model.num_layers: checkpoint 1, config 2"]
    assert checkpoint_manager.compute_changes(saved, _with_model(dropout_rate=0.1)) == [
        "model.dropout_rate: checkpoint 0.0, config 0.1"]
    vocab = saved["model"]["vocab_size"]  # read by every family (ALWAYS_READ)
    assert checkpoint_manager.structural_differences(saved, _with_model(vocab_size=300)) == [
        f"model.vocab_size: checkpoint {vocab}, config 300"]
    gpt = _with_model(family="gpt", num_heads=4)
    assert checkpoint_manager.structural_differences(saved, gpt) == [
        "model.family: checkpoint 'lstm', config 'gpt'",
        "model.num_heads: checkpoint 2, config 4"]
    # A config saved before the MoE and MLA groups existed: their defaults, unread all the same.
    old = {**saved, "model": {k: v for k, v in saved["model"].items() if k not in ("moe", "mla")}}
    assert checkpoint_manager.structural_differences(old, unread) == []
    # A transformer reads every key.
    assert checkpoint_manager.structural_differences(
        _with_model("gpt_tiny"), _with_model("gpt_tiny", num_heads=4)) == [
        "model.num_heads: checkpoint 2, config 4"]


def test_an_lstm_resumes_with_a_changed_key_it_never_reads(tmp_path, capsys):
    """The probe's run: an LSTM trained with one num_heads continues with another (nothing
    announced changed); one with another depth is refused."""
    def lstm(steps: int, **model):
        config = tiny_config("lstm_lm", steps=steps, samples=0)
        config.model.update(**model)  # after tiny_config's TINY_MODEL
        return config

    workdir = tmp_path / "lstm"
    train.train_and_evaluate(lstm(2), str(workdir))
    train.train_and_evaluate(lstm(3, num_heads=4, attention_dropout_rate=0.1), str(workdir))
    assert checkpoint_steps(workdir)[-1] == 3
    assert "changed on resume" not in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"model\.num_layers: checkpoint 1, config 2$"):
        train.train_and_evaluate(lstm(4, num_layers=2), str(workdir))


def test_a_resume_under_another_runtime_or_on_moved_data_says_so(tmp_path, capsys):
    """A checkpoint records the jax, jaxlib, backend, device count and mesh that wrote it (a
    mesh of as many devices laid out otherwise sums in another order: probe p2 of stop 110 was
    told nothing): a resume under others continues, saying that its steps are no longer
    bit-identical to an uninterrupted run's (a probe's run trained under jax 0.10.2 and resumed
    under 0.12.0.1 was silent). A data.path moved to a file of the same fingerprint is said
    too: here a copy edited in the middle, which the fingerprint cannot see. A step saved
    before the record resumes without a line."""
    from transformer.training import checkpoint

    def lstm(steps: int, path: Path):
        config = tiny_config("lstm_lm", steps=steps, samples=0)
        config.data.path = str(path)
        return config

    old, new = tmp_path / "a.txt", tmp_path / "b.txt"
    text = SHAKESPEARE.read_bytes()
    old.write_bytes(text)
    middle = len(text) // 2
    new.write_bytes(text[:middle] + b"EDITED" + text[middle + 6:])  # the same size
    workdir = tmp_path / "run"
    train.train_and_evaluate(lstm(2, old), str(workdir))
    record = workdir / "checkpoints" / "2" / "stream" / "metadata"
    stream = json.loads(record.read_text())
    assert stream[checkpoint.RUNTIME] == checkpoint.runtime(lstm(2, old).mesh)
    assert stream[checkpoint.RUNTIME]["mesh"] == "one device"
    devices = jax.device_count()
    record.write_text(json.dumps({**stream, checkpoint.RUNTIME: {
        **stream[checkpoint.RUNTIME], "jax": "0.0.1", "devices": devices + 7,
        "mesh": "fsdp=2 x tensor=4"}}))
    capsys.readouterr()
    train.train_and_evaluate(lstm(3, new), str(workdir))
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("changed on resume")] == [
        f"changed on resume: jax 0.0.1 -> {jax.__version__}, devices {devices + 7} -> "
        f"{devices}, mesh fsdp=2 x tensor=4 -> one device (steps from here are not "
        "bit-identical to an uninterrupted run's)",
        f"changed on resume: data.path {str(old)!r} -> {str(new)!r} (the same names, sizes "
        "and ends: read as the same data moved; an edit in the middle of a file is not "
        "detected)"]
    record = workdir / "checkpoints" / "3" / "stream" / "metadata"
    stream = json.loads(record.read_text())
    del stream[checkpoint.RUNTIME]  # as a version that recorded no runtime saved it
    record.write_text(json.dumps(stream))
    train.train_and_evaluate(lstm(4, new), str(workdir))
    assert checkpoint_steps(workdir)[-1] == 4
    assert "changed on resume" not in capsys.readouterr().out


# --- 6. NaN / Inf ---------------------------------------------------------------------------

DIVERGING = dict(optimizer=dict(learning_rate=1e30, grad_clip_norm=0.0))


@pytest.fixture(scope="module")
def diverged_run(tmp_path_factory):
    """lr 1e30: step 1 has lr 0 (warmup), step 2 makes params ~1e29, step 3's loss is NaN.
    Nothing is logged before step 6, so only the check before each save can stop the run."""
    workdir = tmp_path_factory.mktemp("diverged")
    config = tiny_config(steps=6, checkpoint_every=1, log_every=6, **DIVERGING)
    with pytest.raises(FloatingPointError) as error:
        train.train_and_evaluate(config, str(workdir))
    return workdir, str(error.value)


@pytest.mark.slow
def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(diverged_run,
                                                                         tmp_path):
    workdir, message = diverged_run
    assert re.search(r"step \d+", message), message
    saved = checkpoint_steps(workdir)
    # Step 2's params (~1e29) are finite but gave step 3's NaN: not a good checkpoint.
    assert saved == [1], saved
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints.nonfinite").iterdir()] == ["2"]
    assert "the last good checkpoint is step 1 " in message, message
    for step in saved:
        assert all_finite(load_state(workdir, step)), f"checkpoint {step} holds NaN/Inf"

    # nonfinite="skip": the NaN steps are skipped (params stay finite) and the run completes.
    skip_dir = tmp_path / "skip"
    config = tiny_config(steps=4, nonfinite="skip", **DIVERGING)
    result = train.train_and_evaluate(config, str(skip_dir))
    assert result["summary"]["step"] == 4
    assert not math.isfinite(train_losses(skip_dir)[3])  # it did meet a NaN loss
    assert checkpoint_steps(skip_dir) == [4]
    assert all_finite(load_state(skip_dir, 4)["params"])
    assert all_finite(result["state"].params)
    # A skipped step does not advance the schedule: each logged rate is that of the updates
    # applied before the step (the optimizer's own count; a skipped step's own skip is not
    # among them), and the skips are counted.
    schedule = optim.learning_rate_schedule(config.optimizer, config.steps)
    logged = [r for r in read_metrics(skip_dir) if r["split"] == "train"]
    skips = [r["skipped_steps"] for r in logged]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert skips[-1] == int(result["state"].opt_state.total_notfinite) > 0, skips
    assert any(b == a + 1 for a, b in zip(skips, skips[1:], strict=False)), skips
    for r, before in zip(logged, [0, *skips], strict=False):
        assert r["learning_rate"] == pytest.approx(
            float(schedule(r["step"] - 1 - before)), rel=1e-6), r


@pytest.mark.slow
def test_nan_error_names_the_step_the_logs_call_it(diverged_run):
    _, message = diverged_run
    assert re.search(r"\bstep 3\b", message), message


@pytest.mark.slow
def test_a_non_finite_update_is_never_checkpointed(tmp_path):
    # lr 1e39 overflows float32: the schedule gives NaN, so step 1's update is NaN while step
    # 1's loss and gradients (computed before the update) are finite.
    config = tiny_config(steps=2, checkpoint_every=1,
                         optimizer=dict(learning_rate=1e39, grad_clip_norm=0.0))
    with pytest.raises(FloatingPointError):
        train.train_and_evaluate(config, str(tmp_path))
    for step in checkpoint_steps(tmp_path):
        assert all_finite(load_state(tmp_path, step)), f"checkpoint {step} holds NaN/Inf"


@pytest.mark.slow
def test_skip_stops_after_max_nonfinite_skips_in_a_row(tmp_path):
    config = tiny_config(steps=6, checkpoint_every=1, nonfinite="skip", max_nonfinite_skips=1,
                         **DIVERGING)
    with pytest.raises(FloatingPointError):  # steps 3, 4, ... are all NaN: 2 in a row > 1
        train.train_and_evaluate(config, str(tmp_path))
    for step in checkpoint_steps(tmp_path):
        assert all_finite(load_state(tmp_path, step)["params"]), f"checkpoint {step} is NaN"


def test_a_checkpoint_is_judged_by_the_losses_before_it_however_long_ago():
    """Watch keeps each checkpoint's reference losses from when it was saved: a NaN hundreds
    of logged steps later still judges it (and its successor) against them."""
    from transformer.training import nonfinite

    watch = nonfinite.Watch()
    for step in range(1, 101):
        watch.logged(step, 2.0 + 0.01 * (step % 3))
    watch.saved(100)
    watch.stepped(101, 6.5)  # over 3x the median 2.01: blown up
    for step in range(101, 600):
        watch.logged(step, 9.0)
    watch.saved(600)
    watch.stepped(601, 9.5)  # 9.5 < 3 x 9.0: not blown up, against its own recent losses
    assert "gave loss 6.5 on the next batch, over 3x the median 2.01" in watch.blown_up(100)
    assert watch.blown_up(600) is None
    watch.saved(700)
    watch.stepped(701, float("nan"))
    assert "NaN/Inf" in watch.blown_up(700)
    assert watch.blown_up(5) is None  # no loss after it is known


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_one_bad_element_in_any_float_leaf(bad):
    """The check before a save: one NaN/+-Inf anywhere in any float leaf (float32, bfloat16,
    float8, complex, a scalar) makes the tree not finite; integer leaves (the step count) are
    not looked at, and huge finite values (1e38, bfloat16's 3e38, float8's 448) are finite."""
    from transformer.training import nonfinite

    tree = {"count": jnp.array(7, jnp.int32), "scalar": jnp.float32(1e38),
            "mu": [jnp.full((3, 5), 2.0), jnp.full((4,), 3e38, jnp.bfloat16)],
            "fp8": jnp.full((2,), 448, jnp.float8_e4m3fn), "z": jnp.full((3,), 1 + 2j)}
    assert bool(nonfinite.all_finite(tree))
    assert bool(nonfinite.all_finite({"count": jnp.array(1)}))
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            continue
        index = (-1,) * leaf.ndim  # the last element; () for a scalar
        broken = jax.tree_util.tree_map_with_path(
            lambda p, x, path=path, index=index: x.at[index].set(bad) if p == path else x, tree)
        assert not bool(nonfinite.all_finite(broken)), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_the_last_good_checkpoint_is_one_a_sane_rerun_continues_from(tmp_path):
    """learning_rate=1e4, no clipping: step 2's params stay finite but give a loss of ~1e7 on
    the next batch, and the NaN comes two steps later. Such checkpoints are not good ones
    (nonfinite.Watch): a rerun at a sane learning rate continues from the one named and trains
    (before, it resumed params that gave losses of ~1e10 to the end)."""
    config = tiny_config(steps=8, checkpoint_every=1,
                         optimizer=dict(learning_rate=1e4, grad_clip_norm=0.0))
    with pytest.raises(FloatingPointError, match="blown up") as error:
        train.train_and_evaluate(config, str(tmp_path))
    good = int(re.search(r"the last good checkpoint is step (\d+)", str(error.value))[1])
    assert checkpoint_steps(tmp_path) == list(range(1, good + 1)), str(error.value)
    assert train_losses(tmp_path)[good + 2] > 1e3, "the test needs a finite blow-up"

    config = tiny_config(steps=8, checkpoint_every=1, optimizer=dict(grad_clip_norm=0.0))
    result = train.train_and_evaluate(config, str(tmp_path))
    assert result["summary"]["step"] == 8
    losses = train_losses(tmp_path)
    assert all(loss < 3 * losses[1] for loss in losses.values()), losses


# --- 7. speed and ETA in the log -----------------------------------------------------------


@pytest.mark.slow
def test_speed_is_timed_over_training_steps_alone_and_the_eta_counts_evaluations(
        tmp_path, monkeypatch, capsys):
    """tok/s, MFU and step_time time training steps only: not the first step (which
    compiles) and not the evaluations between steps (made to take 1.5 s here). The ETA adds
    the evaluations still to come at the time they took."""
    evaluate = run_eval.evaluate_split

    def slow_evaluate(*args, **kwargs):
        time.sleep(1.5)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(run_eval, "evaluate_split", slow_evaluate)
    result = train.train_and_evaluate(tiny_config(steps=6, eval_every=2), str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["split"] == "train" and "tokens_per_s" in r]
    assert [r["step"] for r in timed] == [2, 3, 4, 5, 6]  # step 1's log times no steps
    assert max(r["step_time"] for r in timed) < 0.75, timed  # evaluations after 2 and 4
    assert 0 < result["summary"]["first_step_seconds"] < result["summary"]["wall_seconds"]
    out = capsys.readouterr().out
    assert re.search(r"step 1: the first step \(compilation included, attention dense\) "
                     r"took [\d.]+ s", out)
    assert re.search(r"step 1/6 loss [\d.]+ acc [\d.]+ lr \S+ gnorm [\d.]+ *$", out, re.M)
    # 1.5 s a evaluation: at 3 and at 4 (its own evaluation runs after its line) those at 4
    # and 6 are to come; at 6, its own
    for step, evaluations in ((3, 2), (4, 2), (6, 1)):
        eta = re.search(rf"step {step}/6 .* ETA >?0:00:(\d\d)", out)
        assert eta and int(eta[1]) >= int(1.5 * evaluations), (step, out)
    # at 2 no evaluation is timed yet: a lower bound, said so
    assert re.search(r"step 2/6 .* ETA >0:00:\d\d$", out, re.M), out
    # steps after `step` that evaluate (or save): multiples of `every`, and the last
    assert [progress.remaining(step, 7, 2) for step in (0, 3, 6, 7)] == [4, 3, 1, 0]
    assert progress.remaining(0, 5, 10) == 1 and progress.remaining(3, 6, 2) == 2


def test_the_eta_is_a_lower_bound_until_each_pause_still_to_come_is_timed():
    """Evaluations and saves to come count at the latest one's time; before this process timed
    one of a kind that is still due (a start's first, a resume's), the ETA says it is a lower
    bound, but not while the evaluations to come count at the first one, which compiled (it
    said '>' of an ETA 4 s above the time left); it rounds up, so 0:00:00 means nothing is
    left."""
    config = ml_collections.ConfigDict({"steps": 10, "eval_every": 4, "checkpoint_every": 5})
    untimed = {"eval": [], "save": []}
    # after step 3: 10 s of steps, evaluations at 4, 8, 10 and saves at 5, 10 still to come
    assert progress._eta(config, 3, 1.0, untimed) == (7.0, True)
    assert progress._eta(config, 3, 1.0, {"eval": [2.0], "save": []}) == (13.0, False)
    assert progress._eta(config, 3, 1.0, {"eval": [9.0, 2.0], "save": []}) == (13.0, True)
    assert progress._eta(config, 3, 1.0, {"eval": [9.0, 2.0], "save": [0.5]}) == (14.0, False)
    assert progress._eta(config, 10, 1.0, {"eval": [2.0], "save": [0.5]}) == (2.5, False)
    config.steps = 11  # at step 10: its own save, and step 11's evaluation and save to come
    assert progress._eta(config, 10, 1.0, {"eval": [5.0, 2.0], "save": []}) == (3.0, True)
    # lm-eval tasks count at their own latest time, not validation's (probe p6 of stop 110: an
    # 8 s task evaluation was charged to each validation to come, an ETA 8x the time left)
    config.update(steps=60, eval_every=10, checkpoint_every=60, eval_tasks=("copy.yaml",),
                  eval_tasks_every=30)
    timed = {"eval": [0.5, 0.5], "tasks": [8.0, 8.0], "save": [1.0]}
    # after step 35: 25 steps, validations at 40, 50, 60, tasks at 60, the save at 60
    assert progress._eta(config, 35, 0.1, timed) == (pytest.approx(2.5 + 1.5 + 8.0 + 1.0), False)
    config.eval_tasks_every = 0  # the last step's only
    assert progress._eta(config, 35, 0.1, {**timed, "tasks": []}) == (
        pytest.approx(2.5 + 1.5 + 1.0), True)
    assert [metrics_lib.format_eta(s) for s in (0.0, 0.2, 59.01, 3600.0)] == [
        "0:00:00", "0:00:01", "0:01:00", "1:00:00"]


# --- 8. gradient accumulation ---------------------------------------------------------------


@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    """Token-weighted micro-batch gradients equal the full batch's. Prefix-LM rows carry loss
    on a random number of tokens, so the micro-batches' token counts differ and a plain mean
    of their gradients would not match."""
    results = {}
    for k in (1, 2):
        config = tiny_config("prefix_lm", steps=2, batch_size=4,
                             optimizer=dict(grad_accumulation_steps=k, warmup_steps=1))
        config.model.dropout_rate = 0.0
        results[k] = train.train_and_evaluate(config, str(tmp_path / f"accumulate_{k}"))
    full, accumulated = (flat(jax.device_get(results[k]["state"].params)) for k in (1, 2))
    assert results[1]["summary"]["learning_rate"] > 0  # step 2 really updated the params
    assert full.keys() == accumulated.keys()
    for key, value in full.items():
        np.testing.assert_allclose(accumulated[key], value, rtol=0, atol=1e-5, err_msg=key)
    for name in ("loss", "accuracy", "num_tokens"):
        assert results[2]["summary"][name] == pytest.approx(results[1]["summary"][name],
                                                            rel=1e-5), name


def test_accumulated_gradients_of_16_bit_params_are_summed_in_float32():
    """bfloat16 params' micro-batch gradients are summed in float32 (weighted by their token
    counts) and averaged back to bfloat16: the sum had started in the params' dtype, and
    adding a float32 count turned the scan's carry to float32, which jax refuses (the first
    step of any run with param_dtype=bfloat16 and grad_accumulation_steps > 1 crashed)."""
    from transformer.training import step

    params = {"w": jnp.zeros((3,), jnp.bfloat16)}
    rows = jnp.asarray([[1.0, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    weights = jnp.asarray([1.0, 3.0, 2.0, 0.0])  # uneven token counts per row

    def grads_of(params, batch, rng, mtp_ratio, per_token=None):
        n = jnp.sum(batch["weights"])
        grads = jnp.sum(batch["rows"] * batch["weights"][:, None], 0) / jnp.maximum(n, 1.0)
        return {"w": grads.astype(jnp.bfloat16)}, {"num_tokens": n, "perplexity": jnp.e}

    grads, metrics = jax.jit(lambda p, b: step._accumulated(
        grads_of, p, b, jax.random.key(0), 2, None))(params, {"rows": rows, "weights": weights})
    assert grads["w"].dtype == jnp.bfloat16 and metrics["num_tokens"] == 6
    want = np.sum(np.asarray(rows) * np.asarray(weights)[:, None], 0) / 6  # the whole batch's
    np.testing.assert_allclose(np.asarray(grads["w"], np.float32), want, rtol=1e-2)


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32_training(tmp_path):
    """Mixed precision (params float32, matmuls in bfloat16, softmax and loss in float32) gives
    the float32 run's losses within bfloat16 rounding over several steps, and leaves the params
    (and the optimizer's updates to them) in float32."""
    losses, params = {}, {}
    for dtype in ("float32", "bfloat16"):
        config = tiny_config(steps=6, optimizer=dict(warmup_steps=1, learning_rate=3e-3))
        config.model.dtype = dtype
        workdir = tmp_path / dtype
        result = train.train_and_evaluate(config, str(workdir))
        losses[dtype] = train_losses(workdir)
        params[dtype] = flat(jax.device_get(result["state"].params))
    assert losses["float32"].keys() == losses["bfloat16"].keys() == set(range(1, 7))
    first, last = losses["float32"][1], losses["float32"][6]
    assert last < first - 0.05  # float32 really trained, so tracking it means something
    for step, loss in losses["float32"].items():
        assert losses["bfloat16"][step] == pytest.approx(loss, rel=2e-2), step
    assert all(v.dtype == np.float32 for v in params["bfloat16"].values())
    changed = [k for k in params["float32"]
               if not np.array_equal(params["float32"][k], params["bfloat16"][k])]
    assert changed  # bfloat16 compute really ran (it rounds differently)


def _damage(step_dir: Path, how: str) -> None:
    state = step_dir / "state"
    if how == "truncate":  # every data file of the saved arrays cut in half
        for f in (state / "ocdbt.process_0" / "d").iterdir():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "config":  # the saved config cut short (read before the state, to check it)
        config = step_dir / "config" / "metadata"
        config.write_bytes(config.read_bytes()[:10])
    else:  # "delete": the arrays' metadata file is gone
        (state / "_METADATA").unlink()


def _reference_and_run(config, tmp_path) -> tuple[dict, Path]:
    """(the params of `config` trained uninterrupted, a workdir of the same run saved at steps
    2, 4 and 6)."""
    reference = flat(jax.device_get(
        train.train_and_evaluate(config, str(tmp_path / "reference"))["state"].params))
    workdir = tmp_path / "run"
    train.train_and_evaluate(config, str(workdir))
    assert checkpoint_steps(workdir) == [2, 4, 6]
    return reference, workdir


@pytest.mark.slow
def test_damaged_checkpoints_fall_back_to_the_newest_usable_one(tmp_path, caplog):
    """A newest step with its config cut short and a step with truncated arrays are skipped
    with warnings naming them and moved to checkpoints.damaged/; the run resumes from the
    newest usable step and ends bitwise equal to an uninterrupted run. With every step
    damaged it refuses to start fresh (and touches nothing) until fresh_start=True, which sets
    the checkpoints aside."""
    config = tiny_config(steps=6, checkpoint_every=2)
    reference, workdir = _reference_and_run(config, tmp_path)
    _damage(workdir / "checkpoints" / "6", "config")
    _damage(workdir / "checkpoints" / "4", "truncate")
    with caplog.at_level("WARNING"):
        resumed = train.train_and_evaluate(config, str(workdir))
    warnings = [r.getMessage() for r in caplog.records if " is unusable" in r.getMessage()]
    assert len(warnings) == 2 and "checkpoints/6 is unusable" in warnings[0], warnings
    assert "checkpoints/4 is unusable" in warnings[1], warnings
    assert sorted(p.name.split("-")[0] for p in (workdir / "checkpoints.damaged").iterdir()) \
        == ["4", "6"]
    assert checkpoint_steps(workdir) == [2, 4, 6]  # 4 and 6 saved again by the resumed run
    resumed = flat(jax.device_get(resumed["state"].params))
    for key, value in reference.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)

    for step in (2, 4, 6):
        _damage(workdir / "checkpoints" / str(step), "delete")
    before = snapshot(workdir / "checkpoints")
    with pytest.raises(RuntimeError, match=r"no usable checkpoint .*step 6 .*step 4 .*step 2 "
                                           r".*fresh_start=True"):
        train.train_and_evaluate(config, str(workdir))
    assert snapshot(workdir / "checkpoints") == before
    config.fresh_start = True
    fresh = flat(jax.device_get(train.train_and_evaluate(config, str(workdir))["state"].params))
    for key, value in reference.items():
        np.testing.assert_array_equal(fresh[key], value, err_msg=key)
    aside = [p for p in workdir.iterdir() if p.name.startswith("checkpoints.set-aside-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()
                                      if p.name.isdigit()) == ["2", "4", "6"]
    old_steps = [json.loads(line)["step"] for line in
                 (aside[0] / "metrics.jsonl").read_text().splitlines()]
    assert max(old_steps) == 6  # the old run's metrics moved along, not dropped


@pytest.mark.slow
def test_a_step_missing_its_data_stream_item_is_damage_not_an_older_version(tmp_path, caplog):
    """The newest step with its `stream` item deleted is damaged like any other item: skipped
    with a warning, set aside, and the run resumes from the step before, at that step's data
    position (bitwise equal to an uninterrupted run). Only steps whose Orbax record names no
    stream item were written before streams were: those are refused as an older version's."""
    config = tiny_config(steps=6, checkpoint_every=2)
    reference, workdir = _reference_and_run(config, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "6" / "stream")
    with caplog.at_level("WARNING"):
        resumed = train.train_and_evaluate(config, str(workdir))
    warnings = [r.getMessage() for r in caplog.records if " is unusable" in r.getMessage()]
    assert len(warnings) == 1 and "checkpoints/6 is unusable" in warnings[0], warnings
    assert "stream" in warnings[0], warnings
    aside = list((workdir / "checkpoints.damaged").iterdir())
    assert [p.name.split("-")[0] for p in aside] == ["6"]
    assert (aside[0] / "state").is_dir() and not (aside[0] / "stream").exists()
    resumed = flat(jax.device_get(resumed["state"].params))
    for key, value in reference.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)

    for step in checkpoint_steps(workdir):  # as an older version wrote them: no stream at all
        step_dir = workdir / "checkpoints" / str(step)
        shutil.rmtree(step_dir / "stream")
        record = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
        del record["item_handlers"]["stream"]
        (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(record))
    config.steps = 8
    with pytest.raises(ValueError, match=r"checkpoints/6 was trained on another data stream: "
                                         r"the checkpoint records no data stream \(an older"):
        train.train_and_evaluate(config, str(workdir))


@pytest.mark.slow
def test_old_checkpoints_leave_by_one_rename_then_are_removed(tmp_path, monkeypatch):
    """Steps past keep_checkpoints are renamed into checkpoints/deleted/ before removal (so a
    run stopped mid-removal, e.g. by a second Ctrl-C, leaves no half-deleted step behind), and
    that folder is emptied before the next save and at the end."""
    config = tiny_config(steps=4, checkpoint_every=1, keep_checkpoints=2)
    train.train_and_evaluate(config, str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3", "4"]
    monkeypatch.setattr(checkpoint_manager.Manager, "_empty_deleted", lambda self: None)
    train.train_and_evaluate(config, str(tmp_path / "kept"))
    checkpoints = tmp_path / "kept" / "checkpoints"
    assert checkpoint_steps(tmp_path / "kept") == [3, 4]
    assert sorted(p.name for p in (checkpoints / "deleted").iterdir()) == ["1", "2"]


@pytest.mark.slow
def test_a_failed_checkpoint_write_is_reported_and_keeps_the_previous_one(tmp_path,
                                                                          monkeypatch):
    """Disk full while saving step 4 (an injected ENOSPC from Orbax): the run stops with an
    error naming the step, the cause and the intact checkpoints; step 2 stays restorable and a
    rerun resumes from it."""
    import errno

    original = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, step, *args, **kwargs)

    config = tiny_config(steps=6, checkpoint_every=2)
    workdir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(ocp.CheckpointManager, "save", save)
        with pytest.raises(checkpoint_manager.WriteError,
                           match=r"checkpoint step 4 .*No space left on device.*"
                                 r"checkpoints \[2\] are intact"):
            train.train_and_evaluate(config, str(workdir))
    assert checkpoint_steps(workdir) == [2]
    assert int(load_state(workdir, 2)["step"]) == 2
    result = train.train_and_evaluate(config, str(workdir))
    assert result["summary"]["step"] == 6 and checkpoint_steps(workdir) == [2, 4, 6]
    assert sorted(train_losses(workdir)) == list(range(1, 7))


@pytest.mark.parametrize("overrides, message", [
    (dict(model=dict(num_heads=3)), r"d_model=32: expected a multiple of num_heads=3"),
    (dict(model=dict(num_heads=4, num_kv_heads=3)), r"num_kv_heads=3: expected a divisor"),
    (dict(seq_len=128, model=dict(position="learned", max_len=64)),
     r"seq_len=128: expected <= model.max_len=64"),
    (dict(mesh=dict(data=3)), r"mesh data=3 .* expected the 1 devices available"),
    (dict(steps=0), r"steps=0: expected an int >= 1"),
    (dict(batch_size=3, optimizer=dict(grad_accumulation_steps=2)), r"batch_size=3: expected "
     r"a multiple of grad_accumulation_steps=2"),
    (dict(nonfinite="ignore"), r"nonfinite='ignore'"),
    (dict(optimizer=dict(decay="step")), r"optimizer.decay='step'"),
])
def test_config_values_get_one_line_errors_before_anything_runs(overrides, message):
    config = tiny_config()
    for key, value in overrides.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    with pytest.raises(ValueError, match=message) as error:
        configs.validate_config(config)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_ctrl_c_twice_exits_at_once_and_leaves_only_complete_checkpoints(tmp_path):
    """The first Ctrl-C asks for a checkpoint at the next step boundary; a second one right
    after exits without waiting for the run to finish. Whatever is on disk then is complete:
    the rerun resumes from it and finishes."""
    workdir = tmp_path / "run"
    args = ["--config=experiments/gpt_tiny.py", f"--workdir={workdir}",
            *tiny_flags(500, checkpoint_every=1)]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "transformer.train", *args], cwd=REPO, env=cli_env(),
            stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(TIMEOUT, process.kill)
    watchdog.start()
    try:
        for line in process.stdout:
            if line.startswith("step 3/"):
                process.send_signal(signal.SIGINT)
                # Two signals before the handler runs would count as one: the second is sent
                # once the handler has said it runs (a fixed wait lost that race in CI).
                while process.poll() is None and "received SIGINT: saving" not in \
                        (tmp_path / "stderr.txt").read_text(errors="replace"):
                    time.sleep(0.005)
                process.send_signal(signal.SIGINT)
                break
        process.stdout.read()
        returncode = process.wait()
    finally:
        watchdog.cancel()
    log = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert returncode == 130, log[-3000:]  # interrupted, not a clean stop (transformer.utils.cli)
    assert log.strip().splitlines()[-1] == "error: interrupted", log[-3000:]
    # Orbax logs (at ERROR, with its traceback) an interrupt that lands while it waits for an
    # async save to finalize; no other traceback may appear.
    assert "Traceback" not in log or "Save Finalize thread" in log, log[-3000:]
    saved = checkpoint_steps(workdir)
    assert saved and max(saved) < 500, saved
    for step in saved:
        assert int(load_state(workdir, step)["step"]) == step
    final = max(saved) + 2
    args = [a for a in args if not a.startswith("--config.steps=")]
    assert_succeeded(run_cli("transformer.train", *args, f"--config.steps={final}",
                             logs=tmp_path / "rerun"))
    assert max(checkpoint_steps(workdir)) == final


@pytest.mark.slow
def test_an_exploding_gradient_norm_stops_or_is_skipped_like_nan(tmp_path):
    """max_grad_norm: a finite but exploding step is bad. "stop" names the step and its batch
    and saves nothing from it; "skip" leaves the params untouched and counts the skips."""
    config = tiny_config(steps=3, checkpoint_every=1, max_grad_norm=1e-6)  # every step exceeds
    with pytest.raises(FloatingPointError, match=r"exceeded max_grad_norm=1e-06, at step 1 "
                                                 r"\(batch 0 of the data stream"):
        train.train_and_evaluate(config, str(tmp_path / "stop"))
    # A new workdir with no checkpoint and no logged step is removed (nothing to resume or
    # read); one whose run logged steps before stopping keeps them.
    assert not (tmp_path / "stop").exists()
    config = tiny_config(steps=3, max_grad_norm=1e-6, nonfinite="skip", max_nonfinite_skips=1)
    with pytest.raises(FloatingPointError):  # steps 1 and 2 skipped, step 2 logged
        train.train_and_evaluate(config, str(tmp_path / "logged"))
    assert list(train_losses(tmp_path / "logged")) == [1]
    assert checkpoint_steps(tmp_path / "logged") == []

    config = tiny_config(steps=3, checkpoint_every=1, max_grad_norm=1e-6, nonfinite="skip",
                         max_nonfinite_skips=5)
    result = train.train_and_evaluate(config, str(tmp_path / "skip"))
    assert int(jax.device_get(result["state"].opt_state.notfinite_count)) == 3
    run = train.setup(tiny_config(steps=3), str(tmp_path / "init"))  # the initial params
    start = flat(jax.device_get(run.state.params))
    run.manager.close(), run.train_data.close(), run.logger.close()
    for key, value in flat(jax.device_get(result["state"].params)).items():
        np.testing.assert_array_equal(value, start[key], err_msg=key)  # no update applied


# --- 11. what a resumed or profiled run reports ---------------------------------------------


class Killed(BaseException):
    """A kill -9 at this point: nothing after it in the start runs but its `finally`s."""


def records_at(workdir: Path, step: int) -> list[str]:
    return [r["split"] for r in read_metrics(workdir) if r["step"] == step]


def test_a_start_killed_in_the_after_training_evaluations_redoes_only_the_missing_ones(
        tmp_path, monkeypatch):
    """Killed after the final checkpoint, in the second after-training evaluation (the test
    split logged, the other lengths not), then rerun: the test split is not evaluated or
    logged again, the lengths are, once, and summary.json has the last train and validation
    metrics that the first start logged."""
    from test_logged_numbers import start_purging_scalars

    from transformer.training import evaluation

    held_out = tmp_path / "test.txt"
    held_out.write_text(SHAKESPEARE.read_text()[-20000:])
    config = tiny_config(steps=2, eval_seq_lens=(32, 64))
    config.data.update(path=str(SHAKESPEARE), test_path=str(held_out))
    workdir = tmp_path / "run"
    at_length = evaluation.evaluate_at_length

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(evaluation, "evaluate_at_length", killed)
    with pytest.raises(Killed):
        train.train_and_evaluate(config, str(workdir))
    assert records_at(workdir, 2) == ["train", "validation", "test"]
    assert checkpoint_steps(workdir) == [2] and not (workdir / "summary.json").exists()

    evaluated = []
    evaluate = evaluation.evaluate

    def counted(*args, split="validation", **kwargs):
        evaluated.append(split)
        return evaluate(*args, split=split, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", counted)
    monkeypatch.setattr(evaluation, "evaluate_at_length", at_length)
    summary = train.train_and_evaluate(config, str(workdir))["summary"]
    assert evaluated == ["validation", "validation"]  # at 32 and 64 (evaluate_at_length's)
    assert records_at(workdir, 2) == ["train", "validation", "test", "validation@32",
                                      "validation@64"]
    last = {r["split"]: r for r in read_metrics(workdir) if r["step"] == 2}
    for key in ("loss", "accuracy", "tokens_per_s", "mfu", "step_time", "learning_rate"):
        assert summary[key] == last["train"][key], key
    for key in ("loss", "bits_per_byte", "perplexity"):
        assert summary[f"val_{key}"] == last["validation"][key], key
        assert summary[f"test_{key}"] == last["test"][key], key
    assert summary["val_loss@64"] == last["validation@64"]["loss"]
    assert json.loads((workdir / "summary.json").read_text())["val_loss"] == summary["val_loss"]
    scalars = start_purging_scalars(workdir / "tensorboard")
    assert [s for s, _ in scalars["test/loss"]] == [2]  # TensorBoard: once too
    assert [s for s, _ in scalars["validation_32/loss"]] == [2]


@pytest.mark.slow
def test_sigterm_in_the_after_training_evaluations_stops_the_run_and_the_rerun_ends_them(
        tmp_path, monkeypatch):
    """Probe p7 of stop 110: a SIGTERM during the after-training evaluations was lost: the run
    ran them all and exited 0 (a sweep then trained its next variants). Now it stops after the
    evaluation under way, exits 143 (its summary says after_training false), and the rerun
    runs only the lengths left."""
    import signal

    from transformer.training import evaluation

    config = tiny_config(steps=2, eval_seq_lens=(32, 64))
    workdir = tmp_path / "run"
    at_length = evaluation.evaluate_at_length

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # (the run's handler: stop after this one)
        return at_length(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_at_length", signalled)
    result = train.train_and_evaluate(config, str(workdir))
    assert records_at(workdir, 2) == ["train", "validation", "validation@32"]
    assert progress.unfinished(result["summary"], 2) and train.stopped_status(result) == 143
    monkeypatch.setattr(evaluation, "evaluate_at_length", at_length)
    result = train.train_and_evaluate(config, str(workdir))
    assert records_at(workdir, 2) == ["train", "validation", "validation@32", "validation@64"]
    assert not progress.unfinished(result["summary"], 2)


@pytest.mark.parametrize("start, timed_steps", [(3, [2, 5, 6, 7]), (6, [2, 3, 4, 5])])
def test_the_profilers_start_and_stop_are_outside_the_timed_steps(tmp_path, monkeypatch, start,
                                                                  timed_steps):
    """Starting and stopping the trace (made 1.5 s slower each here, as writing a big trace
    is) are pauses: no tok/s window holds them, and goodput counts them as other, not as
    training steps. A window running past the last step (6..7 of 6..7 here) stops after the
    last step, in the loop: the last step is not timed with the profiler on, and the
    evaluations after training are not traced."""
    profiler = {name: getattr(jax.profiler, name) for name in ("start_trace", "stop_trace")}
    for name, call in profiler.items():
        monkeypatch.setattr(jax.profiler, name, lambda *args, call=call: (
            time.sleep(1.5), call(*args))[1])
    config = tiny_config(steps=7)
    config.profile.update(start_step=start, num_steps=2 if start == 3 else 5)
    summary = train.train_and_evaluate(config, str(tmp_path))["summary"]
    timed = [r for r in read_metrics(tmp_path) if r["split"] == "train" and "step_time" in r]
    assert [r["step"] for r in timed] == timed_steps  # windows restart after start and stop
    assert max(r["step_time"] for r in timed) < 0.75, timed
    goodput = summary["goodput"]
    assert goodput["other_seconds"] >= 3.0
    assert goodput["productive_seconds"] < 1.5, goodput


class FakeWandb:
    """The wandb package as the sink uses it, over one run's rows on "W&B's server" (step ->
    {"split/metric": value}). As W&B does: an online run resumed by id starts at the step
    after the last row the server holds (an offline one at 0, knowing nothing of the earlier
    files), and a log to a step below the current one is dropped."""

    def __init__(self, monkeypatch):
        import importlib.machinery
        import types

        self.rows = {}
        module = types.ModuleType("wandb")
        module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        module.init, module.Settings = self.init, lambda **settings: settings
        monkeypatch.setitem(sys.modules, "wandb", module)

    def init(self, mode, settings, **arguments):
        rows = self.rows

        class Run:
            offline = mode == "offline"
            step = max(rows) + 1 if rows and not offline else 0
            summary = {}

            def log(self, values, step):
                if step >= self.step:
                    self.step = step
                    rows.setdefault(step, {}).update(values)

            def finish(self, exit_code):
                pass

        return Run()


def failing_training_data(monkeypatch, at: int):
    """Reading training batch `at` (the first is the start-up's peek at the shapes) raises
    Killed; returns the unpatched inputs.get_dataset."""
    from transformer.data import inputs

    get_dataset, read = inputs.get_dataset, []

    def fail(batch):
        read.append(1)
        if len(read) == at:
            raise Killed
        return batch

    monkeypatch.setattr(inputs, "get_dataset", lambda config, tokenizer, split, **kwargs: (
        get_dataset(config, tokenizer, split, **kwargs).map(fail) if split == "train"
        else get_dataset(config, tokenizer, split, **kwargs)))
    return get_dataset


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_a_resumed_wandb_run_gets_the_records_a_killed_start_never_sent(tmp_path, monkeypatch,
                                                                         mode):
    """The first start logs steps 1 to 3 (a checkpoint at 2), its W&B queue holding all but
    step 1 when it is killed reading step 4's batch; the rerun resumes from 2. Online, W&B's
    server then holds every record metrics.jsonl keeps; offline (docs/watching.md) the rerun
    cannot know what the killed start's files hold and sends only its own."""
    from transformer.data import inputs
    from transformer.training import wandb_logging

    server = FakeWandb(monkeypatch)
    config = tiny_config(steps=4, checkpoint_every=2, eval_every=2)
    config.wandb.update(project="p", mode=mode)
    killed, log = [True], wandb_logging.Sink.log
    monkeypatch.setattr(wandb_logging.Sink, "log", lambda self, step, split, metrics: (
        None if killed[0] and step >= 2 else log(self, step, split, metrics)))  # never sent
    get_dataset = failing_training_data(monkeypatch, at=5)
    with pytest.raises(Killed):
        train.train_and_evaluate(config, str(tmp_path))
    assert sorted(server.rows) == [1] and checkpoint_steps(tmp_path) == [2]
    assert [(r["step"], r["split"]) for r in read_metrics(tmp_path)][-2:] == [
        (2, "validation"), (3, "train")]

    killed[0] = False
    monkeypatch.setattr(inputs, "get_dataset", get_dataset)
    train.train_and_evaluate(config, str(tmp_path))
    kept = {}
    for record in read_metrics(tmp_path):
        kept.setdefault(record["step"], {}).update({
            f"{record['split']}/{k}": v for k, v in record.items()
            if k not in ("step", "split", "elapsed")})
    assert sorted(kept) == [1, 2, 3, 4] and "validation/loss" in kept[2]
    if mode == "online":
        assert server.rows == kept
    else:
        assert server.rows == {step: row for step, row in kept.items() if step != 2}
