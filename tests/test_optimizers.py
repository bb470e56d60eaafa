"""optimizer.name's optimizers and optimizer.decay's schedules: each update equals optax's own
transformation (muon: its matrices Muon's, the rest AdamW's), each optimizer resumes bit for bit,
a resume with another optimizer is refused, the logged learning rates follow their formulas (WSD
also resumed with larger `steps`), bad settings get one-line errors, schedule-free runs evaluate
at x, and batched seeds train a non-AdamW optimizer as separate runs do.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

from transformer import batched, configs, train
from transformer import evaluate as evaluate_lib
from transformer.models import build_model, family_of
from transformer.parallel import sharding
from transformer.training import checkpoint as checkpoint_lib
from transformer.training import checkpoint_manager, optim
from transformer.training.state import TrainState, example_batch

# Settings that exercise each optimizer's own keys (adafactor factors the tiny matrices).
SETTINGS = {
    "adamw": {},
    "adafactor": dict(adafactor_min_dim_size_to_factor=16, adafactor_momentum=0.9,
                      learning_rate=1e-2),
    "lion": dict(learning_rate=1e-4),
    "muon": {},
    "sgd": dict(momentum=0.9, nesterov=True, learning_rate=0.1),
    "schedule_free_adamw": dict(decay="constant"),
}


@pytest.fixture(autouse=True, scope="module")
def threefry():
    """JAX's default PRNG, as batched seeds require (tests/conftest.py sets rbg)."""
    previous = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "threefry2x32")
    yield
    jax.config.update("jax_default_prng_impl", previous)


def tiny(name: str = "adamw", steps: int = 4, seed: int = 0, **optimizer):
    """A 1-layer GPT on the embedded corpus, `name`'s settings (`SETTINGS`) and `optimizer`."""
    config = configs.base_config()
    config.experiment = f"optim/{name}"
    # MFU against a fixed peak: no CPU measurement at every start (tests/test_metrics.py)
    config.update(seed=seed, steps=steps, batch_size=2, seq_len=16, log_every=1,
                  eval_every=steps, eval_steps=1, checkpoint_every=2, keep_checkpoints=5,
                  peak_flops_per_device=1e11)
    config.model.update(num_layers=1, d_model=32, num_heads=2, d_ff=64, max_len=16,
                        vocab_size=0)
    config.optimizer.update(name=name, warmup_steps=1, **SETTINGS[name])
    config.optimizer.update(**optimizer)
    return config


def records(workdir: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == split]


# --- each update is optax's -------------------------------------------------------------------


def gradients(params, i):
    """Step `i`'s fixed pseudo-random gradients."""
    return jax.tree.map(lambda p: jnp.sin(p * (i + 2.0) + 1.0), params)


def trajectory(steps, step, carry):
    """`step` (carry, i) -> (carry, out) `steps` times in one compiled loop; each step's out."""
    _, out = jax.lax.scan(step, carry, jnp.arange(steps))
    return [jax.tree.map(lambda a, i=i: a[i], out) for i in range(steps)]


def updates(tx, params, steps: int = 3):
    """`tx`'s updates over `steps` steps of fixed pseudo-random gradients (one program)."""

    def step(carry, i):
        params, state = carry
        update, state = tx.update(gradients(params, i), state, params)
        return (optax.apply_updates(params, update), state), update

    out = jax.jit(lambda params: trajectory(steps, step, (params, tx.init(params))))(params)
    return jax.tree.map(np.asarray, out)


# The tiny GPT's params that weight decay reaches: its matrices, not biases or norm scales.
DECAYED = ("embed/embedding", "query", "key", "value", "out", "mlp/wi", "mlp/wo")


def decayed(params) -> dict:
    """`DECAYED` as a mask of `params`, written out by name (whatever the layout)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "/".join(k.key for k in path).endswith(DECAYED), params)


def direct(config) -> optax.GradientTransformation:
    """optimizer.name's transformation built from optax directly (no clipping); adafactor's
    decay as AdamW's, lr(t) * weight_decay * p (optax's weight_decay_rate is not scaled)."""
    opt, mask = config.optimizer, decayed
    lr = optim.learning_rate_schedule(opt, config.steps)
    return {
        "adamw": lambda: optax.adamw(lr, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                                     mask=mask),
        "adafactor": lambda: optax.chain(
            optax.adafactor(lr, min_dim_size_to_factor=16, momentum=0.9),
            optax.add_decayed_weights(lambda t: -opt.weight_decay * lr(t), mask)),
        "lion": lambda: optax.lion(lr, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                                   mask=mask),
        "sgd": lambda: optax.chain(optax.add_decayed_weights(opt.weight_decay, mask),
                                   optax.sgd(lr, momentum=0.9, nesterov=True)),
        "schedule_free_adamw": lambda: contrib.schedule_free_adamw(
            opt.learning_rate, 1, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay),
    }[opt.name]()


def tiny_params(config, scan: bool = False):
    """The tiny GPT's params (with biases; `scan`: as one scanned stack)."""
    config.model.update(use_bias=True, scan_layers=scan, num_layers=2, vocab_size=64)
    model = build_model(config.model)
    args = family_of(config).init_args(example_batch(config))
    return jax.tree.map(np.asarray, nn.unbox(jax.jit(model.init)(jax.random.key(0),
                                                                 *args)["params"]))


