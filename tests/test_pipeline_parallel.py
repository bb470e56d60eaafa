"""Pipeline parallelism (transformer.parallel.pipeline_parallel, mesh axis `stage`).

Fast: the schedule itself (GPipe and circular) against running the layers in order, on one
device; the one-line refusals. Slow: tests/pipeline_check.py on 8 forced CPU devices (every mesh
against one device, losses and params), and a checkpoint written at stage=4 resumed through the
CLI at stage=1 and at stage=2 x data=2.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import cli_env, tiny_flags

from transformer import configs
from transformer.parallel import pipeline_parallel

REPO = Path(__file__).resolve().parent.parent


def toy_layers(groups: int, width: int = 4):
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.standard_normal((groups, width, width)) / width**0.5,
                             jnp.float32),
            "b": jnp.asarray(rng.standard_normal((groups, width)), jnp.float32)}


def toy_stage(params, x_bTD, args, key):
    """Layers tanh(x W + b + shift): `args` (a per-row shift [B, 1, 1] and a shared one) must
    reach every microbatch's rows; aux: each layer's mean output (mean over the layers)."""
    row_shift, shared = args

    def layer(x, p):
        y = jnp.tanh(x @ p["w"] + p["b"] + row_shift + shared)
        return y, jnp.mean(y)

    y, means = jax.lax.scan(layer, x_bTD, params)
    return y, {"mean": jnp.mean(means)}


def in_order(params, x, args):
    """The reference: every layer on the whole batch, in order; aux over layers and rows."""
    row_shift, shared = args
    means = []
    for g in range(params["w"].shape[0]):
        x = jnp.tanh(x @ params["w"][g] + params["b"][g] + row_shift + shared)
        means.append(jnp.mean(x))
    return x, jnp.mean(jnp.stack(means))


@pytest.mark.parametrize("stages, microbatches, repeats", [
    (2, 1, 1), (4, 4, 2), pytest.param(4, 2, 1, marks=pytest.mark.slow),
    pytest.param(2, 4, 3, marks=pytest.mark.slow)])
def test_the_schedule_applies_every_layer_in_order_to_every_microbatch(stages, microbatches,
                                                                       repeats):
    groups = stages * repeats * 2
    params = toy_layers(groups)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 3, 4)), jnp.float32)
    args = (jnp.asarray(rng.standard_normal((8, 1, 1)), jnp.float32), jnp.float32(0.25))
    want, want_mean = in_order(params, x, args)

    def loss(params, x):
        y, aux = pipeline_parallel.run(toy_stage, params, x, args, stages=stages,
                                       microbatches=microbatches, repeats=repeats)
        return jnp.sum(y**2), (y, aux)

    (_, (got, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params, x)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # each microbatch's mean over its rows, averaged: the batch's (equal microbatches)
    np.testing.assert_allclose(aux["mean"], want_mean, atol=1e-6)
    want_grads = jax.grad(lambda p: jnp.sum(in_order(p, x, args)[0] ** 2))(params)
    for name in params:
        np.testing.assert_allclose(grads[name], want_grads[name], atol=1e-5)


def test_the_bubble_fraction_line():
    assert pipeline_parallel.bubble_fraction(4, 4) == 3 / 7
    assert pipeline_parallel.bubble_fraction(4, 4, 2) == 3 / 11
    assert pipeline_parallel.describe(1, 4, 1) == ""
    assert pipeline_parallel.describe(4, 8, 2) == (
        "pipeline: 4 stages, 8 microbatches (circular, 2 repeats), bubble 15.8% = "
        "(S-1)/(M*R+S-1)")


def pipeline_config(**overrides):
    config = configs.base_config()
    config.update(batch_size=16, seq_len=16)
    config.model.update(num_layers=4, d_model=32, num_heads=4, d_ff=64, scan_layers=True)
    config.mesh.update(data=1, stage=2)
    config.update_from_flattened_dict(overrides)
    return config


@pytest.mark.parametrize("overrides, message", [
    ({"model.num_layers": 6, "mesh.stage": 4}, "mesh.stage=4 x pipeline.repeats=1: expected "
                                                "their product to divide the 6 scanned layer "
                                                "groups"),
    ({"model.num_layers": 6, "model.moe.num_experts": 2, "model.moe.every_n_layers": 2},
     "divide the 3 scanned layer groups"),
    ({"pipeline.repeats": 4}, "mesh.stage=2 x pipeline.repeats=4: expected their product to "
                              "divide the 4 scanned layer groups"),
    ({"pipeline.microbatches": 3}, "pipeline.microbatches=3: expected a divisor of the 16 rows "
                                   "each data-parallel shard gets"),
    ({"pipeline.microbatches": 16, "optimizer.grad_accumulation_steps": 2},
     "pipeline.microbatches=16: expected a divisor of the 8 rows"),
    ({"pipeline.repeats": 2}, "pipeline.microbatches=1 with pipeline.repeats=2: expected "
                              "microbatches >= mesh.stage=2"),
    ({"pipeline.microbatches": 0}, "pipeline.microbatches=0: expected an int >= 1"),
    ({"model.scan_layers": False}, "mesh.stage=2: expected model.scan_layers=True"),
    ({"model.family": "bert"}, "pipeline parallelism supports model.family gpt or prefix_lm, "
                               "not 'bert'"),
    ({"model.family": "t5"}, "not 't5'"),
    ({"model.position": "alibi"}, "mesh.stage=2 with model.position='alibi'"),
    ({"mesh.sequence": 2, "mesh.stage": 2}, "mesh.stage=2 with mesh.sequence=2"),
])
def test_a_pipeline_that_cannot_run_is_a_one_line_error(overrides, message):
    config = pipeline_config(**overrides)
    devices = config.mesh.stage * config.mesh.sequence
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        configs.validate_config(config, num_devices=devices)
    assert "\n" not in str(error.value)


def test_a_schedule_that_runs_passes_validation():
    configs.validate_config(pipeline_config(**{"pipeline.microbatches": 4,
                                               "pipeline.repeats": 2}), num_devices=2)
    configs.validate_config(pipeline_config(**{"mesh.stage": 1, "model.scan_layers": False,
                                               "model.family": "bert"}), num_devices=1)


# --- 8 devices ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    result = subprocess.run([sys.executable, str(REPO / "tests" / "pipeline_check.py"),
                             str(tmp_path_factory.mktemp("pipeline_check"))],
                            env=cli_env(8), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


MESHES = ["stage=2", "stage=4", "stage=2 x data=2 x fsdp=2", "stage=2 x tensor=4",
          "stage=4 x data=2", "stage=2 x data=2 x fsdp=2, circular",
          "stage=2 x fsdp=2 x tensor=2, circular", "stage=4, circular",
          "stage=2 x fsdp=2, circular, remat dots",
          "stage=2 x data=2, accumulation 2, remat"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_each_pipeline_mesh_gives_the_single_device_losses_and_params(mesh_results, mesh):
    got, want = mesh_results[mesh], mesh_results["single"]
    np.testing.assert_allclose(got["losses"], want["losses"], atol=1e-5, rtol=0)
    assert got["max_param_diff"] < 1e-5
    assert got["stage_sharded"], got  # the layer params live split over the stages


@pytest.mark.slow
def test_a_pipelined_moe_trains_like_one_device(mesh_results):
    got, want = mesh_results["moe stage=2 x expert=2"], mesh_results["moe single"]
    np.testing.assert_allclose(got["losses"], want["losses"], atol=1e-5, rtol=0)
    assert got["max_param_diff"] < 1e-5


@pytest.mark.slow
def test_dropout_trains_under_the_pipeline(mesh_results):
    """Dropout draws its masks per (iteration, stage), not as one device does: the losses are
    finite, near those without dropout, and not equal to them (the masks apply)."""
    losses = np.array(mesh_results["dropout stage=2"]["losses"][:3])
    without = np.array(mesh_results["stage=2"]["losses"])
    assert np.all(np.isfinite(losses)) and np.all(np.abs(losses - without) < 0.1)
    assert np.all(np.abs(losses - without) > 1e-5)


@pytest.mark.slow
def test_a_stage_4_checkpoint_resumes_at_stage_1_and_at_stage_2_x_data_2(tmp_path):
    # (a constant schedule after warmup: a 2-step run's learning rates are a 4-step run's)
    model = ["--config.model.num_layers=4", "--config.model.scan_layers=True",
             "--config.batch_size=8", "--config.optimizer.decay=constant"]
    flags = [f for f in tiny_flags(4, checkpoint_every=2)
             if not f.startswith(("--config.model.num_layers", "--config.batch_size"))]

    def train(workdir, steps, mesh):
        result = subprocess.run(
            [sys.executable, "-m", "transformer.train", "--config=experiments/gpt_tiny.py",
             f"--workdir={workdir}", *flags, *model, f"--config.steps={steps}", *mesh],
            cwd=REPO, env=cli_env(8), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    stage4 = ["--config.mesh.data=2", "--config.mesh.stage=4",
              "--config.pipeline.microbatches=4"]
    first = train(tmp_path / "stage4", 2, stage4)
    assert "pipeline: 4 stages, 4 microbatches (GPipe), bubble 42.9%" in first
    assert re.search(r"step 2/2 loss .* ms/step", first)
    meshes = {"stage1": ["--config.mesh.data=-1"],
              "stage2_data2": ["--config.mesh.data=2", "--config.mesh.stage=2",
                               "--config.mesh.fsdp=2", "--config.pipeline.microbatches=2"]}
    for name in meshes:  # the 2-step stage=4 run, trained once
        shutil.copytree(tmp_path / "stage4", tmp_path / name, symlinks=True)
    train(tmp_path / "stage4", 4, stage4)  # the reference: resumed on the same mesh
    want = losses(tmp_path / "stage4")
    for name, mesh in meshes.items():
        workdir = tmp_path / name
        log = train(workdir, 4, mesh)
        assert "steps 2..4" in log
        np.testing.assert_allclose(losses(workdir), want, atol=1e-5, rtol=0)


def losses(workdir: Path) -> list[float]:
    """Each step's train loss from the run's metrics (the resumed run's win for a step)."""
    by_step = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train":
            by_step[record["step"]] = record["loss"]
    return [by_step[s] for s in sorted(by_step)]
