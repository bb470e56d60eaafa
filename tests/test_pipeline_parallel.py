"""Pipeline parallelism (transformer.parallel.pipeline_parallel, mesh axis `stage`).

Fast: the schedule itself (GPipe and circular) against running the layers in order, on one
device, also on params stage-major; the one-line refusals. Slow: tests/pipeline_check.py on 8
forced CPU devices (every mesh against one device, losses and params), and a checkpoint written
by a circular pipeline resumed through the CLI at stage=1 and at stage=4.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import forkserver
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sharding import run_check
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

    (_, (got, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # each microbatch's mean over its rows, averaged: the batch's (equal microbatches)
    np.testing.assert_allclose(aux["mean"], want_mean, atol=1e-6)
    want_grads = jax.jit(jax.grad(lambda p: jnp.sum(in_order(p, x, args)[0] ** 2)))(params)
    for name in params:
        np.testing.assert_allclose(grads[name], want_grads[name], atol=1e-5)


@pytest.mark.parametrize("stages, repeats", [(4, 2), (2, 3)])
def test_stage_major_params_run_the_same_stack_and_get_stage_major_gradients(stages, repeats):
    """A circular pipeline trains on params stage-major (stage s's blocks contiguous, as
    `stage` splits them) and reads them so inside `reading_stage_major`: the same outputs as
    layer order, and the gradients in the params' own order."""
    groups = stages * repeats * 2
    assert pipeline_parallel.to_stage_major(jnp.arange(12), 2, 3).tolist() == [
        0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]  # stage 0: repeats 0, 1, 2's groups
    params = toy_layers(groups)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 3, 4)), jnp.float32)
    args = (jnp.asarray(rng.standard_normal((8, 1, 1)), jnp.float32), jnp.float32(0.25))

    def loss(params, x):
        y, _ = pipeline_parallel.run(toy_stage, params, x, args, stages=stages,
                                     microbatches=4, repeats=repeats)
        return jnp.sum(y**2), y

    (_, want), want_grads = jax.value_and_grad(loss, has_aux=True)(params, x)
    moved = jax.tree.map(lambda p: pipeline_parallel.to_stage_major(p, stages, repeats), params)
    (_, got), grads = jax.value_and_grad(pipeline_parallel.reading_stage_major(loss),
                                         has_aux=True)(moved, x)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for name in params:
        np.testing.assert_allclose(grads[name], pipeline_parallel.to_stage_major(
            want_grads[name], stages, repeats), atol=1e-6)
        back = pipeline_parallel.to_stage_major(moved[name], stages, repeats, inverse=True)
        np.testing.assert_array_equal(back, params[name])


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
    return run_check("pipeline_check.py", tmp_path_factory, timeout=1200)


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
@pytest.mark.parametrize("case", ["moe stage=2 x expert=2", "moe mtp stage=2"])
def test_a_pipelined_moe_trains_like_one_device(mesh_results, case):
    """Also with an MTP module's MoE layer outside the stages: the router z-loss is the mean
    over every MoE layer, as on one device (it weighed the stages' 8 layers as one)."""
    got, want = mesh_results[case], mesh_results[case.split(" stage")[0] + " single"]
    np.testing.assert_allclose(got["losses"], want["losses"], atol=1e-5, rtol=0)
    assert got["max_param_diff"] < 1e-5


@pytest.mark.slow
def test_lora_adapters_train_under_the_pipeline_as_on_one_device(mesh_results):
    """Probe p1 of stop 110: a targets regex naming the stack (decoder/layers/...) matched
    nothing inside a stage, so the adapters got no gradient (gnorm 0, exit 0); LoRA dropout
    without model dropout had no RNG in the stages and failed. The adapters now train as on
    one device, and their dropout applies (the losses move off the run without it)."""
    got, want = mesh_results["lora stage=2"], mesh_results["lora single"]
    np.testing.assert_allclose(got["losses"], want["losses"], atol=1e-5, rtol=0)
    assert got["max_param_diff"] < 1e-5 and got["stage_sharded"]
    dropped = np.array(mesh_results["lora dropout stage=2"]["losses"])
    # (the adapters' B starts at 0 and the first step's rate is 0 (warmup): the third step is
    # the first whose forward reads a dropped-out adapter)
    assert np.all(np.isfinite(dropped)) and abs(dropped[2] - got["losses"][2]) > 1e-6


@pytest.mark.slow
def test_dropout_trains_under_the_pipeline(mesh_results):
    """Dropout draws its masks per (iteration, stage), not as one device does: the losses are
    finite, near those without dropout, and not equal to them (the masks apply)."""
    losses = np.array(mesh_results["dropout stage=2"]["losses"][:3])
    without = np.array(mesh_results["stage=2"]["losses"])
    assert np.all(np.isfinite(losses)) and np.all(np.abs(losses - without) < 0.1)
    assert np.all(np.abs(losses - without) > 1e-5)


