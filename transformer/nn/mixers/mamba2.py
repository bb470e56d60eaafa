"""Mamba 2: the SSD token mixer (Dao & Gu 2024, "Transformers are SSMs"), parametrised as Hugging
Face's `Mamba2Mixer` so that an HF checkpoint imports by reshaping each weight.

Per head h (of H, each P wide) and token t, with a scalar decay A_h < 0 and a state [P, N]:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        y_t = h_t C_t + D x_t

B_t, C_t [N] are shared by the H / G heads of a group (head h reads group h // (H / G)), dt_t > 0
is a per-head step. `ssd_recurrent` runs this step by step; `ssd_chunked` computes the same by
chunks of Q tokens: within a chunk as a masked [Q, Q] "attention" (C B^T times the decays
between the two positions), between chunks by passing the [P, N] state along a `lax.scan`.

The layer (HF's torch path): z, x, B, C, dt = projections of the input; x, B, C through a
depthwise causal convolution (K taps) and SiLU; dt = clip(softplus(dt + dt_bias),
time_step_limit); A = -exp(A_log); y = SSD(x, dt, A, B, C) + D x; y = RMSNorm(y * SiLU(z)) per
group of H / G heads (`norm_before_gate`: RMSNorm(y) * SiLU(z)) times a weight; out projection.

Documents (`segment_ids`, see `base`): a run of equal segment ids is one document; a run of
non-zero ids starts from the zero state, and no convolution tap crosses a run's start. Padding
(segment 0) has dt = 0, so it leaves the state as it is. The first token continues the state
(and the convolution state) passed in.

Shapes: B batch, T tokens, D model width, H heads, P head_dim, G groups, R = H / G heads per
group, N state_size, K conv taps, C channels, Q chunk. Matrices B and C are `b_*`, `c_*`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn.attention import matmul, projection_init
from transformer.nn.mixers.base import Mixer, no_sequence_axis
from transformer.nn.mixers.conv import causal_conv
from transformer.utils.keys import BOOL, check_fields, int_, key, number

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """Mamba 2 layers' settings (`model.mamba2.*`), HF `Mamba2Config`'s names where it has them
    (`num_groups` is its n_groups). The layer has H = expand * d_model / head_dim heads.

    `chunk_size` 64 (HF and mamba_ssm: 256, for their fused kernels): here the chunks run as
    XLA einsums, where the [Q, Q] block costs O(Q) per token and the chunk states O(P N / Q)
    memory per head and token; 64 keeps both small (P = 64, N = 128) and the results are the
    same for any Q up to float rounding.
    """

    state_size: int = key(128, "SSM state size N per head.", int_(ge=1))
    expand: int = key(2, "Inner width expand x d_model = heads x head_dim.", int_(ge=1))
    head_dim: int = key(64, "Width P of each SSM head.", int_(ge=1))
    num_groups: int = key(1, "Groups of heads sharing B and C (HF's n_groups); divides the "
                          "heads.", int_(ge=1))
    conv_kernel: int = key(4, "Taps of the causal depthwise convolution on x, B, C.", int_(ge=1))
    chunk_size: int = key(64, "Tokens per chunk of the chunked SSD (memory and work per token "
                          "grow with it; results do not change).", int_(ge=1), structural=False,
                          export_neutral=True)
    use_conv_bias: bool = key(True, "A bias on the convolution.", BOOL)
    norm_before_gate: bool = key(False, "RMSNorm(y) * SiLU(z) rather than RMSNorm(y * SiLU(z)) "
                                 "(HF: False).", BOOL)
    time_step_min: float = key(0.001, "Smallest initial dt (dt_bias = softplus^-1 of dt, "
                               "log-uniform in [min, max]).", number(gt=0), structural=False,
                               export_neutral=True)
    time_step_max: float = key(0.1, "Largest initial dt.", number(gt=0), structural=False,
                               export_neutral=True)
    time_step_floor: float = key(1e-4, "Initial dt clipped below at this.", number(ge=0),
                                 structural=False, export_neutral=True)
    # HF's time_step_limit pair as two numbers: a config file keeps them as they are
    time_step_limit_min: float = key(0.0, "dt clipped below at this after softplus.",
                                     number(ge=0))
    time_step_limit_max: float = key(0.0, "dt clipped above at this after softplus; 0: no "
                                     "limit (HF's inf).", number(ge=0, note="0: no limit"))

    # what its keys act only with (`utils.keys.Key.needs`), given the stack's config
    NEEDS = (lambda cfg: "mamba2" in cfg.used_layer_types,
             "a mamba2 layer (model.layer_types)")

    def __post_init__(self):
        check_fields(self, prefix="mamba2.")
        if 0 < self.time_step_limit_max <= self.time_step_limit_min:
            raise ValueError(f"mamba2.time_step_limit_max={self.time_step_limit_max!r}: expected "
                             f"0 (no limit) or > time_step_limit_min={self.time_step_limit_min!r}")
        if self.time_step_min > self.time_step_max:
            raise ValueError(f"mamba2.time_step_min={self.time_step_min!r}: expected <= "
                             f"time_step_max={self.time_step_max!r}")

    @property
    def time_step_limit(self) -> tuple[float, float]:
        """(low, high), HF's pair (high inf when there is no limit)."""
        return (float(self.time_step_limit_min), float(self.time_step_limit_max or math.inf))

    def num_heads(self, d_model: int) -> int:
        return self.expand * d_model // self.head_dim

    def check(self, config) -> None:
        """The rules across keys and the model width (`config.d_model`; TransformerConfig runs
        it for a stack with mamba2 layers).

        >>> import types
        >>> Mamba2Config(head_dim=48).check(types.SimpleNamespace(d_model=64))
        Traceback (most recent call last):
        ValueError: mamba2.head_dim=48: expected a divisor of expand x d_model = 128
        """
        d_model = config.d_model
        inner = self.expand * d_model
        if inner % self.head_dim:
            raise ValueError(f"mamba2.head_dim={self.head_dim}: expected a divisor of expand x "
                             f"d_model = {inner}")
        if self.num_heads(d_model) % self.num_groups:
            raise ValueError(f"mamba2.num_groups={self.num_groups}: expected a divisor of the "
                             f"heads, expand x d_model / head_dim = {self.num_heads(d_model)}")