@pytest.mark.parametrize("name", [n for n in optim.NAMES if n != "muon"])
def test_each_update_is_optax_own(name):
    config = tiny(name, steps=10, grad_clip_norm=0.0)
    params = tiny_params(config)
    for ours, theirs in zip(updates(optim.make_optimizer(config), params),
                            updates(direct(config), params), strict=True):
        jax.tree.map(np.testing.assert_array_equal, ours, theirs)


@pytest.mark.parametrize("name", [n for n in optim.NAMES if n != "schedule_free_adamw"])
def test_weight_decay_is_lr_times_decay_on_matrices_whatever_the_layout(name):
    """With zero gradients an update is the decay alone: -lr * weight_decay * p on every
    matrix (adafactor's too, where optax's own rate ignored lr: 10% a step), nothing on biases
    or norm scales, and the same params decayed in a scanned stack ([layers, d] vectors)."""
    config = tiny(name, steps=10, grad_clip_norm=0.0, warmup_steps=0, decay="constant",
                  weight_decay=0.1)
    opt = config.optimizer
    rate = opt.learning_rate * (1 + opt.momentum if name == "sgd" else 1)  # SGD's L2 term
    for scan in (False, True):  # goes through its Nesterov momentum: (1 + m) at the first step
        params = tiny_params(config, scan)
        tx = optim.make_optimizer(config)
        update, _ = tx.update(jax.tree.map(np.zeros_like, params), tx.init(params), params)
        flat = jax.tree_util.tree_flatten_with_path(update)[0]
        for (path, u), p, decays in zip(flat, jax.tree.leaves(params),
                                        jax.tree.leaves(decayed(params)), strict=True):
            name_ = "/".join(k.key for k in path)
            if name == "muon" and decays and not name_.startswith("embed"):
                continue  # Muon's matrices: its own rate and orthogonalized decay
            want = -rate * 0.1 * p if decays else np.zeros_like(p)
            np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-12, err_msg=name_)


@pytest.fixture(scope="module")
def gpt_params():
    """A tiny scanned GPT's params (unboxed) and their logical axis names."""
    config = tiny("muon")
    config.model.update(scan_layers=True, num_layers=2, vocab_size=64)
    model = build_model(config.model)
    args = family_of(config).init_args(example_batch(config))
    boxed = jax.jit(model.init)(jax.random.key(0), *args)["params"]
    is_box = lambda x: isinstance(x, nn.Partitioned)
    names = jax.tree.map(lambda x: x.names, boxed, is_leaf=is_box)
    return config, nn.unbox(boxed), names


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(gpt_params):
    config, params, _ = gpt_params
    dims = optim.muon_dimension_numbers(config)
    flat = {"/".join(k.key for k in path): d for path, d in
            jax.tree_util.tree_flatten_with_path(dims, is_leaf=optim._IS_DIMS)[0]}
    attention, mlp = "decoder/layers/self_attention", "decoder/layers/mlp"
    # [layers, embed, heads, kv]: the layers axis is a batch axis, rows embed.
    assert flat[f"{attention}/query"] == contrib.MuonDimensionNumbers((1,), (2, 3))
    assert flat[f"{attention}/out"] == contrib.MuonDimensionNumbers((1, 2), (3,))
    assert flat[f"{mlp}/wi"] == contrib.MuonDimensionNumbers((1,), (2,))
    assert flat[f"{mlp}/wo"] == contrib.MuonDimensionNumbers((1,), (2,))
    assert sorted(k for k, d in flat.items() if d is not None) == sorted(
        [f"{attention}/{n}" for n in ("query", "key", "value", "out")] +
        [f"{mlp}/wi", f"{mlp}/wo"])
    opt = config.optimizer
    config.optimizer.grad_clip_norm = 0.0  # (clipping couples the leaves)
    muon_alone = contrib.muon(
        optim.learning_rate_schedule(opt, config.steps, opt.muon_learning_rate),
        beta=opt.muon_momentum, weight_decay=opt.weight_decay, nesterov=True,
        muon_weight_dimension_numbers=dims)
    adamw_alone = optax.adamw(optim.learning_rate_schedule(opt, config.steps), b1=opt.b1,
                              b2=opt.b2, weight_decay=opt.weight_decay, mask=decayed)
    for ours, muon_update, adamw_update in updates_along(
            [optim.make_optimizer(config), muon_alone, adamw_alone], params):
        for (path, d), a, m, w in zip(
                jax.tree_util.tree_flatten_with_path(dims, is_leaf=optim._IS_DIMS)[0],
                *(jax.tree.leaves(u) for u in (ours, muon_update, adamw_update)), strict=True):
            np.testing.assert_array_equal(a, w if d is None else m, err_msg=str(path))


