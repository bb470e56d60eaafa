"""Batched seeds (transformer.batched): a variant's seed runs trained as one program equal the
same runs trained one after another, bit for bit on one device (losses, validation windows,
params; to 1e-6 on a mesh, under the suite's -O0 flags, and for the params with
max_grad_norm > 0), also
after a kill -9 left the seeds at different steps; a seed that turns NaN stops alone; a group
whose configs differ in more than the seed is refused. The sweep's --batched_seeds through the
CLI, with a real kill -9 and a mesh, is in the slow tier.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import forkserver
import jax
import jaxlib
import numpy as np
import pytest
from test_layers import XLA_FUSIONS

from transformer import batched, train
from transformer.configs import base_config
from transformer.parallel.sharding import MESH_AXIS_TABLE
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import evaluation

MESH_AXES = tuple(axis.name for axis in MESH_AXIS_TABLE)

REPO = Path(__file__).resolve().parents[1]
SEEDS = 3
# Fields that time the run: the only ones a batched run's records may differ in.
TIMING = {"elapsed", "step_time", "tokens_per_s", "mfu", "hfu"}


def seed_config(seed: int, steps: int = 6, **overrides):
    """A tiny GPT with dropout and clipping: every random and stateful piece of the step."""
    config = base_config()
    config.experiment = f"batched/seed_{seed}"
    # MFU against a fixed peak: no CPU measurement at every start (tests/test_metrics.py)
    config.update(seed=seed, steps=steps, batch_size=2, seq_len=16, log_every=1, eval_every=3,
                  eval_steps=2, checkpoint_every=2, keep_checkpoints=3,
                  peak_flops_per_device=1e11)
    config.update(**overrides)
    config.model.update(num_layers=1, d_model=32, num_heads=2, d_ff=64, max_len=16,
                        dropout_rate=0.1)
    return config


@pytest.fixture(autouse=True, scope="module")
def threefry():
    """JAX's default PRNG (tests/conftest.py sets the cheaper rbg, which batched seeds refuse:
    its bits under vmap differ from a separate run's)."""
    previous = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "threefry2x32")
    yield
    jax.config.update("jax_default_prng_impl", previous)


def records(workdir: Path) -> list[dict]:
    """metrics.jsonl without its timing fields."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def final_params(workdir: Path):
    """The newest checkpoint's params on this process's first device (whatever the run's mesh)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)),
                             MESH_AXES)
    return checkpoint_lib.restore_params(str(workdir), mesh=mesh).params


def assert_same_runs(separate: Path, together: Path, seeds=range(SEEDS), exact: bool = False):
    """Every record, the validation windows, the final params and the summary equal: bit for
    bit with `exact`, else to 1e-6. In-process tests compile with the suite's -O0 XLA flags
    (tests/conftest.py), under which the vmapped gradients' reductions may round an ulp apart;
    the CLI tests compile as users do, and compare bit for bit."""
    def same(a, b):
        if isinstance(a, list):  # a record's or summary's values: compare the numbers
            assert [v for v in a if not isinstance(v, float)] == \
                [v for v in b if not isinstance(v, float)]
            a, b = ([v for v in x if isinstance(v, float)] for x in (a, b))
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    for k in seeds:
        a, b = separate / f"seed_{k}", together / f"seed_{k}"
        ra, rb = records(a), records(b)
        assert [(r["step"], r["split"], sorted(r)) for r in ra] == \
            [(r["step"], r["split"], sorted(r)) for r in rb], k
        for x, y in zip(ra, rb, strict=True):
            same([x[key] for key in sorted(x)], [y[key] for key in sorted(x)])
        wa, wb = evaluation.load_windows(str(a)), evaluation.load_windows(str(b))
        assert wa["fingerprint"] == wb["fingerprint"] and wa["step"] == wb["step"]
        for key in ("loss_sum", "num_tokens"):
            same(wa[key], wb[key])
        jax.tree.map(same, final_params(a), final_params(b))
        summary_a, summary_b = ({k: v for k, v in json.loads((d / "summary.json").read_text())
                                 .items() if k not in TIMING and "seconds" not in k
                                 and k != "goodput"}  # the breakdown of its wall time
                                for d in (a, b))
        assert sorted(summary_a) == sorted(summary_b), k
        same([summary_a[key] for key in sorted(summary_a)],
             [summary_b[key] for key in sorted(summary_a)])