# --- the pure functions (float32 inside, float64 when given it) ----------------------------------


def _float(*arrays):
    dtype = jnp.promote_types(jnp.result_type(*arrays), jnp.float32)
    return [a.astype(dtype) for a in arrays]


def _resets(segment_ids: Array | None, shape) -> Array:
    """[B, T] bool: the tokens that start a document (a run of non-zero ids, after the first)."""
    if segment_ids is None:
        return jnp.zeros(shape, bool)
    start = segment_ids[:, 1:] != segment_ids[:, :-1]  # [B, T - 1]: [B, 0] for one token
    start = jnp.pad(start, ((0, 0), (1, 0)))
    return start & (segment_ids != 0)


def _masked_dt(dt_BTH: Array, segment_ids: Array | None) -> Array:
    """dt = 0 on padding: the state passes through it unchanged."""
    return dt_BTH if segment_ids is None else jnp.where(segment_ids[..., None] != 0, dt_BTH, 0)


def _segsum(a_Q: Array, runs_Q: Array) -> Array:
    """a [..., Q] -> [..., Q, Q]: at [l, s] the sum of a over (s, l] where s <= l and tokens s
    and l are in one document, else -inf. Cumulative sums of masked copies (no differences of
    large sums, never an exp of a positive number: a <= 0)."""
    q = a_Q.shape[-1]
    row, col = jnp.arange(q)[:, None], jnp.arange(q)[None, :]
    terms = jnp.where(row > col, a_Q[..., :, None], 0)  # [k, s] = a_k for k > s
    sums = jnp.cumsum(terms, axis=-2)  # [l, s] = sum_{s < k <= l} a_k
    same = runs_Q[..., :, None] == runs_Q[..., None, :]
    return jnp.where((row >= col) & same, sums, -jnp.inf)


