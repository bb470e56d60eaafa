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

import pytest

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
    for bad, message in [("v5p-12", "power of two"), ("v7x-8", "unknown TPU generation"),
                         ("tpu", "expected a TPU type"), ("v4-2", "power of two")]:
        with pytest.raises(ValueError, match=message) as error:
            accelerators.parse(bad)
        assert repr(bad) in str(error.value)


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
    (dict(accelerator="v6e-8", spot=True, reserved=True), TRAIN, "--spot and --reserved"),
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
    # first training command "is preempted": it fails and the slice becomes SUSPENDED.
    import json, os, sys
    root = os.environ["FAKE_GCLOUD_DIR"]
    args = sys.argv[1:]
    with open(os.path.join(root, "calls.jsonl"), "a") as f:
        f.write(json.dumps(args) + "\\n")
    state_file = os.path.join(root, "state")
    verb = args[3]  # compute tpus (queued-resources | tpu-vm) VERB ...
    if verb == "describe":
        if not os.path.exists(state_file):
            sys.exit(1)
        print(open(state_file).read())
    elif verb == "create":
        open(state_file, "w").write("ACTIVE")
    elif verb == "delete":
        os.remove(state_file)
    elif verb == "ssh" and "transformer.train" in args[-1]:
        runs = os.path.join(root, "train_runs")
        n = int(open(runs).read()) if os.path.exists(runs) else 0
        open(runs, "w").write(str(n + 1))
        if n == 0:
            open(state_file, "w").write("SUSPENDED")
            print("Connection closed by remote host", file=sys.stderr)
            sys.exit(255)
        print("[worker 0] step 100/100 loss 1.23")
""")


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
    assert config.model.attention_impl == "auto"  # the default
    accelerator = accelerators.parse("v5p-8")
    devices = aot.tpu_topology(accelerator)
    assert aot.jax.default_backend() == "cpu"
    report = aot.compile_train_step(config, devices, accelerator)
    assert report.attention == ("splash",) and not report.error
    assert "attention kernel compiled into the step: splash" in aot.format_report(report, config)


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