def test_a_muon_head_scales_its_muon_matrices_by_the_head_ratio():
    """optimizer.head under muon: the head's Muon matrices and AdamW params (biases, norms)
    both take head_learning_rate / learning_rate of their no-head first update (Muon's had
    stayed at the full muon_learning_rate); the rest are unchanged."""
    config = tiny("muon", grad_clip_norm=0.0, warmup_steps=0, decay="constant")
    params = tiny_params(config)
    dims = jax.tree.leaves(optim.muon_dimension_numbers(config), is_leaf=optim._IS_DIMS)

    def first(config):
        tx = optim.make_optimizer(config)
        return tx.update(gradients(params, 0), tx.init(params), params)[0]

    plain = first(config)
    config.optimizer.update(head="^decoder/layers_1/", head_learning_rate=1e-5)
    headed = first(config)
    ratio = 1e-5 / config.optimizer.learning_rate
    flat = jax.tree_util.tree_flatten_with_path(headed)[0]
    kinds = set()
    for (path, h), p, d in zip(flat, jax.tree.leaves(plain), dims, strict=True):
        name = "/".join(k.key for k in path)
        in_head = name.startswith("decoder/layers_1/")
        kinds.add((in_head, d is not None))
        if in_head:
            np.testing.assert_allclose(h, np.asarray(p) * ratio, rtol=1e-5, atol=1e-12,
                                       err_msg=name)
        else:
            np.testing.assert_array_equal(h, p, err_msg=name)
    assert kinds == {(True, True), (True, False), (False, True), (False, False)}


def updates_along(txs, params, steps: int = 3):
    """Each of `txs`' updates on the params and gradients of the first one's trajectory (one
    program)."""

    def step(carry, i):
        params, states = carry
        grads = gradients(params, i)
        out = [tx.update(grads, state, params) for tx, state in zip(txs, states, strict=True)]
        params = optax.apply_updates(params, out[0][0])
        return (params, [state for _, state in out]), [update for update, _ in out]

    out = jax.jit(lambda params: trajectory(
        steps, step, (params, [tx.init(params) for tx in txs])))(params)
    return jax.tree.map(np.asarray, out)


# --- training: resume, refusal, batched seeds ----------------------------------------------


def final_params(workdir: Path):
    return checkpoint_lib.restore_params(str(workdir)).params


