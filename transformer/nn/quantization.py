"""Quantization-aware training through Qwix: `model.quantization` "int8" or "fp8" runs the
attention projections and MLP matmuls in that type, forward and backward; "" (the default)
computes in `model.dtype`.

`quantize(model, model_config)` wraps a Linen model with a Qwix `QtProvider`, which intercepts
`projection_dot` (the matmul of every dense projection) while the model runs and swaps in
Qwix's quantized dot where a rule matches the module's path. `build_model` calls it, so
training, evaluation and generation all run the same quantized model. The params themselves
are untouched: they stay float (in `param_dtype`) in the train state and in checkpoints, and
quantization is a compute setting that a resumed run may change.

What each setting quantizes (the recipes MaxText's Qwix `int8` and `fp8_full` use):

- int8: weights int8 with one absmax scale per output channel, activations int8 with one scale
  per token (dynamic, computed every step), and the backward pass's incoming gradients int8 too.
  A scale is absmax / 127.5 (Qwix's symmetric bound) and values round to the full -128..127.
- fp8: the same granularity, forward operands float8_e4m3fn and gradients float8_e5m2 (more
  range, less precision, for gradients).

Rounding is straight-through: the gradient of a quantized matmul is the float matmul's gradient
evaluated at the quantized operands. Only the dense projections (`projection_dot`: an
activation times a param kernel) are quantized, so the attention scores and weighted values
(activation x activation) stay in the compute dtype, as do the token embedding lookup,
mixture-of-experts layers (router, experts and shared experts alike) and, unless
`model.quantize_head`, the projections outside the blocks: the output head (the tied
embedding's logits, `lm_head`, classifier heads) and any other.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

# model.quantization -> (forward type of weights and activations, backward type of gradients)
SCHEMES = {
    "int8": (jnp.int8, jnp.int8),
    "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2),
}
# A block's sublayers: fullmatch over Qwix's module path, e.g. "decoder/layers_0/mlp" or
# "encoder/layers/self_attention" (scan_layers).
BLOCK_MODULES = r"(.*/)?(self_attention|cross_attention|mlp)"
# What model.quantize_head adds: every module outside the layer stacks ("embed" for a tied head,
# "lm_head", a multi-token prediction module's projection), not the linear mixers' own
# projections inside a layer ("decoder/layers_0/mixer"), which stay in model.dtype.
HEAD_MODULES = r"(?!(.*/)?layers(_\d+)?(/|$)).*"
# The methods callers `apply` (transformer.training.evaluation, generate, speculative decoding's
# draft), by name: each must be intercepted. A method passed as a function (`method=Cls.draft`)
# bypasses Qwix's wrapper and runs in float.
_METHODS = ("__call__", "encode", "decode", "draft", "embed_images", "embed_texts")


def check(model_config: ml_collections.ConfigDict) -> None:
    """One-line error for a `model.quantization` that is not "" or a key of SCHEMES."""
    value = model_config.get("quantization", "")
    if value not in ("", *SCHEMES):
        raise ValueError(f"model.quantization={value!r}: expected one of {('', *SCHEMES)}")


def dimensions(x_ndim: int, contract: int = 1) -> tuple:
    """dot_general's dimension numbers for x [..., in...] times a kernel [in..., out...] over
    the `contract` axes `in`, no batch axes."""
    return ((tuple(range(x_ndim - contract, x_ndim)), tuple(range(contract))), ((), ()))


def dot(x: jax.Array, kernel: jax.Array, preferred_element_type=None,
        contract: int = 1) -> jax.Array:
    """x [..., in...] times a kernel [in..., out...] over its `contract` input axes, never
    quantized: `projection_dot`'s math."""
    return jax.lax.dot_general(x, kernel, dimensions(x.ndim, contract),
                               preferred_element_type=preferred_element_type)


def projection_dot(x: jax.Array, kernel: jax.Array, preferred_element_type=None,
                   contract: int = 1) -> jax.Array:
    """x [..., in...] times a param kernel [in..., out...] over its `contract` input axes: the
    matmul of every dense projection (`attention.matmul`; 2-D [M, K] x [K, N] on CPU). Quantized
    runs intercept this function: its second operand is known to be a weight, under vmap
    (batched seeds) and scan too."""
    return dot(x, kernel, preferred_element_type, contract)


@functools.cache
def _provider_class():
    """Qwix's quantized-training provider, intercepting `projection_dot` only: activation x
    kernel matmuls, where a rule matches the module's path. The attention scores and weighted
    values (activation x activation) and everything outside `projection_dot` stay unquantized.
    (Qwix is imported here, when a run quantizes: it takes half a second.)"""
    import qwix
    from qwix._src.core import dot_general_qt

    class ProjectionQtProvider(qwix.QtProvider):
        def get_intercept_map(self):
            return {**qwix.QuantizationProvider.get_intercept_map(self),
                    f"{__name__}.projection_dot": self.quantized_dot}

        def quantized_dot(self, x, kernel, preferred_element_type=None, contract=1):
            rule, _ = self._get_current_rule_and_op_id("dot_general")
            if rule is None:  # not intercepted here
                return projection_dot(x, kernel, preferred_element_type, contract)
            config = dot_general_qt.DotGeneralQtConfig(
                lhs_qtype=rule.act_qtype, rhs_qtype=rule.weight_qtype,
                lhs_calibration_method=rule.act_calibration_method,
                rhs_calibration_method=rule.weight_calibration_method,
                dlhs_grad_qtype=rule.bwd_qtype, drhs_grad_qtype=rule.bwd_qtype,
                dlhs_grad_calibration_method=rule.bwd_calibration_method,
                drhs_grad_calibration_method=rule.bwd_calibration_method)
            y = dot_general_qt.dot_general_qt(x, kernel, dimensions(x.ndim, contract), config)
            return y if preferred_element_type is None else y.astype(preferred_element_type)

    return ProjectionQtProvider


def rules(model_config: ml_collections.ConfigDict) -> list:
    """`qwix.QtRule`s for `model.quantization` (and `model.quantize_head`); [] when it is ""."""
    check(model_config)
    scheme = model_config.get("quantization", "")
    if not scheme:
        return []
    import qwix
    forward, backward = SCHEMES[scheme]
    types = dict(weight_qtype=forward, act_qtype=forward, bwd_qtype=backward,
                 op_names=("dot_general",))
    found = [qwix.QtRule(module_path=BLOCK_MODULES, **types)]
    if model_config.get("quantize_head", False):
        found.append(qwix.QtRule(module_path=HEAD_MODULES, **types))  # the head, tied or not
    return found


def quantize(model: nn.Module, model_config: ml_collections.ConfigDict) -> nn.Module:
    """`model`, quantized as `model_config.quantization` says (itself when it is "")."""
    found = rules(model_config)
    if not found:
        return model
    import qwix
    methods = [name for name in _METHODS if hasattr(type(model), name)]
    return qwix.quantize_model(model, _provider_class()(found), methods=methods)
