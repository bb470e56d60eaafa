"""Quantized training through Qwix (transformer.nn.quantization, `model.quantization`): forward
close to float, the int8 / fp8 dots really in the program, straight-through gradients to every
quantized kernel (scanned, rematerialised, vmapped), the head (and the MTP input projection)
only with quantize_head, speculative decoding's draft quantized as training runs it, bad
values in one line, the CLI training int8 and resuming a float checkpoint in int8, and meshes
equal to one device (tests/quantization_check.py on 8 forced CPU devices)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core
from test_sharding import run_check
from test_train import (
    SHAKESPEARE,
    assert_succeeded,
    run_cli,
    tiny_flags,
    train_losses,
)

from transformer import configs
from transformer.models import build_model, default_model_config

LAYERS = 2
# Per layer: query, key, value and out projections, and the MLP's wi and wo.
PROJECTIONS = 6


def model_config(quantization: str = "", **overrides):
    config = default_model_config()
    config.update(family="gpt", num_layers=LAYERS, d_model=64, num_heads=4, d_ff=128,
                  vocab_size=96, position="rope", max_len=32, quantization=quantization,
                  **overrides)
    return config


TOKENS = np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)


def params_for(config):
    init = lambda tokens: build_model(config).init(jax.random.key(0), tokens)  # noqa: E731
    return nn.unbox(jax.jit(init)(TOKENS)["params"])


def logits(config, params, tokens=TOKENS):
    return build_model(config).apply({"params": params}, tokens)


def jitted_logits(config, params) -> np.ndarray:
    """logits(config, params) as one compiled program (traced afresh on each call)."""
    return np.asarray(jax.jit(lambda p: logits(config, p))(params))


def dots(fn, *args) -> list[tuple[str, str]]:
    """(lhs dtype, rhs dtype) of every dot_general in fn's jaxpr, nested jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for sub in jax_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@functools.cache
def layout_params(layout: tuple = ()):
    """The float model's params with model_config(**dict(layout)), initialised once."""
    return params_for(model_config(**dict(layout)))


@pytest.fixture(scope="module")
def float_params():
    return layout_params()


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("scheme,bound", [("int8", 0.05), ("fp8", 0.15)])
def test_the_forward_is_close_to_float_but_quantized(scheme, bound):
    want = shared("logits", "")
    got = shared("logits", scheme)
    # int8 keeps ~2 significant digits per operand, e4m3 ~1: errors of that size, not zero
    assert 1e-3 < relative_error(got, want) < bound


@pytest.mark.parametrize("scheme,dtype", [("int8", "int8"), ("fp8", "float8_e4m3fn")])
def test_each_projection_multiplies_quantized_operands_and_attention_stays_float(
        float_params, scheme, dtype):
    found = dots(lambda p: logits(model_config(scheme), p), float_params)
    assert found.count((dtype, dtype)) == LAYERS * PROJECTIONS, found
    # the rest (attention scores and weighted values, the tied head) stay float32
    assert all(d == ("float32", "float32") for d in found if d != (dtype, dtype)), found
    assert len(found) == LAYERS * (PROJECTIONS + 2) + 1


def test_quantize_head_quantizes_the_tied_head_too(float_params):
    found = dots(lambda p: logits(model_config("int8", quantize_head=True), p), float_params)
    assert found.count(("int8", "int8")) == LAYERS * PROJECTIONS + 1


@pytest.mark.parametrize("scan", [False, True])
def test_quantize_head_leaves_a_linear_mixers_projections_in_float(scan):
    """The head's rule matched every module (".*"): a short-conv hybrid's own projections,
    which stay in model.dtype, were quantized too under quantize_head."""
    layout = (("layer_types", "conv,full_attention"), ("scan_layers", scan))
    params = layout_params(layout)
    plain = dots(lambda p: logits(model_config("int8", **dict(layout)), p), params)
    head = dots(lambda p: logits(model_config("int8", quantize_head=True, **dict(layout)), p),
                params)
    assert head.count(("int8", "int8")) == plain.count(("int8", "int8")) + 1  # the head alone
    assert len(head) == len(plain) and plain.count(("int8", "int8")) < len(plain) - 3


def kernel_gradients(config, params):
    def loss(p):
        return jnp.mean(jnp.square(logits(config, p).astype(jnp.float32)))

    return jax.jit(jax.grad(loss))(params)