def straight_config(name: str):
    """`tiny(name)` as the straight runs train it: muon on a scanned stack, adafactor with
    nonfinite="skip" (optax.apply_if_finite) and accumulation."""
    config = tiny(name)
    config.model.scan_layers = name == "muon"
    if name == "adafactor":
        config.update(nonfinite="skip")
        config.optimizer.grad_accumulation_steps = 2
    return config


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """`straight_run(name)`: the workdir and result of `name` trained 4 steps straight
    (checkpoints at 2 and 4), trained the first time a test asks for it: the fast tests need
    two of the optimizers, the slow resume test all of them."""
    root = tmp_path_factory.mktemp("straight")
    results = {}

    def run(name: str):
        if name not in results:
            results[name] = train.train_and_evaluate(straight_config(name), str(root / name))
        return root / name, results[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", optim.NAMES)
def test_each_optimizer_resumes_bit_for_bit(straight_run, tmp_path, name):
    """Stopped at step 2 (the straight run's checkpoint, later steps removed), resumed to 4."""
    straight, _ = straight_run(name)
    shutil.copytree(straight, tmp_path / name)
    shutil.rmtree(tmp_path / name / "checkpoints" / "4")
    (tmp_path / name / "summary.json").unlink()
    train.train_and_evaluate(straight_config(name), str(tmp_path / name))
    jax.tree.map(np.testing.assert_array_equal, final_params(straight),
                 final_params(tmp_path / name))
    assert records(tmp_path / name)[-1]["loss"] == records(straight)[-1]["loss"]


def test_a_resume_with_another_optimizer_is_refused(straight_run, tmp_path):
    shutil.copytree(straight_run("adamw")[0], tmp_path / "run")
    with pytest.raises(checkpoint_manager.ConfigMismatch) as error:
        train.train_and_evaluate(tiny("lion", steps=6), str(tmp_path / "run"))
    assert "optimizer.name: checkpoint 'adamw', config 'lion'" in str(error.value)
    assert "\n" not in str(error.value)
    # A checkpoint from before optimizer.name was adamw's.
    old = {key: value for key, value in tiny().to_dict().items() if key != "optimizer"}
    assert checkpoint_manager.structural_differences(old, tiny().to_dict()) == []
    assert checkpoint_manager.structural_differences(old, tiny("sgd").to_dict()) == [
        "optimizer.name: checkpoint 'adamw', config 'sgd'"]


def test_a_saved_schedule_free_run_evaluates_at_x(straight_run):
    """Training evaluates schedule-free's x, not the state's y, and so does evaluate (through
    checkpoint.read_params): it gives the training's final validation loss."""
    workdir, result = straight_run("schedule_free_adamw")
    state, config = result["state"], tiny("schedule_free_adamw")
    x = optim.eval_params(state, config)
    assert not all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(x), jax.tree.leaves(state.params), strict=True))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), x)
    final = records(workdir, "validation")[-1]
    assert evaluate_lib.evaluate_workdir(str(workdir), eval_steps=1)["loss"] == final["loss"]


@pytest.mark.slow
def test_batched_seeds_train_muon_as_separate_runs(tmp_path):
    """The vmapped program rounds a few gradients an ulp apart from the separate ones (as for
    every optimizer); Muon's Newton-Schulz iterations amplify such differences in the small
    singular directions (its quintic's slope reaches 3.4, five times over), so params agree
    to 5e-6 here (seen: 1.1e-6 on params of 1e-3) where a swapped or shared seed is off by
    1e-3."""
    configs_ = [tiny("muon", steps=3, seed=k) for k in range(2)]
    for k, config in enumerate(configs_):
        config.experiment = f"optim/seed_{k}"
        train.train_and_evaluate(config, str(tmp_path / "separate" / str(k)))
    batched.train_seeds(configs_, [str(tmp_path / "together" / str(k)) for k in range(2)])
    for k in range(2):
        a, b = (tmp_path / where / str(k) for where in ("separate", "together"))
        np.testing.assert_allclose([r["loss"] for r in records(a)],
                                   [r["loss"] for r in records(b)], rtol=1e-6)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=5e-6),
                     final_params(a), final_params(b))


# --- schedules --------------------------------------------------------------------------------


