"""Meshes, logical axis rules and multi-host training.

The 8-device checks run tests/mesh_check.py in a subprocess with forced host devices; the
multi-host test starts two real processes of the training CLI joined by a 127.0.0.1 coordinator
(gloo collectives), kills them after a checkpoint, resumes, and compares every step's loss with
a single-process run on the same number of devices.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import forkserver
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec
from test_train import cli_env

from transformer import configs
from transformer.parallel import sharding
from transformer.training import optim, state

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 900  # the 8-device checks take 3 minutes alone; CI machines under load, far longer


# --- mesh shapes and rules ------------------------------------------------------------------


def test_mesh_shape_fills_the_minus_one_axis():
    # an axis left out is its default
    assert sharding.mesh_shape({"data": -1, "fsdp": 2, "tensor": 2}, 8) == {
        "data": 2, "stage": 1, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}
    assert sharding.mesh_shape({"data": -1, "sequence": 4}, 8)["data"] == 2
    assert sharding.mesh_shape({"data": 1, "fsdp": -1, "tensor": 1}, 4)["fsdp"] == 4


@pytest.mark.parametrize("mesh, devices, message", [
    ({"data": 2, "fsdp": 2, "tensor": 4}, 8, "= 16 devices: expected the 8 devices"),
    ({"data": -1, "fsdp": -1, "tensor": 1}, 8, "at most one axis set to -1"),
    ({"data": -1, "fsdp": 3, "tensor": 1}, 8, "must divide the 8 devices"),
    ({"data": 0, "fsdp": 1, "tensor": 1}, 8, "mesh.data=0: expected a positive int or -1"),
    ({"data": 1, "fsdp": 1.5, "tensor": 1}, 8, "mesh.fsdp=1.5"),
])
def test_mesh_shape_errors_name_the_bad_sizes(mesh, devices, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        sharding.mesh_shape(mesh, devices)


def test_jax_distributed_without_a_cluster_says_what_it_needs():
    """--jax_distributed off a TPU slice: jax finds no cluster and said "coordinator_address
    should be defined", a flag nobody had passed."""
    env = {k: v for k, v in cli_env().items()
           if not k.startswith(("TPU_", "MEGASCALE_", "CLOUD_TPU"))}
    result = subprocess.run(
        [sys.executable, "-c", "from transformer.parallel import sharding; "
         "sharding.initialize_distributed(cluster=True)"],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ValueError: --jax_distributed: no cluster environment found (a Cloud TPU VM slice or "
        "a GKE TPU pod sets one): expected a TPU slice, or --coordinator_address, "
        "--num_processes and --process_id")


def test_the_mesh_axis_table_drives_the_axes_the_config_and_the_batch_sharding():
    table = sharding.MESH_AXIS_TABLE
    assert sharding.MESH_AXES == tuple(axis.name for axis in table) == (
        "data", "stage", "fsdp", "expert", "sequence", "tensor")
    assert sharding.BATCH_AXES == tuple(a.name for a in table if a.shards_batch) == (
        "data", "fsdp", "expert")
    assert sharding.SLICE_AXIS == "data" and sharding.SLICE_AXES == ("data", "stage")
    defaults = configs.base_config().mesh
    assert defaults.to_dict() == {axis.name: axis.default for axis in table} == {
        "data": -1, "stage": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    mesh = sharding.make_mesh(defaults)
    assert mesh.axis_names == sharding.MESH_AXES
    assert sharding.batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp", "expert"))
    assert sharding.data_parallel_size(mesh) == sharding.data_parallel_size(dict(mesh.shape)) == 1
    docstring = " ".join(sharding.__doc__.split())
    for axis in table:  # the module docstring lists every axis with its description
        assert f"{axis.name} {axis.doc}" in docstring


def sized(sizes: tuple[int, int, int]) -> dict[str, int]:
    """(data, fsdp, tensor) sizes as `mesh_shape` gives them (sequence 1)."""
    return dict(zip(("data", "fsdp", "sequence", "tensor"), (*sizes[:2], 1, sizes[2]),
                    strict=True))


@pytest.mark.parametrize("batch_size, sizes, kwargs", [
    (8, (8, 1, 1), {}),
    (6, (1, 1, 8), dict(accumulation=3)),  # tensor parallelism does not split the batch
    (64, (4, 4, 2), dict(accumulation=4, processes=4, num_slices=2)),
    (32, (2, 8, 1), dict(accumulation=2, processes=8, num_slices=2)),
])
def test_check_batch_split_accepts_batches_that_split(batch_size, sizes, kwargs):
    sharding.check_batch_split(batch_size, sized(sizes), **kwargs)


@pytest.mark.parametrize("batch_size, sizes, kwargs, message", [
    (8, (1, 1, 1), dict(accumulation=0),
     "batch_size=8: expected a multiple of grad_accumulation_steps=0 x processes=1"),
    (8, (1, 1, 1), dict(accumulation=3),
     "batch_size=8: expected a multiple of grad_accumulation_steps=3 x processes=1"),
    (12, (8, 1, 1), dict(processes=8),
     "batch_size=12: expected a multiple of grad_accumulation_steps=1 x processes=8"),
    # checked first: the slices and the data-parallel size are wrong too
    (6, (3, 1, 1), dict(accumulation=4, num_slices=2),
     "batch_size=6: expected a multiple of grad_accumulation_steps=4 x processes=1"),
    (16, (2, 4, 1), dict(num_slices=4),
     "mesh.data=2: expected a multiple of num_slices=4 (data parallelism spans the slices; "
     "or mesh.stage a multiple, pipeline stages across them)"),
    # checked before the data-parallel size, which does not divide 8 either
    (8, (3, 1, 1), dict(num_slices=2),
     "mesh.data=3: expected a multiple of num_slices=2 (data parallelism spans the slices; "
     "or mesh.stage a multiple, pipeline stages across them)"),
    (24, (4, 4, 1), {},
     "batch_size=24: expected a multiple of the data-parallel size 16 x "
     "grad_accumulation_steps=1 (each micro-batch of 24 rows splits over mesh.data x "
     "mesh.fsdp x mesh.expert)"),
    # 32 rows split over 16, but each of the 4 micro-batches of 8 does not
    (32, (2, 8, 1), dict(accumulation=4, processes=2, num_slices=2),
     "batch_size=32: expected a multiple of the data-parallel size 16 x "
     "grad_accumulation_steps=4 (each micro-batch of 8 rows splits over mesh.data x "
     "mesh.fsdp x mesh.expert)"),
])
def test_check_batch_split_refuses_each_bad_split_with_one_line(batch_size, sizes, kwargs,
                                                                message):
    with pytest.raises(ValueError) as error:
        sharding.check_batch_split(batch_size, sized(sizes), **kwargs)
    assert str(error.value) == message


def test_a_multi_slice_mesh_needs_data_to_be_a_multiple_of_the_slices():
    devices = [SimpleNamespace(slice_index=i // 4) for i in range(8)]
    with pytest.raises(ValueError, match=r"mesh\.data=1: expected a multiple of num_slices=2"):
        sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu "
                    "extra) to describe a multi-slice TPU topology")
def test_a_multi_slice_mesh_spans_the_slices_only_on_the_data_axis():
    from launch import accelerators, aot

    devices = aot.tpu_topology(accelerators.parse("v5p-32"), num_slices=2)  # 2 x 16 chips
    mesh = sharding.make_mesh({"data": 4, "fsdp": -1, "sequence": 2, "tensor": 2}, devices)
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 2, "expert": 1, "sequence": 2,
                                "tensor": 2}
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    # data rows 0-1 lie in slice 0, rows 2-3 in slice 1: the other axes stay inside a slice
    np.testing.assert_array_equal(
        slices, np.arange(4)[:, None, None, None, None, None] // 2 + np.zeros((4, 1, 2, 1, 2, 2)))
    # mesh.data=1 does not split over 2 slices; mesh.stage=2 does: the pipeline spans them
    mesh = sharding.make_mesh({"data": 1, "stage": 2, "fsdp": -1}, devices)
    assert dict(mesh.shape)["fsdp"] == 16
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    np.testing.assert_array_equal(slices[0, :, :, 0, 0, 0], [[0] * 16, [1] * 16])


def test_the_rules_map_each_logical_axis_once_and_onto_mesh_axes():
    names = [name for name, _ in sharding.LOGICAL_AXIS_RULES]
    assert len(names) == len(set(names))
    for _, axes in sharding.LOGICAL_AXIS_RULES:
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            assert axis in sharding.MESH_AXES


def test_every_param_name_the_models_use_has_a_rule():
    """A param whose logical name has no rule would silently stay replicated."""
    from transformer.models import build_model

    ruled = {name for name, _ in sharding.LOGICAL_AXIS_RULES}
    for family, extra in [("gpt", {}), ("bert", {}), ("t5", {}), ("lstm", {}),
                          ("gpt", {"position": "learned"}), ("t5", {"scan_layers": True}),
                          ("vit", {"num_classes": 3, "patch_position": "learned"}),
                          ("clip", {}), ("captioner", {})]:
        config = configs.base_config()
        config.model.update(family=family, num_layers=1, d_model=16, num_heads=2, d_ff=32,
                            vocab_size=32, **extra)
        model = build_model(config.model)
        tokens = jnp.zeros((1, 8), jnp.int32)
        image = jnp.zeros((1, 8, 8, 1))
        args = {"t5": (tokens, tokens), "vit": (image,), "clip": (image, tokens, tokens),
                "captioner": (image, tokens)}.get(family, (tokens,))
        boxed = jax.eval_shape(lambda m=model, a=args: m.init(jax.random.key(0), *a))
        specs = jax.tree.leaves(nn.get_partition_spec(boxed),
                                is_leaf=lambda x: isinstance(x, PartitionSpec))
        used = {name for spec in specs for name in spec if name is not None}
        assert used <= ruled, (family, used - ruled)


def test_dimensions_the_mesh_does_not_divide_stay_replicated():
    # data stage fsdp expert sequence tensor
    mesh = AbstractMesh((1, 1, 2, 1, 3, 4), sharding.MESH_AXES)
    rules = sharding.LOGICAL_AXIS_RULES
    # embed maps to fsdp x expert x sequence (outside the experts the expert axis shards like
    # fsdp, and so does sequence): a width of 48 splits over all three (2 x 1 x 3) ...
    assert sharding.mesh_spec(PartitionSpec("embed", "heads", "kv"), (48, 4, 8), mesh,
                               rules) == PartitionSpec(("fsdp", "expert", "sequence"), "tensor",
                                                       None)
    # ... one of 32 over the leading fsdp x expert that divide it, not over none.
    # 2 KV heads cannot split over tensor=4.
    fsdp = ("fsdp", "expert")
    assert sharding.mesh_spec(PartitionSpec("embed", "kv_heads", "kv"), (32, 2, 8), mesh,
                               rules) == PartitionSpec(fsdp, None, None)
    assert sharding.mesh_spec(PartitionSpec("embed", "heads", "kv"), (32, 4, 8), mesh,
                               rules) == PartitionSpec(fsdp, "tensor", None)
    # A vocabulary of 262 bytes does not split over 4 either.
    assert sharding.mesh_spec(PartitionSpec("vocab", "embed"), (262, 32), mesh,
                               rules) == PartitionSpec(None, fsdp)
    # A length of 16 does not split over sequence=3; 24 does.
    assert sharding.mesh_spec(PartitionSpec("activation_batch", "activation_length"), (8, 16),
                               mesh, rules) == PartitionSpec(("data", "fsdp", "expert"), None)
    assert sharding.mesh_spec(PartitionSpec("activation_batch", "activation_length"), (8, 24),
                               mesh, rules) == PartitionSpec(("data", "fsdp", "expert"), "sequence")


def test_constrain_is_a_no_op_without_a_mesh_and_rules():
    x = jnp.ones((2, 3, 4))
    assert sharding.constrain(x, sharding.ACTIVATIONS) is x


def test_initialize_distributed_checks_its_arguments():
    assert sharding.initialize_distributed() is False  # not on a multi-host TPU slice
    with pytest.raises(ValueError, match="expected num_processes and process_id too"):
        sharding.initialize_distributed("127.0.0.1:1234", num_processes=2)
    with pytest.raises(ValueError, match="process_id=2: expected 0 <= id < num_processes=2"):
        sharding.initialize_distributed("127.0.0.1:1234", num_processes=2, process_id=2)


def test_summary_reports_per_device_bytes_and_batch():
    config = configs.base_config()
    config.model.update(num_layers=1, d_model=16, num_heads=2, d_ff=32, vocab_size=32)
    from transformer.models import build_model

    model = build_model(config.model)
    optimizer = optim.make_optimizer(config)
    mesh = sharding.make_mesh(config.mesh)
    abstract, shardings, _ = state.initial_state(config, model, mesh, optimizer=optimizer)
    params = sum(x.size * 4 for x in jax.tree.leaves(abstract.params))
    assert sharding.bytes_per_device(abstract.params, shardings.params) == params
    text = sharding.summary(mesh, abstract, shardings, 16)
    assert "mesh data=1 x stage=1 x fsdp=1 x expert=1 x sequence=1 x tensor=1" in text
    assert "batch 16 global, 16 per data-parallel shard" in text


# --- 8 devices: every mesh trains like one device --------------------------------------------


def run_check(script: str, tmp_path_factory, timeout: float = TIMEOUT) -> dict:
    """Runs tests/`script` on 8 forced CPU devices with a fresh directory (forked: the device
    count is XLA's, read when the fork starts its backend); its JSON results."""
    result = forkserver.run([sys.executable, str(REPO / "tests" / script),
                             str(tmp_path_factory.mktemp(Path(script).stem))],
                            env=cli_env(8), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    return run_check("mesh_check.py", tmp_path_factory)


@pytest.mark.slow
def test_a_batch_the_data_parallel_size_does_not_divide_is_a_one_line_error(mesh_results):
    error = mesh_results["batch_error"]
    assert error is not None and "\n" not in error
    assert "batch_size=12" in error and "data-parallel size 8" in error, error


@pytest.mark.slow
def test_a_cpu_mesh_runs_many_streamed_steps_to_the_same_results(tmp_path_factory):
    """200 evaluation steps dispatched before any is read (tests/stream_check.py): under jaxlib
    0.10.2 XLA:CPU's collectives deadlocked past 32 in flight and the process aborted
    (placement.Synchronous runs those steps one at a time); one device never waits."""
    streamed = run_check("stream_check.py", tmp_path_factory)
    assert streamed == {"calls": 200, "alike": True, "single_waits": False}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8,1,1", "1,8,1", "2,2,2", "1,2,4"])
def test_each_mesh_gives_the_single_device_losses(mesh_results, mesh):
    single, sharded = mesh_results["single"], mesh_results[mesh]
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=2e-6)
    assert sharded["max_param_diff"] < 1e-5


@pytest.mark.slow
def test_each_token_mixer_trains_alike_on_a_data_fsdp_tensor_mesh(mesh_results):
    """A scanned, rematerialised hybrid stack with a layer of each mixer (mesh_check.MIXERS:
    Mamba 2, the short convolution, Gated DeltaNet, MLA) on data x fsdp x tensor: the single
    device's losses and each mixer's params, its heads split over `tensor`."""
    results = mesh_results["mixers"]
    assert sorted(results) == ["conv 2,2,2", "linear_attention 2,2,2", "mamba2 2,2,2",
                               "mla 2,2,2"]
    for name, result in results.items():
        np.testing.assert_allclose(result["losses"], result["single"], rtol=2e-5, err_msg=name)
        assert result["max_param_diff"] < 5e-5, name
        assert any("tensor" in spec for spec in result["specs"].values()), (name, result["specs"])


EMBED = ('fsdp', 'expert', 'sequence')  # the mesh axes of a param's `embed` dimension


@pytest.mark.slow
@pytest.mark.parametrize("mesh, name, spec, shard_shape, num_shards", [
    # embedding [vocab 64, embed 32]: vocab over tensor, embed over fsdp
    # (embed maps to fsdp x expert x sequence; expert and sequence are 1 here)
    ("8,1,1", "embedding", f"P('tensor', {EMBED})", [64, 32], 1),  # pure data parallel
    ("1,8,1", "embedding", f"P('tensor', {EMBED})", [64, 4], 8),
    ("1,8,1", "mlp_wi", f"P({EMBED}, 'tensor')", [4, 64], 8),
    ("2,2,2", "query", f"P({EMBED}, 'tensor', None)", [16, 2, 8], 4),
    ("1,2,4", "query", f"P({EMBED}, 'tensor', None)", [16, 1, 8], 8),
    ("1,2,4", "mlp_wi", f"P({EMBED}, 'tensor')", [16, 16], 8),
])
def test_params_are_sharded_by_the_rules(mesh_results, mesh, name, spec, shard_shape,
                                         num_shards):
    layout = mesh_results[mesh]["layout"][name]
    assert layout == {"spec": spec, "shard_shape": shard_shape, "num_shards": num_shards}


@pytest.mark.slow
def test_a_checkpoint_saved_on_one_mesh_continues_on_another(mesh_results):
    """Saved on 8 devices with fsdp=8, restored on 4 as data=2 x fsdp=2."""
    reshard = mesh_results["reshard"]
    assert reshard["devices"] == 4
    assert reshard["layout"]["embedding"]["shard_shape"] == [64, 16]  # 32 / fsdp 2
    np.testing.assert_allclose(reshard["losses"], reshard["uninterrupted"], rtol=2e-6)
    assert reshard["max_param_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2,2,2", "4,1,2", "2,2,2 sinks"])
def test_splash_runs_per_device_in_shard_map_and_matches_dense(mesh_results, mesh):
    """Packed causal rows with GQA (4 query heads, 2 KV heads): output and q/k/v gradients of
    the interpret-mode kernel, batch and heads split over the mesh, equal the dense reference;
    with attention sinks (split with the heads), their gradients too."""
    result = mesh_results["splash"][mesh]
    assert result["out_specs"] == ["(P(('data', 'fsdp', 'expert'), None, 'tensor', None),)"]
    assert result["max_diff"] < 1e-4


@pytest.mark.slow
def test_a_gpt_with_splash_on_a_mesh_matches_dense_on_one_device(mesh_results):
    assert mesh_results["splash"]["gpt_2,2,2"]["max_diff"] < 1e-5


# --- two processes ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Two gloo processes on CPU take ~0.4 s a step (one takes 25 ms): few steps, each kill still
# lands with a later checkpoint to come (the first is at 4, the last at STEPS).
STEPS = 12
RUN_FLAGS = [f"--config={REPO}/experiments/gpt_tiny.py", f"--config.steps={STEPS}",
             "--config.batch_size=8", "--config.seq_len=32", "--config.log_every=1",
             f"--config.eval_every={STEPS}",
             "--config.eval_steps=1", "--config.checkpoint_every=4",
             "--config.model.num_layers=2", "--config.model.d_model=32",
             "--config.model.num_heads=4", "--config.model.d_ff=64",
             "--config.mesh.data=2", "--config.mesh.fsdp=2",
             "--config.peak_flops_per_device=1e11"]


def start(workdir: Path, logs: Path, tag: str, *, processes: int, devices: int,
          flags: tuple[list[str], ...] = (), cwds: tuple[Path, ...] = ()
          ) -> list[subprocess.Popen]:
    """The run on `processes` processes of `devices` devices each; `flags`: process i's own
    extra flags; `cwds`: the directory each starts in (default: the repository)."""
    port = free_port()
    runs = []
    for i in range(processes):
        extra = [*(flags[i] if flags else [])] + ([] if processes == 1 else [
            f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
            f"--process_id={i}"])
        out = open(logs / f"{tag}-{i}.log", "w")  # noqa: SIM115
        runs.append(forkserver.Popen(
            [sys.executable, "-m", "transformer.train", *RUN_FLAGS, f"--workdir={workdir}",
             *extra], cwd=cwds[i] if cwds else REPO, env=cli_env(devices), stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL))
    return runs


def wait(runs: list[subprocess.Popen], logs: Path) -> None:
    for run in runs:
        try:
            code = run.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            for r in runs:
                r.kill()
            raise
        assert code == 0, "\n".join(p.read_text()[-3000:] for p in logs.iterdir())


def step_losses(workdir: Path) -> dict[int, float]:
    """The loss logged at each step (the last record wins: resumed steps are logged again)."""
    losses = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            losses[record["step"]] = record["loss"]
    return losses


def kill_after_first_checkpoint(runs: list[subprocess.Popen], workdir: Path, logs: Path) -> int:
    """kill -9 every process right after the run's first complete checkpoint; its step."""
    deadline = time.time() + TIMEOUT
    checkpoints = workdir / "checkpoints"
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert all(r.poll() is None for r in runs), "\n".join(
            p.read_text()[-3000:] for p in logs.iterdir())
        assert time.time() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    for run in runs:
        run.send_signal(signal.SIGKILL)
        run.wait()
    return max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_processes_started_with_other_settings_are_refused_before_anything_compiles(tmp_path):
    """Process 1 with another steps: each process built its own schedule, the two halves of
    the batch took different updates, and the run died at its end in a gloo "collective
    mismatch". Every process now stops at once, naming the setting."""
    logs = tmp_path / "logs"
    logs.mkdir()
    runs = start(tmp_path / "run", logs, "mismatch", processes=2, devices=2,
                 flags=([], [f"--config.steps={STEPS + 8}"]))
    for i, run in enumerate(runs):
        assert run.wait(TIMEOUT) == 2
        last = (logs / f"mismatch-{i}.log").read_text().strip().splitlines()[-1]
        assert last == (f"error: the processes were started differently (steps: process 0 "
                        f"{STEPS}, process 1 {STEPS + 8}): expected every process to run the "
                        "same command on the same data"), last
    assert not (tmp_path / "run").exists()  # the workdir this start made is removed


@pytest.mark.slow
def test_a_workdir_each_host_has_its_own_copy_of_is_refused_at_the_start(tmp_path):
    """--workdir=run on hosts whose "run" is each one's own disk (here: each process in its
    own directory): process 1 never saw process 0's checkpoints and waited on them until a
    timeout. Every process now stops at once, saying the workdir is not shared."""
    logs = tmp_path / "logs"
    logs.mkdir()
    hosts = (tmp_path / "host0", tmp_path / "host1")
    for host in hosts:
        host.mkdir()
    runs = start(Path("run"), logs, "unshared", processes=2, devices=2, cwds=hosts)
    for i, run in enumerate(runs):
        assert run.wait(TIMEOUT) == 2
        last = (logs / f"unshared-{i}.log").read_text().strip().splitlines()[-1]
        assert last == ("error: workdir=run: process 1 does not see the train.lock process 0 "
                        "holds there (a directory of its own host's?): expected a workdir every "
                        "process shares (a gs:// bucket, or a filesystem every host mounts)"), last


@pytest.mark.slow
def test_a_run_resumes_on_another_process_count_like_one_uninterrupted_run(tmp_path):
    """Saved by 2 processes, resumed by 1 (and 1 -> 2), on the same 4 devices: the data
    position is one global batch index, so the resumed run reads the same global batches and
    logs the uninterrupted run's losses."""
    logs = tmp_path / "logs"
    logs.mkdir()
    single = tmp_path / "single"
    reference = start(single, logs, "single", processes=1, devices=4)
    expected = None
    for before, after in ((2, 1), (1, 2)):
        workdir = tmp_path / f"{before}to{after}"
        per_process = 4 // before
        killed_at = kill_after_first_checkpoint(
            start(workdir, logs, f"first-{before}", processes=before, devices=per_process),
            workdir, logs)
        assert killed_at < STEPS
        wait(start(workdir, logs, f"resumed-{after}", processes=after, devices=4 // after),
             logs)
        if expected is None:
            wait(reference, logs)
            expected = step_losses(single)
        resumed = step_losses(workdir)
        assert sorted(resumed) == sorted(expected) == list(range(1, STEPS + 1))
        np.testing.assert_allclose([resumed[s] for s in range(1, STEPS + 1)],
                                   [expected[s] for s in range(1, STEPS + 1)], rtol=2e-6)
        # Process 0 alone writes the logs and the summary.
        assert json.loads((workdir / "summary.json").read_text())["step"] == STEPS
        log_text = (logs / f"resumed-{after}-0.log").read_text()
        assert f"steps {killed_at}..{STEPS}" in log_text
        assert (f"mesh data=2 x stage=1 x fsdp=2 x expert=1 x sequence=1 x tensor=1 (4 devices, "
                f"{after} process(es))") in log_text
        assert "batch 8 global, 2 per data-parallel shard" in log_text
        if after == 2:
            assert "steps" not in (logs / "resumed-2-1.log").read_text()  # process 1 is quiet


def test_a_process_whose_coordinator_is_not_listening_says_so_in_one_line(monkeypatch, capsys):
    """Process 1 pointed at an address nobody listens on waited 5 minutes in silence, then
    aborted with a C++ trace ("another task died"). It now says it is waiting, then stops
    with one line."""
    monkeypatch.setattr(sharding, "COORDINATOR_WAIT_S", 0.3)
    monkeypatch.setattr(sharding, "COORDINATOR_NOTICE_S", 0.1)
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # (not gloo in this process)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: pytest.fail("initialized"))
    port = free_port()  # closed again: nothing listens there
    with pytest.raises(ConnectionError) as error:
        sharding.initialize_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=1)
    assert str(error.value) == (f"coordinator_address=127.0.0.1:{port}: nothing listening after "
                                "0.3 s: expected process 0 to be started with the same address")
    assert capsys.readouterr().err == (f"waiting for process 0 to listen at coordinator_address="
                                       f"127.0.0.1:{port} (at most 0.3 s)\n")


def test_processes_with_other_device_counts_are_refused_in_one_line(monkeypatch):
    """Process 0 with 2 devices, process 1 with 3: the first collective failed with "cannot
    reshape array of size 5 into shape (2,2)"."""
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: None)
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(process_index=p)
                                                 for p in (0, 0, 1, 1, 1)])
    with pytest.raises(ValueError) as error:
        sharding.initialize_distributed("127.0.0.1:1234", num_processes=2, process_id=0)
    assert str(error.value) == ("process 0 has 2 devices, process 1 has 3: expected the same "
                                "count on every process")


