"""The Cloud TPU launcher: accelerator types, validation before anything is created, the exact
commands of dry runs (golden files), the preemption -> recreate -> resume loop against a fake
`gcloud`, and ahead-of-time compilation for TPU topologies (needs libtpu: the `tpu` extra).

Regenerate the golden files after an intended change with UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import forkserver
import pytest
from test_train import cli_env

from launch import accelerators, tpu

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is absent: install the tpu "
                                  "extra (pip install -e '.[tpu]') to compile for TPU")
TRAIN = ("--config=experiments/gpt_tiny.py", "--workdir=gs://bucket/runs/tiny",
         "--config.batch_size=64")


def make_launch(accelerator="v5p-32", *, train=TRAIN, **kwargs) -> tpu.Launch:
    a = accelerators.parse(accelerator)
    return tpu.Launch("run1", "proj", "us-east5-a", a, a.generation.runtime_version,
                      train_args=tuple(train), **kwargs)


def test_accelerator_types_know_their_chips_hosts_and_memory():
    cases = {"v4-8": (4, 1, "v4:2x2x1"), "v5p-32": (16, 4, "v5p:2x2x4"),
             "v5p-256": (128, 32, "v5p:4x4x8"), "v6e-8": (8, 1, "v6e:2x4"),
             "v5litepod-16": (16, 4, "v5e:4x4"), "v5e-4": (4, 1, "v5e:2x2")}
    for name, (chips, hosts, topology) in cases.items():
        a = accelerators.parse(name)
        assert (a.chips, a.hosts, a.topology_name) == (chips, hosts, topology), name
        assert a.chips_per_host * a.hosts == a.chips
    assert accelerators.parse("v5p-32").hbm_bytes > 90 * 2**30
    for bad, message in [("v5p-12", "N one of 8, 16, 32,"), ("v7x-8", "unknown TPU generation"),
                         ("tpu", "expected a TPU type"), ("v4-2", "N one of 8, 16,")]:
        with pytest.raises(ValueError, match=message) as error:
            accelerators.parse(bad)
        assert repr(bad) in str(error.value)


def test_slice_sizes_are_the_ones_cloud_tpu_offers():
    """The generations' tables in the Cloud TPU docs: the largest v5p slice is 16x16x24 (6144
    chips, not a power of two; the 8960-chip pod is no slice), v5e and v6e have no 2-chip one."""
    a = accelerators.parse("v5p-12288")
    assert (a.chips, a.hosts, a.topology_name) == (6144, 1536, "v5p:16x16x24")
    assert accelerators.parse("v5p-8192").topology == "16x16x16"
    for one in ("v5e-1", "v6e-1", "v6e-256"):
        accelerators.parse(one)
    for bad in ("v5p-16384", "v5p-17920", "v5e-2", "v5litepod-2", "v6e-2", "v6e-512"):
        with pytest.raises(ValueError, match="N one of") as error:
            accelerators.parse(bad)
        assert repr(bad) in str(error.value) and "power of two" not in str(error.value)
    with pytest.raises(ValueError, match=re.escape("N one of 1, 4, 8, 16, 32, 64, 128, 256 ")):
        accelerators.parse("v6e-2")


@pytest.mark.parametrize("kwargs, train, message", [
    (dict(accelerator="v5p-32"), (TRAIN[0], "--workdir=/local/run", TRAIN[2]),
     "workdir='/local/run': a run on 4 hosts"),
    (dict(accelerator="v5p-32"), TRAIN + ("--config.mesh.data=3",),
     "mesh data=3 x stage=1 x fsdp=1 x expert=1 x sequence=1 x tensor=1 = 3 devices: "
     "expected the 16"),
    (dict(accelerator="v5p-32"), TRAIN[:2] + ("--config.batch_size=24",),
     "batch_size=24: expected a multiple of the data-parallel size 16"),
    (dict(accelerator="v5p-32", num_slices=2), TRAIN + ("--config.mesh.data=1",
                                                        "--config.mesh.fsdp=-1"),
     "mesh.data=1: expected a multiple of num_slices=2"),
    (dict(accelerator="v5p-32", num_slices=2), TRAIN[:2] + ("--config.batch_size=12",),
     "batch_size=12: expected a multiple of grad_accumulation_steps=1 x processes=8; "
     "on 2 x v5p-32 (8 hosts)"),
    (dict(accelerator="v5p-32"), TRAIN + ("--config.mesh.data=1", "--config.mesh.sequence=16",
                                          "--config.seq_len=48"),
     "seq_len=48: expected a multiple of 2 x mesh.sequence=16 (load-balanced chunks); on 1 x "
     "v5p-32 (4 hosts)"),
    (dict(accelerator="v5p-32"), TRAIN + ("--config.mesh.data=2", "--config.mesh.stage=8",
                                          "--config.model.scan_layers=True"),
     "mesh.stage=8 x pipeline.repeats=1: expected their product to divide the 4 scanned layer "
     "groups (num_layers / the layer period); on 1 x v5p-32 (4 hosts)"),
    (dict(accelerator="v5p-32", num_slices=2), TRAIN + (
        "--config.mesh.data=1", "--config.mesh.stage=2", "--config.mesh.fsdp=-1",
        "--config.model.scan_layers=True", "--config.pipeline.microbatches=3"),
     "pipeline.microbatches=3: expected a divisor of the 4 rows each data-parallel shard"),
    (dict(accelerator="v6e-8"), ("--workdir=gs://b/r",), "include --config=FILE"),
    (dict(accelerator="v6e-8"), TRAIN + ("--config.model.num_layrs=2",), "num_layrs"),
    # what transformer.train refuses, a launch refuses before creating the slice
    (dict(accelerator="v6e-8"), TRAIN + ("--config.optimizer.learning_rate=-1",),
     "optimizer.learning_rate=-1"),
    (dict(accelerator="v6e-8"), TRAIN + ("--config.model.num_heads=3",), "model.d_model="),
])
def test_bad_launches_are_refused_before_anything_is_created(kwargs, train, message):
    launch = make_launch(kwargs.pop("accelerator"), train=train, **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        tpu.validate(launch)


@pytest.mark.parametrize("train, message", [
    (TRAIN + ("--steps=100",), "train arguments: Unknown command line flag 'steps'"),
    (TRAIN + ("WANDB_API_KEY=x",), "train arguments: unexpected arguments ['WANDB_API_KEY=x']: "
     "expected only flags"),
    (TRAIN + ("--config.batch_size", "x"), "flag --config.batch_size=x: invalid literal"),
    (("--config=experiments/nonexistent.py",), "--config=experiments/nonexistent.py: No such "
     "file"),
])
def test_train_arguments_are_parsed_as_transformer_train_parses_them(train, message):
    launch = make_launch("v6e-8", train=train)
    with pytest.raises(ValueError, match=re.escape(message)):
        tpu.validate(launch)


def test_space_separated_train_flags_are_understood_and_passed_on_joined():
    """absl takes `--workdir gs://b/r` and `--config.KEY VALUE`: validation reads them, and the
    workers and launch.aot get them as --NAME=VALUE (a boolean flag takes no value)."""
    train = ("--config", "experiments/gpt_tiny.py", "--workdir", "gs://b/r",
             "--config.batch_size", "24", "--config.model.scan_layers", "--jax_distributed")
    assert tpu.train_arguments(train) == (
        "--config=experiments/gpt_tiny.py", "--workdir=gs://b/r", "--config.batch_size=24",
        "--config.model.scan_layers", "--jax_distributed")
    with pytest.raises(ValueError, match="batch_size=24: expected a multiple of the "
                       "data-parallel size 16"):  # the value, read; and the workdir: gs://
        tpu.validate(make_launch("v5p-32", train=train))
    launch = make_launch("v5p-32", train=tpu.train_arguments(train[:5] + ("16",)))
    tpu.validate(launch)
    assert tpu.aot_command(launch)[-2:] == ["--config=experiments/gpt_tiny.py",
                                            "--config.batch_size=16"]


@pytest.mark.parametrize("workdir, restart, message", [
    ("runs/tiny", False, "--workdir=runs/tiny: a workdir inside ~/transformer"),
    (None, False, "no --workdir (runs/<experiment>): a workdir inside ~/transformer"),
    ("~/transformer/runs/tiny", False, "a workdir inside ~/transformer"),
    # ~/transformer as the workers' shell expands it (it passed, and the next ship deleted it)
    ("/home/alice/transformer/runs/tiny", False,
     "--workdir=/home/alice/transformer/runs/tiny: a workdir inside ~/transformer"),
    ("/root/transformer/runs/tiny", False, "--workdir=/root/transformer/runs/tiny: a workdir"),
    ("/mnt/runs/tiny", True, "--workdir=/mnt/runs/tiny with --restart_on_preemption: a "
     "recreated slice starts with empty disks"),
])
def test_a_run_whose_checkpoints_would_be_lost_is_refused(workdir, restart, message):
    train = (TRAIN[0],) + ((f"--workdir={workdir}",) if workdir else ())
    launch = make_launch("v6e-8", train=train)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        tpu.validate_run(launch, restart_on_preemption=restart)
    assert str(error.value).endswith("expected --workdir=gs://BUCKET/PATH")
    for kept in ("/mnt/runs/tiny", "/home/alice/runs/tiny", "/home/alice/x/transformer/r"):
        tpu.validate_run(make_launch("v6e-8", train=(TRAIN[0], f"--workdir={kept}")), False)


def test_a_launch_that_restarts_after_preemption_refuses_fresh_start():
    """Each restart reruns the same train command: with fresh_start it would set the run aside
    and start over from step 0 after every preemption (the JobSet restarts pods likewise)."""
    launch = make_launch("v6e-8", train=(*TRAIN, "--config.fresh_start=True"))
    for check in (lambda: tpu.validate_run(launch, restart_on_preemption=True),
                  lambda: tpu.check_restartable(launch, "a JobSet (it restarts preempted pods)")):
        with pytest.raises(ValueError, match=re.escape(
                "--config.fresh_start=True with ")) as error:
            check()
        assert "would start over from step 0" in str(error.value)
    tpu.validate_run(launch, restart_on_preemption=False)  # once, by hand: as asked


def test_status_in_a_dry_run_reads_no_state():
    result = subprocess.run(
        [sys.executable, "-m", "launch.tpu", "status", "--name=run1", "--project=p", "--zone=z",
         "--accelerator=v6e-8", "--dry_run"], cwd=REPO, capture_output=True, text=True,
        timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout.splitlines()
    assert out[-1] == "(dry run: the state is not read)" and "READY" not in out, out


def test_a_config_outside_the_shipped_tree_is_refused():
    """An absolute path, one outside the checkout, one git ignores: the workers would not have
    it (.launch/ is ignored: the launcher's own scratch folder)."""
    ignored = REPO / ".launch" / "test_ignored_config.py"
    ignored.parent.mkdir(exist_ok=True)
    ignored.write_text((REPO / "experiments" / "gpt_tiny.py").read_text())
    outside = Path("..") / REPO.name / "experiments" / "gpt_tiny.py"
    try:
        for config in (str(REPO / "experiments" / "gpt_tiny.py"), str(outside),
                       ".launch/test_ignored_config.py"):
            launch = make_launch("v6e-8", train=(f"--config={config}", TRAIN[1]))
            tpu.validate(launch)  # a good config: only the shipping is wrong
            with pytest.raises(ValueError, match=re.escape(
                    f"--config={config}: not in the working tree that run ships")) as error:
                tpu.validate_run(launch, restart_on_preemption=True)
            assert "expected the config to be a file of the shipped tree" in str(error.value)
    finally:
        ignored.unlink()
    tpu.validate_run(make_launch("v6e-8"), restart_on_preemption=True)


def _git_tree(root: Path) -> Path:
    """A small git checkout: a.txt committed, b.txt committed then deleted (not committed),
    c.txt untracked, d.log ignored."""
    root.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run(git + ["init", "-q"], check=True)
    for name in ("a.txt", "b.txt", ".gitignore"):
        (root / name).write_text("*.log\n" if name == ".gitignore" else name)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    (root / "b.txt").unlink()
    (root / "c.txt").write_text("c")
    (root / "d.log").write_text("d")
    return root


def test_the_tree_is_packed_as_it_is_before_anything_is_created(tmp_path, monkeypatch):
    """A tracked file deleted but not committed is left out (tar failed on it, after the slice
    was created); a directory that is no git checkout is refused in one line (it shipped an
    empty archive)."""
    import tarfile

    monkeypatch.setattr(tpu, "REPO", str(_git_tree(tmp_path / "tree")))
    assert sorted(tpu.shipped_files()) == [".gitignore", "a.txt", "c.txt"]
    out = io.StringIO()
    tpu.pack(make_launch("v6e-8"), tpu.Runner(dry_run=False, out=out))
    with tarfile.open(tmp_path / "tree" / tpu.archive_path(make_launch("v6e-8"))) as archive:
        assert sorted(archive.getnames()) == [".gitignore", "a.txt", "c.txt"]
    (tmp_path / "plain").mkdir()
    monkeypatch.setattr(tpu, "REPO", str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="cannot list the working tree to ship .*: expected a "
                       "git checkout") as error:
        tpu.run(make_launch("v6e-8"), tpu.Runner(dry_run=False, out=out),
                restart_on_preemption=False, max_restarts=0)
    assert "\n" not in str(error.value) and "gcloud" not in out.getvalue()


def test_bad_launcher_flags_are_refused_up_front():
    import types

    good = dict(name="run-1", project="p", zone="z", accelerator="v5p-8", runtime_version=None,
                spot=False, reserved=False, num_slices=1, max_restarts=20, poll_seconds=30.0)
    tpu.make_launch(types.SimpleNamespace(**good), [])
    for bad, message in [(dict(name="My_Run.1"), "--name=My_Run.1: expected lowercase"),
                         (dict(name="run-"), "--name=run-: expected"),
                         (dict(name="1run"), "--name=1run: expected"),
                         (dict(name="a;rm -rf ~"), "--name=a;rm -rf ~: expected"),
                         (dict(name="x" * 64), "at most 63 characters"),
                         # its slices' nodes are NAME-0 and NAME-1
                         (dict(name="x" * 62, num_slices=2), f"--name={'x' * 62}: the name "
                          f"{'x' * 62}-1 made from it has 64 characters: expected a name of "
                          "at most 61"),
                         (dict(num_slices=0), "--num_slices=0: expected a number >= 1"),
                         (dict(max_restarts=-5), "--max_restarts=-5: expected a number >= 0"),
                         (dict(poll_seconds=-1.0), "--poll_seconds=-1.0: expected a number >= 0")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            tpu.make_launch(types.SimpleNamespace(**{**good, **bad}), [])
    with pytest.raises(ValueError, match=re.escape("status: unexpected arguments ['extra']")):
        tpu.main(["launch.tpu", "status", "extra"])
    tpu.make_launch(types.SimpleNamespace(**{**good, "name": "x" * 61, "num_slices": 2}), [])
    # a JobSet's pods are named NAME-slice-J-P: 4 hosts of a v5p-32, 2 slices
    from launch import gke
    gke.check_name("x" * 53, 2, accelerators.parse("v5p-32"))
    with pytest.raises(ValueError, match=re.escape(f"{'x' * 54}-slice-1-3 made from it has 64")):
        gke.check_name("x" * 54, 2, accelerators.parse("v5p-32"))


def test_stop_signals_training_alone():
    """`stop`'s pattern, run by a shell as ssh runs it, matches the training process: not the
    launch.worker wrapping it (whose command line names the train command too), nor the shell.
    (pgrep for pkill: the same matching, and nothing on this machine is signalled.)"""
    remote = tpu.stop_commands(make_launch("v6e-8"))[0][-1].removeprefix("--command=")
    assert remote.startswith("pkill -TERM -f ")
    python = os.path.expanduser(tpu.PYTHON)  # as the workers' shell expanded it in train_remote
    train = f"{python} -m transformer.train --config=experiments/gpt_tiny.py"
    # `exec -a` gives `sleep` the command lines of training and of its wrapper
    processes = {name: subprocess.Popen(["bash", "-c", f'exec -a "{line}" sleep 60'])
                 for name, line in [("train", train), ("worker", f"{python} -m launch.worker "
                                                       f"--log=~/logs/x.log -- {train}")]}
    try:
        import time

        time.sleep(0.5)
        listed = subprocess.run(["bash", "-c", "echo $$; " + remote.replace("pkill -TERM",
                                                                           "pgrep", 1)],
                                capture_output=True, text=True, check=True).stdout.split()
        shell, matched = int(listed[0]), {int(pid) for pid in listed[1:]}
        assert processes["train"].pid in matched
        assert processes["worker"].pid not in matched and shell not in matched
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


FAKE_PYTHON3 = textwrap.dedent("""\
    #!/bin/bash
    # The image's python3 (3.10: the project's install would fail), recording its arguments;
    # `-m uv venv ... DIR` makes DIR/bin/python, which records its own path and arguments.
    echo "python3 $*" >> "$HOME/calls"
    if [ "$1 $2 $3" = "-m uv venv" ]; then
        venv="${@: -1}"
        mkdir -p "$venv/bin"
        printf '#!/bin/bash\\necho "$0 $*" >> "$HOME/calls"\\n' > "$venv/bin/python"
        chmod +x "$venv/bin/python"
    fi
""")


def test_the_workers_install_and_train_in_a_python_312_venv_made_once(tmp_path):
    """The images' python3 is 3.10, the project needs >= 3.11: each worker installs uv for
    python3, makes a venv of Python 3.12 outside the shipped tree once (not again on the next
    ship), installs the project into it, and runs launch.worker and training with its python,
    `~` expanded by the worker's shell. The ssh commands run by bash, a fake python3 on PATH."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    (home / "src").mkdir(parents=True)
    bin_dir.mkdir()
    (home / "src" / "setup.cfg").write_text("[metadata]\n")
    subprocess.run(["tar", "-czf", str(home / "transformer.tar.gz"), "-C", str(home / "src"),
                    "setup.cfg"], check=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    launch = make_launch("v5p-32")
    install = tpu.ship_commands(launch)[2][0][-1].removeprefix("--command=")
    train = tpu.run_commands(launch)[0][-1].removeprefix("--command=")
    for remote in (install, install, train):  # two ships, then training
        subprocess.run(["bash", "-c", remote], env=env, check=True, timeout=60)
    assert (home / "transformer" / "setup.cfg").is_file()  # unpacked, the venv kept outside
    venv = home / ".venvs" / "transformer"
    python = f"{venv}/bin/python"
    setup = ["python3 -m pip install -q --user uv",
             f"python3 -m uv pip install -q --python {python} -e .[tpu,chat,wandb]"]
    assert (home / "calls").read_text().splitlines() == [
        setup[0], f"python3 -m uv venv -q --clear --python 3.12 {venv}", setup[1], *setup,
        f"{python} -m launch.worker --log=~/logs/run1.log -- {python} -m transformer.train "
        "--jax_distributed " + " ".join(TRAIN)]


CHILD = textwrap.dedent("""\
    import os, signal, sys, time
    def stop(signum, frame):
        print(f"got {signal.Signals(signum).name}", flush=True)
        time.sleep(0.5)  # saving a checkpoint, its output still flowing
        print("saved", flush=True)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    time.sleep(60)
    print("not stopped", flush=True)
""")


def _worker(tmp_path, code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "launch.worker", f"--log={tmp_path / 'w.log'}", "--",
         sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "TPU_WORKER_ID": "3"})


def test_the_worker_passes_sigterm_on_and_keeps_the_output_until_the_command_exits(tmp_path):
    """SIGTERM to launch.worker alone (the command runs in a session of its own): the command
    gets it once, saves (its output still copied) and exits 143, and so does the worker."""
    import signal

    worker = _worker(tmp_path, CHILD)
    assert worker.stdout.readline() == "[worker 3] ready\n"
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 143
    assert out == "[worker 3] got SIGTERM\n[worker 3] saved\n"
    assert (tmp_path / "w.log").read_text() == "[worker 3] ready\n" + out


def test_the_worker_exits_128_plus_the_signal_that_killed_the_command(tmp_path):
    worker = _worker(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    worker.communicate(timeout=30)
    assert worker.returncode == 128 + 9  # as a shell reports it (sys.exit(-9) gave 247)


def test_an_unknown_train_key_is_one_clean_line_naming_it():
    launch = make_launch("v6e-8", train=TRAIN + ("--config.stpes=3",))
    with pytest.raises(ValueError) as error:
        tpu.validate(launch)
    assert str(error.value) == ("train arguments: unknown key 'stpes'. Did you mean \"steps\" "
                                "instead of \"stpes\"?")


DRY_RUNS = {
    "single_host": dict(accelerator="v5p-8", train=("--config=experiments/gpt_tiny.py",
                                                    "--workdir=gs://bucket/runs/tiny")),
    "multi_host": dict(accelerator="v5p-32", reserved=True),
    "multi_slice_spot": dict(accelerator="v5p-32", num_slices=2, spot=True),
    "spot": dict(accelerator="v6e-8", spot=True),
}


@pytest.mark.parametrize("name", sorted(DRY_RUNS))
def test_dry_run_prints_the_exact_commands(name):
    kwargs = dict(DRY_RUNS[name])
    launch = make_launch(kwargs.pop("accelerator"), **kwargs)
    tpu.validate(launch)
    out = io.StringIO()
    runner = tpu.Runner(dry_run=True, out=out)
    runner.run(tpu.aot_command(launch))
    assert tpu.run(launch, runner, restart_on_preemption=True, max_restarts=3) == 0
    text = out.getvalue().replace(sys.executable, "python")
    golden = GOLDEN / f"launch_{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.slow
def test_the_cli_dry_run_matches_the_library(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launch.tpu", "run", "--dry_run", "--name=run1", "--project=proj",
         "--zone=us-east5-a", "--accelerator=v6e-8", "--spot", "--", *TRAIN],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.replace(sys.executable, "python") == \
        (GOLDEN / "launch_spot.txt").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "launch.tpu", "run", "--dry_run", "--name=run1", "--project=proj",
         "--zone=us-east5-a", "--accelerator=v5p-12", "--", *TRAIN],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert bad.returncode == 2 and bad.stdout == ""
    assert "accelerator='v5p-12'" in bad.stderr.strip().splitlines()[-1]


FAKE_GCLOUD = textwrap.dedent("""\
    #!{python}
    # A stand-in for gcloud: records its arguments; the slice's state lives in a file. The
    # first training command "is preempted": it fails and the slice becomes SUSPENDED. With
    # FAKE_MODE: "late", training stopped by the preemption's SIGTERM exits 143 and the slice
    # still reads ACTIVE once before SUSPENDED; "stop", training stopped by `launch.tpu stop`
    # exits 143 on an ACTIVE slice; "reauth", every describe fails on credentials; "install",
    # the first install is the one preempted.
    import json, os, sys
    root, mode = os.environ["FAKE_GCLOUD_DIR"], os.environ.get("FAKE_MODE", "")
    args = sys.argv[1:]
    with open(os.path.join(root, "calls.jsonl"), "a") as f:
        f.write(json.dumps(args) + "\\n")
    state_file = os.path.join(root, "state")
    verb = args[3]  # compute tpus (queued-resources | tpu-vm) VERB ...
    if verb == "describe" and mode == "reauth":
        print("ERROR: (gcloud.compute.tpus.tpu-vm.describe) There was a problem refreshing "
              "your current auth tokens: Reauthentication failed.", file=sys.stderr)
        sys.exit(1)
    if verb == "describe":
        if not os.path.exists(state_file):
            print("ERROR: (gcloud.compute.tpus.describe) NOT_FOUND: Resource was not found",
                  file=sys.stderr)
            sys.exit(1)
        state = open(state_file).read()
        print(state.split(">")[0])
        open(state_file, "w").write(state.split(">")[-1])  # "A>B": A once, then B
    elif verb == "create":
        open(state_file, "w").write("ACTIVE")
    elif verb == "delete":
        os.remove(state_file)
    elif verb == "ssh" and mode == "install" and not os.path.exists(os.path.join(root, "i")):
        open(os.path.join(root, "i"), "w").close()
        open(state_file, "w").write("SUSPENDED")
        print("Connection closed by remote host", file=sys.stderr)
        sys.exit(255)
    elif verb == "ssh" and "transformer.train" in args[-1]:
        runs = os.path.join(root, "train_runs")
        n = int(open(runs).read()) if os.path.exists(runs) else 0
        open(runs, "w").write(str(n + 1))
        if n == 0 and mode == "stop":
            print("[worker 0] received SIGTERM: saving a checkpoint after this step")
            sys.exit(143)
        if n == 0 and mode != "install":
            open(state_file, "w").write("ACTIVE>SUSPENDED" if mode == "late" else "SUSPENDED")
            print("Connection closed by remote host", file=sys.stderr)
            sys.exit(143 if mode == "late" else 255)
        print("[worker 0] step 100/100 loss 1.23")
""")


@pytest.fixture
def fake_gcloud(tmp_path, monkeypatch):
    """`gcloud` is FAKE_GCLOUD; the tree shipped a small git checkout. Returns the calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(gcloud.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GCLOUD_DIR", str(tmp_path))
    monkeypatch.setattr(tpu, "REPO", str(_git_tree(tmp_path / "tree")))
    calls = tmp_path / "calls.jsonl"
    return lambda: [_step(json.loads(line)) for line in calls.read_text().splitlines()]


@pytest.mark.slow
def test_a_preempted_slice_is_recreated_and_the_same_command_rerun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(gcloud.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FAKE_GCLOUD_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    archive = REPO / ".launch" / "run1.tar.gz"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "launch.tpu", "run", "--name=run1", "--project=proj",
             "--zone=us-east5-a", "--accelerator=v5p-32", "--spot", "--restart_on_preemption",
             "--skip_aot", "--poll_seconds=0", "--", *TRAIN],
            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert archive.is_file() and archive.stat().st_size > 10_000  # the working tree
    finally:
        archive.unlink(missing_ok=True)
        (REPO / ".launch" / "run1.files").unlink(missing_ok=True)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    steps = [_step(call) for call in calls]
    assert steps == [
        "describe", "create", "describe",  # absent -> created (queued) -> ACTIVE
        "scp", "ssh install", "ssh train",  # ship, install, train: preempted
        "describe", "describe", "delete", "create", "describe",  # SUSPENDED -> recreated
        "scp", "ssh install", "ssh train",  # the same command again: resumes
    ]
    trains = [call[-1] for call in calls if _step(call) == "ssh train"]
    assert trains[0] == trains[1]
    assert "--jax_distributed" in trains[0] and "--workdir=gs://bucket/runs/tiny" in trains[0]
    assert "training finished" in result.stdout
    assert "recreating it and resuming (restart 1/20)" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command, message", [
    (["run", "--poll_seconds=-1", "--", *TRAIN], "--poll_seconds=-1.0: expected a number >= 0"),
    (["run", "--max_restarts=-5", "--", *TRAIN], "--max_restarts=-5: expected a number >= 0"),
    (["stop", "--num_slices=0"], "--num_slices=0: expected a number >= 1"),
    (["logs", "--name=My_Run.1"], "--name=My_Run.1: expected lowercase letters"),
    (["status", "extra"], "status: unexpected arguments ['extra']"),
    (["create", "--spot", "--reserved"], "--spot and --reserved: expected at most one"),
    (["run", "--spot", "--reserved", "--", *TRAIN], "--spot and --reserved: expected at most"),
    (["run", "--", TRAIN[0], "--workdir=runs/tiny"], "--workdir=runs/tiny: a workdir inside"),
    (["run", "--restart_on_preemption", "--", TRAIN[0], "--workdir=/mnt/r"],
     "--workdir=/mnt/r with --restart_on_preemption"),
    (["run", "--", "--config=../x.py", TRAIN[1]], "--config=../x.py: No such file"),
    (["run", "--", f"--config={REPO}/experiments/gpt_tiny.py", TRAIN[1]],
     f"--config={REPO}/experiments/gpt_tiny.py: not in the working tree that run ships"),
    (["run", "--", *TRAIN, "--steps=100"], "Unknown command line flag 'steps'"),
    (["run", "--", *TRAIN, "WANDB_API_KEY=x"], "unexpected arguments ['WANDB_API_KEY=x']"),
])
def test_bad_input_is_one_line_before_anything_is_created_or_compiled(tmp_path, command,
                                                                       message):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(gcloud.stat().st_mode | stat.S_IEXEC)
    result = forkserver.run(
        [sys.executable, "-m", "launch.tpu", command[0], "--name=run1", "--project=proj",
         "--zone=us-east5-a", "--accelerator=v6e-8", *command[1:]],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**cli_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             "FAKE_GCLOUD_DIR": str(tmp_path)})
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "calls.jsonl").exists()  # no gcloud call; no launch.aot either