def _chunks(a: Array, q: int) -> Array:
    """[B, T, ...] -> [B, T / q, q, ...], zero-padded at the end."""
    pad = -a.shape[1] % q
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    return a.reshape(a.shape[0], -1, q, *a.shape[2:])


def ssd_chunked(x_BTHP: Array, dt_BTH: Array, A_H: Array, b_BTGN: Array, c_BTGN: Array,
                initial_state: Array | None = None, chunk_size: int = 64,
                segment_ids: Array | None = None, D_H: Array | None = None
                ) -> tuple[Array, Array]:
    """The SSD recurrence (module docstring) by chunks of min(chunk_size, T) tokens: the
    diagonal [Q, Q] blocks as masked C B^T products, the off-diagonal ones through the state at
    each chunk's start, passed along a `lax.scan` over chunks. Never a [T, T] tensor.

    dt > 0 (after softplus), A < 0; `initial_state` [B, H, P, N] (zeros if None). Returns
    (y [B, T, H, P], the state after the last token [B, H, P, N]), in float32 (or float64)."""
    batch, length, heads, width = x_BTHP.shape
    groups, state = b_BTGN.shape[2:]
    x, dt, A, b, c = _float(x_BTHP, dt_BTH, A_H, b_BTGN, c_BTGN)
    q, r = min(chunk_size, length), heads // groups
    dt = _masked_dt(dt, segment_ids)
    x_c = _chunks(x * dt[..., None], q).reshape(batch, -1, q, groups, r, width)  # dt x
    b_c, c_c = _chunks(b, q), _chunks(c, q)  # [B, n, Q, G, N]
    a_c = _chunks(dt * A, q).transpose(0, 1, 3, 2)  # [B, n, H, Q], <= 0
    runs = _chunks(_resets(segment_ids, (batch, length)), q).astype(jnp.int32).cumsum(2)
    seg = _segsum(a_c, runs[:, :, None])  # [B, n, H, Q, Q], runs: documents inside a chunk
    decay = jnp.exp(seg).reshape(*seg.shape[:2], groups, r, q, q)
    scores = jnp.einsum("bclgn,bcsgn->bcgls", c_c, b_c)
    y_diag = jnp.einsum("bcgls,bcgrls,bcsgrp->bclgrp", scores, decay, x_c)
    # the chunk's own contribution to the state at its end: decay from s to the end (seg's last row)
    to_end = decay[..., -1, :]  # [B, n, G, R, Q]
    states = jnp.einsum("bcsgn,bcgrs,bcsgrp->bcgrpn", b_c, to_end, x_c)
    # decay from the chunk's start to l, -inf once a document has started in the chunk
    from_start = jnp.where(runs[:, :, None] == 0, jnp.cumsum(a_c, -1), -jnp.inf)
    h0 = (jnp.zeros((batch, heads, width, state), x.dtype) if initial_state is None
          else initial_state.astype(x.dtype))

    def pass_state(h, chunk):  # h [B, G, R, P, N]: the state at the chunk's start
        log_decay, own = chunk
        return jnp.exp(log_decay)[..., None, None] * h + own, h

    total = from_start[..., -1].reshape(batch, -1, groups, r)  # [B, n, G, R]
    final, h_in = jax.lax.scan(pass_state, h0.reshape(batch, groups, r, width, state),
                               (total.transpose(1, 0, 2, 3), states.transpose(1, 0, 2, 3, 4, 5)))
    into = jnp.exp(from_start).reshape(batch, -1, groups, r, q)
    y_off = jnp.einsum("bclgn,cbgrpn,bcgrl->bclgrp", c_c, h_in, into)
    y = (y_diag + y_off).reshape(batch, -1, heads, width)[:, :length]
    if D_H is not None:
        y = y + D_H.astype(y.dtype)[:, None] * x
    return y, final.reshape(batch, heads, width, state)


