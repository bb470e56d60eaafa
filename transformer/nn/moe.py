"""Mixture-of-experts feed-forward (GShard / Switch routing with expert capacity).

Each row of the batch is one routing group. A float32 router scores every token against E
experts (softmax or sigmoid scores, optionally grouped and with DeepSeek-V3's expert bias:
transformer.nn.routing); each token goes to its top-k experts, into per-expert buffers of
`capacity` slots:

    capacity = ceil(capacity_factor * T * k / E)      (capacity_factor = 0: T, nothing dropped)

Slots are handed out in priority order, every token's first choice before any token's second
(GShard), and in token order within a choice; padding (segment_ids 0) takes none. A (token,
expert) choice that finds its expert's buffer full is dropped: that expert contributes nothing
to the token (its other choices still do; the residual connection carries it). The buffers
are computed as one batched matmul over experts and combined back with the gate weights:

    dispatch [B, T, E, C]  one-hot: token t fills slot c of expert e
    combine  [B, T, E, C]  the same, times the token's gate for e
    y = combine . FFN_e(dispatch . x)

Dropless routing (capacity_factor = 0) builds no buffers: the (token, choice) pairs are sorted
by expert and each expert's run of rows goes through `jax.lax.ragged_dot`, O(T k) per row.
When a mesh axis splits the tokens (batch, expert or sequence) the same runs per device in a
`jax.shard_map` (`sharded_experts`): each device sorts its own pairs, sends them to the devices
holding their experts along `expert` and back, O(T k) per row as well. Only where that cannot
run (the experts or the batch not divisible by `expert`) is it the buffer path with C = T.

The auxiliary quantities (load balance, router z, dropped fraction, per-expert load) are
`routing.Routing`'s.

Expert parallelism (the `expert` mesh axis, `parallel.sharding`): outside the MoE layers the
axis splits the batch like data parallelism; the experts' params are split over it. Two
sharding constraints around the experts' matmuls move the buffers x_BECD from batch-split to
expert-split and y_BECD back, which GSPMD lowers to an all-to-all each way (GShard's own
formulation). Constraints rather than a shard_map: routing stays per row and local, the
experts' matmuls keep the fsdp and tensor splits of their params without hand-written
collectives, and the same code runs unsharded, under scan and under remat. Dropless routing
has no buffers to constrain: there `sharded_experts` moves the sorted rows itself.

Shapes: B batch, T tokens per row, D model width, E experts, C capacity, K = top_k, F d_ff.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn import kernels
from transformer.nn.activations import clamped_swiglu
from transformer.nn.routing import SCORES, Routing, capacity, current_token_weight, route
from transformer.parallel import pipeline_parallel, sharding
from transformer.utils.keys import BOOL, check_fields, choice, described, int_, key, number

Array = jax.Array
# The experts' own params: [E, in, out] kernels and (moe.use_bias) [E, out] biases.
EXPERT_WEIGHTS = ("wi", "wi_gate", "wi_up", "wo", "wi_bias", "wi_gate_bias", "wi_up_bias",
                  "wo_bias")
# Expert buffers [B, E, C, D] on the experts' side of the all-to-all, and on the tokens' side.
EXPERT_BUFFERS = ("activation_moe_batch", "activation_expert", None, "activation_embed")
TOKEN_BUFFERS = ("activation_batch", None, None, "activation_embed")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts settings of a stack (`model.moe.*`); `num_experts=0`: dense layers.

    Layer i (from 0) has an MoE feed-forward when (i + 1) % every_n_layers == 0 (2: every
    other layer, as Switch and GShard) and i >= first_dense_layers; its experts have the
    stack's activation, no biases. The auxiliary losses are averaged over the MoE layers and
    added to the training loss with these weights (Switch: 0.01; ST-MoE's z-loss: 0.001).
    DeepSeek-V3's routing: score="sigmoid", n_group=8, topk_group=4, top_k=8,
    routed_scaling_factor=2.5, balance_bias=True with bias_update_rate=0.001, and the aux
    loss nearly off (transformer.nn.routing).
    """

    num_experts: int = key(0, "Experts per MoE layer; 0 keeps dense feed-forward layers.",
                           int_(ge=0, note="0: dense"))
    top_k: int = key(2, "Experts per token.", described(int_(ge=1), "an int in [1, num_experts]"))
    every_n_layers: int = key(1, "Layer i (from 0) is MoE when (i + 1) % n == 0; n divides "
                              "num_layers.", int_(ge=1))
    capacity_factor: float = key(
        1.25, "Slots per expert and row, ceil(cf x T x k / E); choices over capacity are "
        "dropped; 0: dropless.", number(ge=0, note="0: dropless"), structural=False)
    num_shared: int = key(0, "Always-on shared experts (DeepSeek), num_shared x the experts' "
                          "width hidden units.", int_(ge=0))
    d_ff: int = key(0, "Each expert's hidden width; 0: `model.d_ff` (Qwen-MoE's "
                    "moe_intermediate_size).", int_(ge=0, note="0: model.d_ff"))
    normalize_gates: bool = key(
        True, "A token's top-k gates renormalised to sum 1 (Mixtral); False: its router "
        "probabilities (Qwen2-MoE). Top-1 keeps the probability.", BOOL)
    shared_gate: bool = key(False, "The shared experts' output times sigmoid(x . w) per token "
                            "(Qwen2-MoE).", BOOL)
    load_balance_loss: float = key(0.01, "Weight of the load-balancing loss (Switch / GShard).",
                                   number(ge=0), structural=False, export_neutral=True)
    router_z_loss: float = key(0.001, "Weight of the router z-loss (ST-MoE).", number(ge=0),
                               structural=False, export_neutral=True)
    score: str = key("softmax", "The router's scores: softmax over experts, or each expert's "
                     "sigmoid (DeepSeek-V3).", choice(SCORES))
    n_group: int = key(1, "Expert groups (DeepSeek-V3): a token chooses within its topk_group "
                       "best groups; divides num_experts.", int_(ge=1))
    topk_group: int = key(1, "Groups a token chooses its experts from (with n_group > 1).",
                          described(int_(ge=1), "an int in [1, n_group]"))
    routed_scaling_factor: float = key(1.0, "The routed experts' gates times this "
                                       "(DeepSeek-V3: 2.5).", number(gt=0))
    first_dense_layers: int = key(0, "The first k layers keep a dense feed-forward "
                                  "(DeepSeek-V3's first_k_dense_replace).", int_(ge=0))
    balance_bias: bool = key(False, "A per-expert bias added to the scores for the choice "
                             "only (DeepSeek-V3's aux-loss-free balancing; params .../moe/"
                             "balance_bias).", BOOL)
    bias_update_rate: float = key(
        0.0, "After each step the balance bias moves by this times the sign of each expert's "
        "load error (DeepSeek-V3: 0.001); 0: fixed.", number(ge=0), structural=False,
        export_neutral=True)
    use_bias: bool = key(False, "Biases on the router's logits and the experts' projections "
                         "(gpt-oss).", BOOL)
    swiglu_limit: float = key(
        0.0, "gpt-oss's clamped SwiGLU in the experts: gate clamped to <= limit, up to "
        "[-limit, limit], out (up + 1) * gate * sigmoid(1.702 gate); 0: the stack's "
        "activation.", number(ge=0, note="0: off"))

    # what its keys act only with (`utils.keys.Key.needs`), given the stack's config
    NEEDS = (lambda cfg: cfg.moe.num_experts > 0, "model.moe.num_experts > 0")

    def __post_init__(self):
        check_fields(self, prefix="moe.")
        if not self.num_experts:
            return
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k!r}: expected an int in [1, "
                             f"num_experts={self.num_experts}]")
        if self.num_experts % self.n_group:
            raise ValueError(f"moe.n_group={self.n_group!r}: expected a divisor of "
                             f"num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            raise ValueError(f"moe.topk_group={self.topk_group!r}: expected an int in [1, "
                             f"n_group={self.n_group}]")
        if self.top_k > self.topk_group * self.num_experts // self.n_group:
            raise ValueError(f"moe.top_k={self.top_k!r}: expected at most the experts of "
                             f"topk_group={self.topk_group} groups "
                             f"({self.topk_group * self.num_experts // self.n_group})")
        if self.shared_gate and not self.num_shared:
            raise ValueError("moe.shared_gate=True: expected moe.num_shared > 0 (there is no "
                             "shared expert to gate)")
        if self.bias_update_rate and not self.balance_bias:
            raise ValueError(f"moe.bias_update_rate={self.bias_update_rate!r}: expected 0 "
                             "without moe.balance_bias=True (there is no bias to move)")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) of the stack has the MoE feed-forward.

        >>> [MoEConfig(num_experts=4, every_n_layers=2).is_moe_layer(i) for i in range(4)]
        [False, True, False, True]
        """
        return (self.num_experts > 0 and layer >= self.first_dense_layers
                and (layer + 1) % self.every_n_layers == 0)


def token_shards() -> int:
    """How many ways the tokens of a batch are split where this is traced: over the batch axes
    (expert included) and the sequence axis."""
    return math.prod([sharding.traced_split("activation_batch", axis)
                      for axis in sharding.BATCH_AXES]
                     + [sharding.traced_split("activation_length", "sequence")])


class MoEFeedForward(nn.Module):
    """A feed-forward layer of `num_experts` expert FFNs, each token through its top-k.

    Experts are act(x W_i) W_o, or (act(x W_gate) * x W_up) W_o when `gated`; their params
    carry the logical axis `expert` first. `num_shared` > 0 adds an always-on dense FFN of
    `num_shared * d_ff` hidden units (DeepSeek's shared experts). Returns (y [B, T, D], Routing).
    """

    num_experts: int
    d_ff: int
    top_k: int = 2
    capacity_factor: float = 1.25
    num_shared: int = 0
    activation: Callable[[Array], Array] = nn.gelu
    gated: bool = False
    normalize_gates: bool = True
    shared_gate: bool = False  # the shared FFN's output times sigmoid(x . w_gate) per token
    score: str = "softmax"  # routing: the scores, groups, gate scale and bias (nn.routing)
    groups: int = 1
    top_groups: int = 1
    scale: float = 1.0
    balance_bias: bool = False  # params `balance_bias` [E], moved by the train step, not trained
    use_bias: bool = False  # router_bias [E] and the experts' biases (gpt-oss)
    swiglu_limit: float = 0.0  # > 0: activations.clamped_swiglu (gated experts)
    init_std: float | None = None
    init_scale: float = 1.0  # the experts' input kernels' init std multiplier (muP)
    out_init_scale: float = 1.0  # their output kernels' (muP, scale_residual_init)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BTD: Array, segment_ids: Array | None = None) -> tuple[Array, Routing]:
        """x [B, T, D] -> (y [B, T, D], its `Routing`); `segment_ids` 0 marks padding, which
        takes no expert slot and counts in no auxiliary quantity (`routing.route`)."""
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k}: expected 1 <= top_k <= num_experts="
                             f"{self.num_experts}")
        if self.capacity_factor < 0:
            raise ValueError(f"capacity_factor={self.capacity_factor}: expected >= 0 (0: no "
                             "token is dropped)")
        _, tokens, d_model = x_BTD.shape
        router = self.param("router", nn.with_logical_partitioning(self._init(), ("embed", None)),
                            (d_model, self.num_experts), jnp.float32)
        # Dropless routing sorts the tokens by expert for ragged matmuls: on one device, or
        # per device in a shard_map when a mesh axis splits the tokens; the capacity path with
        # a slot for every token only where the shard_map cannot split them (see `dispatch_path`).
        path = dispatch_path(self.capacity_factor, self.num_experts, x_BTD.shape)
        kernels.record(f"moe dispatch: {path}")
        ragged = path != CAPACITY
        slots = None if ragged else capacity(tokens, self.num_experts, self.top_k,
                                             self.capacity_factor)
        bias_E = self.param("balance_bias", nn.with_logical_partitioning(
            nn.initializers.zeros, (None,)), (self.num_experts,), jnp.float32) \
            if self.balance_bias else None
        logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), router)
        if self.use_bias:
            logits_BTE = logits_BTE + self.param("router_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, (None,)), (self.num_experts,), jnp.float32)
        # The router runs in float32 whatever the compute dtype: its scores pick the experts.
        routing = route(logits_BTE,
                        self.top_k, slots, self.normalize_gates, score=self.score,
                        bias_E=bias_E, groups=self.groups, top_groups=self.top_groups,
                        scale=self.scale, valid_BT=None if segment_ids is None else segment_ids > 0,
                        per_token=self._per_token())
        # Beside the bias's path (losses/.../moe/expert_load), for the train step to move it.
        self.sow("losses", "expert_load", routing.load_E)

        def expert_param(name, shape, names):  # [E, in, out]: fan-in per expert
            init = self._init("wo" if name == "wo" else "in", in_axis=1, out_axis=2,
                              batch_axis=(0,))
            return self.param(name, nn.with_logical_partitioning(init, names), shape,
                              self.param_dtype).astype(self.dtype)

        shape_in = (self.num_experts, d_model, self.d_ff)
        names_in = ("expert", "expert_embed", "mlp")
        weights = {name: expert_param(name, shape_in, names_in)
                   for name in (("wi_gate", "wi_up") if self.gated else ("wi",))}
        weights["wo"] = expert_param("wo", (self.num_experts, self.d_ff, d_model),
                                     ("expert", "mlp", "expert_embed"))
        if self.use_bias:  # the input projections' biases go with their kernels
            for name in list(weights)[:-1]:
                weights[f"{name}_bias"] = self._bias(f"{name}_bias", self.d_ff, "mlp")
        x_BTD = x_BTD.astype(self.dtype)
        if ragged:
            y_BTD = self._ragged(x_BTD, routing, weights, path != RAGGED)
        else:
            dispatch = routing.dispatch_BTEC.astype(self.dtype)
            # Filled where the tokens are, then the all-to-all into the experts' layout (left
            # to itself, GSPMD may move the inputs instead and fill the buffers redundantly).
            x_BECD = sharding.constrain(jnp.einsum("btec,btd->becd", dispatch, x_BTD),
                                        TOKEN_BUFFERS)
            x_BECD = sharding.constrain(x_BECD, EXPERT_BUFFERS)
            matmul = lambda x_BECI, w_EIO: jnp.einsum("beci,eio->beco", x_BECI, w_EIO)
            y_BECD = sharding.constrain(self._experts(x_BECD, weights, matmul, lambda b_EO: b_EO[
                None, :, None]), EXPERT_BUFFERS)
            y_BECD = sharding.constrain(y_BECD, TOKEN_BUFFERS)  # and back to the tokens' layout
            y_BTD = jnp.einsum("btec,becd->btd", routing.combine_BTEC.astype(self.dtype),
                               y_BECD)
        if self.use_bias:
            # The output bias of each kept choice, times its gate: sum_k g_k (h_k W_o + b_o).
            # Added here, after the experts (a tensor split sums their partial outputs).
            wo_bias = self._bias("wo_bias", d_model, "expert_embed")
            if ragged:
                y_BTD = y_BTD + jnp.einsum("btk,btkd->btd", routing.gates_BTK.astype(self.dtype),
                                           wo_bias[routing.choice_BTK])
            else:
                y_BTD = y_BTD + jnp.einsum("btec,ed->btd", routing.combine_BTEC.astype(
                    self.dtype), wo_bias)
        if self.num_shared:
            y_BTD = y_BTD + self._shared(x_BTD)
        return y_BTD, routing

    def _experts(self, x, weights, matmul, rows_of):
        """The expert FFNs on buffers x, with `matmul(x, w [E, in, out])` per expert and, with
        biases, `rows_of(b [E, out])` each expert's bias laid out as x's rows (the output bias
        is added after the combine, in `__call__`)."""

        def project(name):
            y = matmul(x, weights[name])
            return y + rows_of(weights[f"{name}_bias"]) if f"{name}_bias" in weights else y

        if self.swiglu_limit:
            h = clamped_swiglu(project("wi_gate"), project("wi_up"), self.swiglu_limit)
        elif self.gated:
            h = self.activation(project("wi_gate")) * project("wi_up")
        else:
            h = self.activation(project("wi"))
        return matmul(h, weights["wo"])

    def _bias(self, name: str, size: int, axis: str) -> Array:
        return self.param(name, nn.with_logical_partitioning(nn.initializers.zeros, (
            "expert", axis)), (self.num_experts, size), self.param_dtype).astype(self.dtype)

    @staticmethod
    def _per_token():
        """A valid token's weight in the routing's token means (`routing.token_weight`; None:
        their own means). Inside a pipeline stage, the M microbatches' values are averaged
        (`pipeline_parallel.run`): each counts M times its share of the batch."""
        weight = current_token_weight()
        if weight is not None and pipeline_parallel.in_stage():
            weight = weight * pipeline_parallel.current_schedule()[0]
        return weight

    def _ragged(self, x_BTD: Array, routing: Routing, weights, sharded: bool) -> Array:
        """Dropless experts: the (token, choice) pairs sorted by expert, each expert's run of
        rows through its weights by `jax.lax.ragged_dot`, then scattered back with the gates.
        O(T k) work and memory per row, against O(T^2 E) for a dispatch tensor with T slots.
        `sharded`: per device, in `sharded_experts`."""

        def apply(x_ND, sizes_E, weights):  # rows sorted by expert, sizes_E rows each
            matmul = lambda x, w: jax.lax.ragged_dot(x, w, sizes_E)
            rows_of = lambda b_EO: jnp.repeat(b_EO, sizes_E, axis=0,
                                              total_repeat_length=x_ND.shape[0])
            return self._experts(x_ND, weights, matmul, rows_of)

        if sharded:
            return sharded_experts(x_BTD, routing.choice_BTK, routing.gates_BTK, weights,
                                   apply, self.num_experts)
        return sorted_apply(x_BTD, routing.choice_BTK, routing.gates_BTK,
                            lambda x_ND, sizes_E: apply(x_ND, sizes_E, weights),
                            self.num_experts)

    def _init(self, kind: str = "router", **axes) -> nn.initializers.Initializer:
        """Normal(init_std) if given, else fan-in variance scaling (over `axes`); an input
        kernel's ("in") std times `init_scale`, an output kernel's ("wo") `out_init_scale`."""
        scale = {"in": self.init_scale, "wo": self.out_init_scale}.get(kind, 1.0)
        if self.init_std is not None:
            return nn.initializers.normal(self.init_std * scale)
        return nn.initializers.variance_scaling(scale**2, "fan_in", "truncated_normal", **axes)

    def _shared(self, x_BTD: Array) -> Array:
        hidden = self.num_shared * self.d_ff
        d_model = x_BTD.shape[-1]

        def param(name, shape, names):
            init = self._init("wo" if name == "shared_wo" else "in")
            return self.param(name, nn.with_logical_partitioning(init, names), shape,
                              self.param_dtype).astype(self.dtype)

        h_BTF = jnp.einsum("btd,df->btf", x_BTD, param("shared_wi", (d_model, hidden),
                                                        ("embed", "mlp")))
        h_BTF = self.activation(h_BTF)
        if self.gated:
            h_BTF = h_BTF * jnp.einsum("btd,df->btf", x_BTD, param(
                "shared_wi_up", (d_model, hidden), ("embed", "mlp")))
        y_BTD = jnp.einsum("btf,fd->btd", h_BTF, param("shared_wo", (hidden, d_model),
                                                        ("mlp", "embed")))
        if self.shared_gate:
            y_BTD = y_BTD * jax.nn.sigmoid(jnp.einsum("btd,dk->btk", x_BTD, param(
                "shared_gate", (d_model, 1), ("embed", None))))
        return y_BTD


RAGGED = "ragged"  # the dispatch paths `dispatch_path` names
CAPACITY = "capacity buffers"
TOKENS = ("activation_batch", "activation_length", None)  # [B, T, D] and [B, T, K]


def dispatch_path(capacity_factor: float, num_experts: int, shape_BTD: tuple[int, ...]) -> str:
    """The MoE dispatch path traced here, as the run's start line names it:

    "capacity buffers"   capacity_factor > 0; or dropless where `expert` > 1 does not divide
                         the experts or split the batch (e.g. decoding one row), or in a
                         pipeline stage (transformer.parallel.pipeline_parallel): T slots
    "ragged"             dropless, the tokens on one device
    "ragged per shard"   dropless, mesh axes split the tokens, `expert` is 1: no exchange
    "ragged all-to-all over expert=N"   dropless, `sharded_experts` with the exchange by
                         `jax.lax.ragged_all_to_all`, or "dense all-to-all ..." with padded
                         per-device blocks on CPU, whose XLA has no ragged-all-to-all

    >>> dispatch_path(0, num_experts=8, shape_BTD=(4, 16, 32))  # no mesh in context
    'ragged'
    """
    if capacity_factor or pipeline_parallel.in_stage():  # (no shard_map under the stages' vmap)
        return CAPACITY
    if token_shards() == 1:
        return RAGGED
    mesh = jax.sharding.get_abstract_mesh()
    ep = mesh.shape.get(sharding.EXPERT_AXIS, 1)
    if ep == 1:
        return "ragged per shard"
    batch_axes = _tokens_spec(shape_BTD)[0]
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    if num_experts % ep or sharding.EXPERT_AXIS not in batch_axes:
        return CAPACITY
    kind = "dense" if kernels.target_platform() == "cpu" else "ragged"
    return f"{kind} all-to-all over {sharding.EXPERT_AXIS}={ep}"


def _tokens_spec(shape) -> jax.sharding.PartitionSpec:
    return sharding.mesh_spec(jax.sharding.PartitionSpec(*TOKENS), shape,
                              jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules())


def sorted_apply(x_BTD: Array, choice_BTK: Array, gates_BTK: Array, apply, num_experts: int):
    """The (token, choice) pairs of x sorted by expert, `apply(x_ND, sizes_E)` on them (rows
    of expert e after those of e - 1, sizes_E[e] of them), and each token's k results summed
    with its gates: [B, T, D].

    >>> x = jnp.arange(3.0).reshape(1, 3, 1)  # tokens 0, 1, 2 choose experts 1, 0, 1 (k=1)
    >>> def apply(x_ND, sizes_E):  # sorted rows: token 1 (expert 0), then tokens 0 and 2
    ...     scale_N = jnp.repeat(jnp.array([10.0, 100.0]), sizes_E, total_repeat_length=3)
    ...     return x_ND * scale_N[:, None]
    >>> sorted_apply(x, jnp.array([[[1], [0], [1]]]), jnp.ones((1, 3, 1)), apply, 2)[0, :, 0]
    Array([  0.,  10., 200.], dtype=float32)
    """
    batch, tokens, d_model = x_BTD.shape
    top_k = choice_BTK.shape[-1]
    expert_N = choice_BTK.reshape(-1)
    order_N = jnp.argsort(expert_N, stable=True)
    token_N = order_N // top_k  # index into the B * T tokens
    sizes_E = jnp.bincount(expert_N, length=num_experts).astype(jnp.int32)
    y_ND = apply(x_BTD.reshape(batch * tokens, d_model)[token_N], sizes_E)
    gates_N = gates_BTK.reshape(-1)[order_N].astype(x_BTD.dtype)
    y_TD = jnp.zeros((batch * tokens, d_model), x_BTD.dtype).at[token_N].add(
        y_ND * gates_N[:, None])
    return y_TD.reshape(batch, tokens, d_model)


def sharded_experts(x_BTD: Array, choice_BTK: Array, gates_BTK: Array, weights, apply,
                    num_experts: int) -> Array:
    """Dropless experts under a mesh that splits the tokens, in a `jax.shard_map`: each device
    runs `sorted_apply` on its own tokens, and with `expert` > 1 its sorted rows go to the
    devices holding their experts and come back (`_exchange`); there `apply(x_ND, sizes_E,
    weights)` runs that device's experts. The experts' kernels enter whole but for their
    expert split and their `mlp` split (tensor): those devices sum their partial outputs.
    Memory per device: the tokens' N = T k sorted rows, and expert x N received rows (what
    the worst case, every pair choosing this device's experts, needs: no token dropped)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    P = jax.sharding.PartitionSpec
    ep = mesh.shape.get(sharding.EXPERT_AXIS, 1)
    ragged = dispatch_path(0, num_experts, x_BTD.shape).startswith("ragged all-to-all")
    tokens = _tokens_spec(x_BTD.shape)
    names = {name: ("expert", "mlp", None) if name == "wo" else ("expert", "mlp")
             if name.endswith("_bias") else ("expert", None, "mlp") for name in weights}
    specs = {name: sharding.mesh_spec(P(*names[name]), w.shape, mesh, rules)
             for name, w in weights.items()}
    hidden = specs["wo"][1]  # the mesh axes splitting the experts' hidden units
    hidden = (hidden,) if isinstance(hidden, str) else tuple(hidden or ())

    def local(x_btD, choice_btK, gates_btK, weights):
        run = lambda x_ND, sizes_E: apply(x_ND, sizes_E, weights)
        experts = run if ep == 1 else lambda x_ND, sizes_E: _exchange(x_ND, sizes_E, run, ragged)
        y_btD = sorted_apply(x_btD, choice_btK, gates_btK, experts, num_experts)
        return jax.lax.psum(y_btD, hidden) if hidden else y_btD

    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, specs),
                         out_specs=tokens)(x_BTD, choice_BTK, gates_BTK, weights)