def test_training_stopped_by_a_signal_on_a_live_slice_stays_stopped(fake_gcloud, monkeypatch):
    """`stop` -> training saves and exits 143 on an ACTIVE slice: one line says so, and the
    run exits 143 without recreating the slice, though --restart_on_preemption."""
    monkeypatch.setenv("FAKE_MODE", "stop")
    out = io.StringIO()
    code = tpu.run(make_launch("v6e-8", spot=True), tpu.Runner(dry_run=False, out=out),
                   restart_on_preemption=True, max_restarts=3, poll_seconds=0)
    assert code == 143
    assert fake_gcloud() == ["describe", "create", "describe", "scp", "ssh install",
                             "ssh train", "describe", "describe", "describe", "describe"]
    assert out.getvalue().splitlines()[-1] == (
        "run1: training was stopped by SIGTERM (e.g. `python -m launch.tpu stop`), its "
        "checkpoint saved; the slice is ACTIVE: run the same command again to resume")


def test_a_preemption_the_slice_state_shows_late_is_still_a_preemption(fake_gcloud,
                                                                       monkeypatch):
    """Training exits 143 (the preemption's SIGTERM, its checkpoint saved) while the slice
    still reads ACTIVE: the state is read again, SUSPENDED, and the run resumes."""
    monkeypatch.setenv("FAKE_MODE", "late")
    out = io.StringIO()
    code = tpu.run(make_launch("v6e-8", spot=True), tpu.Runner(dry_run=False, out=out),
                   restart_on_preemption=True, max_restarts=3, poll_seconds=0)
    assert code == 0, out.getvalue()
    assert fake_gcloud() == ["describe", "create", "describe", "scp", "ssh install",
                             "ssh train", "describe", "describe",  # ACTIVE, then SUSPENDED
                             "describe", "delete", "create", "describe", "scp", "ssh install",
                             "ssh train"]
    assert "the slice is SUSPENDED: recreating it and resuming (restart 1/3)" in out.getvalue()


