"""Feed-forward, norms, pre/post-LN blocks and stacks: formulas, causality, symmetry, scan."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy.special import erf

from transformer.nn import masks
from transformer.nn.activations import gelu, gelu_tanh
from transformer.nn.attention import AttentionSettings, MultiHeadAttention
from transformer.nn.blocks import TransformerBlock, TransformerStack
from transformer.nn.config import TransformerConfig
from transformer.nn.layers import MLP, stack_layers, unstack_layers
from transformer.training import placement

SMALL = dict(num_layers=2, d_model=16, num_heads=4, d_ff=32)
B, T = 2, 7


def inputs(seed=0, length=T, batch=B, d_model=16):
    """Standard normal float32 [batch, length, d_model] (NumPy's draws, put on the device
    without an op to compile)."""
    x = np.random.default_rng(seed).standard_normal((batch, length, d_model), np.float32)
    return jax.device_put(x)


@functools.partial(jax.jit, static_argnums=0, static_argnames="deterministic")
def jit_apply(module, variables, *args, **kwargs):
    """`module.apply`, compiled once per module, shapes and keywords."""
    return module.apply(variables, *args, **kwargs)


@functools.partial(jax.jit, static_argnums=0)
def init_and_apply(module, key, *args, **kwargs):
    """`module`'s variables from `key`, and its output on `args`: one program."""
    variables = module.init(key, *args, **kwargs)
    return variables, module.apply(variables, *args, **kwargs)


def layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p.get("bias", 0.0)