def kernels_of(tree) -> dict[str, np.ndarray]:
    """The quantized kernels' leaves: path -> array."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = ("'query'", "'key'", "'value'", "'out'", "'wi'", "'wo'")
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat
            if jax.tree_util.keystr(path).endswith(tuple(f"[{n}]" for n in names))}


@functools.cache
def shared(what: str, scheme: str, layout: tuple = ()):
    """The logits ("logits", jitted_logits) or the quantized kernels' gradients ("gradients",
    kernels_of(kernel_gradients)) of model_config(scheme, **dict(layout)) at the float model's
    params (the int8 and fp8 models init the same ones), on the flat GEMMs (never asked for
    under test_dots_over_the_head_axes_equal_the_flat_gemms's monkeypatch): compiled once for
    the tests that ask for the same model."""
    config, params = model_config(scheme, **dict(layout)), layout_params(layout)
    return (jitted_logits(config, params) if what == "logits" else
            kernels_of(kernel_gradients(config, params)))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("layout", [{}, {"scan_layers": True, "remat_policy": "full"}])
def test_straight_through_gradients_reach_every_quantized_kernel(scheme, layout):
    layout = tuple(sorted(layout.items()))
    want, got = shared("gradients", "", layout), shared("gradients", scheme, layout)
    assert len(got) == PROJECTIONS * (1 if layout else LAYERS) == len(want)
    for name, grad in got.items():
        cosine = np.sum(grad * want[name]) / (np.linalg.norm(grad) * np.linalg.norm(want[name]))
        assert cosine > 0.97, (name, cosine)  # the float gradient, through the rounding
        assert not np.array_equal(grad, want[name]), name  # but computed quantized


# int8: the forward and both gradients' dots per projection; fp8: e5m2 in the 2 gradients'.
@pytest.mark.parametrize("scheme,dtype,per_projection", [("int8", "int8", 3),
                                                         ("fp8", "float8_e5m2", 2)])
def test_the_backward_pass_quantizes_the_gradients(float_params, scheme, dtype, per_projection):
    """Qwix's quantized training: the gradients' matmuls (the activations' and the kernel's)
    multiply quantized operands too."""
    config = model_config(scheme)
    found = dots(jax.grad(lambda p: jnp.sum(logits(config, p))), float_params)
    assert sum(dtype in d for d in found) == per_projection * LAYERS * PROJECTIONS, found


def test_batched_seeds_quantize_every_projection_under_vmap(float_params):
    config = model_config("int8")
    stacked = jax.tree.map(lambda x: np.stack([x, x]), float_params)  # traced only
    found = dots(jax.vmap(lambda p: logits(config, p)), stacked)
    assert found.count(("int8", "int8")) == LAYERS * PROJECTIONS


@pytest.mark.parametrize("scheme", ["", "int8"])
def test_dots_over_the_head_axes_equal_the_flat_gemms(float_params, monkeypatch, scheme):
    """Off CPU `attention.matmul` dots over the kernels' own axes ([B, T, D] x [D, N, H] to heads,
    [B, T, N, H] x [N, H, D] back); on CPU it flattens them to 2-D GEMMs. Both are one math:
    Qwix's per-token and per-channel scales cover the same values either way."""
    from transformer.nn import attention

    config = model_config(scheme)
    flat = (shared("logits", scheme), shared("gradients", scheme))
    monkeypatch.setattr(attention, "FLAT_MATMUL_PLATFORMS", ())
    program = str(jax.make_jaxpr(lambda p: logits(config, p))(float_params))
    assert program.count("dimension_numbers=(([2, 3], [0, 1])") == LAYERS, program  # W_o's
    over_heads = (jitted_logits(config, float_params),  # traced again: over the head axes
                  kernels_of(kernel_gradients(config, float_params)))
    np.testing.assert_allclose(over_heads[0], flat[0], rtol=1e-5, atol=1e-5)
    assert over_heads[1].keys() == flat[1].keys() and len(flat[1]) == LAYERS * PROJECTIONS
    for name, grad in over_heads[1].items():
        np.testing.assert_allclose(grad, flat[1][name], rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("value", ["int4", "INT8", "bf16"])
def test_a_bad_quantization_is_one_line(value):
    config = configs.base_config()
    config.model.quantization = value
    with pytest.raises(ValueError) as error:
        configs.validate_config(config)
    assert "model.quantization" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"model.quantization=.*expected one of"):
        build_model(model_config(value))