@pytest.fixture(scope="module")
def separate(tmp_path_factory) -> Path:
    """The seeds trained one after another, as `transformer.sweep --seeds` does."""
    root = tmp_path_factory.mktemp("separate")
    for k in range(SEEDS):
        train.train_and_evaluate(seed_config(k), str(root / f"seed_{k}"))
    return root


@pytest.mark.slow
def test_batched_seeds_equal_separate_runs_bit_for_bit(separate, tmp_path):
    results = batched.train_seeds([seed_config(k) for k in range(SEEDS)],
                                  [str(tmp_path / f"seed_{k}") for k in range(SEEDS)])
    assert [r["summary"]["step"] for r in results] == [6] * SEEDS
    assert_same_runs(separate, tmp_path)
    # The seeds differ from one another (each its own init, data and dropout).
    losses = [records(tmp_path / f"seed_{k}")[0]["loss"] for k in range(SEEDS)]
    assert len(set(losses)) == SEEDS
    # A finished group is skipped, its files untouched.
    before = (tmp_path / "seed_1" / "metrics.jsonl").read_text()
    again = batched.train_seeds([seed_config(k) for k in range(SEEDS)],
                                [str(tmp_path / f"seed_{k}") for k in range(SEEDS)])
    assert [r["state"] for r in again] == [None] * SEEDS
    assert (tmp_path / "seed_1" / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_the_profilers_start_and_stop_are_outside_every_seeds_timed_steps(tmp_path,
                                                                          monkeypatch):
    """As in a single run (tests/test_train.py): the trace's start and stop (made 1.5 s slower
    each here) are pauses, so no seed's tok/s window holds them."""
    profiler = {name: getattr(jax.profiler, name) for name in ("start_trace", "stop_trace")}
    for name, call in profiler.items():
        monkeypatch.setattr(jax.profiler, name, lambda *args, call=call: (
            time.sleep(1.5), call(*args))[1])
    configs = [seed_config(k, steps=7, eval_every=100, checkpoint_every=100)
               for k in range(2)]
    for config in configs:
        config.profile.update(start_step=3, num_steps=2)  # started in step 3, stopped after 4
    batched.train_seeds(configs, [str(tmp_path / f"seed_{k}") for k in range(2)])
    for k in range(2):
        lines = (tmp_path / f"seed_{k}" / "metrics.jsonl").read_text().splitlines()
        timed = [r for r in map(json.loads, lines) if r["split"] == "train" and "step_time" in r]
        assert [r["step"] for r in timed] == [2, 5, 6, 7]  # the windows restart after 3 and 4
        assert max(r["step_time"] for r in timed) < 0.75, timed


@pytest.mark.slow
def test_every_seeds_clock_leaves_out_the_other_seeds_setups(tmp_path, monkeypatch):
    """The seeds are set up one after another (each made 2 s slower here), then train in one
    program: every seed's `elapsed` at a step is the same (to the writes' own spread), and its
    goodput start-up is its own setup, not the later seeds' as well."""
    own, setup = [], train.setup

    def slow_setup(*args, **kwargs):
        began = time.perf_counter()
        run = setup(*args, **kwargs)
        time.sleep(2.0)  # after the run's metrics log opened
        own.append(time.perf_counter() - began)
        return run

    monkeypatch.setattr(train, "setup", slow_setup)
    configs = [seed_config(k, steps=2, eval_every=100, checkpoint_every=100) for k in range(2)]
    batched.train_seeds(configs, [str(tmp_path / f"seed_{k}") for k in range(2)])
    # Each record's `elapsed` is read when it is written, one seed after another (0.21 s apart
    # under CI load at the last step, whose log also fetches and checks): within half the 2 s
    # that a clock keeping another seed's setup would add. The validation records come after
    # the seeds before them were evaluated, so the train records are compared.
    elapsed = [{r["step"]: r["elapsed"] for r in map(json.loads, (
        tmp_path / f"seed_{k}" / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "train"} for k in range(2)]
    summaries = [json.loads((tmp_path / f"seed_{k}" / "summary.json").read_text())
                 for k in range(2)]
    assert sorted(elapsed[0]) == sorted(elapsed[1]) == [1, 2]
    for step in (1, 2):
        assert abs(elapsed[0][step] - elapsed[1][step]) < 1.0, elapsed
    assert abs(summaries[0]["elapsed"] - summaries[1]["elapsed"]) < 1.0
    for k in range(2):  # the setup it was charged is its own (2 s of seed 1's: not seed 0's)
        startup = summaries[k]["goodput"]["startup_seconds"]
        assert own[k] - 0.01 < startup < own[k] + 1.0, (k, startup, own)


@pytest.mark.slow
def test_a_resume_after_kill_catches_the_seeds_behind_up_first(separate, tmp_path):
    """A kill -9 during saves leaves seed 1 at step 2 and seed 2 at step 4 while seed 0
    finished: seed 1 trains alone to step 4 (the others masked), then 1 and 2 together."""
    dirs = [tmp_path / f"seed_{k}" for k in range(SEEDS)]
    for k, directory in enumerate(dirs):
        shutil.copytree(separate / f"seed_{k}", directory)
    for directory, newest in ((dirs[1], 2), (dirs[2], 4)):
        for step in (4, 6):
            if step > newest:
                shutil.rmtree(directory / "checkpoints" / str(step))
        for name in ("summary.json", "val_windows.npz"):
            (directory / name).unlink()
    results = batched.train_seeds([seed_config(k) for k in range(SEEDS)], [str(d) for d in dirs])
    assert results[0]["state"] is None  # finished: skipped
    assert [r["summary"]["step"] for r in results] == [6] * SEEDS
    assert_same_runs(separate, tmp_path)


@pytest.mark.slow
def test_a_seed_that_turns_nan_stops_alone(separate, tmp_path):
    """max_grad_norm between the seeds' largest gradient norms: only the seed above it stops,
    with the message and set-aside checkpoints a separate run gives; the others finish."""
    # The norms the seeds reach together: the separate runs' (bit for bit, tested above).
    probe = [separate / f"seed_{k}" for k in range(SEEDS)]
    peaks = [max(r["grad_norm"] for r in records(p) if r["split"] == "train") for p in probe]
    bad = int(np.argmax(peaks))
    limit = (peaks[bad] + max(p for k, p in enumerate(peaks) if k != bad)) / 2
    configs = [seed_config(k, max_grad_norm=limit) for k in range(SEEDS)]
    dirs = [tmp_path / "together" / f"seed_{k}" for k in range(SEEDS)]
    results = batched.train_seeds(configs, [str(d) for d in dirs])
    assert isinstance(results[bad], FloatingPointError)
    for k in set(range(SEEDS)) - {bad}:
        assert results[k]["summary"]["step"] == 6
        assert records(dirs[k])[-1]["split"] == "validation"
    assert not (dirs[bad] / "summary.json").exists()
    alone = tmp_path / "alone"
    with pytest.raises(FloatingPointError) as error:
        train.train_and_evaluate(configs[bad], str(alone))
    assert str(results[bad]) == str(error.value).replace(str(alone), str(dirs[bad]))
    assert records(dirs[bad]) == records(alone)


@pytest.mark.slow
def test_batched_steps_give_separate_steps_perplexity_bit_for_bit_with_clipping(tmp_path):
    """Three seeds (XLA's CPU exp of a [3] vector rounds an ulp apart from its scalar exp) with
    global-norm clipping and the explosion check (max_grad_norm), compiled as users do (a
    subprocess without the suite's -O0 flags, under which the vector exp rounds as the scalar
    one): each seed's loss, grad norm and perplexity equal a separate run's step's bit for bit;
    the params to 1e-6 (the explosion check's select fuses differently inside the group's
    per-seed update: docs/ablations.md#batched-seeds)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "tests")))}
    code = ("import sys, jax, test_batched as t; "
            "jax.config.update('jax_default_prng_impl', 'threefry2x32'); "
            "t.compare_steps(__import__('pathlib').Path(sys.argv[1]))")
    result = forkserver.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compared 3 seeds" in result.stdout


def compare_steps(tmp_path: Path) -> None:
    """The comparison above, in this process (see its docstring)."""
    configs = [seed_config(k, max_grad_norm=1e3) for k in range(SEEDS)]
    for config in configs:
        config.compiler_options = XLA_FUSIONS
        config.optimizer.update(grad_clip_norm=0.1, warmup_steps=1)  # clipping at every step
    runs = [train.setup(c, str(tmp_path / f"seed_{k}")) for k, c in enumerate(configs)]
    try:
        steps, exp = 4, jax.jit(jax.numpy.exp)
        batches = [[r.placement.global_batch(next(r.train_data)) for _ in range(steps)]
                   for r in runs]
        alone = []
        for k, run in enumerate(runs):
            state, logged = jax.tree.map(jax.numpy.copy, run.state), []
            for batch in batches[k]:
                state, metrics = run.train_step(state, batch)
                logged.append(metrics)
            alone.append((state.params, logged))
        group = batched.Group(runs)
        together = [group.train([b[i] for b in batches], np.ones(SEEDS, bool))[0]
                    for i in range(steps)]
        for k in range(SEEDS):
            for i in range(steps):
                mine, theirs = ({key: np.asarray(m[key]) for key in ("loss", "grad_norm")}
                                for m in (alone[k][1][i], jax.tree.map(lambda x, k=k: x[k],
                                                                       together[i])))
                np.testing.assert_allclose(list(mine.values()), list(theirs.values()),
                                           rtol=1e-6)
                # a separate run's perplexity is the scalar exp of its loss: so is each seed's
                assert np.asarray(together[i]["perplexity"][k]) == exp(theirs["loss"]), (k, i)
                if i < 2:  # the params are still equal: the metrics are, bit for bit
                    assert mine == theirs and np.asarray(alone[k][1][i]["perplexity"]) == \
                        np.asarray(together[i]["perplexity"][k]), (k, i)
            assert alone[k][1][-1]["grad_norm"] > 0.1  # clipped
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
                         alone[k][0], group.take(k).params)
    finally:
        for run in runs:
            batched._close(run)
            run.lock.release(failed=True)
    print(f"compared {SEEDS} seeds")


def test_a_group_must_differ_only_in_seed(tmp_path):
    configs = [seed_config(0), seed_config(1, batch_size=4)]
    with pytest.raises(ValueError) as error:
        batched.train_seeds(configs, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert str(error.value) == ("batched seeds: config key 'batch_size' is 2 in one seed run "
                                "and 4 in another: expected runs that differ only in seed")
    assert not (tmp_path / "a").exists()
    jax.config.update("jax_default_prng_impl", "rbg")
    try:
        with pytest.raises(ValueError, match=r"^batched seeds: jax_default_prng_impl='rbg' "
                           r"draws other random bits .* expected 'threefry2x32'"):
            batched.train_seeds([seed_config(0), seed_config(1)],
                                [str(tmp_path / "a"), str(tmp_path / "b")])
    finally:
        jax.config.update("jax_default_prng_impl", "threefry2x32")


# --- through the CLI ------------------------------------------------------------------------

EXPERIMENT = textwrap.dedent("""
    from transformer import sweep
    from transformer.configs import base_config


    def get_config():
        config = base_config()
        config.experiment = "batched"
        config.update(steps=24, batch_size=2, seq_len=16, log_every=1, eval_every=12,
                      eval_steps=2, checkpoint_every=4, keep_checkpoints=2)
        config.model.update(num_layers=1, d_model=32, num_heads=2, d_ff=64, max_len=16,
                            dropout_rate=0.1)
        return config


    def get_sweep():
        return sweep.axis("model.position", ["rope", "alibi"])


    def get_seeds():
        return 2
""")


def run_sweep(*args: str, devices: int | None = None, wait: bool = True):
    """The sweep CLI, compiling as users do (without the suite's -O0 flags)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}" if devices else ""}
    command = [sys.executable, "-m", "transformer.sweep", *args]
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return forkserver.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_batched_seeds_through_the_cli_survive_kill_9(tmp_path):
    """Bit for bit with Eigen's dots and XLA's own fusions under jaxlib 0.10 / 0.11: the float32
    CPU default's YNNPACK fusions round the vmapped gradients' reductions an ulp apart from a
    separate run's, and so does jaxlib 0.12 with XLA's own fusions (the grad norm from step 2,
    the params 7e-7 apart after 24 steps; 2026-12-04), where the runs agree to 1e-6."""
    experiment = tmp_path / "batched.py"
    assert "    return config\n" in EXPERIMENT
    experiment.write_text(EXPERIMENT.replace("    return config\n", "    config.compiler_options = "
                                             f"{XLA_FUSIONS}\n    return config\n"))
    only = "--only=position=rope"  # one variant: the group logic is the in-process tests'
    separate = run_sweep(f"--config={experiment}", f"--workdir={tmp_path / 'separate'}", only)
    assert separate.returncode == 0, separate.stdout[-3000:] + separate.stderr[-3000:]
    together = tmp_path / "together"
    args = [f"--config={experiment}", f"--workdir={together}", "--batched_seeds", only]
    process = run_sweep(*args, wait=False)
    checkpoints = together / "position=rope" / "seed_1" / "checkpoints"
    deadline = time.time() + 300
    while not (checkpoints.exists() and any(p.name.isdigit() and int(p.name) >= 8
                                            for p in checkpoints.iterdir())):
        assert process.poll() is None and time.time() < deadline, process.stdout.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = run_sweep(*args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "position=rope/seed_0: resuming in" in resumed.stdout
    assert "seed 1: batched seeds: seeds [0, 1] train in one program" in resumed.stdout
    assert_same_runs(tmp_path / "separate" / "position=rope", together / "position=rope",
                     range(2), exact=jaxlib.version.__version_info__ < (0, 12))
    assert "position=rope" in (together / "report.md").read_text()


@pytest.mark.slow
def test_batched_seeds_on_a_mesh_equal_separate_runs(tmp_path):
    """fsdp=2 x data=2 on 4 CPU devices: the seed axis is unsharded, each seed's params and
    rows shard as a separate run's. Equal to 1e-6, not bit for bit: the vmapped gradients'
    cross-device reductions round differently."""
    experiment = tmp_path / "batched.py"
    experiment.write_text(EXPERIMENT.replace("steps=24", "steps=6").replace(
        "batch_size=2", "batch_size=4"))
    mesh = ["--config.mesh.fsdp=2", "--config.mesh.data=2", "--only=position=rope"]
    for name, extra in (("separate", []), ("together", ["--batched_seeds"])):
        result = run_sweep(f"--config={experiment}", f"--workdir={tmp_path / name}", *mesh,
                           *extra, devices=4)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fsdp=2" in result.stdout
    assert_same_runs(tmp_path / "separate" / "position=rope",
                     tmp_path / "together" / "position=rope", range(2))


def test_the_benchmark_passes_losses_an_ulp_apart_and_fails_beyond_its_tolerance():
    import importlib.util
    spec = importlib.util.spec_from_file_location("batched_seeds_benchmark",
                                                  REPO / "benchmarks" / "batched_seeds.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # (defines no flags: they are defined at run time)
    same = [[3.5, 3.2246161], [3.4, 3.1]]
    assert bench.compare_losses(same, [list(r) for r in same]) == ("equal bit for bit", True)
    ulp = [[3.5, 3.2246169], [3.4, 3.1]]  # seed 0's validation loss on YNNPACK
    text, ok = bench.compare_losses(same, ulp)
    assert ok and text.startswith("not bitwise equal, within 1e-05")
    assert not bench.compare_losses(same, [[3.5, 3.3], [3.4, 3.1]])[1]
    assert not bench.compare_losses(same, [[3.5, float("nan")], [3.4, 3.1]])[1]
    assert not bench.compare_losses(same, [[3.5], [3.4, 3.1]])[1]