def ssd_recurrent(x_BTHP: Array, dt_BTH: Array, A_H: Array, b_BTGN: Array, c_BTGN: Array,
                  initial_state: Array | None = None, segment_ids: Array | None = None,
                  D_H: Array | None = None) -> tuple[Array, Array]:
    """The SSD recurrence token by token (`ssd_chunked`'s arguments and results, no chunks):
    the decode step, and the reference the chunked form is tested against."""
    batch, length, heads, width = x_BTHP.shape
    groups, state = b_BTGN.shape[2:]
    x, dt, A, b, c = _float(x_BTHP, dt_BTH, A_H, b_BTGN, c_BTGN)
    dt = _masked_dt(dt, segment_ids)
    keep = ~_resets(segment_ids, (batch, length))  # [B, T]: False where a document starts
    h0 = (jnp.zeros((batch, heads, width, state), x.dtype) if initial_state is None
          else initial_state.astype(x.dtype))
    r = heads // groups

    def step(h, token):  # h [B, G, R, P, N]
        x_t, dt_t, b_t, c_t, keep_t = token
        decay = jnp.exp(dt_t * A) * keep_t[:, None]  # [B, H]
        h = (decay.reshape(batch, groups, r)[..., None, None] * h
             + jnp.einsum("bgrp,bgn->bgrpn", (x_t * dt_t[..., None]).reshape(
                 batch, groups, r, width), b_t))
        return h, jnp.einsum("bgrpn,bgn->bgrp", h, c_t).reshape(batch, heads, width)

    time_major = [a.swapaxes(0, 1) for a in (x, dt, b, c, keep)]
    final, y = jax.lax.scan(step, h0.reshape(batch, groups, r, width, state), time_major)
    y = y.swapaxes(0, 1)
    if D_H is not None:
        y = y + D_H.astype(y.dtype)[:, None] * x
    return y, final.reshape(batch, heads, width, state)


def gated_rms_norm(y_BTHP: Array, z_BTHP: Array, weight_HP: Array, groups: int,
                   epsilon: float, norm_before_gate: bool = False) -> Array:
    """RMSNorm(y * SiLU(z)) over each group's H / G heads x P values, times the weight
    (`norm_before_gate`: RMSNorm(y) * SiLU(z)), in float32."""
    gate = jax.nn.silu(z_BTHP.astype(jnp.float32))
    y = y_BTHP.astype(jnp.float32)
    y = y if norm_before_gate else y * gate
    grouped = y.reshape(*y.shape[:2], groups, -1)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped**2, -1, keepdims=True) + epsilon)
    y = grouped.reshape(y.shape) * weight_HP.astype(jnp.float32)
    return y * gate if norm_before_gate else y