def _exchange(x_ND: Array, sizes_E: Array, apply, ragged: bool) -> Array:
    """Inside `sharded_experts`: this device's N rows, sorted by expert (sizes_E rows each
    of all E experts), sent along `expert` to the devices holding their experts, `apply(x,
    local sizes)` there on the rows all devices sent, sorted by local expert, and the results
    returned to the rows' order here.

    Each device receives ep blocks of N rows, block s holding (first) what device s sent: with
    E = 4 on ep = 2 devices and sizes_E = [1, 2, 0, 1] here, rows 0:3 (experts 0, 1) stay on
    device 0 and row 3 goes to device 1, into rows [N * me, N * me + 1) of its buffer."""
    rows, _ = x_ND.shape
    ep = jax.lax.axis_size(sharding.EXPERT_AXIS)
    send_JL = sizes_E.reshape(ep, -1)  # rows to device j for its local expert l
    # First the counts: recv_JL[s, l], rows device s sends here for local expert l.
    recv_JL = jax.lax.all_to_all(send_JL, sharding.EXPERT_AXIS, 0, 0, tiled=True)
    send_J, recv_J = send_JL.sum(1), recv_JL.sum(1)
    start_J = jnp.cumsum(send_J) - send_J
    x_JND = _all_to_all(x_ND, start_J, send_J, recv_J, rows, ragged)
    # Every block is sorted by expert: regroup all rows expert-major, the padding (the rows
    # past recv_J[s] in block s, local index L) last, which ragged_dot leaves out (zeros).
    i_N = jnp.arange(rows)
    local_JN = jax.vmap(lambda ends_L: jnp.searchsorted(ends_L, i_N, side="right"))(
        jnp.cumsum(recv_JL, axis=1))
    order_M = jnp.argsort(local_JN.reshape(-1), stable=True)
    y_MD = apply(x_JND.reshape(ep * rows, -1)[order_M], recv_JL.sum(0))
    y_MD = y_MD[jnp.argsort(order_M)]  # back to the blocks' order
    y_JND = _all_to_all(y_MD, jnp.arange(ep, dtype=jnp.int32) * rows, recv_J, send_J, rows,
                        ragged)  # block j: this device's rows device j computed
    dest_N = jnp.searchsorted(jnp.cumsum(send_J), i_N, side="right")
    return y_JND[dest_N, i_N - start_J[dest_N]]