def test_a_slice_preempted_while_the_code_is_installed_is_recreated(fake_gcloud, monkeypatch):
    """A spot slice preempted during the minutes of `pip install` fails the install: its
    state is read and the run goes on as for a preemption during training (it stopped with a
    RuntimeError, never reading the state)."""
    monkeypatch.setenv("FAKE_MODE", "install")
    out = io.StringIO()
    code = tpu.run(make_launch("v6e-8", spot=True), tpu.Runner(dry_run=False, out=out),
                   restart_on_preemption=True, max_restarts=3, poll_seconds=0)
    assert code == 0, out.getvalue()
    assert fake_gcloud() == ["describe", "create", "describe", "scp", "ssh install",
                             "describe", "describe", "delete", "create", "describe", "scp",
                             "ssh install", "ssh train"]
    assert "the slice is SUSPENDED: recreating it and resuming (restart 1/3)" in out.getvalue()
    # without --restart_on_preemption it stops there, saying how to resume
    (Path(os.environ["FAKE_GCLOUD_DIR"]) / "i").unlink()
    out = io.StringIO()
    code = tpu.run(make_launch("v6e-8", spot=True), tpu.Runner(dry_run=False, out=out),
                   restart_on_preemption=False, max_restarts=3, poll_seconds=0)
    assert code == 255 and "the slice is SUSPENDED (pass --restart_on_preemption" in \
        out.getvalue().splitlines()[-1]