def wsd(step: int, steps: int, shape: str, peak=1e-3, warmup=2, fraction=0.4, ratio=0.1):
    """WSD's rate at update `step` (1-based, as logged)."""
    t, end = step - 1, peak * ratio
    start = max(steps - round(fraction * steps), warmup)
    if t < warmup:
        return peak * t / warmup
    if t < start:
        return peak
    p = (t - start) / (steps - start)
    f = {"linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2, "1-sqrt": 1 - math.sqrt(p)}
    return end + (peak - end) * f[shape]


def logged_rates(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["learning_rate"] for r in records(workdir)}


def schedule_config(steps: int, **optimizer):
    config = tiny("adamw", steps=steps, warmup_steps=2, learning_rate=1e-3, **optimizer)
    config.update(eval_every=steps, checkpoint_every=steps)
    return config


def schedule_rates(config) -> dict[int, float]:
    """The rates the schedule gives each logged step (1-based), as a run logs them."""
    schedule = optim.learning_rate_schedule(config.optimizer, config.steps)
    return {step: float(schedule(step - 1)) for step in range(1, config.steps + 1)}


@pytest.mark.slow
def test_wsd_rates_follow_the_formula(tmp_path):
    """Each shape's schedule follows the formula; a run logs its schedule's rates (cosine; the
    linear one through a resume below)."""
    for shape in ("cosine", "1-sqrt", "linear"):
        config = schedule_config(10, decay="wsd", decay_fraction=0.4, decay_shape=shape)
        for step, rate in schedule_rates(config).items():
            assert rate == pytest.approx(wsd(step, 10, shape), rel=1e-5, abs=1e-9), (shape, step)
    train.train_and_evaluate(config := schedule_config(10, decay="wsd", decay_fraction=0.4,
                                                       decay_shape="cosine"), str(tmp_path))
    rates = logged_rates(tmp_path)
    assert sorted(rates) == list(range(1, 11))
    assert rates == pytest.approx(schedule_rates(config), rel=1e-7)


@pytest.mark.slow
def test_wsd_resumed_with_larger_steps_decays_at_its_new_end(tmp_path):
    """A stable-phase checkpoint serves a longer budget: a 6-step run (stable through step 4,
    then its decay) continues from its step-4 checkpoint to 12 steps, whose rates follow the
    12-step schedule (stable through step 7, then the decay to its new end)."""
    config = schedule_config(6, decay="wsd", decay_fraction=0.4)
    config.checkpoint_every = 4
    train.train_and_evaluate(config, str(tmp_path))
    assert logged_rates(tmp_path)[6] < 1e-3  # it decayed at its end
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    train.train_and_evaluate(schedule_config(12, decay="wsd", decay_fraction=0.4),
                             str(tmp_path))
    rates = logged_rates(tmp_path)
    assert sorted(rates) == list(range(1, 13))
    for step, rate in rates.items():
        expected = wsd(step, 6 if step <= 4 else 12, "linear")
        assert rate == pytest.approx(expected, rel=1e-5, abs=1e-9), step
    assert rates[7] == pytest.approx(1e-3) and rates[8] < 1e-3


def test_inverse_sqrt_rates_follow_the_formula(tmp_path):
    """With and without warmup; a run logs the schedule's rates (warmup 3)."""
    for warmup in (0, 3):
        config = schedule_config(8, decay="inverse_sqrt")
        config.optimizer.warmup_steps = warmup
        for step, rate in schedule_rates(config).items():
            t, w = step - 1, max(warmup, 1)
            expected = 1e-3 * t / w if t < warmup else 1e-3 * math.sqrt(w / max(t, w))
            assert rate == pytest.approx(expected, rel=1e-6, abs=1e-12), (warmup, step)
    train.train_and_evaluate(config, str(tmp_path))
    rates = logged_rates(tmp_path)
    assert sorted(rates) == list(range(1, 9))
    assert rates == pytest.approx(schedule_rates(config), rel=1e-7)


# --- config refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("key, value, message", [
    ("name", "adam", "optimizer.name='adam': expected one of ('adamw', 'adafactor', 'lion', "
                     "'muon', 'sgd', 'schedule_free_adamw')"),
    ("decay", "step", "optimizer.decay='step': expected one of"),
    ("decay_shape", "exp", "optimizer.decay_shape='exp': expected one of ('linear', 'cosine', "
                           "'1-sqrt')"),
    ("decay_fraction", 1.5, "optimizer.decay_fraction=1.5: expected a number in [0, 1]"),
    ("momentum", 1.0, "optimizer.momentum=1.0: expected a number in [0, 1)"),
    ("adafactor_momentum", 1.0, "optimizer.adafactor_momentum=1.0: expected a number in "
                                "[0, 1) (0: none)"),
    ("muon_learning_rate", 0.0, "optimizer.muon_learning_rate=0.0: expected a number > 0"),
    ("adafactor_min_dim_size_to_factor", 0, "optimizer.adafactor_min_dim_size_to_factor=0: "),
    ("adafactor_clipping_threshold", -1.0, "optimizer.adafactor_clipping_threshold=-1.0: "),
])
def test_bad_optimizer_settings_are_refused_in_one_line(key, value, message):
    config = tiny()
    with config.optimizer.unlocked():
        config.optimizer[key] = value
    with pytest.raises(ValueError) as error:
        configs.validate_config(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_schedule_free_refuses_a_decay():
    config = tiny("schedule_free_adamw", decay="cosine")
    with pytest.raises(ValueError, match=r"^optimizer.decay='cosine' with optimizer.name="
                                         r"'schedule_free_adamw': expected 'constant'"):
        configs.validate_config(config)


@pytest.mark.parametrize("name", optim.NAMES)
def test_the_optimizer_state_shards_like_the_params(name):
    """On an fsdp=2 x tensor=2 mesh (abstract: no devices needed) every state leaf gets a
    sharding its shape splits evenly under, the moments of `query` are split like `query`, and
    adafactor's factored statistics are replicated."""
    config = tiny(name, adafactor_min_dim_size_to_factor=16, adafactor_momentum=0.0)
    config.model.vocab_size = 64
    mesh = jax.sharding.AbstractMesh(
        tuple(2 if axis in ("fsdp", "tensor") else 1 for axis in sharding.MESH_AXES),
        sharding.MESH_AXES)
    model, tx = build_model(config.model), optim.make_optimizer(config)
    args = family_of(config).init_args(example_batch(config))
    boxed = jax.eval_shape(lambda: tx.init(model.init(jax.random.key(0), *args)["params"]))
    specs = sharding.logical_shardings(boxed, mesh)
    query = {}
    for (path, spec), leaf in zip(jax.tree_util.tree_flatten_with_path(specs)[0],
                                  jax.tree.leaves(nn.unbox(boxed)), strict=True):
        spec.shard_shape(leaf.shape)  # raises unless the mesh axes divide the dimensions
        if "'query'" in jax.tree_util.keystr(path):
            query[jax.tree_util.keystr(path)] = (leaf.shape, spec.spec)
    assert query, name
    for path, (shape, spec) in query.items():
        if shape == (32, 2, 16):
            assert spec == jax.sharding.PartitionSpec(("fsdp", "expert", "sequence"), "tensor",
                                                        None), path
        else:
            assert name == "adafactor" and spec == jax.sharding.PartitionSpec(), path


@pytest.mark.parametrize("name", optim.NAMES)
def test_fine_tuning_groups_work_with_every_optimizer(gpt_params, name):
    """optimizer.freeze keeps the embedding, optimizer.head trains the final norm at its own
    rate, under every optimizer (muon's and schedule-free's groups nested in multi_transform);
    schedule-free's evaluation params leave the frozen embedding too."""
    _, params, _ = gpt_params
    config = tiny(name, freeze="^embed/", head="final_norm", head_learning_rate=1e-2)
    config.model.update(scan_layers=True, num_layers=2, vocab_size=64)
    tx = optim.make_optimizer(config)

    def step(carry, i):
        trained, state = carry
        grads = jax.tree.map(lambda p: jnp.cos(p + i), trained)
        update, state = tx.update(grads, state, trained)
        return (optax.apply_updates(trained, update), state), None

    @jax.jit
    def train_and_eval_params(params):
        (trained, state), _ = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(2))
        return trained, optim.eval_params(TrainState(jnp.zeros((), jnp.int32), trained, state,
                                                     jnp.full((), -1, jnp.int32)), config)

    trained, x = jax.tree.map(np.asarray, train_and_eval_params(params))
    frozen = params["embed"]["embedding"]
    np.testing.assert_array_equal(trained["embed"]["embedding"], frozen)
    assert not np.array_equal(trained["decoder"]["final_norm"]["scale"],
                              params["decoder"]["final_norm"]["scale"])
    np.testing.assert_array_equal(x["embed"]["embedding"], frozen)
    moved = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(x), jax.tree.leaves(trained), strict=True)]
    assert sum(moved) == (len(moved) - 1 if name == "schedule_free_adamw" else 0)