def _all_to_all(x_MD: Array, offsets_J: Array, sizes_J: Array, recv_J: Array, block: int,
                ragged: bool) -> Array:
    """Rows offsets_J[j] + [0, sizes_J[j]) of x to device j along `expert`; returns [ep, block,
    D], block s starting with the recv_J[s] rows device s sent, zeros after. `ragged`: by
    `jax.lax.ragged_all_to_all`; else padded to `block` rows per device and `all_to_all`."""
    ep = sizes_J.shape[0]
    if ragged:
        here = jax.lax.axis_index(sharding.EXPERT_AXIS) * block
        out = jnp.zeros((ep * block, x_MD.shape[1]), x_MD.dtype)
        out = jax.lax.ragged_all_to_all(x_MD, out, offsets_J, sizes_J,
                                        jnp.full((ep,), here, jnp.int32), recv_J,
                                        axis_name=sharding.EXPERT_AXIS)
        return out.reshape(ep, block, -1)
    i = jnp.arange(block)
    rows_JB = jnp.minimum(offsets_J[:, None] + i, x_MD.shape[0] - 1)
    blocks = jnp.where((i < sizes_J[:, None])[..., None], x_MD[rows_JB], 0)
    return jax.lax.all_to_all(blocks, sharding.EXPERT_AXIS, 0, 0, tiled=True)


__all__ = ["MoEConfig", "MoEFeedForward", "Routing", "capacity", "dispatch_path", "route",
           "sharded_experts", "sorted_apply"]