# --- the layer -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mamba2Settings:
    """Everything one Mamba 2 layer is built from, read off a `TransformerConfig` by
    `from_config`."""

    num_heads: int
    head_dim: int = 64
    num_groups: int = 1
    state_size: int = 128
    conv_kernel: int = 4
    chunk_size: int = 64
    use_bias: bool = False  # on the input projections (z, x, B, C) and the output's
    use_conv_bias: bool = True
    norm_before_gate: bool = False
    norm_epsilon: float = 1e-5
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple = (0.0, math.inf)
    init_std: float | None = None
    init_scale: float = 1.0  # the input projections' init std multiplier (projection_init)
    out_init_scale: float = 1.0  # the output projection's
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @classmethod
    def from_config(cls, cfg) -> Mamba2Settings:
        m = cfg.mamba2
        m.check(cfg)
        return cls(
            num_heads=m.num_heads(cfg.d_model), head_dim=m.head_dim, num_groups=m.num_groups,
            state_size=m.state_size, conv_kernel=m.conv_kernel, chunk_size=m.chunk_size,
            use_bias=cfg.use_bias, use_conv_bias=m.use_conv_bias,
            norm_before_gate=m.norm_before_gate, norm_epsilon=cfg.norm_epsilon,
            time_step_min=m.time_step_min, time_step_max=m.time_step_max,
            time_step_floor=m.time_step_floor, time_step_limit=m.time_step_limit,
            init_std=cfg.init_std, init_scale=cfg.init_scale(),
            out_init_scale=cfg.init_scale(residual=True), dtype=cfg.dtype,
            param_dtype=cfg.param_dtype)

    @property
    def conv_channels(self) -> int:
        """The convolved channels: x's H P, then B's and C's G N each (HF's conv_dim)."""
        return self.num_heads * self.head_dim + 2 * self.num_groups * self.state_size


def _dt_bias_init(s: Mamba2Settings):
    """HF's: softplus^-1 of dt, dt log-uniform in [time_step_min, time_step_max], floored."""
    def init(rng, shape, dtype=jnp.float32):
        low, high = math.log(s.time_step_min), math.log(s.time_step_max)
        dt = jnp.exp(jax.random.uniform(rng, shape) * (high - low) + low)
        dt = jnp.maximum(dt, s.time_step_floor)
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
    return init


def _a_log_init(rng, shape, dtype=jnp.float32):
    """HF's: A = -exp(A_log) = -1, -2, ..., -H."""
    return jnp.log(jnp.arange(1, shape[0] + 1, dtype=jnp.float32)).astype(dtype)