def test_a_start_up_check_one_process_fails_is_raised_on_every_process(monkeypatch):
    """startup.agreed, as process 0 of two sees it: its own check passed, process 1's did
    not; every process raises process 1's line (a usage error stays one: status 2)."""
    from transformer.training import startup

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    shared = []
    monkeypatch.setattr(startup, "_allgather_text", lambda text: shared.append(text) or [
        text, "usage /data/x.txt: no such file or directory"])
    with pytest.raises(ValueError) as error:
        startup.agreed(lambda path: path, "data.txt")
    assert shared == [""]  # this process's check passed
    assert str(error.value) == ("process 1 failed its start-up checks: /data/x.txt: no such "
                                "file or directory")
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # one process: the check itself
    assert startup.agreed(lambda path: path, "data.txt") == "data.txt"


def test_a_process_interrupted_in_a_start_up_check_tells_the_others(monkeypatch):
    """A Ctrl-C in one process's check (hosts started by hand): it shares that it stopped, then
    goes on with its interrupt; the others raise one line naming it (they failed in a gloo
    timeout, then a C++ abort, saying nothing of process 1)."""
    from transformer.training import startup

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    shared = []
    monkeypatch.setattr(startup, "_allgather_text", lambda text: shared.append(text) or [
        "", "interrupted -"])

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        startup.agreed(interrupted)
    assert shared == ["interrupted -"]
    with pytest.raises(RuntimeError, match=r"^process 1 was interrupted during its start-up "
                                           r"checks$"):
        startup.agreed(lambda: None)


@pytest.mark.slow
def test_one_process_failing_a_start_up_check_stops_every_process(tmp_path):
    """Process 1 given a data path that does not exist printed its error and never exited:
    process 0 waited for it in its next collective, and it for process 0 in jax.distributed's
    shutdown, for ever. Every process now stops, naming process 1's error."""
    logs = tmp_path / "logs"
    logs.mkdir()
    missing = tmp_path / "missing.txt"
    runs = start(tmp_path / "run", logs, "nodata", processes=2, devices=2,
                 flags=([], [f"--config.data.path={missing}"]))
    for i, run in enumerate(runs):
        try:
            code = run.wait(120)
        except subprocess.TimeoutExpired:
            for r in runs:
                r.kill()
            raise
        last = (logs / f"nodata-{i}.log").read_text().strip().splitlines()[-1]
        assert code == 2 and last == (
            f"error: process 1 failed its start-up checks: {missing}: no such file or "
            "directory, and no file matches it as a glob pattern"), (code, last)
    assert not (tmp_path / "run").exists()  # the workdir this start made is removed