def test_a_gcloud_failure_is_an_error_not_an_absent_slice(fake_gcloud, monkeypatch):
    """Only gcloud's NOT_FOUND means no slice: a credentials error is an error with gcloud's
    message (it read as NOT_FOUND: `status` printed that and `run` created a slice)."""
    launch, runner = make_launch("v6e-8", spot=True), tpu.Runner(dry_run=False, out=io.StringIO())
    assert tpu.slice_state(launch, runner) == "NOT_FOUND"
    monkeypatch.setenv("FAKE_MODE", "reauth")
    with pytest.raises(RuntimeError, match="Reauthentication failed") as error:
        tpu.slice_state(launch, runner)
    assert "\n" not in str(error.value)
    with pytest.raises(RuntimeError, match="Reauthentication failed"):
        tpu.ensure_slice(launch, runner, poll_seconds=0)
    assert fake_gcloud() == ["describe", "describe", "describe"]  # nothing created


def _step(call: list[str]) -> str:
    verb = call[3]
    if verb == "ssh":
        return "ssh train" if "transformer.train" in call[-1] else "ssh install"
    return verb


# --- ahead-of-time compilation ------------------------------------------------------------


@pytest.mark.slow
@needs_libtpu
def test_a_tiny_gpt_compiles_for_a_v5p_slice_and_reports_its_memory():
    from launch import aot
    from transformer.configs import base_config

    config = base_config()
    config.update(batch_size=8, seq_len=32)
    # Scanned: XLA counts a loop body once, so the FLOPs must come from the unrolled compiles.
    config.model.update(num_layers=3, d_model=64, num_heads=4, d_ff=128, vocab_size=512,
                        scan_layers=True)
    config.mesh.update(data=1, fsdp=4)
    # read on the slice (a gcsfuse mount), not here (probe p5 of stop 110: refused here)
    config.data.sources = ("path=/mnt/bucket-not-on-this-machine/a.txt,weight=0.7",
                           "path=/mnt/bucket-not-on-this-machine/b.txt,weight=0.3")
    accelerator = accelerators.parse("v5p-8")
    devices = aot.tpu_topology(accelerator)
    assert len(devices) == 4 and "TPU" in devices[0].device_kind
    report = aot.compile_train_step(config, devices, accelerator)
    assert report.fits and not report.error
    params = 3 * (4 * 64 * 64 + 2 * 64 * 128) + 512 * 64
    assert report.num_params >= params
    # fsdp=4: each chip holds about a quarter of the params and Adam moments (float32).
    assert 3 * 4 * report.num_params / 4 <= report.argument_bytes < 3 * 4 * report.num_params
    assert report.temp_bytes > 0 and report.total_bytes < report.hbm_bytes
    # XLA's FLOPs for the whole slice are close to the model's 6N + attention per token
    # (counting the scanned body once would give about half).
    assert 0.8 < report.flops_per_chip * 4 / report.model_flops < 1.25
    assert "fits" in aot.format_report(report, config).splitlines()[-1]
    assert report.attention == ("dense",)  # "auto" at 32 tokens: splash needs multiples of 128