def test_an_lstm_which_has_no_matmul_to_quantize_is_refused():
    """An LSTM's int8 run trained bit for bit as its float run: refused, not a silent no-op."""
    config = configs.experiment("lstm_lm")
    config.model.quantization = "int8"
    with pytest.raises(ValueError, match=r"model.quantization='int8' with family='lstm': "
                                         r"expected a transformer family"):
        build_model(config.model)


@pytest.mark.parametrize("layer_types,experts,refused", [
    ("mamba2", 0, True), ("linear_attention,conv", 4, True),
    ("mamba2,full_attention", 0, False)])
def test_a_model_with_nothing_to_quantize_is_refused(layer_types, experts, refused):
    """Linear mixers without a dense feed-forward (d_ff=0, or every one routed: the experts'
    einsums stay float) trained bit for bit as float: refused; one softmax layer is enough."""
    config = model_config("int8")
    config.layer_types, config.moe.num_experts = layer_types, experts
    config.d_ff = 32 if experts else 0
    if refused:
        with pytest.raises(ValueError, match=rf"layer_types={layer_types!r}, no dense "
                                             r"feed-forward: expected a softmax attention"):
            build_model(config)
    else:
        build_model(config)
    config.quantize_head = True  # the head is a matmul it quantizes
    build_model(config)


def test_resuming_may_change_quantization_and_says_so():
    from transformer.training import checkpoint_manager

    saved, current = {"model": {"quantization": ""}}, {"model": {"quantization": "fp8"}}
    assert checkpoint_manager.structural_differences(saved, current) == []
    assert checkpoint_manager.compute_changes(saved, current) == [
        "model.quantization: checkpoint '', config 'fp8'"]


@pytest.mark.slow
def test_cli_trains_int8_and_resumes_a_float_checkpoint_in_int8(tmp_path):
    workdir = tmp_path / "run"
    common = ["--config=experiments/gpt_tiny.py", f"--workdir={workdir}",
              f"--config.data.path={SHAKESPEARE}", "--config.optimizer.learning_rate=3e-3",
              "--config.optimizer.warmup_steps=2"]
    float_run = run_cli("transformer.train", *common, *tiny_flags(4),
                        logs=tmp_path / "float")
    assert_succeeded(float_run)
    steps = 30
    flags = [f if not f.startswith("--config.log_every") else "--config.log_every=2"
             for f in tiny_flags(steps)]
    resumed = run_cli("transformer.train", *common, *flags, "--config.model.quantization=int8",
                      logs=tmp_path / "int8")
    assert_succeeded(resumed)
    assert "changed on resume: model.quantization: checkpoint '', config 'int8'" in (
        resumed.stdout + resumed.stderr)
    losses = train_losses(workdir)
    assert min(losses) == 1 and max(losses) == steps  # steps 5.. resumed, not restarted
    later = [losses[s] for s in sorted(losses) if s > 4]
    assert np.mean(later[-3:]) < np.mean(later[:3]) - 0.2, losses  # int8 training learns


@pytest.mark.slow
def test_int8_training_on_meshes_equals_one_device(tmp_path_factory):
    """fsdp=8, data=2 x tensor=4 and 2 x 2 x 2 against one device, unrolled and scanned with
    remat. Not to float precision: a sharded reduction that rounds differently flips an int8
    rounding here and there (measured: losses 6e-5 apart, params 2e-3 after 4 Adam steps of
    lr 1e-3, where the float mesh runs agree to 2e-6)."""
    results = run_check("quantization_check.py", tmp_path_factory)
    for variant in ("unrolled", "scanned"):
        single = results[f"{variant} single"]
        for mesh in ("fsdp=8", "data=2,tensor=4", "2,2,2"):
            got = results[f"{variant} {mesh}"]
            np.testing.assert_allclose(got["losses"], single["losses"], rtol=2e-4)
            assert got["max_param_diff"] < 5e-3, (variant, mesh, got)
    # the sharded program multiplies int8: forward and both gradients of each projection
    assert results["unrolled 2,2,2"]["int8_dots"] == 3 * 2 * PROJECTIONS
    assert results["scanned 2,2,2"]["int8_dots"] >= 3 * PROJECTIONS


