"""Mixture of experts: the block against a plain loop over tokens and experts; in the stacks
(every n-th layer, scanned and rematerialised, the router losses in the training loss, active
params); config and restore checks; and (slow, 8 forced CPU devices in tests/expert_check.py)
the expert mesh axis against one device."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer import configs, models
from transformer.nn import moe
from transformer.parallel import sharding
from transformer.training import checkpoint_manager, metrics, optim
from transformer.training import state as state_lib
from transformer.training.state import TrainState
from transformer.training.step import make_seeded_train_step, make_train_step

B, T, D, F = 2, 8, 8, 12


def decisions(logits_BTE: np.ndarray, top_k: int, slots: int, normalize: bool):
    """The routing a loop makes: for each row, first choices of every token, then second
    choices, ..., each taking a slot of its expert while there are any. Returns the kept
    (row, token, expert) triples and, per row, the (token, expert) pairs chosen and dropped."""
    kept, chosen, dropped = [], 0, 0
    for b in range(logits_BTE.shape[0]):
        order = np.argsort(-logits_BTE[b], axis=-1, kind="stable")[:, :top_k]
        used = np.zeros(logits_BTE.shape[-1], int)
        for k in range(top_k):
            for t in range(logits_BTE.shape[1]):
                e = int(order[t, k])
                chosen += 1
                if used[e] < slots:
                    used[e] += 1
                    kept.append((b, t, e, tuple(order[t])))
                else:
                    dropped += 1
    return kept, dropped / chosen


def reference(params, x, kept, *, gated, normalize, shared):
    """y[b, t] = sum over the kept (b, t, e) of gate(b, t, e) * FFN_e(x[b, t]), one token and
    one expert at a time."""
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, params["router"]), -1)

    def ffn(token, wi, wo, wi_up=None):
        h = nn.gelu(token @ wi)
        return (h if wi_up is None else h * (token @ wi_up)) @ wo

    out = {(b, t): [] for b in range(x.shape[0]) for t in range(x.shape[1])}
    for b, t, e, top in kept:
        # Top-1 keeps the raw probability (a normalized gate of 1 would not train the router).
        gate = probs[b, t, e] / (sum(probs[b, t, j] for j in top)
                                 if normalize and len(top) > 1 else 1.0)
        if gated:
            y = ffn(x[b, t], params["wi_gate"][e], params["wo"][e], params["wi_up"][e])
        else:
            y = ffn(x[b, t], params["wi"][e], params["wo"][e])
        out[b, t].append(gate * y)
    if shared:
        for (b, t), parts in out.items():
            parts.append(ffn(x[b, t], params["shared_wi"], params["shared_wo"],
                             params["shared_wi_up"] if gated else None))
    rows = [sum(parts) if parts else jnp.zeros(x.shape[-1]) for parts in out.values()]
    return jnp.stack(rows).reshape(x.shape)


@pytest.mark.slow
@pytest.mark.parametrize("experts, top_k, capacity_factor, gated, normalize, shared", [
    (4, 2, 1.25, False, True, 0),
    (4, 2, 0.5, True, True, 0),  # tight: many (token, expert) pairs are dropped
    (5, 1, 1.0, False, False, 0),  # Switch: top-1, raw probabilities as gates
    (5, 1, 1.0, False, True, 0),  # top-1 is never normalized
    (4, 3, 0.0, True, True, 1),  # dropless, with a shared expert
])
def test_the_block_equals_a_loop_over_tokens_and_experts(experts, top_k, capacity_factor,
                                                         gated, normalize, shared):
    layer = moe.MoEFeedForward(num_experts=experts, d_ff=F, top_k=top_k,
                               capacity_factor=capacity_factor, num_shared=shared,
                               activation=nn.gelu, gated=gated, normalize_gates=normalize,
                               init_std=0.5)
    x = np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32)

    @jax.jit
    def init(x):  # the params and the router's logits, in one program
        params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
        return params, jnp.einsum("btd,de->bte", x, params["router"])

    params, logits = init(x)
    slots = moe.capacity(T, experts, top_k, capacity_factor)
    logits = np.asarray(logits)
    kept, dropped = decisions(logits, top_k, slots, normalize)
    if capacity_factor == 0.5:
        assert dropped > 0.2  # the case really drops
    if capacity_factor == 0.0:
        assert dropped == 0

    @jax.jit
    def outputs_and_grads(params, x, probe):  # the block's and the loop's, in one program
        (y, routing), vjp = jax.vjp(lambda p, x: layer.apply({"params": p}, x), params, x)
        want, want_vjp = jax.vjp(lambda p, x: reference(p, x, kept, gated=gated,
                                                        normalize=normalize, shared=shared),
                                 params, x)
        zero = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0)
                            if jnp.issubdtype(a.dtype, jnp.integer) else jnp.zeros_like(a),
                            routing)
        return y, routing.dropped, want, vjp((probe, zero)), want_vjp(probe)

    probe = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    y, got_dropped, want, got_grads, want_grads = outputs_and_grads(params, x, probe)
    np.testing.assert_allclose(y, want, atol=1e-5)
    assert float(got_dropped) == pytest.approx(dropped)
    for got, expected in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads),
                             strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_auxiliary_losses_equal_their_formulas():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 16, 6)).astype(np.float32) * 2
    route = jax.jit(moe.route, static_argnames=("top_k", "slots"))
    routing = route(logits, top_k=2, slots=4)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top2 = np.argsort(-logits, -1)[..., :2]
    fraction = np.array([(top2 == e).sum() for e in range(6)]) / top2.size
    np.testing.assert_allclose(routing.load_balance,
                               6 * np.sum(fraction * probs.mean((0, 1))), rtol=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(routing.router_z, np.mean(lse**2), rtol=1e-6)
    # A uniform router is perfectly balanced (1), however ties are broken.
    assert float(route(np.zeros((2, 8, 4), np.float32), top_k=2, slots=8).load_balance) == (
        pytest.approx(1.0))


def test_padding_takes_no_slot_and_counts_in_no_auxiliary_quantity():
    # Real tokens then padding: the real tokens route exactly as the row without the padding
    # would with the same slots, and the padding's buffers stay empty.
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 12, 4)).astype(np.float32) * 2
    valid = np.arange(12)[None] < np.array([[7], [12]])
    route = jax.jit(moe.route, static_argnames=("top_k", "slots"))
    padded = route(logits, top_k=2, slots=3, valid_BT=valid)
    alone = route(logits[:1, :7], top_k=2, slots=3)
    np.testing.assert_array_equal(padded.dispatch_BTEC[0, :7], alone.dispatch_BTEC[0])
    np.testing.assert_array_equal(padded.combine_BTEC[0, :7], alone.combine_BTEC[0])
    assert not np.any(padded.dispatch_BTEC[0, 7:])
    full = route(logits[1:], top_k=2, slots=3)
    np.testing.assert_array_equal(padded.dispatch_BTEC[1], full.dispatch_BTEC[0])
    # The auxiliary quantities are over the 19 real tokens' 38 pairs, by hand in float64.
    real = np.concatenate([logits[0, :7], logits[1]]).astype(np.float64)
    probs = np.exp(real - real.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top2 = np.argsort(-real, -1)[:, :2]
    fraction = np.array([(top2 == e).sum() for e in range(4)]) / top2.size
    np.testing.assert_allclose(padded.load_E, fraction, rtol=1e-6)
    np.testing.assert_allclose(padded.load_balance, 4 * np.sum(fraction * probs.mean(0)),
                               rtol=1e-5)
    lse = np.log(np.exp(real).sum(-1))
    np.testing.assert_allclose(padded.router_z, np.mean(lse**2), rtol=1e-5)
    kept = np.sum(alone.dispatch_BTEC) + np.sum(full.dispatch_BTEC)
    np.testing.assert_allclose(padded.dropped, 1 - kept / 38, rtol=1e-6)


def test_the_router_runs_in_float32_and_experts_carry_the_expert_axis():
    layer = moe.MoEFeedForward(num_experts=4, d_ff=F, dtype=jnp.bfloat16)
    x = np.ones((B, T, D), jnp.bfloat16)
    variables = jax.jit(lambda x: layer.init(jax.random.key(0), x))(x)
    boxed = variables["params"]
    assert boxed["router"].value.dtype == jnp.float32
    assert boxed["wi"].names == ("expert", "expert_embed", "mlp")
    assert boxed["wo"].names == ("expert", "mlp", "expert_embed")
    (y, routing), _ = jax.vjp(jax.jit(lambda v: layer.apply(v, x)), nn.unbox(variables))
    assert y.dtype == jnp.bfloat16 and routing.combine_BTEC.dtype == jnp.float32


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4, d_ff=F, top_k=5), "top_k=5: expected 1 <= top_k <= num_experts=4"),
    (dict(num_experts=4, d_ff=F, capacity_factor=-1.0), "capacity_factor=-1.0: expected >= 0"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        jax.eval_shape(lambda: moe.MoEFeedForward(**kwargs).init(jax.random.key(0),
                                                                  jnp.ones((1, 4, D))))


# --- in the stacks ------------------------------------------------------------------------------


def gpt_config(**moe_settings):
    config = configs.base_config()
    config.update(batch_size=4, seq_len=16)
    config.model.update(family="gpt", num_layers=4, d_model=32, num_heads=4, d_ff=48,
                        vocab_size=64, activation="swiglu", use_bias=False)
    config.model.moe.update({**dict(num_experts=4, top_k=2, every_n_layers=2,
                                     capacity_factor=1.0), **moe_settings})
    return config


def text_batch(rows=4, length=16, vocab=64):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((rows, length), np.float32),
            "segment_ids": np.ones((rows, length), np.int32),
            "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1))}


def test_a_capacity_moe_reads_the_same_real_tokens_whatever_the_padding_holds():
    # Right-padded rows (segment_ids 0): with 8 slots an expert for 16 tokens' 32 choices, the
    # padding's first choices would go before the real tokens' second ones and take slots.
    config = gpt_config(capacity_factor=1.0)
    model = models.build_model(config.model)
    batch = text_batch()
    segments = (np.arange(16)[None] < np.array([[5], [9], [16], [11]])).astype(np.int32)
    params = jax.jit(lambda x: model.init(jax.random.key(0), x))(batch["inputs"])["params"]
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens,
                                                 segment_ids=segments))
    logits = [np.asarray(forward(np.where(segments > 0, batch["inputs"], pad)))
              for pad in (np.zeros_like(batch["inputs"]), np.roll(batch["inputs"], 3, axis=1))]
    real = segments > 0
    np.testing.assert_array_equal(logits[0][real], logits[1][real])


def grouped(unrolled: dict, num_layers: int, every: int) -> dict:
    """Unrolled decoder params {layers_i} -> the scanned groups {layers: {block_j: [L/n]}}."""
    decoder = dict(unrolled["decoder"])
    layers = [decoder.pop(f"layers_{i}") for i in range(num_layers)]
    decoder["layers"] = {f"block_{j}": jax.tree.map(lambda *xs: np.stack(xs),
                                                    *layers[j::every]) for j in range(every)}
    return {**unrolled, "decoder": decoder}


@pytest.mark.slow
def test_every_nth_layer_is_moe_and_a_scanned_rematerialised_stack_equals_the_unrolled_one():
    config = gpt_config()
    batch = text_batch()
    family = models.family_of(config)
    unrolled_model = models.build_model(config.model)
    params = nn.unbox(jax.jit(lambda inputs: unrolled_model.init(jax.random.key(0), inputs))(
        batch["inputs"])["params"])
    assert [("moe" in params["decoder"][f"layers_{i}"]) for i in range(4)] == [
        False, True, False, True]
    assert "mlp" in params["decoder"]["layers_0"] and "mlp" not in params["decoder"]["layers_1"]
    config.model.update(scan_layers=True, remat_policy="full")
    scanned_model = models.build_model(config.model)
    scanned = grouped(params, 4, 2)
    shapes = jax.eval_shape(lambda inputs: scanned_model.init(jax.random.key(0), inputs),
                            batch["inputs"])["params"]
    assert jax.tree.map(lambda x: x.shape, nn.unbox(shapes)) == jax.tree.map(
        lambda x: x.shape, scanned)

    def loss(model, p):
        return family.loss_and_metrics(model, config, p, batch)

    (want, want_metrics), want_grads = jax.jit(jax.value_and_grad(
        lambda p: loss(unrolled_model, p), has_aux=True))(params)
    (got, got_metrics), got_grads = jax.jit(jax.value_and_grad(
        lambda p: loss(scanned_model, p), has_aux=True))(scanned)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for name in ("moe_load_balance", "moe_router_z", "moe_dropped"):
        assert float(got_metrics[name]) == pytest.approx(float(want_metrics[name]), rel=1e-6)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got_grads),
                                   jax.tree.leaves(grouped(want_grads, 4, 2)), strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, atol=2e-6)


@pytest.mark.slow
def test_the_training_loss_adds_the_weighted_router_losses_averaged_over_the_moe_layers():
    config = gpt_config(load_balance_loss=0.5, router_z_loss=0.25)
    batch = text_batch()
    family = models.family_of(config)
    model = models.build_model(config.model)
    config0 = gpt_config(load_balance_loss=0.0, router_z_loss=0.0)
    grad = lambda c, params: jax.grad(lambda p: family.loss_and_metrics(model, c, p, batch)[0])(
        params)["decoder"]["layers_1"]["moe"]["router"]

    @jax.jit
    def run(inputs):  # everything the test compares, in one program
        params = nn.unbox(model.init(jax.random.key(0), inputs)["params"])
        loss, metrics = family.loss_and_metrics(model, config, params, batch)
        # The per-layer routing, recomputed from the MoE layers' own inputs.
        _, state = model.apply({"params": params}, batch["inputs"],
                               positions=batch["positions"], segment_ids=batch["segment_ids"],
                               mutable=["losses"])
        ce, _ = family.loss(family.logits(model, params, batch), batch)
        return (loss, metrics, state["losses"]["decoder"], ce, grad(config, params),
                grad(config0, params))

    loss, metrics, per_layer, ce, router_grad, router_grad0 = run(batch["inputs"])
    assert sorted(per_layer) == ["layers_1", "layers_3"]
    mean = lambda name: np.mean([per_layer[f"layers_{i}"][f"moe_{name}"][0] for i in (1, 3)])
    assert float(metrics["moe_load_balance"]) == pytest.approx(mean("load_balance"))
    assert float(metrics["moe_router_z"]) == pytest.approx(mean("router_z"))
    assert float(metrics["loss"]) == pytest.approx(float(ce), rel=1e-6)  # the task's loss
    assert float(loss) == pytest.approx(float(ce) + 0.5 * mean("load_balance")
                                        + 0.25 * mean("router_z"), rel=1e-6)
    assert 0.0 <= float(metrics["moe_dropped"]) < 1.0
    # The balance loss reaches the router: its gradient changes with the loss's weight.
    assert np.abs(np.asarray(router_grad) - np.asarray(router_grad0)).max() > 1e-4


def packed_batch(rows=4, length=16, vocab=64):
    """Packed documents of uneven lengths and right padding, so that micro-batches hold
    different shares of the targets (a document's last token has none) and of the valid
    tokens (padding has neither)."""
    batch = text_batch(rows, length, vocab)
    lengths = {0: [3], 1: [5, 11], 2: [2, 4], 3: [16]}
    segments, positions = (np.zeros((rows, length), np.int32) for _ in range(2))
    weights = np.zeros((rows, length), np.float32)
    for row, docs in lengths.items():
        start = 0
        for i, n in enumerate(docs):
            segments[row, start:start + n] = i + 1
            positions[row, start:start + n] = np.arange(n)
            weights[row, start:start + n - 1] = 1.0
            start += n
    return {**batch, "segment_ids": segments, "positions": positions, "weights": weights}


def test_micro_batches_give_the_whole_batch_router_z_loss_and_gradients():
    """Under gradient accumulation the router z-loss (a mean over the valid tokens), the
    dropped fraction and the expert loads are the whole batch's, not a mean of the
    micro-batches' weighted by their targets: with uneven packing these differ."""
    config = gpt_config(capacity_factor=2.0, load_balance_loss=0.0, router_z_loss=1.0)
    batch = packed_batch()
    model = models.build_model(config.model)
    params = nn.unbox(jax.jit(lambda x: model.init(jax.random.key(0), x))(
        batch["inputs"])["params"])
    optimizer = optax.sgd(0.0)
    state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                       np.asarray(-1, np.int32))
    results = []
    for accumulation in (1, 2):
        config.optimizer.grad_accumulation_steps = accumulation
        gradients = make_seeded_train_step(model, config, optimizer).gradients
        results.append(jax.jit(gradients)(state, batch, jax.random.key(0)))
    (grads1, m1), (grads2, m2) = results
    assert float(m2["moe_router_z"]) == pytest.approx(float(m1["moe_router_z"]), rel=1e-6)
    assert float(m2["moe_dropped"]) == pytest.approx(float(m1["moe_dropped"]), abs=1e-6)
    for a, b in zip(jax.tree.leaves(m1["moe_expert_load"]), jax.tree.leaves(m2["moe_expert_load"]),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_active_params_leave_out_the_experts_a_token_skips_and_flops_count_them():
    config = gpt_config(num_shared=1)
    model = models.build_model(config.model)
    abstract, _, _ = state_lib.initial_state(config, model, sharding.make_mesh(config.mesh,
                                                                              jax.devices()[:1]))
    total = state_lib.num_params(abstract)
    # Per MoE layer, 4 experts of SwiGLU (gate, up, down: 3 x 32 x 48), 2 of them skipped.
    assert state_lib.active_params(abstract, config) == total - 2 * 2 * 3 * 32 * 48
    dense = configs.base_config()
    dense.model.update(gpt_config().model.to_dict())
    dense.model.moe.num_experts = 0
    dense_abstract, _, _ = state_lib.initial_state(
        dense, models.build_model(dense.model), sharding.make_mesh(dense.mesh, jax.devices()[:1]))
    assert state_lib.active_params(dense_abstract, dense) == state_lib.num_params(dense_abstract)
    active = state_lib.active_params(abstract, config)
    assert metrics.flops_per_token(config, active) == pytest.approx(
        6 * active + 12 * 4 * 32 * 16)


@pytest.mark.parametrize("settings, message", [
    (dict(every_n_layers=3), "model.moe.every_n_layers=3: expected a divisor of num_layers=4"),
    (dict(top_k=5), "model.moe.top_k=5: expected an int in [1, num_experts=4]"),
    (dict(capacity_factor=-1.0), "model.moe.capacity_factor=-1.0: expected a number >= 0"),
    (dict(num_experts=-2), "model.moe.num_experts=-2: expected an int >= 0"),
])
def test_bad_moe_settings_are_one_line_errors_before_anything_runs(settings, message):
    config = gpt_config()
    config.model.moe.update(settings)
    with pytest.raises(ValueError, match=re.escape(message)):
        configs.validate_config(config)


def test_an_lstm_with_experts_and_an_moe_export_are_refused():
    config = gpt_config()
    config.model.family = "lstm"
    with pytest.raises(ValueError, match=re.escape("moe.num_experts=4 with family='lstm'")):
        configs.validate_config(config)
    from transformer.hf import export

    # MoE GPTs export as Mixtral / Qwen-MoE (test_export.py); not with LayerNorm
    with pytest.raises(ValueError, match="export to mixtral: model.norm='layernorm' has no "):
        export.to_hf(gpt_config().model, {})


def test_restoring_checks_the_moe_structure_but_not_its_loss_weights():
    saved = gpt_config().to_dict()
    changed = gpt_config(capacity_factor=2.0, load_balance_loss=0.1, router_z_loss=0.0)
    assert checkpoint_manager.structural_differences(saved, changed.to_dict()) == []
    other = gpt_config(top_k=1)
    assert checkpoint_manager.structural_differences(saved, other.to_dict()) == [
        "model.moe.top_k: checkpoint 2, config 1"]
    # A checkpoint from before `moe` existed is a dense model: it restores into a dense config.
    dense = configs.base_config().to_dict()
    old = {**dense, "model": {k: v for k, v in dense["model"].items() if k != "moe"}}
    assert checkpoint_manager.structural_differences(old, dense) == []
    assert "model.moe.num_experts: checkpoint 0, config 4" in \
        checkpoint_manager.structural_differences(old, saved)


@pytest.fixture(scope="module")
def expert_results(tmp_path_factory):
    from test_sharding import run_check

    return run_check("expert_check.py", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["expert=8", "fsdp=2,expert=4", "fsdp=2,expert=2,tensor=2",
                                  "fsdp=2,expert=4 scanned", "expert=8 dropless",
                                  "data=8 dropless", "fsdp=2,expert=4 scanned dropless"])
def test_each_expert_mesh_trains_like_one_device_with_the_experts_split(expert_results, mesh):
    result = expert_results[mesh]
    variant = mesh.split(" ", 1)[1] if " " in mesh else "unrolled"
    single = expert_results[f"single {variant}"]["records"]
    for got, want in zip(result["records"], single, strict=True):
        for name in ("loss", "moe_load_balance", "moe_router_z", "moe_dropped", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=2e-5, abs=1e-7), (name, got, want)
    if variant.endswith("dropless"):
        assert all(record["moe_dropped"] == 0 for record in single)
        # the balance bias moved (3 steps of 0.01) and equals one device's (max_param_diff)
        assert result["bias_moved"] >= 0.01
        for got, want in zip(result["records"], single, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        experts = mesh.split()[0].split("expert=")[1].split(",")[0] if "expert" in mesh else 1
        assert result["dispatch"] == ["moe dispatch: " + (
            f"dense all-to-all over expert={experts}" if "expert" in mesh
            else "ragged per shard")]  # the all-to-all XLA:CPU compiles
        assert expert_results[f"single {variant}"]["dispatch"] == ["moe dispatch: ragged"]
    else:
        assert single[0]["moe_dropped"] > 0.05  # the capacity really drops tokens
    assert result["max_param_diff"] < 2e-5
    sizes = dict(part.split("=") for part in mesh.split()[0].split(","))
    experts = int(sizes.get("expert", 1))
    layout = result["layout"]
    layer = [2] if variant.startswith("scanned") else []  # a scanned stack's layer axis: 2 groups
    fsdp = int(sizes.get("fsdp", 1))
    tensor = int(sizes.get("tensor", 1))
    assert layout["wi_gate"]["shard_shape"] == layer + [8 // experts, 32 // fsdp, 48 // tensor]
    assert layout["wo"]["shard_shape"] == layer + [8 // experts, 48 // tensor, 32 // fsdp]
    # The router, like every param outside the experts, is split over fsdp x expert.
    assert layout["router"]["shard_shape"] == layer + [32 // (fsdp * experts), 8]
    if mesh in ("expert=8", "fsdp=2,expert=4 scanned"):  # the programs the script reads
        assert result["all_to_all"] > 0  # tokens travel to their experts and back


@pytest.fixture(scope="module")
def dispatch_results(tmp_path_factory):
    from test_sharding import run_check

    return run_check("moe_dispatch_check.py", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, path", [
    ("expert=4", "dense all-to-all over expert=4"),
    ("data=2,expert=4", "dense all-to-all over expert=4"),
    ("fsdp=2,expert=4", "dense all-to-all over expert=4"),
    ("expert=4,tensor=2", "dense all-to-all over expert=4"),
    ("fsdp=2,expert=2,tensor=2", "dense all-to-all over expert=2"),
    ("expert=2,sequence=2,data=2", "dense all-to-all over expert=2"),
    ("data=8", "ragged per shard"),
    ("fsdp=2,sequence=2,tensor=2", "ragged per shard"),
    # XLA:CPU has no ragged-all-to-all: the script emulates the primitive from its docstring.
    ("expert=4 emulated ragged", "ragged all-to-all over expert=4"),
    ("data=2,expert=2,tensor=2 emulated ragged", "ragged all-to-all over expert=2"),
])
def test_dropless_moe_on_a_mesh_equals_the_one_device_ragged_path(dispatch_results, mesh, path):
    result = dispatch_results[mesh]
    assert result["dispatch"] == [f"moe dispatch: {path}"]
    assert result["loss_diff"] <= 1e-5 * abs(result["loss"])
    assert result["output_diff"] < 1e-5 and result["grad_diff"] < 1e-5


@pytest.mark.slow
def test_dropless_moe_on_an_expert_mesh_needs_memory_linear_in_the_tokens(dispatch_results):
    memory = dispatch_results["memory"]
    sharded = memory["sharded T=256"]["temp_bytes"] / memory["sharded T=64"]["temp_bytes"]
    buffers = memory["capacity T=256"]["temp_bytes"] / memory["capacity T=64"]["temp_bytes"]
    assert memory["sharded T=64"]["dispatch"] == ["moe dispatch: dense all-to-all over expert=4"]
    assert sharded < 5, sharded  # 4x the tokens: ~4x the bytes
    assert buffers > 10, buffers  # what T slots per expert cost: ~16x


def test_dropless_dispatch_without_a_mesh_is_the_ragged_path_and_capacity_is_buffers():
    assert moe.dispatch_path(0, 8, (2, 8, 4)) == "ragged"
    assert moe.dispatch_path(1.25, 8, (2, 8, 4)) == "capacity buffers"


def test_sorted_apply_sends_each_expert_its_rows_and_sums_them_back_with_the_gates():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    choice = rng.integers(0, 4, (2, 5, 2)).astype(np.int32)
    gates = rng.uniform(size=(2, 5, 2)).astype(np.float32)
    scale_E = np.array([1.0, -2.0, 3.0, 0.5], np.float32)

    @jax.jit
    def run(x, choice, gates):
        seen = {}

        def apply(x_ND, sizes_E):  # expert e multiplies its rows by scale_E[e]
            assert x_ND.shape[0] == 20
            seen["sizes_E"] = sizes_E
            return x_ND * jnp.repeat(scale_E, sizes_E, total_repeat_length=20)[:, None]

        return moe.sorted_apply(x, choice, gates, apply, 4), seen["sizes_E"]

    got, sizes_E = run(x, choice, gates)
    assert int(np.asarray(sizes_E).sum()) == 20
    want = np.einsum("btk,btd->btd", gates * scale_E[choice], x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_first_step_line_names_the_moe_dispatch_path_apart_from_attention():
    import types

    from transformer.nn import kernels
    from transformer.training import progress

    lines = []
    run = types.SimpleNamespace(step=1, goodput=types.SimpleNamespace(compiled=lambda now: None),
                                logger=types.SimpleNamespace(print=lines.append))
    x = np.ones((2, 4, D), np.float32)
    layer = moe.MoEFeedForward(num_experts=4, d_ff=F, top_k=2, capacity_factor=0.0)
    with kernels.recording() as chosen:
        jax.eval_shape(lambda x: layer.init(jax.random.key(0), x), x)
        kernels.record("dense")
    progress.log_first_step(run, 0.0, chosen)
    assert re.match(r"step 1: the first step \(compilation included, attention dense, moe "
                    r"dispatch: ragged\) took", lines[0]), lines


def test_a_t5s_two_stacks_log_each_moe_layer_and_move_their_balance_biases():
    """A T5 with experts in both stacks (scanned, the first layer dense, the decoder shallower)
    trains a step: each MoE layer's imbalance is logged under its stack and true index, and
    every balance bias moves (the step once read the layout off `model.config`, which an
    encoder-decoder does not have: an AttributeError at the first step)."""
    config = configs.base_config()
    config.update(batch_size=2, seq_len=8)
    config.model.update(family="t5", position="t5", num_layers=3, num_decoder_layers=2,
                        d_model=32, num_heads=4, d_ff=48, vocab_size=64, scan_layers=True)
    config.model.moe.update(num_experts=4, top_k=2, first_dense_layers=1, score="sigmoid",
                            balance_bias=True, bias_update_rate=0.05)
    model = models.build_model(config.model)
    rng = np.random.default_rng(0)
    tokens = lambda length: rng.integers(1, 64, (2, length)).astype(np.int32)
    targets = tokens(6)
    batch = {"encoder_inputs": tokens(8), "decoder_inputs": models.shift_right(targets, 0),
             "targets": targets, "weights": np.ones((2, 6), np.float32)}
    params = nn.unbox(model.init(jax.random.key(0), batch["encoder_inputs"],
                                 batch["decoder_inputs"])["params"])
    optimizer = optax.sgd(0.0)  # only the balance biases move
    state = TrainState(np.zeros((), np.int32), params, optimizer.init(params),
                       np.asarray(-1, np.int32))
    new, metrics = jax.jit(make_train_step(model, config, optimizer))(state, batch)
    logged = sorted(name for name in metrics if name.startswith("moe_imbalance/"))
    assert logged == ["moe_imbalance/decoder_1", "moe_imbalance/encoder_1",
                      "moe_imbalance/encoder_2"]
    assert float(metrics["moe_imbalance"]) == max(float(metrics[name]) for name in logged)
    moved = {path: np.abs(np.asarray(b) - np.asarray(a)).max() for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(
            new.params), strict=True) if "balance_bias" in jax.tree_util.keystr(path)}
    assert len(moved) == 2 and all(m > 0 for m in moved.values())  # one per scanned stack


def balance_bias_step(**optimizer):
    """(config, params, state after) one train step of `gpt_config`'s MoE (layers 1 and 3)
    with balance biases moving 0.01 a step, under make_optimizer with `optimizer`'s keys."""
    config = gpt_config(balance_bias=True, bias_update_rate=0.01)
    config.update(steps=4)
    config.optimizer.update(warmup_steps=0, **optimizer)
    model = models.build_model(config.model)
    batch = text_batch()
    params = nn.unbox(model.init(jax.random.key(0), batch["inputs"])["params"])
    tx = optim.make_optimizer(config)
    state = TrainState(np.zeros((), np.int32), params, tx.init(params),
                       np.asarray(-1, np.int32))
    new, _ = jax.jit(make_train_step(model, config, tx))(state, batch)
    return config, params, new


def test_optimizer_freeze_keeps_a_balance_bias_fixed():
    """optimizer.freeze names params that stay fixed: a frozen balance bias does not move
    (the step once moved every bias whatever the freeze); an unfrozen one does."""
    _, params, new = balance_bias_step(freeze="layers_1/moe/")
    bias = lambda p, layer: np.asarray(p["decoder"][layer]["moe"]["balance_bias"])
    np.testing.assert_array_equal(bias(new.params, "layers_1"), bias(params, "layers_1"))
    assert np.abs(bias(new.params, "layers_3") - bias(params, "layers_3")).max() > 0


def test_schedule_free_evaluates_a_balance_bias_at_its_train_value():
    """No optimizer moves a balance bias: schedule-free's x = (y - (1 - b1) z) / b1, which
    evaluates the other params, would read its stale z (a bias of 0.03 exported as 0.0333)."""
    config, _, new = balance_bias_step(name="schedule_free_adamw", decay="constant")
    evaluated = optim.eval_params(new, config)
    layer, evaluated_layer = new.params["decoder"]["layers_1"], evaluated["decoder"]["layers_1"]
    assert np.abs(np.asarray(layer["moe"]["balance_bias"])).max() > 0
    np.testing.assert_array_equal(evaluated_layer["moe"]["balance_bias"],
                                  layer["moe"]["balance_bias"])
    assert not np.array_equal(evaluated_layer["moe"]["router"], layer["moe"]["router"])