@pytest.mark.slow
@needs_libtpu
def test_the_configs_xla_options_reach_xla_tpu_which_judges_them():
    """The step compiles ahead of time with the XLA options training compiles with, judged by
    XLA:TPU: the TPU defaults and an option only XLA:TPU knows (this machine's XLA:CPU refuses
    it) compile; one XLA:TPU does not know is a one-line error before anything compiles."""
    from launch import aot
    from transformer.configs import base_config
    from transformer.parallel import sharding
    from transformer.training import placement

    accelerator = accelerators.parse("v5p-8")
    devices = aot.tpu_topology(accelerator)

    def config_with(option):
        config = base_config()
        config.update(batch_size=8, seq_len=32, compiler_options={option: 1})
        config.model.update(num_layers=1, d_model=64, num_heads=4, d_ff=128, vocab_size=512)
        config.mesh.update(data=1, fsdp=4)
        return config

    config = config_with("xla_tpu_buffer_assignment_randomization_salt")
    assert placement.compiler_options(config, sharding.make_mesh(config.mesh, devices)) == {
        **placement.TPU_OPTIONS, "xla_tpu_buffer_assignment_randomization_salt": 1}
    compiled, report = aot._compile(config, devices, accelerator)
    assert compiled is not None and not report.error, report.error
    with pytest.raises(ValueError, match=r"compiler_options=.*XLA rejects them \(.*No such "
                       r"compile option: 'xla_tpu_no_such_option'"):
        aot._compile(config_with("xla_tpu_no_such_option"), devices, accelerator)