def test_a_head_regex_matching_no_param_is_refused_before_training(gpt_params, tmp_path):
    """optimizer.head='^clasifier/' (a typo) trained no param at head_learning_rate, silently:
    like optimizer.freeze, a head regex matching no param is one line, before any step."""
    from transformer.training import state

    _, params, _ = gpt_params
    state.check_freeze(params, tiny(head="final_norm"))
    message = (r"^optimizer.head='\^clasifier/' matches no param: expected a regex over param "
               r"paths such as embed/embedding($|\n)")
    with pytest.raises(ValueError, match=message):
        state.check_freeze(params, tiny(head="^clasifier/"))
    with pytest.raises(ValueError, match=message):
        train.train_and_evaluate(tiny(head="^clasifier/", head_learning_rate=1e-2),
                                 str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("decay", optim.DECAYS)
def test_without_warmup_every_schedule_starts_at_the_peak(decay):
    """warmup_steps=0: update 0 runs at the peak learning rate (cosine's optax warmup of one
    step spent it at 0 and shifted the curve by a step), and cosine reaches its end at the
    last update."""
    config = tiny(steps=10, warmup_steps=0, decay=decay, min_learning_rate_ratio=0.1)
    schedule = optim.learning_rate_schedule(config.optimizer, config.steps)
    peak = config.optimizer.learning_rate
    assert float(schedule(0)) == pytest.approx(peak, rel=1e-6)
    if decay == "cosine":
        want = [0.1 * peak + 0.9 * peak * (1 + math.cos(math.pi * t / 10)) / 2
                for t in range(11)]
        np.testing.assert_allclose([float(schedule(t)) for t in range(11)], want, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in optim.NAMES if n != "schedule_free_adamw"])