class Mamba2(nn.Module):
    """The Mamba 2 mixer (module docstring), called as every mixer is (`base`). Its per-head
    params (A_log, D, dt_bias), dt and gated norm are float32 even in a float64 model, as in
    Hugging Face's; the scan runs in the widest of its inputs' dtypes (`ssd_chunked`).

    Params, with logical axes, and where HF's `Mamba2Mixer` has them (E = H P):
      z, x [embed, heads, kv]; B, C [embed, kv_heads, state] (the groups split over `tensor`
      like GQA's key heads); dt [embed, heads]: HF's in_proj.weight [2 E + 2 G N + H, D] is
      rows z | x | B | C | dt, each kernel its rows transposed, reshaped ([D, E] -> [D, H, P]);
      z_bias ... C_bias with `use_bias`: in_proj.bias's rows (its dt rows add to dt_bias);
      conv_x [conv, heads, kv], conv_B, conv_C [conv, kv_heads, state]: conv1d.weight[:, 0].T
      [K, E + 2 G N], columns x | B | C; conv_*_bias: conv1d.bias's; A_log, D, dt_bias
      [heads] as HF's; norm [heads, kv]: norm.weight.reshape(H, P); out [heads, kv, embed]:
      out_proj.weight.T.reshape(H, P, D), out_bias its bias.

    Separate projections rather than one fused in_proj keep each sharded over its own heads.
    With G = 1 the gated norm reduces over all heads (HF's design: mamba_ssm's tensor
    parallelism uses G = the tensor split).
    Decode: 'cache' variables conv_state [B, K-1, E + 2 G N] (the last inputs of x | B | C, HF's
    channel order) and ssm_state [B, H, P, N], both float32; T > 1 tokens run the chunked form
    from them (a right-padded prefill), one token the recurrent step.
    """

    settings: Mamba2Settings

    @nn.compact
    def __call__(self, x_BTD: Array, *, mask=None, bias=None, q_positions=None,
                 segment_ids: Array | None = None, deterministic: bool = True,
                 decode: bool = False) -> Array:
        del mask, bias, q_positions, deterministic  # attention's arguments; no dropout here
        s, (batch, length, _) = self.settings, x_BTD.shape
        heads, width, groups, state = s.num_heads, s.head_dim, s.num_groups, s.state_size
        z_BTHP = self._project("z", x_BTD, (heads, width), ("heads", "kv"))
        parts = {"x": self._project("x", x_BTD, (heads, width), ("heads", "kv")),
                 "B": self._project("B", x_BTD, (groups, state), ("kv_heads", "state")),
                 "C": self._project("C", x_BTD, (groups, state), ("kv_heads", "state"))}
        dt_BTH = self._project("dt", x_BTD, (heads,), ("heads",), bias=False)
        cache = self._cache_variables(batch) if decode else None
        conv_state = None if cache is None else cache[0].value
        parts, conv_state = self._convolve(parts, conv_state, segment_ids)
        dt_bias = self._vector("dt_bias", _dt_bias_init(s))
        dt_BTH = jnp.clip(jax.nn.softplus(dt_BTH.astype(jnp.float32) + dt_bias),
                          *s.time_step_limit)
        A_H = -jnp.exp(self._vector("A_log", _a_log_init))
        ssd = dict(initial_state=None if cache is None else cache[1].value,
                   segment_ids=segment_ids, D_H=self._vector("D", nn.initializers.ones))
        args = (parts["x"], dt_BTH, A_H, parts["B"], parts["C"])
        if decode and length == 1:
            y_BTHP, ssm_state = ssd_recurrent(*args, **ssd)
        else:
            y_BTHP, ssm_state = ssd_chunked(*args, chunk_size=s.chunk_size, **ssd)
        if cache is not None and cache[2]:  # `init` only creates the zero state
            cache[0].value, cache[1].value = conv_state, ssm_state.astype(jnp.float32)
        return self._output(self._gated_norm(y_BTHP, z_BTHP), x_BTD.shape[-1])

    def _project(self, name: str, x_BTD: Array, shape: tuple, names: tuple,
                 bias: bool = True) -> Array:
        """x [B, T, D] -> [B, T, *shape] through kernel `name` [D, *shape] (+ `name`_bias)."""
        s = self.settings
        init = projection_init(s.init_std, 0, tuple(range(1, len(shape) + 1)), s.init_scale)
        kernel = self.param(name, nn.with_logical_partitioning(init, ("embed", *names)),
                            (x_BTD.shape[-1], *shape), s.param_dtype)
        y = matmul(x_BTD, kernel, 1, dtype=s.dtype)
        if bias and s.use_bias:
            y = y + self.param(f"{name}_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, names), shape, s.param_dtype).astype(s.dtype)
        return y

    def _vector(self, name: str, init) -> Array:
        """A per-head param [H] ("heads"), float32 in the math."""
        return self.param(name, nn.with_logical_partitioning(init, ("heads",)),
                          (self.settings.num_heads,), self.settings.param_dtype
                          ).astype(jnp.float32)

    def _convolve(self, parts: dict, conv_state: Array | None, segment_ids: Array | None):
        """SiLU(`conv.causal_conv`) of x, B and C, each with its own kernel (HF's one conv1d
        split by rows); the state [B, K-1, E + 2 G N] split and joined in HF's channel order."""
        s, out, states, start = self.settings, {}, [], 0
        # kaiming_uniform(a=sqrt(5)) over the K taps, as HF's conv1d: U(-1/sqrt(K), 1/sqrt(K))
        init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=0,
                                                out_axis=(1, 2))
        for name, axes in (("x", ("heads", "kv")), ("B", ("kv_heads", "state")),
                           ("C", ("kv_heads", "state"))):
            value = parts[name]
            shape, channels = value.shape[2:], math.prod(value.shape[2:])
            kernel = self.param(f"conv_{name}", nn.with_logical_partitioning(
                init, ("conv", *axes)), (s.conv_kernel, *shape), s.param_dtype)
            conv_bias = self.param(f"conv_{name}_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, axes), shape, s.param_dtype).reshape(-1) \
                if s.use_conv_bias else None
            part_state = None if conv_state is None else conv_state[..., start:start + channels]
            y, new = causal_conv(value.reshape(*value.shape[:2], channels),
                                 kernel.reshape(s.conv_kernel, channels), conv_bias,
                                 part_state, segment_ids, activation=jax.nn.silu)
            out[name], start = y.reshape(value.shape), start + channels
            states.append(new)
        return out, None if conv_state is None else jnp.concatenate(states, -1)

    def _gated_norm(self, y_BTHP: Array, z_BTHP: Array) -> Array:
        """`gated_rms_norm` with the weight `norm` [heads, kv] (HF's MambaRMSNormGated)."""
        s = self.settings
        weight = self.param("norm", nn.with_logical_partitioning(
            nn.initializers.ones, ("heads", "kv")), y_BTHP.shape[2:], s.param_dtype)
        return gated_rms_norm(y_BTHP, z_BTHP, weight, s.num_groups, s.norm_epsilon,
                              s.norm_before_gate)

    def _output(self, y_BTHP: Array, d_model: int) -> Array:
        """out [heads, kv, embed] (+ out_bias): [B, T, H, P] -> [B, T, D]."""
        s = self.settings
        init = projection_init(s.init_std, (0, 1), 2, s.out_init_scale)
        kernel = self.param("out", nn.with_logical_partitioning(init, ("heads", "kv", "embed")),
                            (*y_BTHP.shape[2:], d_model), s.param_dtype)
        out = matmul(y_BTHP.astype(s.dtype), kernel, 2, dtype=s.dtype)
        if s.use_bias:
            out = out + self.param("out_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, ("embed",)), (d_model,), s.param_dtype).astype(s.dtype)
        return out

    def _cache_variables(self, batch: int):
        """(conv_state, ssm_state, whether they existed before this call: False inside `init`)."""
        s, initialized = self.settings, self.has_variable("cache", "ssm_state")
        conv = self.variable("cache", "conv_state", jnp.zeros,
                             (batch, s.conv_kernel - 1, s.conv_channels), jnp.float32)
        ssm = self.variable("cache", "ssm_state", jnp.zeros,
                            (batch, s.num_heads, s.head_dim, s.state_size), jnp.float32)
        return conv, ssm, initialized


# --- the registry's record -----------------------------------------------------------------------


def flops_per_token(cfg, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one layer beyond 6 x its params (the projections,
    and the depthwise convolution, whose 2 K C per token forward is 6 x its params too): the SSD
    work of `ssd_chunked` with Q = min(chunk_size, seq_len), forward

        2 Q G N (C B^T in a chunk) + 2 Q H P (its [Q, Q] times x)
        + 2 H P N (the chunk's state) + 2 H P N (C times the incoming state),

    times 3 for the backward pass. The [Q, Q] blocks are counted whole (their upper triangle
    too), as `metrics.flops_per_token` counts causal attention; the elementwise work is not."""
    m = cfg.mamba2
    heads, q = m.num_heads(cfg.d_model), min(m.chunk_size, seq_len)
    inner = heads * m.head_dim
    forward = 2 * q * m.num_groups * m.state_size + 2 * q * inner + 4 * inner * m.state_size
    return 3.0 * forward


def cache_bytes_per_token(cfg) -> int:
    """0: the decode state (conv and SSM state) does not grow with the tokens."""
    return 0


refuses = no_sequence_axis("mamba2")


MIXER = Mixer(layer=lambda cfg, name: Mamba2(Mamba2Settings.from_config(cfg), name=name),
              param_name="mamba2", flops_per_token=flops_per_token,
              decode_state="recurrent state", cache_bytes_per_token=cache_bytes_per_token,
              refuses=refuses, config=Mamba2Config)