@pytest.mark.slow
def test_a_circular_checkpoint_resumes_at_stage_1_and_at_stage_4(tmp_path):
    """A circular pipeline trains on its layer params stage-major and saves them in layer order:
    its checkpoint resumes on its own mesh, on one stage and on a GPipe of 4 as a run on one
    stage does."""
    # (a constant schedule after warmup: a 2-step run's learning rates are a 4-step run's)
    model = ["--config.model.num_layers=4", "--config.model.scan_layers=True",
             "--config.batch_size=8", "--config.optimizer.decay=constant"]
    flags = [f for f in tiny_flags(4, checkpoint_every=2)
             if not f.startswith(("--config.model.num_layers", "--config.batch_size"))]

    def train(workdir, steps, mesh):
        result = forkserver.run(
            [sys.executable, "-m", "transformer.train", "--config=experiments/gpt_tiny.py",
             f"--workdir={workdir}", *flags, *model, f"--config.steps={steps}", *mesh],
            cwd=REPO, env=cli_env(8), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    circular = ["--config.mesh.data=2", "--config.mesh.stage=2", "--config.mesh.fsdp=2",
                "--config.pipeline.microbatches=2", "--config.pipeline.repeats=2"]
    stage1 = ["--config.mesh.data=-1"]
    train(tmp_path / "reference", 2, stage1)  # the reference: written and resumed on one stage
    train(tmp_path / "reference", 4, stage1)
    want = losses(tmp_path / "reference")
    log = train(tmp_path / "written", 2, circular)
    assert "pipeline: 2 stages, 2 microbatches (circular, 2 repeats)" in log
    assert re.search(r"step 2/2 loss .* ms/step", log)
    meshes = {"circular": circular, "stage1": stage1,
              "stage4": ["--config.mesh.data=2", "--config.mesh.stage=4",
                         "--config.pipeline.microbatches=4"]}
    for name, mesh in meshes.items():  # each resumes the 2-step circular run
        shutil.copytree(tmp_path / "written", tmp_path / name, symlinks=True)
        assert "steps 2..4" in train(tmp_path / name, 4, mesh)
        np.testing.assert_allclose(losses(tmp_path / name), want, atol=1e-5, rtol=0)
        # and the last validation, which a circular run makes on its params in train order
        np.testing.assert_allclose(losses(tmp_path / name, "validation")[-1],
                                   losses(tmp_path / "reference", "validation")[-1],
                                   atol=1e-5, rtol=0)


def losses(workdir: Path, split: str = "train") -> list[float]:
    """Each step's `split` loss from the run's metrics (the resumed run's win for a step)."""
    by_step = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == split:
            by_step[record["step"]] = record["loss"]
    return [by_step[s] for s in sorted(by_step)]


PADDED_MICROBATCHES = """
import json, sys
import jax, numpy as np
sys.path.insert(0, "tests")
from mesh_check import BATCH, LENGTH, VOCAB, Run, small_config
from transformer.training import placement

rng = np.random.default_rng(0)
tokens = rng.integers(7, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
segments = np.ones((BATCH, LENGTH), np.int32)
segments[1::2, 5:] = 2  # odd rows: two documents
segments[0::2, 3:] = 0  # even rows: 3 real tokens, then padding
weights = (segments > 0) & (segments == np.roll(segments, -1, axis=1))  # none at a document end
positions = np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))
positions[1::2, 5:] -= 5
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
         "weights": weights.astype(np.float32), "positions": positions}
out, start = {}, None
for stage, accumulation in ((1, 1), (2, 1), (2, 2)):
    config = small_config()
    config.model.update(num_layers=4, scan_layers=True)
    config.mesh.update({"data": 1, "stage": stage})
    config.pipeline.update(microbatches=2, repeats=1)
    config.optimizer.grad_accumulation_steps = accumulation
    config.model.moe.update(num_experts=4, capacity_factor=0.0, load_balance_loss=0.0,
                            router_z_loss=1.0)
    run = Run(config, jax.devices()[:stage])
    state = run.init(jax.random.key(0)) if start is None else run.place(start)
    if start is None:
        start = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state)
    state = run.placement.train_order(state)
    with run.placement.context():
        _, metrics = run.step(state, run.placement.global_batch(batch))
    metrics = placement.fetch(metrics)
    out[f"{stage} {accumulation}"] = {k: float(metrics[k]) for k in ("moe_router_z", "grad_norm")}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_pipeline_microbatches_with_different_padding_give_the_whole_batch_router_z_loss():
    """The router z-loss is a mean over the valid tokens: pipelined (stage=2, 2 microbatches,
    one nearly all padding), also with gradient accumulation, it and its gradient are one
    device's, not the microbatches' mean."""
    result = forkserver.run([sys.executable, "-c", PADDED_MICROBATCHES], env=cli_env(2),
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for case in ("2 1", "2 2"):
        for name in ("moe_router_z", "grad_norm"):
            assert out[case][name] == pytest.approx(out["1 1"][name], rel=1e-5), (case, out)
