"""DeepSeek-style experts (transformer.nn.routing): sigmoid scores, grouped top-k, the gates'
scaling and the auxiliary-loss-free expert bias against a float64 loop and against
transformers' DeepSeek-V3 router; the train step moving the bias towards balance (and only
the bias: gradients and the optimizer never touch it); per-layer load imbalance; the first
dense layers, scanned apart; and the settings' one-line errors."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_moe import gpt_config, text_batch

from transformer import configs, models
from transformer.nn import routing
from transformer.training import checkpoint_manager
from transformer.training.state import TrainState
from transformer.training.step import make_train_step

ROUTINGS = {  # name -> route()'s settings
    "softmax": dict(top_k=2),
    "sigmoid grouped biased": dict(top_k=3, score="sigmoid", groups=4, top_groups=2,
                                   scale=2.5),
    "sigmoid top-1": dict(top_k=1, score="sigmoid", normalize=False),
}


def reference_routing(logits, bias, top_k, score="softmax", groups=1, top_groups=1,
                      scale=1.0, normalize=True):
    """Per token, in float64: the scores, each group's two best score + bias, the best
    top_groups groups, the top-k of score + bias among their experts, and the gates."""
    logits = np.asarray(logits, np.float64)
    experts = logits.shape[-1]
    choices, gates = [], []
    for row in logits.reshape(-1, experts):
        if score == "softmax":
            p = np.exp(row - row.max())
            p /= p.sum()
        else:
            p = 1 / (1 + np.exp(-row))
        biased = p + bias
        size = experts // groups
        group_score = [sum(sorted(biased[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
        allowed = [e for g in np.argsort(group_score)[::-1][:top_groups]
                   for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        gate = p[chosen]
        if normalize and top_k > 1:
            gate = gate / gate.sum()
        choices.append(chosen)
        gates.append(gate * scale)
    return np.array(choices), np.array(gates)


@pytest.mark.parametrize("name", ROUTINGS)
def test_routing_equals_a_float64_loop(name):
    settings = dict(ROUTINGS[name])
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 10, 16)).astype(np.float32) * 2
    bias = rng.normal(scale=0.3, size=16).astype(np.float32) if "biased" in name else 0.0
    top_k = settings.pop("top_k")
    normalize = settings.pop("normalize", True)
    got = jax.jit(lambda logits, bias: routing.route(logits, top_k, None, normalize, bias_E=bias,
                                                     **settings))(
        logits, bias if "biased" in name else None)
    ref = {"score": settings.get("score", "softmax"), "groups": settings.get("groups", 1),
           "top_groups": settings.get("top_groups", 1), "scale": settings.get("scale", 1.0)}
    choices, gates = reference_routing(logits, bias, top_k, normalize=normalize, **ref)
    np.testing.assert_array_equal(np.asarray(got.choice_BTK).reshape(choices.shape), choices)
    np.testing.assert_allclose(np.asarray(got.gates_BTK).reshape(gates.shape), gates,
                               rtol=2e-6)
    load = np.bincount(choices.ravel(), minlength=16) / choices.size
    np.testing.assert_allclose(got.load_E, load, rtol=1e-6)
    if "grouped" in name:  # the case really restricts the choice to the best groups
        free = reference_routing(logits, bias, top_k, **{**ref, "groups": 1})[0]
        assert (np.sort(free, -1) != np.sort(choices, -1)).any()


def test_routing_equals_transformers_deepseek_v3_router():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, n_group=4,
                                           topk_group=2, num_experts_per_tok=4,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = hf.DeepseekV3TopkRouter(config)
    rng = np.random.default_rng(1)
    weight = rng.normal(scale=0.3, size=(16, 32)).astype(np.float32)
    bias = rng.normal(scale=0.1, size=16).astype(np.float32)
    x = rng.standard_normal((2, 12, 32)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, hf_gates, hf_choice = router(torch.from_numpy(x))
    ours = jax.jit(lambda x, weight, bias: routing.route(
        jnp.einsum("btd,ed->bte", x, weight), 4, None, score="sigmoid", bias_E=bias, groups=4,
        top_groups=2, scale=2.5))(x, weight, bias)
    order = np.argsort(hf_choice.numpy(), -1)  # HF's top-k is unsorted
    np.testing.assert_array_equal(np.sort(np.asarray(ours.choice_BTK).reshape(24, 4), -1),
                                  np.take_along_axis(hf_choice.numpy(), order, -1))
    mine = np.argsort(np.asarray(ours.choice_BTK).reshape(24, 4), -1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(ours.gates_BTK).reshape(24, 4), mine, -1),
        np.take_along_axis(hf_gates.numpy(), order, -1), rtol=1e-6)


# --- the expert bias in training -----------------------------------------------------------


def biased_config(rate=0.05, **settings):
    return gpt_config(**{**dict(num_experts=8, top_k=2, score="sigmoid", n_group=4,
                                topk_group=2, capacity_factor=0.0, balance_bias=True,
                                bias_update_rate=rate), **settings})


@functools.cache  # shared by the tests that train the same model (each compiles once)
def setup(rate, learning_rate=1e-2, skew=0.0, **settings):
    """(config, model, train step, state, batch) of `biased_config(rate, **settings)` with AdamW
    (weight decay 0.1); `skew` added to expert 0's bias in every MoE layer (every token then
    prefers it)."""
    config = biased_config(rate, **settings)
    model = models.build_model(config.model)
    batch = text_batch()
    optimizer = optax.adamw(learning_rate, weight_decay=0.1)

    @jax.jit
    def initial_state(inputs):  # one program, not an eager op per param
        params = nn.unbox(model.init(jax.random.key(0), inputs)["params"])
        for name in ("layers_1", "layers_3"):
            moe = params["decoder"][name]["moe"]
            moe["balance_bias"] = moe["balance_bias"].at[0].add(skew)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                          jnp.asarray(-1, jnp.int32))

    state = initial_state(batch["inputs"])
    return config, model, jax.jit(make_train_step(model, config, optimizer)), state, batch


def sown_loads(model, params, batch):
    @jax.jit
    def loads(params, batch):
        _, state = model.apply({"params": params}, batch["inputs"],
                               positions=batch["positions"], segment_ids=batch["segment_ids"],
                               mutable=["losses"])
        return {name: state["losses"]["decoder"][name]["moe"]["expert_load"][0]
                for name in ("layers_1", "layers_3")}

    return {name: np.asarray(load) for name, load in loads(params, batch).items()}


@pytest.mark.slow
def test_the_step_moves_each_bias_by_the_sign_of_its_load_error_and_nothing_else_does():
    config, model, step, state, batch = setup(0.05)
    loads = sown_loads(model, state.params, batch)
    new, metrics = step(state, batch)
    for name, load in loads.items():
        before = np.asarray(state.params["decoder"][name]["moe"]["balance_bias"])
        after = np.asarray(new.params["decoder"][name]["moe"]["balance_bias"])
        np.testing.assert_allclose(after - before, 0.05 * np.sign(1 / 8 - load), atol=1e-7)
        assert (after != before).any()  # the router really moved (the other params did too)
        layer = f"moe_imbalance/decoder_{name[7:]}"
        assert float(metrics[layer]) == pytest.approx(load.max() * 8, rel=1e-6)
    assert float(metrics["moe_imbalance"]) == pytest.approx(
        max(load.max() * 8 for load in loads.values()), rel=1e-6)
    assert "moe_expert_load" not in metrics
    # Gradients never reach the bias (it only moves a choice) ...
    family = models.family_of(config)
    grads = jax.jit(jax.grad(lambda p: family.loss_and_metrics(model, config, p, batch)[0]))(
        state.params)
    assert not np.asarray(grads["decoder"]["layers_1"]["moe"]["balance_bias"]).any()
    assert np.asarray(grads["decoder"]["layers_1"]["moe"]["router"]).any()
    # ... and at rate 0 AdamW's weight decay does not either: the bias is fixed.
    _, _, step0, state0, _ = setup(0.0, skew=0.5)
    new0, _ = step0(state0, batch)
    np.testing.assert_array_equal(new0.params["decoder"]["layers_3"]["moe"]["balance_bias"],
                                  state0.params["decoder"]["layers_3"]["moe"]["balance_bias"])


@pytest.mark.slow
def test_the_bias_brings_a_skewed_router_to_balance_without_any_gradient():
    """Every token prefers expert 0 (its bias starts 1 above the rest); with the learning
    rate 0 only the bias moves, and it evens the load out (DeepSeek-V3's mechanism)."""
    _, _, step, state, batch = setup(0.02, learning_rate=0.0, skew=1.0, load_balance_loss=0.0,
                                     router_z_loss=0.0)
    imbalances = []
    for _ in range(60):
        state, metrics = step(state, batch)
        imbalances.append(float(metrics["moe_imbalance"]))
    assert imbalances[0] > 3.5  # expert 0 takes nearly every token
    assert max(imbalances[-10:]) < 2.0 and max(imbalances[-10:]) < imbalances[0] / 2
    frozen = setup(0.0, learning_rate=0.0, skew=1.0)
    assert float(frozen[2](frozen[3], batch)[1]["moe_imbalance"]) == imbalances[0]


@pytest.mark.slow
def test_micro_batches_move_the_bias_as_the_whole_batch_does():
    _, model, step, state, batch = setup(0.05)
    accumulated = biased_config(rate=0.05)
    accumulated.optimizer.grad_accumulation_steps = 2
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    step2 = jax.jit(make_train_step(model, accumulated, optimizer))
    (one, m1), (two, m2) = step(state, batch), step2(state, batch)
    for name in ("layers_1", "layers_3"):
        np.testing.assert_array_equal(one.params["decoder"][name]["moe"]["balance_bias"],
                                      two.params["decoder"][name]["moe"]["balance_bias"])
        key = f"moe_imbalance/decoder_{name[7:]}"
        assert float(m2[key]) == pytest.approx(float(m1[key]), rel=1e-5)


def test_the_first_dense_layers_scan_apart_and_equal_the_unrolled_stack():
    config = biased_config(every_n_layers=1, first_dense_layers=2)
    batch = text_batch()
    plain = models.build_model(config.model)
    params = nn.unbox(jax.jit(lambda inputs: plain.init(jax.random.key(0), inputs))(
        batch["inputs"])["params"])
    decoder = params["decoder"]
    assert ["moe" in decoder[f"layers_{i}"] for i in range(4)] == [False, False, True, True]
    config.model.scan_layers = True
    scanned = models.build_model(config.model)
    stack = lambda *names: jax.tree.map(lambda *x: np.stack(x), *(decoder[n] for n in names))
    p_scan = {**params, "decoder": {"final_norm": decoder["final_norm"],
                                    "dense_layers": stack("layers_0", "layers_1"),
                                    "layers": stack("layers_2", "layers_3")}}
    shapes = nn.unbox(jax.eval_shape(lambda inputs: scanned.init(jax.random.key(0), inputs),
                                     batch["inputs"])["params"])
    assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, p_scan)
    family = models.family_of(config)
    loss = lambda m, p: family.loss_and_metrics(m, config, p, batch, loads=True)[1]
    want, got = jax.jit(lambda p: loss(plain, p))(params), jax.jit(lambda p: loss(scanned, p))(
        p_scan)
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-6)
    loads = want["moe_expert_load"]["decoder"]
    np.testing.assert_allclose(got["moe_expert_load"]["decoder"]["layers"]["moe"]["expert_load"],
                               [loads[f"layers_{i}"]["moe"]["expert_load"] for i in (2, 3)],
                               rtol=1e-6)
    from transformer.nn import blocks

    # the names alone (eval_shape: no program to compile)
    names = lambda loads, cfg: sorted(jax.eval_shape(lambda x: blocks.layer_imbalance(x, cfg),
                                                     loads))
    assert names(got["moe_expert_load"], scanned.config) == names(
        want["moe_expert_load"], plain.config) == ["decoder_2", "decoder_3"]