@pytest.mark.slow
@needs_libtpu
def test_a_pipeline_with_its_stages_across_two_slices_compiles_for_tpu():
    """stage=2 over 2 x v5p-32 (mesh.data=1 does not split over the slices, stage does): the
    step compiles for TPU with splash inside each stage, and the report says its FLOPs are
    XLA's count of the loop."""
    from launch import aot
    from transformer.configs import base_config

    config = base_config()
    config.update(batch_size=32, seq_len=256)
    config.model.update(num_layers=4, d_model=256, num_heads=2, d_ff=512, vocab_size=512,
                        max_len=256, dtype="bfloat16", scan_layers=True)
    config.mesh.update(data=1, stage=2, fsdp=16)
    config.pipeline.microbatches = 2
    accelerator = accelerators.parse("v5p-32")
    devices = aot.tpu_topology(accelerator, num_slices=2)
    report = aot.compile_train_step(config, devices, accelerator)
    assert not report.error and report.fits and report.attention == ("splash",)
    text = aot.format_report(report, config)
    assert "mesh data=1 x stage=2 x fsdp=16" in text and "loop bodies counted once" in text
    assert "on 2 x v5p-32 (32 chips)" in text.splitlines()[0]


@pytest.mark.slow
@needs_libtpu
def test_auto_attention_compiles_splash_for_a_tpu_topology_from_a_cpu_host():
    """The kernel is chosen for the devices the step is compiled for (the TPU topology), not for
    the host's CPU backend: "auto" puts splash into the compiled step, and the report says so."""
    from launch import aot
    from transformer.configs import base_config

    config = base_config()
    config.update(batch_size=8, seq_len=128)
    config.model.update(num_layers=2, d_model=128, num_heads=2, d_ff=256, vocab_size=512,
                        max_len=128, dtype="bfloat16")
    config.mesh.update(data=1, fsdp=4)
    config.optimizer.grad_accumulation_steps = 2  # a lax.scan, counted once (probe p5, stop 110)
    assert config.model.attention_impl == "auto"  # the default
    accelerator = accelerators.parse("v5p-8")
    devices = aot.tpu_topology(accelerator)
    assert aot.jax.default_backend() == "cpu"
    report = aot.compile_train_step(config, devices, accelerator)
    assert report.attention == ("splash",) and not report.error
    text = aot.format_report(report, config)
    assert "attention kernel compiled into the step: splash" in text
    # XLA counts the Pallas kernel as 0 FLOPs: said beside its figure
    assert "splash's attention is not in it" in text
    assert "its loop over 2 accumulated micro-batches counted once: about 2x too low" in text


@pytest.mark.slow
@needs_libtpu
def test_dropless_moe_on_an_expert_mesh_compiles_the_ragged_all_to_all_for_tpu():
    """XLA:CPU has no ragged-all-to-all (the CPU checks run a padded dense all-to-all); XLA:TPU
    compiles the exchange `moe.sharded_experts` makes with it, and the report names the path."""
    from launch import aot
    from transformer.configs import base_config

    config = base_config()
    config.update(batch_size=8, seq_len=128)
    config.model.update(num_layers=2, d_model=128, num_heads=2, d_ff=256, vocab_size=512,
                        max_len=128, dtype="bfloat16")
    config.model.moe.update(num_experts=8, top_k=2, capacity_factor=0.0)
    config.mesh.update(data=1, expert=4)
    accelerator = accelerators.parse("v5p-8")
    report = aot.compile_train_step(config, aot.tpu_topology(accelerator), accelerator,
                                    flops=False)
    assert not report.error, report.error
    assert report.moe_dispatch == ("moe dispatch: ragged all-to-all over expert=4",)
    assert "moe dispatch: ragged all-to-all over expert=4 (compiled into the step)" in \
        aot.format_report(report, config)


def _scanned_flops_config(family="gpt", **model):
    from transformer.configs import base_config

    config = base_config()
    config.update(batch_size=2, seq_len=16)
    config.model.update(family=family, d_model=32, num_heads=2, d_ff=64, vocab_size=128,
                        scan_layers=True)
    config.model.update(model)
    config.mesh.update(data=1, fsdp=1)
    return config


def _moe(config, **moe):
    config.model.moe.update(num_experts=4, top_k=2, capacity_factor=0.0, **moe)
    return config


FLOPS_STACKS = {  # scanned stacks whose layers differ: hybrid types, MoE every n, dense first
    "hybrid": lambda: _moe(_scanned_flops_config(num_layers=4, layer_types="conv,full_attention")),
    "first_dense": lambda: _moe(_scanned_flops_config(num_layers=4), first_dense_layers=1),
    "pattern_and_moe_every_2": lambda: _moe(
        _scanned_flops_config(num_layers=12, layer_types="conv,full_attention*2"),
        every_n_layers=2),
    "dense_every_2": lambda: _moe(_scanned_flops_config(num_layers=8), every_n_layers=2,
                                  first_dense_layers=2),
    "t5": lambda: _moe(_scanned_flops_config("t5", num_layers=6, num_decoder_layers=4,
                                             layer_types="full_attention*2"),
                       first_dense_layers=2),
}


@pytest.mark.parametrize("name", FLOPS_STACKS)
def test_the_scanned_stacks_flops_extrapolate_to_the_whole_unrolled_stack(name, monkeypatch):
    """The FLOPs of a scanned stack come from unrolled stacks of its first dense layers plus one
    and two scan units (layer_period: a layer-type pattern and MoE every n layers); with a
    fake compile whose FLOPs are the sum of each layer's (by type, MoE or dense), the estimate
    is the whole unrolled stack's."""
    from launch import aot
    from transformer.models import transformer_config

    def layer_flops(model) -> int:
        total = 1000  # embeddings, head, optimizer
        for key, depth in aot._stack_depths(model).items():
            stack = transformer_config(model, num_layers=depth)  # validates the shallow stack
            total += sum((3 if stack.layer_type(i) == "conv" else 7)
                         * (10 if stack.moe.is_moe_layer(i) else 1) * (2 if key == "num_layers"
                                                                      else 5)
                         for i in range(depth))
        return total

    class Compiled:
        def __init__(self, model):
            self.flops = 1.0 if model.scan_layers else float(layer_flops(model))

        def cost_analysis(self):
            return {"flops": self.flops}

        def memory_analysis(self):
            return type("Memory", (), dict.fromkeys(
                ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "temp_size_in_bytes", "generated_code_size_in_bytes"), 0))

    compiled = []
    monkeypatch.setattr(aot, "_compile", lambda config, devices, accelerator: (
        compiled.append(config.model.to_dict()) or Compiled(config.model),
        aot.Report("v5p-8", 4, 0)))
    config = FLOPS_STACKS[name]()
    report = aot.compile_train_step(config, [], accelerators.parse("v5p-8"))
    config.model.scan_layers = False
    assert report.flops_per_chip == layer_flops(config.model)
    assert len(compiled) == 1 + 1 + len(aot._stack_depths(config.model))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "first_dense"])