def rms_norm(x, p, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * p["scale"]


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu", "geglu"])
def test_feed_forward_equals_formula(activation):
    cfg = TransformerConfig(**SMALL, activation=activation)
    x = inputs()
    variables, out = init_and_apply(MLP(cfg), jax.random.key(1), x)
    p = jax.tree.map(np.asarray, nn.unbox(variables)["params"])
    xs = np.asarray(x, np.float64)
    gelu = lambda z: 0.5 * z * (1 + erf(z / np.sqrt(2)))
    gelu_tanh = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
    if activation in ("swiglu", "geglu"):  # (act(x W_g) * x W_u) W_o
        gate = xs @ p["wi_gate"] + p["wi_gate_bias"]
        act = (lambda z: z / (1 + np.exp(-z))) if activation == "swiglu" else gelu_tanh
        hidden = act(gate) * (xs @ p["wi_up"] + p["wi_up_bias"])
    else:  # e.g. ReLU: max(0, x W1 + b1) W2 + b2
        act = {"relu": lambda z: np.maximum(0.0, z), "gelu": gelu, "gelu_tanh": gelu_tanh}
        hidden = act[activation](xs @ p["wi"] + p["wi_bias"])
    expected = hidden @ p["wo"] + p["wo_bias"]
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_with_its_own_jvp_equals_jax_nn_gelu_to_second_order(approximate):
    fn = gelu_tanh if approximate else gelu
    ref_fn = functools.partial(jax.nn.gelu, approximate=approximate)
    with jax.enable_x64():
        x = jnp.linspace(-12.0, 12.0, 4001, dtype=jnp.float64)
        ours, ref = fn, ref_fn
        for order in range(3):  # value, first and second derivative, elementwise
            np.testing.assert_allclose(jax.vmap(ours)(x), jax.vmap(ref)(x), rtol=1e-12,
                                       atol=1e-12, err_msg=f"derivative {order}")
            ours, ref = jax.grad(ours), jax.grad(ref)
    # float32 gradients are as close to the float64 ones as jax.nn.gelu's own (tanh's
    # saturation costs both about 4e-6 near x = -4).
    x = jax.random.normal(jax.random.key(0), (64, 96)) * 4
    grad = lambda f, z: np.asarray(jax.grad(lambda z: jnp.sum(jnp.sin(z) * f(z)))(z))
    with jax.enable_x64():
        truth = grad(ref_fn, x.astype(jnp.float64))
    ours_error = np.abs(grad(fn, x) - truth).max()
    assert ours_error <= max(2e-7, 1.5 * np.abs(grad(ref_fn, x) - truth).max()), ours_error


# XLA:CPU with its own loop fusions and Eigen's dots. What a formulation makes XLA keep for the
# backward pass is decided by its fusion heuristics (XLA's on every platform); the float32
# training default on CPU adds YNNPACK's fusions, whose boundaries change what is kept either way.
XLA_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def train_step_cpu_options(dtype: str = "float32") -> dict:
    """The XLA options a `dtype` train step compiles with on CPU (placement.compiler_options)."""
    config = ml_collections.ConfigDict({"model": {"dtype": dtype}, "compiler_options": {}})
    return placement.compiler_options(config, jax.make_mesh((1,), ("data",)))


def backward_temp_bytes(cfg: TransformerConfig, batch: int = 4, length: int = 32,
                        options: dict | None = None) -> int:
    """Scratch bytes XLA allocates for forward + backward of `cfg.num_layers` causal blocks,
    compiled with `options`, or else the train step's (`train_step_cpu_options`). Lowered for
    the params' and input's shapes and dtypes (all that a compiled program depends on): no
    values are made."""
    if options is None:
        options = train_step_cpu_options()
    block, mask = TransformerBlock(cfg), masks.Causal()
    x = jax.ShapeDtypeStruct((batch, length, cfg.d_model), jnp.float32)
    params = [jax.eval_shape(block.init, jax.random.key(i), x, mask, None, None)
              for i in range(cfg.num_layers)]

    def loss(params, x):
        for p in params:
            x = block.apply(p, x, mask, None, None)
        return jnp.sum(x * x)

    compiled = jax.jit(jax.grad(loss)).lower(params, x).compile(compiler_options=options)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_keeps_for_the_backward_pass_no_more_than_relu(activation):
    """Its derivative is recomputed from the pre-activation alone: XLA's fusions must not keep
    erf(u) or tanh(u) from the forward pass as well, one more [tokens, d_ff] tensor per layer."""
    cfg = lambda act: TransformerConfig(num_layers=3, d_model=32, num_heads=2, d_ff=128,  # noqa: E731
                                        activation=act, use_bias=False)
    assert (backward_temp_bytes(cfg(activation), options=XLA_FUSIONS)
            <= backward_temp_bytes(cfg("relu"), options=XLA_FUSIONS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_steps_keep_no_norm_scale_broadcast_for_the_backward_pass(dtype):
    """With YNNPACK's fusions, XLA's default scheduler computes each norm scale's [B, T, D]
    broadcast (an operand of a YNNPACK reduction in the backward pass) at the start of the step
    and keeps it until then; the scheduler of the CPU default does not: two [B, T, D] tensors
    less per layer (measured: 1,001,984 against 1,135,104 bytes in float32, 933,376 against
    1,119,744 in bfloat16)."""
    cfg = TransformerConfig(num_layers=3, d_model=32, num_heads=2, d_ff=128, use_bias=False,
                            dtype=jnp.dtype(dtype))
    ours = train_step_cpu_options(dtype)
    xla_scheduler = {k: v for k, v in ours.items() if k != "xla_cpu_scheduler_type"}
    tensor_BTD = 4 * 32 * 32 * jnp.dtype(dtype).itemsize  # batch 4, length 32, d_model 32
    assert (backward_temp_bytes(cfg, options=ours)
            <= backward_temp_bytes(cfg, options=xla_scheduler) - 2 * cfg.num_layers * tensor_BTD)


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_block_residuals_follow_pre_and_post_ln_formulas(placement, norm):
    cfg = TransformerConfig(**SMALL, norm_placement=placement, norm=norm, position="none")
    x, mask = np.asarray(inputs()), masks.Causal()
    variables, out = init_and_apply(TransformerBlock(cfg), jax.random.key(2), x, mask, None, None)
    p = jax.tree.map(np.asarray, nn.unbox(variables)["params"])
    normed = lambda h, name: (layer_norm if norm == "layernorm" else rms_norm)(
        np.asarray(h, np.float64), p[f"{name}_norm"], cfg.norm_epsilon)
    attention = lambda h: np.asarray(jit_apply(
        MultiHeadAttention(AttentionSettings(4, 4, use_bias=True)),
        {"params": p["self_attention"]}, np.asarray(h, np.float32), mask=mask))
    mlp = lambda h: np.asarray(jit_apply(MLP(cfg), {"params": p["mlp"]},
                                         np.asarray(h, np.float32)))
    if placement == "pre":  # x + f(LN(x))
        h = x + attention(normed(x, "self_attention"))
        expected = h + mlp(normed(h, "mlp"))
    else:  # LN(x + f(x))
        h = normed(x + attention(x), "self_attention")
        expected = normed(h + mlp(h), "mlp")
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-4)


def init_stack(cfg, x, mask, cross=False, bidirectional=True, **kwargs):
    stack = TransformerStack(cfg, cross_attention=cross, bidirectional=bidirectional)
    variables = jax.jit(stack.init)(jax.random.key(3), x, mask, **kwargs)
    return stack, variables


@pytest.mark.slow
@pytest.mark.parametrize("position", ["none", "learned", "rope", "alibi", "t5"])
def test_decoder_stack_leaks_no_future(position):
    cfg = TransformerConfig(**SMALL, position=position, max_len=16)
    x = inputs()
    stack, variables = init_stack(cfg, x, masks.Causal(), bidirectional=False)
    apply = jax.jit(lambda x: stack.apply(variables, x, masks.Causal()))
    base = apply(x)
    for t in range(T - 1):
        changed = x.at[:, t + 1:].set(inputs(seed=10 + t)[:, t + 1:])
        out = apply(changed)
        np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-5)
        assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


def test_prefix_lm_stack_is_causal_after_the_prefix_and_bidirectional_within():
    cfg = TransformerConfig(**SMALL, position="rope")
    prefix = 3
    mask = masks.PrefixLM(np.array([prefix, prefix], np.int32))
    x = np.asarray(inputs())
    stack, variables = init_stack(cfg, x, mask)
    apply = jax.jit(lambda x: stack.apply(variables, x, mask))
    base = np.asarray(apply(x))
    noise = np.asarray(inputs(seed=99))  # (a constant shift would vanish under LayerNorm)

    def changed(where):
        moved = x.copy()
        moved[:, where] += noise[:, where]
        return np.asarray(apply(moved))

    for t in range(prefix, T - 1):  # beyond the prefix: no future leaks
        out = changed(np.s_[t + 1:])
        np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-5)
        assert not np.allclose(out[:, t + 1:], base[:, t + 1:])
    out = changed(prefix - 1)  # position 0 sees the last prefix
    assert not np.allclose(out[:, 0], base[:, 0])