@pytest.mark.slow
def test_decoding_with_the_cache_sees_the_same_quantization(float_params):
    """Generation builds the model the same way: token-by-token decoding of an int8 model is
    quantized as its full forward pass is (activations are scaled per token in both)."""
    from transformer.models import init_cache

    config = model_config("int8")
    model = build_model(config)
    tokens = TOKENS[:, :8]
    cache = init_cache(model, tokens.shape[0], tokens.shape[1])
    steps = []
    for t in range(tokens.shape[1]):
        positions = np.full((tokens.shape[0], 1), t, np.int32)
        out, variables = model.apply({"params": float_params, "cache": cache}, tokens[:, t:t + 1],
                                     positions=positions, decode=True,
                                     cache_length=tokens.shape[1], mutable=["cache"])
        cache = variables["cache"]
        steps.append(out)
    decoded = jnp.concatenate(steps, axis=1)
    full = logits(config, float_params, tokens)
    float_full = logits(model_config(), float_params, tokens)
    # Not equal: the cached attention rounds differently in float, which flips an int8 rounding
    # downstream here and there; but twice as close to the int8 pass as to the float one.
    assert relative_error(decoded, full) < relative_error(decoded, float_full) / 2


def mtp_config(scheme: str = "", **overrides):
    """model_config with one multi-token prediction module (the speculative draft)."""
    config = model_config(scheme, **overrides)
    config.mtp.depth = 1
    return config


@functools.cache
def mtp_params():
    return params_for(mtp_config())


def mtp_logits(config, params, tokens=TOKENS):
    """The module's logits [B, T, V] on the training path (`__call__` with mtp_tokens)."""
    _, sown = build_model(config).apply({"params": params}, tokens, mtp_tokens=tokens,
                                        mutable=["mtp"])
    return sown["mtp"]["logits"][0][0]


def draft_logits(config, params, tokens=TOKENS):
    """The module's logits as speculative decoding drafts them (`draft` on an empty cache over
    every position), on the stack's final-norm vectors: the training path's math."""
    model, length = build_model(config), tokens.shape[1]
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
    shapes = jax.eval_shape(lambda: model.init(
        jax.random.key(0), tokens, positions=positions, decode=True, cache_length=length,
        mtp_tokens=tokens))["cache"]
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    _, hidden = model.apply({"params": params}, tokens, with_hidden=True)
    (_, drafted), _ = model.apply({"params": params, "cache": cache}, 1, hidden, tokens,
                                  positions, length, method="draft", mutable=["cache"])
    return drafted


def test_speculative_decoding_drafts_with_the_quantized_modules():
    """The draft runs the module's block quantized as training does: int8 in the whole
    speculative program, prefill and verify (the stack) and both drafts (the module's block),
    and its logits are the training path's."""
    from transformer.generation import speculative

    config, params = mtp_config("int8"), mtp_params()
    model = build_model(config)
    mode, knobs = speculative._split(speculative.sampling(0.0, 0, 1.0), 96, None, None)
    program = speculative._Program(model, 16, 4, mode)
    run = functools.partial(speculative._run, program=program)
    prompts = TOKENS[:, :8]
    found = dots(lambda p: run(p, prompts, np.full(2, 8, np.int32), knobs, jax.random.key(0)),
                 params)
    # the 2 stack passes' projections, and 2 x the module's block's (its input projection and
    # the tied head stay float without quantize_head)
    assert found.count(("int8", "int8")) == 2 * (LAYERS + 1) * PROJECTIONS, found
    np.testing.assert_allclose(draft_logits(config, params), mtp_logits(config, params),
                               rtol=1e-4, atol=1e-4)
    float_config = mtp_config()
    np.testing.assert_allclose(draft_logits(float_config, params),
                               mtp_logits(float_config, params), rtol=1e-5, atol=1e-5)


def test_quantize_head_quantizes_the_mtp_input_projection():
    """quantize_head covers every projection outside the blocks: the MTP module's input
    projection too (with the two tied heads, the stack's and the module's)."""
    params = mtp_params()
    fn = lambda config: lambda p: build_model(config).apply(  # noqa: E731
        {"params": p}, TOKENS, mtp_tokens=TOKENS, mutable=["mtp"])
    blocks = (LAYERS + 1) * PROJECTIONS
    assert dots(fn(mtp_config("int8")), params).count(("int8", "int8")) == blocks
    found = dots(fn(mtp_config("int8", quantize_head=True)), params)
    assert found.count(("int8", "int8")) == blocks + 2 + 1, found