def test_the_flops_of_a_scanned_hybrid_or_first_dense_stack_are_the_unrolled_stacks(name):
    """Compiled for real (on this host's CPU: the same code as for a TPU topology), the
    scanned stack's extrapolated FLOPs equal XLA's count of the whole stack unrolled."""
    import jax

    from launch import aot

    config = FLOPS_STACKS[name]()
    accelerator = accelerators.parse("v5p-8")
    report = aot.compile_train_step(config, jax.devices("cpu")[:1], accelerator)
    assert not report.error, report.error
    config.model.scan_layers = False
    unrolled = aot.compile_train_step(config, jax.devices("cpu")[:1], accelerator)
    # (a few dozen of XLA's FLOPs do not grow linearly with depth; a layer's are ~10^6)
    assert report.flops_per_chip == pytest.approx(unrolled.flops_per_chip, rel=1e-5)


@pytest.mark.slow
@needs_libtpu
def test_a_model_too_big_for_hbm_exits_non_zero():
    result = subprocess.run(
        [sys.executable, "-m", "launch.aot", "--config=experiments/gpt_tiny.py",
         "--topology=v5p-8", "--config.mesh.data=1", "--config.mesh.fsdp=4",
         "--config.model.d_model=16384", "--config.model.num_heads=128",
         "--config.model.d_ff=65536", "--config.model.num_layers=8",
         "--config.model.scan_layers=True"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "does not fit" in result.stdout
    assert "Failed to find host bounds" not in result.stderr, result.stderr  # libtpu's warnings
    assert "INVALID_ARGUMENT" not in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flag, message", [
    ("--config.optimizer.learning_rate=-1", "optimizer.learning_rate=-1.0: expected a number > 0"),
    ("--config.mesh.fsdp=3", "the other axes (3 devices) must divide the 8 devices available"),
])
def test_aot_checks_the_whole_config_in_one_line_before_libtpu_starts(flag, message):
    """Against the slice's devices (v5p-16: 8 chips), before libtpu prints anything."""
    result = subprocess.run(
        [sys.executable, "-m", "launch.aot", "--config=experiments/gpt_tiny.py",
         "--topology=v5p-16", flag], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_the_gke_jobset_runs_the_train_command_on_every_host_of_every_slice():
    import yaml

    from launch import gke

    launch = make_launch("v5p-32", num_slices=2)
    manifest = yaml.safe_load(gke.jobset_manifest(launch, "us-docker.pkg.dev/p/r/img:1"))
    job = manifest["spec"]["replicatedJobs"][0]
    assert manifest["kind"] == "JobSet" and job["replicas"] == 2
    assert job["template"]["spec"]["parallelism"] == 4  # hosts per slice
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x4"}
    container = pod["containers"][0]
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    assert container["command"] == ["python3", "-m", "transformer.train", "--jax_distributed",
                                    *TRAIN]
    xpk = gke.xpk_command(launch, "img:1", "cluster1")
    assert xpk[:3] == ["xpk", "workload", "create"] and "--num-slices=2" in xpk
    assert xpk[-1] == "--command=python3 -m transformer.train --jax_distributed " + " ".join(TRAIN)
    assert "--project=proj" in xpk and "--zone=us-east5-a" in xpk


def test_the_gke_manifest_quotes_any_argument_and_xpk_leaves_out_an_unset_project():
    """Each argument a YAML double-quoted scalar (a JSON string): quotes, backslashes and
    non-ASCII come back as they were (a quote broke the YAML, a backslash became an escape)."""
    import yaml

    from launch import gke

    odd = ('--config.data.path=/data/"quoted" dir', "--config.name=a\\b\\n\\\\",
           "--config.note=naïve – 日本")
    launch = make_launch("v6e-8", train=TRAIN + odd)
    manifest = yaml.safe_load(gke.jobset_manifest(launch, "img:1"))
    container = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]
    assert container["command"][4:] == [*TRAIN, *odd]
    unset = tpu.Launch("run1", "", "", launch.accelerator, "", train_args=TRAIN)
    xpk = gke.xpk_command(unset, "img:1", "cluster1")
    assert not [arg for arg in xpk if arg.startswith(("--project", "--zone"))], xpk


def test_gke_noprint_validates_the_launch_and_prints_nothing(capsys):
    """--noprint checks the launch alone (it printed the manifest all the same)."""
    import types

    from launch import gke

    values = types.SimpleNamespace(print=False, name="g1", accelerator="v6e-8", num_slices=1,
                                   image="img:1", xpk=False, cluster=None, project=None,
                                   zone=None)
    assert gke.main(["launch.gke", "--", *TRAIN], values) == 0
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match=re.escape("workdir='runs/tiny': a pod restarted")):
        gke.main(["launch.gke", "--", TRAIN[0], "--workdir=runs/tiny"], values)
    values.print = True
    assert gke.main(["launch.gke", "--", *TRAIN], values) == 0
    assert capsys.readouterr().out.startswith("apiVersion: jobset.x-k8s.io/v1alpha2\n")


@pytest.mark.slow
def test_gke_refuses_a_workdir_a_restarted_pod_would_not_find():
    """The JobSet restarts a preempted pod (exit 143) on a fresh disk: only a gs:// workdir
    still holds the checkpoints to resume from."""
    result = subprocess.run(
        [sys.executable, "-m", "launch.gke", "--name=g1", "--accelerator=v6e-8", "--image=img:1",
         "--", TRAIN[0], "--workdir=runs/tiny"], cwd=REPO, capture_output=True, text=True,
        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: workdir='runs/tiny': a pod restarted by the JobSet (a preemption, exit 143) "
        "starts on a fresh disk, without the checkpoints to resume: expected "
        "--workdir=gs://BUCKET/PATH"]


def test_an_sft_config_compiles_on_packed_conversation_batches():
    """launch.aot's batch for data.objective="sft" is what chat.PackedRows feeds training:
    next-token features of packed conversations (segments, positions, the assistant mask as
    weights); the text pipeline refused the objective."""
    from launch import aot
    from transformer import configs

    config = configs.experiment("sft_chat")
    config.update(seq_len=64, batch_size=8)
    spec = aot.batch_spec(config)
    assert sorted(spec) == ["inputs", "positions", "segment_ids", "targets", "weights"]
    assert {s.shape for s in spec.values()} == {(8, 64)}
    assert spec["weights"].dtype == "float32" and spec["inputs"].dtype == "int32"


TPU_ENV = """ACCELERATOR_TYPE: 'v5p-32'
MEGASCALE_COORDINATOR_ADDRESS: '10.130.0.7'
MEGASCALE_NUM_SLICES: '2'
MEGASCALE_SLICE_ID: '1'
TPU_WORKER_ID: '3'
ZONE: 'us-east5-a'
"""