def test_a_scanned_stack_gets_the_updates_of_an_unrolled_one(name):
    """The same params and gradients, unrolled (layers_i) or scanned (one stack along a
    leading layers axis), get the same updates: weight decay on the same params, and
    Adafactor's factored moments and block RMS per layer (its whole-stack statistics were
    off by half when the layers differ in scale, as here: layer 1 five times layer 0)."""
    from transformer.nn.layers import stack_layers

    config = tiny(name, steps=10, warmup_steps=0, weight_decay=0.1)
    unrolled = tiny_params(config)
    unrolled["decoder"]["layers_1"] = jax.tree.map(lambda x: 5 * x + 0.1,
                                                   unrolled["decoder"]["layers_1"])
    scanned = {**unrolled, "decoder": stack_layers(unrolled["decoder"], 2)}
    config.model.scan_layers = False
    flat = updates(optim.make_optimizer(config), unrolled)
    config.model.scan_layers = True
    stacked = updates(optim.make_optimizer(config), scanned)
    for ours, theirs in zip(stacked, flat, strict=True):
        theirs = {**theirs, "decoder": stack_layers(theirs["decoder"], 2)}
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
                     ours, theirs)


def axes_config(**model):
    """A tiny GPT config (tests read its axes, never build its params) with `model` keys."""
    config = tiny("muon")
    for key, value in model.items():
        node = config.model
        *parents, name = key.split(".")
        for parent in parents:
            node = node[parent]
        node[name] = value
    return config