@pytest.mark.parametrize("position", ["none", "sinusoidal", "learned", "rope", "alibi", "t5"])
def test_self_attention_is_permutation_equivariant_only_without_positions(position):
    cfg = TransformerConfig(**SMALL, position=position, max_len=16)
    x = np.asarray(inputs())
    stack = TransformerStack(cfg, cross_attention=False, bidirectional=True)
    perm = np.random.default_rng(0).permutation(T)

    @jax.jit
    def outputs(x, x_permuted):  # initialised as init_stack does; both in one batch
        variables = stack.init(jax.random.key(3), x, masks.Full())
        return stack.apply(variables, jnp.concatenate([x, x_permuted]), masks.Full())

    out, out_of_permuted = np.split(np.asarray(outputs(x, x[:, perm])), 2)
    if position == "none":
        np.testing.assert_allclose(out_of_permuted, out[:, perm], atol=1e-5)
    else:
        assert not np.allclose(out_of_permuted, out[:, perm], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("position", ["none", "learned", "rope", "alibi", "t5"])
def test_packed_batch_equals_each_document_alone(position):
    cfg = TransformerConfig(**SMALL, position=position, max_len=16)
    lengths = [3, 4, 2]  # three documents packed into one row of 9 (+ 1 padding)
    docs = [inputs(seed=20 + i, length=n, batch=1) for i, n in enumerate(lengths)]
    packed = jnp.concatenate(docs + [jnp.zeros((1, 1, 16))], axis=1)
    segment_ids = jnp.array([[1] * 3 + [2] * 4 + [3] * 2 + [0]])
    doc_positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0, 1, 0]])  # positions restart per document
    mask = masks.Segment(segment_ids) & masks.Causal()
    stack, variables = init_stack(cfg, packed, mask, bidirectional=False, positions=doc_positions)
    apply = jax.jit(stack.apply)  # eager: 2-3x slower
    out = apply(variables, packed, mask, positions=doc_positions)
    start = 0
    for doc, n in zip(docs, lengths, strict=True):
        alone = apply(variables, doc, masks.Causal())
        np.testing.assert_allclose(out[:, start:start + n], alone, atol=1e-5)
        start += n