@pytest.mark.parametrize("settings, message", [
    (dict(n_group=3), "model.moe.n_group=3: expected a divisor of num_experts=8"),
    (dict(topk_group=5), "model.moe.topk_group=5: expected an int in [1, n_group=4]"),
    (dict(top_k=5, topk_group=2), "model.moe.top_k=5: expected at most the experts of "
                                  "topk_group=2 groups (4)"),
    (dict(balance_bias=False), "model.moe.bias_update_rate=0.05: expected 0 without "
                              "moe.balance_bias=True"),
    (dict(shared_gate=True), "model.moe.shared_gate=True: expected moe.num_shared > 0"),
    (dict(score="tanh"), "model.moe.score='tanh': expected one of"),
    (dict(routed_scaling_factor=0.0), "model.moe.routed_scaling_factor=0.0: expected a number > 0"),
    (dict(first_dense_layers=4), "model.moe.first_dense_layers=4: expected fewer than the layers"),
    (dict(first_dense_layers=1, every_n_layers=2, scan=True),
     "model.moe.first_dense_layers=1: with scan_layers, expected a multiple of the layer period"),
    (dict(balance_bias=True, stage=2), "mesh.stage=2 with model.moe.balance_bias=True: expected "
                                      "one of them"),
])
def test_bad_routing_settings_are_one_line_errors_before_anything_runs(settings, message):
    config = biased_config()
    if settings.pop("scan", False):
        config.model.scan_layers = True
    stage = settings.pop("stage", None)
    config.model.moe.update(settings)
    with pytest.raises(ValueError, match=re.escape(message)):
        if stage:
            config.model.scan_layers = True
            configs.check_pipeline(config, {"stage": stage})
        configs.validate_config(config)