@pytest.fixture
def metadata_server(monkeypatch):
    """A stand-in for a TPU VM's metadata server at $GCE_METADATA_IP: its requests' paths and
    Metadata-Flavor headers, listed."""
    import http.server
    import threading

    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append((self.path, self.headers.get("Metadata-Flavor")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(TPU_ENV.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{server.server_port}")
    yield requests
    server.shutdown()
    server.server_close()


def test_the_worker_label_reads_the_slice_from_the_tpu_vms_metadata(metadata_server):
    """A TPU VM's ssh session has no MEGASCALE_SLICE_ID: it is in the `tpu-env` metadata. Off a
    TPU VM (its host name says so) no request is made; an empty variable counts as unset."""
    from launch import worker

    host = "t1v-n-0a1b2c3d-w-3"
    assert worker.worker_label({}, host) == "slice 1 worker 3"
    assert metadata_server == [("/computeMetadata/v1/instance/attributes/tpu-env", "Google")]
    assert worker.worker_label({"TPU_WORKER_ID": "", "MEGASCALE_SLICE_ID": "0"}, host) == \
        "slice 0 worker 3"
    assert worker.worker_label({}, "build-box-w-2") == "worker 2"
    assert len(metadata_server) == 1
    assert worker.tpu_env_value("MEGASCALE_NUM_SLICES") == "2"
    assert worker.tpu_env_value("TPU_ACCELERATOR_TYPE") is None


def test_the_worker_label_without_a_metadata_server_has_no_slice(monkeypatch):
    import socket
    import time

    from launch import worker

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{s.getsockname()[1]}")
        start = time.monotonic()
        assert worker.worker_label({"TPU_WORKER_ID": ""}, "t1v-n-0a1b2c3d-w-3") == "worker 3"
    assert time.monotonic() - start < 2


def test_the_worker_says_in_one_line_that_the_command_is_not_there(tmp_path):
    """As a shell: exit status 127, one line (it was a traceback), in the log too."""
    result = subprocess.run(
        [sys.executable, "-m", "launch.worker", f"--log={tmp_path / 'w.log'}", "--",
         str(tmp_path / "no-such-python"), "-m", "transformer.train"], cwd=REPO,
        capture_output=True, text=True, timeout=60, env={**os.environ, "TPU_WORKER_ID": "3"})
    assert result.returncode == 127 and result.stdout == ""
    line = (f"[worker 3] launch.worker: {tmp_path / 'no-such-python'}: No such file or "
            "directory: expected a command that exists and can run\n")
    assert result.stderr == line
    assert (tmp_path / "w.log").read_text() == line


def test_single_dash_train_flags_are_passed_on_as_double_dash_ones():
    """absl takes `-config=FILE`: launch.aot, which keeps the `--config` flags, got none."""
    train = ("-config=experiments/gpt_tiny.py", "-workdir", "gs://b/r", "-config.batch_size=16",
             "-jax_distributed")
    assert tpu.train_arguments(train) == (
        "--config=experiments/gpt_tiny.py", "--workdir=gs://b/r", "--config.batch_size=16",
        "--jax_distributed")
    launch = make_launch("v5p-32", train=tpu.train_arguments(train))
    assert tpu.aot_command(launch)[-2:] == ["--config=experiments/gpt_tiny.py",
                                            "--config.batch_size=16"]


def test_the_aot_check_compiles_the_config_the_workers_train(tmp_path):
    """Probe p5 of stop 110: launch.aot got only the --config[.=] arguments, so a
    --noconfig.KEY or a --flagfile's overrides reached the workers but not the memory check
    (it reported another model's memory). It now gets every override as train reads them."""
    flagfile = tmp_path / "more.flags"
    flagfile.write_text("--config.model.num_layers=3\n")
    train = ("--config=experiments/gpt_tiny.py", "--workdir=gs://b/r",
             "--noconfig.model.tie_embeddings", f"--flagfile={flagfile}",
             "--config.batch_size=16")
    launch = make_launch("v5p-32", train=tpu.train_arguments(train))
    tpu.validate(launch)
    assert tpu.aot_command(launch)[-4:] == [
        "--config=experiments/gpt_tiny.py", "--config.model.tie_embeddings=False",
        "--config.model.num_layers=3", "--config.batch_size=16"]


def test_the_aot_vocabulary_of_an_hf_tokenizer_is_its_files_where_this_machine_has_it(
        tmp_path):
    """Training takes data.tokenizer='hf''s vocabulary from its tokenizer.json; launch.aot
    refused it without model.vocab_size, saying the tokenizer is built from data (probe p5
    of stop 110). It reads the file where it is here, and says so where it is not."""
    pytest.importorskip("transformers")
    from test_hf_tokenizers import gpt2_style

    from launch import aot
    from transformer.configs import base_config
    from transformer.data import inputs

    config = base_config()
    config.data.update(tokenizer="hf", tokenizer_path=str(gpt2_style(tmp_path / "tok")))
    assert aot.resolved_vocab_size(config) == inputs.get_tokenizer(config).vocab_size > 400
    config.data.tokenizer_path = str(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"^model.vocab_size=0 with data.tokenizer='hf': expected "
                                         r"--config.model.vocab_size \(the tokenizer is a file "
                                         r"this machine lacks\)$"):
        aot.resolved_vocab_size(config)


def _gke_values(**kwargs):
    import types

    return types.SimpleNamespace(**{**dict(
        print=False, name="g1", accelerator="v6e-8", num_slices=1, image="img:1", xpk=False,
        cluster=None, project=None, zone=None), **kwargs})


def test_gke_refuses_multislice_of_single_host_slices():
    """GKE's Multislice needs multi-host TPU slice node pools."""
    from launch import gke

    for accelerator, least in (("v6e-8", "v6e-16"), ("v5p-8", "v5p-16"), ("v4-8", "v4-16")):
        with pytest.raises(ValueError, match=re.escape(
                f"--num_slices=2 with --accelerator={accelerator}, a single-host slice: GKE "
                f"runs Multislice on multi-host TPU slices only: expected --num_slices=1 or "
                f"{least} or larger")):
            gke.main(["launch.gke", "--", *TRAIN], _gke_values(accelerator=accelerator,
                                                               num_slices=2))
    assert gke.main(["launch.gke", "--", *TRAIN], _gke_values(accelerator="v6e-16",
                                                              num_slices=2)) == 0


def test_gke_refuses_a_config_the_image_would_not_hold():
    """Each pod reads --config relative to the image's working directory, the checkout: an
    absolute local path (or one outside the checkout) failed in every pod, restart after
    restart."""
    from launch import gke

    for config in (str(REPO / "experiments" / "gpt_tiny.py"),
                   str(Path("..") / REPO.name / "experiments" / "gpt_tiny.py")):
        with pytest.raises(ValueError, match=re.escape(
                f"--config={config}: not in the working tree the image is expected to hold "
                "as its working directory")):
            gke.main(["launch.gke", "--", f"--config={config}", *TRAIN[1:]], _gke_values())


def test_a_bad_topology_names_the_flag_and_one_host_is_singular():
    launch = make_launch("v6e-8", train=TRAIN[:2] + ("--config.batch_size=12",))
    with pytest.raises(ValueError, match=re.escape("; on 1 x v6e-8 (1 host)")):
        tpu.validate(launch)
    result = subprocess.run(
        [sys.executable, "-m", "launch.aot", "--config=experiments/gpt_tiny.py",
         "--topology=v5p-31"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --topology='v5p-31': expected v5p-N with N one of 8, 16, 32, 64, 128, 256, "
        "512, 1024, 2048, 4096, 8192, 12288 (the slice sizes Cloud TPU offers)"]