def flat_tree(tree, is_leaf=None) -> dict:
    return {"/".join(k.key for k in path): v for path, v in
            jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def test_muon_takes_mlas_latent_matrices_and_mamba2s_b_and_c():
    """MLA's low-rank projections read embed (q_a, kv_a) or the latent (q_b, k_b, v_b: rows
    latent); Mamba 2's B and C [embed, kv_heads, state] read embed. Its convolutions stay
    AdamW's."""
    config = axes_config(layer_types="mamba2,full_attention", num_layers=2, attention_kind="mla",
                         **{"mla.kv_lora_rank": 16, "mla.q_lora_rank": 16,
                            "mla.qk_nope_head_dim": 8, "mla.qk_rope_head_dim": 8,
                            "mla.v_head_dim": 8, "mamba2.state_size": 8, "mamba2.head_dim": 8})
    dims = flat_tree(optim.muon_dimension_numbers(config), optim._IS_DIMS)
    mla, mamba = "decoder/layers_1/self_attention", "decoder/layers_0/mamba2"
    for name in ("q_a", "kv_a"):
        assert dims[f"{mla}/{name}"] == contrib.MuonDimensionNumbers((0,), (1,)), name
    for name in ("q_b", "k_b", "v_b"):
        assert dims[f"{mla}/{name}"] == contrib.MuonDimensionNumbers((0,), (1, 2)), name
    for name in ("B", "C"):
        assert dims[f"{mamba}/{name}"] == contrib.MuonDimensionNumbers((0,), (1, 2)), name
    for name in ("conv_B", "conv_x", "B_bias", "norm"):
        assert dims[f"{mamba}/{name}"] is None, name


def test_a_mamba2_gated_norm_weight_is_not_decayed_but_its_matrices_are():
    """Mamba 2's gated RMSNorm weight `norm` [heads, kv] is a norm scale (once decayed as a
    matrix: 1.0 -> 0.99 in a step at rate 0.1, decay 0.1); GDN's `norm` [kv] was never."""
    config = axes_config(layer_types="mamba2,linear_attention", num_layers=2,
                         **{"mamba2.state_size": 8, "mamba2.head_dim": 8})
    axes = optim.logical_axes(config)
    params = jax.tree.map(lambda names: np.ones((2,) * len(names), np.float32), axes,
                          is_leaf=optim._IS_AXES)
    mask = flat_tree(optim.decay_mask(config)(params))
    mamba, gdn = "decoder/layers_0/mamba2", "decoder/layers_1/linear_attention"
    assert not mask[f"{mamba}/norm"] and not mask[f"{gdn}/norm"]
    assert all(mask[f"{mamba}/{name}"] for name in ("x", "z", "B", "C", "dt", "out"))


def test_the_param_axes_are_read_whatever_attention_kernel_the_run_names():
    """Weight decay and Muon read each param's axes off an abstract init on 8 tokens: a run
    that names splash (which takes multiples of 128 tokens) gets them too, as with auto."""
    config = configs.experiment("gpt_tiny")
    want = optim.logical_axes(config)
    config.model.attention_impl = "splash"
    assert optim.logical_axes(config) == want


def test_a_checkpoint_whose_optimizer_groups_differ_is_refused_in_one_line(tmp_path, monkeypatch):
    """A muP run saved when some of its matrices were outside the hidden group (before
    2026-12-05) has the same config but another optimizer-state layout: Orbax restores it with
    holes the first step failed on ("unsupported operand type(s) for *: 'float' and
    'NoneType'"); the restore now says what differs, in one line."""
    import grain

    from transformer.training import state as state_lib

    config = configs.experiment("gpt_tiny")
    config.model.update(num_layers=1, d_model=64, num_heads=2, d_ff=128, vocab_size=64,
                        parametrization="mup", mup_base_width=32)
    model, mesh = build_model(config.model), sharding.make_mesh(config.mesh)

    def layout():
        return state_lib.initial_state(config, model, mesh, optimizer=optim.make_optimizer(config))

    with monkeypatch.context() as old:  # the old grouping, for the test: no hidden matrices
        old.setattr(optim, "mup_hidden", lambda config: jax.tree.map(
            lambda names: False, optim.logical_axes(config), is_leaf=optim._IS_AXES))
        _, _, init = layout()
        manager = checkpoint_manager.Manager(str(tmp_path), config)
        manager.save(1, init(jax.random.key(0)), iter(grain.MapDataset.range(4).to_iter_dataset()))
        manager.close()
    abstract, shardings, _ = layout()
    manager = checkpoint_manager.Manager(str(tmp_path), config)
    with pytest.raises(checkpoint_manager.ConfigMismatch,
                       match=r"^checkpoint .*/1: its optimizer state groups the params otherwise"):
        manager.restore(1, abstract, shardings)
    manager.close()


@pytest.mark.parametrize("saved, changed, named", [
    (dict(momentum=0.0), dict(optimizer=dict(momentum=0.9)),
     "optimizer.momentum: checkpoint 0.0, config 0.9"),
    (dict(momentum=0.0), dict(nonfinite="skip"), "nonfinite: checkpoint 'stop', config 'skip'")])
def test_an_optimizer_change_that_alters_the_state_is_refused_not_called_damage(
        tmp_path, saved, changed, named):
    """sgd's momentum from 0 adds a trace, nonfinite="skip" a skip counter: Orbax refused every
    step as if damaged ("tree structures do not match"). The restore now names the changed
    keys in one line before restoring anything, and sets nothing aside; the saved settings
    still restore."""
    import grain

    from transformer.training import state as state_lib

    def config_of(**changes):
        config = configs.experiment("gpt_tiny")
        config.model.update(num_layers=1, d_model=32, num_heads=2, d_ff=64, vocab_size=64)
        config.optimizer.update(name="sgd", **saved)
        config.optimizer.update(changes.pop("optimizer", {}))
        config.update(changes)
        return config

    def layout(config):
        return state_lib.initial_state(config, build_model(config.model),
                                       sharding.make_mesh(config.mesh),
                                       optimizer=optim.make_optimizer(config))

    config = config_of()
    abstract, shardings, init = layout(config)
    manager = checkpoint_manager.Manager(str(tmp_path), config)
    for step in (1, 2):
        manager.save(step, init(jax.random.key(0)),
                     iter(grain.MapDataset.range(4).to_iter_dataset()))
    manager.close()
    changed_config = config_of(**changed)
    manager = checkpoint_manager.Manager(str(tmp_path), changed_config)
    with pytest.raises(checkpoint_manager.ConfigMismatch) as error:
        manager.restore_latest(*layout(changed_config)[:2])
    assert str(error.value).startswith(f"checkpoint {tmp_path}/checkpoints/2: its optimizer "
                                       "state is laid out otherwise than this config builds")
    assert named in str(error.value) and "init_from" in str(error.value)
    assert "\n" not in str(error.value)
    assert manager.all_steps() == [1, 2] and not (tmp_path / "checkpoints.damaged").exists()
    manager.close()
    manager = checkpoint_manager.Manager(str(tmp_path), config)  # the saved settings restore
    assert int(manager.restore_latest(abstract, shardings).step) == 0
    manager.close()