def test_the_bias_is_structure_and_its_rate_is_not():
    saved = biased_config().to_dict()
    assert checkpoint_manager.structural_differences(saved, biased_config(rate=0.0).to_dict()) \
        == []
    assert checkpoint_manager.structural_differences(
        saved, biased_config(rate=0.0, balance_bias=False).to_dict()) == [
        "model.moe.balance_bias: checkpoint True, config False"]


@pytest.mark.parametrize("capacity_factor", [0.0, 4.0], ids=["dropless", "capacity"])
def test_gpt_oss_experts_equal_transformers(capacity_factor):
    """Router and expert biases and the clamped SwiGLU (gpt-oss), against GptOssMLP with the
    same weights: HF's fused gate_up_proj interleaves the gate and up columns."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    from transformer.nn import moe

    E, D, F, K = 8, 16, 24, 2
    config = transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                       num_experts_per_tok=K, swiglu_limit=7.0)
    mlp = hf.GptOssMLP(config).eval()
    rng = np.random.default_rng(3)
    p = {name: rng.normal(scale=scale, size=shape).astype(np.float32) for name, shape, scale in [
        ("router", (E, D), 0.5), ("router_bias", (E,), 0.5), ("gate_up", (E, D, 2 * F), 0.6),
        ("gate_up_bias", (E, 2 * F), 0.5), ("down", (E, F, D), 0.3), ("down_bias", (E, D), 0.5)]}
    x = (rng.standard_normal((2, 10, D)) * 2).astype(np.float32)
    with torch.no_grad():
        for name, value in [("router.weight", "router"), ("router.bias", "router_bias"),
                            ("experts.gate_up_proj", "gate_up"),
                            ("experts.gate_up_proj_bias", "gate_up_bias"),
                            ("experts.down_proj", "down"), ("experts.down_proj_bias", "down_bias")]:
            mlp.get_parameter(name).copy_(torch.from_numpy(p[value]))
        want = mlp(torch.from_numpy(x))[0].numpy()
    layer = moe.MoEFeedForward(num_experts=E, d_ff=F, top_k=K, capacity_factor=capacity_factor,
                               gated=True, use_bias=True, swiglu_limit=7.0)
    params = {"router": p["router"].T, "router_bias": p["router_bias"],
              "wi_gate": p["gate_up"][..., ::2], "wi_up": p["gate_up"][..., 1::2],
              "wi_gate_bias": p["gate_up_bias"][:, ::2], "wi_up_bias": p["gate_up_bias"][:, 1::2],
              "wo": p["down"], "wo_bias": p["down_bias"]}
    shapes = nn.unbox(jax.eval_shape(lambda x: layer.init(jax.random.key(0), x), x)["params"])
    assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, params)
    y, routing_out = jax.jit(lambda p, x: layer.apply({"params": p}, x))(params, x)
    assert float(routing_out.dropped) == 0.0
    assert np.abs(want).max() > 1.0  # the biases and the clamp are in play
    np.testing.assert_allclose(y, want.reshape(y.shape), atol=2e-5, rtol=1e-5)