@pytest.mark.slow
@pytest.mark.parametrize("position,cross,remat", [("rope", False, "none"), ("t5", True, "full"),
                                                 ("learned", True, "dots")])
def test_scanned_and_unrolled_stacks_agree(position, cross, remat):
    x, enc = inputs(), inputs(seed=5, length=4)
    cross_mask = masks.Padding(kv_lengths=jnp.array([4, 2]))
    kwargs = dict(encoded=enc, cross_mask=cross_mask) if cross else {}
    scanned_cfg = TransformerConfig(**SMALL, num_kv_heads=2, position=position, max_len=16,
                                    scan_layers=True, remat_policy=remat)
    unrolled_cfg = TransformerConfig(**SMALL, num_kv_heads=2, position=position, max_len=16)
    scanned, variables = init_stack(scanned_cfg, x, masks.Causal(), cross, False, **kwargs)
    unrolled = TransformerStack(unrolled_cfg, cross_attention=cross, bidirectional=False)
    params = nn.unbox(variables)["params"]
    unrolled_params = unstack_layers(params, 2)
    assert "layers_1" in unrolled_params and "layers" not in unrolled_params

    def loss(p, stack):
        return (stack.apply({"params": p}, x, masks.Causal(), **kwargs) ** 2).mean()

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)  # eager: 2-3x slower
    value, g_scanned = value_and_grad(params, scanned)
    unrolled_value, g_unrolled = value_and_grad(unrolled_params, unrolled)
    np.testing.assert_allclose(value, unrolled_value, rtol=1e-6)
    g_unrolled = stack_layers(g_unrolled, 2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
                 g_scanned, g_unrolled)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_every_param_has_logical_axis_names(scan):
    cfg = TransformerConfig(**SMALL, position="t5", activation="swiglu", scan_layers=scan)
    x = inputs()
    _, variables = init_stack(cfg, x, masks.Causal(), cross=True, encoded=x)
    leaves = jax.tree.leaves(variables["params"],
                             is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert len(leaves) > 10
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    scan_axes = {leaf.names[0] for leaf in leaves if leaf.value.ndim == len(leaf.names) and
                 "layers" in leaf.names}
    assert scan_axes == ({"layers"} if scan else set())


def test_dropout_only_when_not_deterministic():
    cfg = TransformerConfig(**SMALL, dropout_rate=0.3, attention_dropout_rate=0.3)
    x = inputs()
    stack, variables = init_stack(cfg, x, masks.Causal())
    eval_a = jit_apply(stack, variables, x, masks.Causal())
    eval_b = jit_apply(stack, variables, x, masks.Causal(), rngs={"dropout": jax.random.key(1)})
    np.testing.assert_array_equal(eval_a, eval_b)
    train = lambda seed: np.asarray(jit_apply(stack, variables, x, masks.Causal(),
                                              deterministic=False,
                                              rngs={"dropout": jax.random.key(seed)}))
    assert not np.allclose(train(1), eval_a)
    assert not np.allclose(train(1), train(2))
    np.testing.assert_array_equal(train(3), train(3))


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params():
    cfg = TransformerConfig(**SMALL, dtype="bfloat16")
    x = inputs()
    stack, variables = init_stack(cfg, x, masks.Causal())
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.unbox(variables)))
    assert stack.apply(variables, x, masks.Causal()).dtype == jnp.bfloat16


@pytest.mark.parametrize("overrides,match", [
    (dict(d_model=30, num_heads=4), "d_model=30: expected a multiple of num_heads=4"),
    (dict(num_kv_heads=3), "num_kv_heads=3: expected a divisor of num_heads=4"),
    (dict(activation="tanh"), "activation='tanh': expected one of"),
    (dict(position="rotary"), "position='rotary': expected one of"),
    (dict(norm_placement="middle"), "norm_placement='middle'"),
    (dict(num_layers=0), "num_layers=0: expected a positive int"),
    (dict(dropout_rate=1.0), "dropout_rate=1.0"),
    (dict(head_dim=5, position="rope"), "head_dim=5: RoPE needs an even head dim"),
])
def test_bad_config_values_raise_one_line_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**SMALL, **overrides})
