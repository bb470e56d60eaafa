"""Transformer blocks (pre/post-LN, parallel, MoE, local) and (scanned) stacks of them.

Shapes: B batch, T length, D model width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.nn import lora, sequence_parallel
from transformer.nn import positions as positions_lib
from transformer.nn.activations import ACTIVATIONS, GATED
from transformer.nn.attention import AttentionSettings, MultiHeadAttention
from transformer.nn.config import REMAT_POLICIES, TransformerConfig
from transformer.nn.layers import MLP, norm_layer
from transformer.nn.masks import Mask
from transformer.nn.mixers import MIXERS
from transformer.nn.moe import MoEFeedForward
from transformer.nn.routing import imbalance, update_balance_bias
from transformer.parallel import pipeline_parallel, sharding

Array = jax.Array


class TransformerBlock(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; each a residual sublayer.

    `config.norm_placement`: pre-LN x + Dropout(f(LN(x))); post-LN (the original Transformer)
    LN(x + Dropout(f(x))); sandwich x + LN'(Dropout(f(LN(x)))); post_sublayer x + LN'(f(x)).
    `config.parallel_block`: x + attn(LN(x)) + mlp(LN(x)), one norm for both.
    An encoder block is self-attention (with a Full/Padding mask) + FFN; a decoder block uses a
    Causal mask and, with `cross_attention=True`, attends to `encoded` in between.
    `layer_type`: the token mixer in the first sublayer (a name in `mixers.MIXERS`, default
    full attention); its record says its params' name and whether it attends under `local_mask`
    (the sliding window) instead of `mask`. `segment_ids` reach the mixer (recurrent mixers
    restart their state at each document; see `mixers.base`).
    `moe_layer=True` makes the feed-forward a mixture of experts (`config.moe`), which sows
    its auxiliary quantities into the 'losses' collection (`moe_aux`).
    `scanned=True` makes it return (x, None), the carry/output pair `nn.scan` expects.
    """

    config: TransformerConfig
    cross_attention: bool = False
    deterministic: bool = True
    scanned: bool = False
    decode: bool = False  # KV-cache decoding (see MultiHeadAttention)
    moe_layer: bool = False
    layer_type: str = "full_attention"

    @nn.compact
    def __call__(self, x_BTD, mask, bias, positions, encoded=None, cross_mask=None,
                 local_mask=None, segment_ids=None):
        cfg = self.config
        if self.cross_attention and encoded is None and not self.decode:
            raise ValueError("a block with cross_attention=True needs `encoded` inputs")
        mixer = MIXERS[self.layer_type]
        # (configs.validate_config refuses it for the CLIs; a model built in Python meets it here)
        if (split := sequence_parallel.shards()) > 1 and \
                (reason := mixer.refuses(cfg, {"sequence": split})) is not None:
            raise ValueError(reason)
        self_mask = local_mask if mixer.local else mask
        attend = lambda h: mixer.layer(cfg, mixer.param_name)(
            h, mask=self_mask, bias=bias, q_positions=positions, segment_ids=segment_ids,
            deterministic=self.deterministic, decode=self.decode)
        mlp = (lambda h: self._moe(h, segment_ids)) if self.moe_layer else MLP(
            cfg, self.deterministic, name="mlp")
        dropout = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
        if cfg.parallel_block:
            if self.cross_attention:
                raise ValueError("parallel_block=True: expected a stack without cross-attention")
            h_BTD = norm_layer(cfg, "self_attention_norm")(x_BTD)
            x_BTD = x_BTD + dropout(attend(h_BTD)) + dropout(mlp(h_BTD))
        else:
            x_BTD = self._residual(x_BTD, mixer.param_name, attend)
            if self.cross_attention:  # decode steps reuse the cached K/V (encoded is None)
                x_BTD = self._residual(x_BTD, "cross_attention", lambda h: self._attention(
                    "cross_attention", False)(h, encoded, mask=cross_mask,
                                              deterministic=self.deterministic,
                                              decode=self.decode))
            if cfg.d_ff or self.moe_layer:  # d_ff 0: the mixer alone (Mamba 2's blocks)
                x_BTD = self._residual(x_BTD, "mlp", mlp)
        x_BTD = sharding.constrain(x_BTD, sharding.ACTIVATIONS)
        return (x_BTD, None) if self.scanned else x_BTD

    def _residual(self, x_BTD: Array, name: str, sublayer) -> Array:
        """x plus the sublayer's dropped-out output, normed where `norm_placement` says: params
        `name`_norm (on its input; post: on the sum) and `name`_output_norm (on its output)."""
        cfg, placement = self.config, self.config.norm_placement
        y_BTD = sublayer(norm_layer(cfg, f"{name}_norm")(x_BTD)
                         if placement in ("pre", "sandwich") else x_BTD)
        if placement in ("sandwich", "post_sublayer"):
            y_BTD = norm_layer(cfg, f"{name}_output_norm")(y_BTD)
        x_BTD = x_BTD + nn.Dropout(cfg.dropout_rate)(y_BTD, deterministic=self.deterministic)
        return norm_layer(cfg, f"{name}_norm")(x_BTD) if placement == "post" else x_BTD

    def _attention(self, name: str, is_self: bool) -> MultiHeadAttention:
        return MultiHeadAttention(AttentionSettings.from_config(self.config, cross=not is_self),
                                  name=name)

    def _moe(self, x_BTD: Array, segment_ids: Array | None) -> Array:
        cfg = self.config
        y_BTD, routing = MoEFeedForward(
            num_experts=cfg.moe.num_experts, d_ff=cfg.moe.d_ff or cfg.d_ff, top_k=cfg.moe.top_k,
            capacity_factor=cfg.moe.capacity_factor, num_shared=cfg.moe.num_shared,
            normalize_gates=cfg.moe.normalize_gates, shared_gate=cfg.moe.shared_gate,
            score=cfg.moe.score, groups=cfg.moe.n_group, top_groups=cfg.moe.topk_group,
            scale=cfg.moe.routed_scaling_factor, balance_bias=cfg.moe.balance_bias,
            use_bias=cfg.moe.use_bias, swiglu_limit=cfg.moe.swiglu_limit,
            activation=ACTIVATIONS[cfg.activation], gated=cfg.activation in GATED,
            init_std=cfg.init_std, init_scale=cfg.init_scale(),
            out_init_scale=cfg.init_scale(residual=True), dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, name="moe")(x_BTD, segment_ids)
        for name in MOE_AUX:
            self.sow("losses", f"moe_{name}", getattr(routing, name))
        return y_BTD


class _BlockGroup(nn.Module):
    """`config.layer_period` consecutive blocks: what one step of the scan runs when layers are
    not all alike (MoE every n layers, a global layer every sliding_window_pattern), each block
    the kind its index in the period gives (params `layers/block_0..n-1`)."""

    config: TransformerConfig
    block: Any  # the block class (possibly rematerialised)
    cross_attention: bool = False
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x_BTD, *args):
        cfg = self.config
        for i in range(cfg.layer_period):
            x_BTD = self.block(cfg, cross_attention=self.cross_attention,
                               deterministic=self.deterministic, decode=self.decode,
                               moe_layer=cfg.moe.is_moe_layer(i), layer_type=cfg.layer_type(i),
                               name=f"block_{i}")(x_BTD, *args)
        return x_BTD, None


def _scanned(cfg: TransformerConfig, block, length: int, kwargs: dict, **module_kwargs):
    """`length` scanned block groups (or blocks, when all layers are alike): the `layers` unit
    whose params have a leading axis of that length, named `layers` by the logical rules."""
    grouped = cfg.layer_period > 1
    scanned = nn.scan(
        _BlockGroup if grouped else block,
        variable_axes={"params": 0, "intermediates": 0, "cache": 0, "losses": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * 7,
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    if grouped:
        return scanned(cfg, block, **kwargs, **module_kwargs)
    return scanned(cfg, scanned=True, moe_layer=cfg.moe.num_experts > 0,
                   layer_type=cfg.layer_type(0), **kwargs, **module_kwargs)


def scan_segments(cfg: TransformerConfig) -> list[tuple[str, TransformerConfig, int]]:
    """The scanned stack's parts, (params name, config, layers): an MoE stack's first dense
    layers (moe.first_dense_layers, DeepSeek-V3's first 3) scan apart as `dense_layers`, then
    the rest as `layers`, each part's params stacked alike."""
    dense = cfg.moe.first_dense_layers if cfg.moe.num_experts else 0
    if not dense:
        return [("layers", cfg, cfg.num_layers)]
    replace = dataclasses.replace
    return [("dense_layers", replace(cfg, moe=replace(cfg.moe, num_experts=0)), dense),
            ("layers", replace(cfg, moe=replace(cfg.moe, first_dense_layers=0)),
             cfg.num_layers - dense)]


def stack_unrolled(cfg: TransformerConfig, stack: dict) -> dict:
    """An unrolled stack's params {layers_0, ..., other} in `cfg`'s scanned layout: each part
    of `scan_segments` stacked along a new leading axis, by groups of `layer_period` layers
    ({block_j: layers j, j + P, ...}) where layers are not all alike."""
    stack = dict(stack)
    layers = [stack.pop(f"layers_{i}") for i in range(cfg.num_layers)]
    stacked = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    start = 0
    for name, part, count in scan_segments(cfg):
        mine, period = layers[start:start + count], part.layer_period
        stack[name] = stacked(mine) if period == 1 else {
            f"block_{j}": stacked(mine[j::period]) for j in range(period)}
        start += count
    return stack


MOE_AUX = ("load_balance", "router_z", "dropped")  # sown per MoE layer as losses/moe_<name>


def moe_aux(losses) -> dict[str, Array]:
    """{"load_balance", "router_z", "dropped"}: each the mean over the MoE layers of what they
    sowed into the 'losses' collection (`{}` for a model without MoE layers)."""
    leaves = {name: [] for name in MOE_AUX}
    flat = jax.tree_util.tree_flatten_with_path(losses)[0]
    for path, value in flat:
        keys = [getattr(k, "key", None) for k in path]
        for name in MOE_AUX:
            if f"moe_{name}" in keys:
                leaves[name].append(jnp.ravel(value))
    return {name: jnp.mean(jnp.concatenate(values)) for name, values in leaves.items() if values}


def expert_loads(losses) -> dict:
    """The MoE layers' sown expert loads (`routing.Routing.load_E`, [..., E], a scanned
    stack's with its layer groups first), nested as the params are: each `.../moe/expert_load`
    beside its layer's `.../moe/balance_bias`; {} without MoE layers."""
    out = {}
    for name, value in losses.items():
        if name == "expert_load":
            out[name] = value[0]  # sow keeps a tuple
        elif isinstance(value, Mapping) and (inner := expert_loads(value)):
            out[name] = inner
    return out


def move_balance_biases(params, before, loads: dict, rate: float, moving=True):
    """`params` with each MoE layer's expert bias set to its value in `before` moved by
    `routing.update_balance_bias` on the load its layer sowed (`expert_loads`) where `moving`
    (kept where not): gradients and the optimizer never change it. Layers without a bias and
    the other params stay as they are."""
    out = dict(params)
    for name, value in loads.items():
        if name != "expert_load":
            out[name] = move_balance_biases(params[name], before[name], value, rate, moving)
        elif "balance_bias" in params:
            old = before["balance_bias"]
            out["balance_bias"] = jnp.where(moving, update_balance_bias(old, value, rate), old)
    return out


def layer_imbalance(loads: dict, cfg: TransformerConfig, prefix: str = "") -> dict[str, Array]:
    """`routing.imbalance` of each MoE layer's load (`expert_loads`), named "<stack>_<i>" with
    i the layer (from 0): unrolled `layers_<i>`, or scanned `layers` (after the first dense
    layers) whose group g, block j is layer g * layer_period + j."""
    out = {}
    for name, value in loads.items():
        if name.startswith("layers_"):
            out[f"{prefix}{int(name[7:])}"] = imbalance(value["moe"]["expert_load"])
        elif name == "layers":
            blocks = {0: value} if "moe" in value else {int(k[6:]): v for k, v in value.items()}
            for j, block in blocks.items():
                for g, x in enumerate(imbalance(block["moe"]["expert_load"])):
                    out[f"{prefix}{cfg.moe.first_dense_layers + g * cfg.layer_period + j}"] = x
        else:
            out.update(layer_imbalance(value, cfg, f"{prefix}{name}_"))
    return out


class TransformerStack(nn.Module):
    """N blocks plus what a stack owns: absolute positions, shared position biases, final norm.

    Adds sinusoidal/learned positions to the input (then the embedding norm, if configured, and
    dropout), computes the ALiBi or T5 bias once (the T5
    bias table is shared by all layers of the stack; `bidirectional=False` uses causal buckets),
    runs the blocks (unrolled as `layers_0..N-1`, or one `nn.scan` over `layers` with a leading
    layer axis so compile time does not grow with depth), then the final norm for pre-LN.
    """

    config: TransformerConfig
    cross_attention: bool = False
    bidirectional: bool = True

    @nn.compact
    def __call__(
        self,
        x_BTD: Array,
        mask: Mask | Array | None = None,
        positions: Array | None = None,
        encoded: Array | None = None,
        cross_mask: Mask | Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        kv_positions: Array | None = None,
        local_mask: Mask | Array | None = None,
        segment_ids: Array | None = None,
    ) -> Array:
        """`decode=True` runs the blocks' attention on the KV cache (see MultiHeadAttention);
        `kv_positions` [1 or B, L] are then the positions of the cache slots, for the ALiBi and
        T5 biases (default: `positions`). `local_mask`: the self-attention mask of the layers
        `config.is_local_layer` names (the sliding window's; default `mask`). `segment_ids`
        [B, T] reach the token mixers (`mixers.base`: documents, or a decode prefill's padding)."""
        cfg = self.config
        length = x_BTD.shape[1]
        if positions is None:
            positions_lib.check_learned_length(cfg, length)
            positions = jnp.arange(length, dtype=jnp.int32)[None]
        x_BTD = x_BTD.astype(cfg.dtype)
        if cfg.scale_embeddings:
            x_BTD = x_BTD * jnp.asarray(cfg.d_model**0.5, cfg.dtype)
        if cfg.position == "sinusoidal":
            x_BTD = x_BTD + positions_lib.sinusoidal_positions(positions, cfg.d_model).astype(
                cfg.dtype)
        elif cfg.position == "learned":
            x_BTD = x_BTD + positions_lib.LearnedPositionEmbedding(
                cfg.max_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                name="position_embedding")(positions)
        bias = None
        kv_positions = positions if kv_positions is None else kv_positions
        # With chunked attention (or "auto", which may pick it) the biases are functions of
        # (query, key) indices, evaluated per tile: never a [B, N, T, S] array.
        as_function = (cfg.attention_impl in ("chunked", "auto")
                       or sequence_parallel.shards() > 1)
        if cfg.position == "alibi":
            bias = (positions_lib.alibi_bias_fn if as_function else positions_lib.alibi_bias)(
                positions, kv_positions, cfg.num_heads)
        elif cfg.position == "t5":
            bias = positions_lib.T5RelativePositionBias(
                cfg.num_heads, bidirectional=self.bidirectional, num_buckets=cfg.t5_num_buckets,
                max_distance=cfg.t5_max_distance, param_dtype=cfg.param_dtype,
                dtype=jnp.promote_types(cfg.dtype, jnp.float32),
                name="relative_position_bias")(positions, kv_positions, as_function=as_function)
        if cfg.embedding_norm:
            x_BTD = norm_layer(cfg, "embedding_norm")(x_BTD)
        x_BTD = nn.Dropout(cfg.dropout_rate)(x_BTD, deterministic=deterministic)
        x_BTD = sharding.constrain(x_BTD, sharding.ACTIVATIONS)

        block = TransformerBlock
        if cfg.remat_policy != "none":
            block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy],
                             prevent_cse=not cfg.scan_layers)
        args = (mask, bias, positions, encoded, cross_mask,
                mask if local_mask is None else local_mask, segment_ids)
        kwargs = dict(cross_attention=self.cross_attention, deterministic=deterministic,
                      decode=decode)
        moe = cfg.moe
        if cfg.scan_layers:
            if self._pipelined(decode):
                x_BTD = self._pipeline(block, kwargs, x_BTD, args, deterministic)
            else:
                for name, part, layers in scan_segments(cfg):
                    x_BTD, _ = _scanned(part, block, layers // part.layer_period, kwargs,
                                        name=name)(x_BTD, *args)
        else:
            for i in range(cfg.num_layers):
                x_BTD = block(cfg, name=f"layers_{i}", moe_layer=moe.is_moe_layer(i),
                              layer_type=cfg.layer_type(i), **kwargs)(x_BTD, *args)
        if cfg.norm_placement != "post":
            x_BTD = norm_layer(cfg, "final_norm")(x_BTD)
        return x_BTD

    def _pipelined(self, decode: bool) -> bool:
        """Whether the scanned blocks run as a pipeline: under a mesh with `stage` > 1, when
        applied (init lays the params out as the plain scan does), not decoding, and for a
        stack without cross-attention (the families `configs.validate_config` accepts)."""
        return (pipeline_parallel.stages_in_mesh() > 1 and not self.is_initializing() and not decode
                and not self.cross_attention)

    def _pipeline(self, block, kwargs, x_BTD, args, deterministic):
        """The scanned blocks over the `stage` axis (`pipeline_parallel.run`), on the params the
        plain scan declares (`layers`, leading axis the layer groups). MoE layers' auxiliary
        losses come back averaged over microbatches and layers, sown as one value per layer."""
        cfg = self.config
        if cfg.position in ("alibi", "t5"):
            raise ValueError(f"position={cfg.position!r}: the pipeline (mesh.stage > 1) "
                             "expected positions without an attention bias (not alibi or t5)")
        microbatches, repeats = pipeline_parallel.current_schedule()
        stages = pipeline_parallel.stages_in_mesh()
        groups = cfg.num_layers // cfg.layer_period
        # `block` keeps its own remat inside `run`'s of each stage: a stage's backward then
        # holds one layer's activations, not its Lps layers', for a third forward of each
        # (where a stage is one block XLA merges the two recomputes: the same FLOPs, measured).
        unit = _scanned(cfg, block, groups // (stages * repeats), kwargs, parent=None)

        def stage_fn(params, x_bTD, stage_args, key):
            (y_bTD, _), state = unit.apply({"params": params}, x_bTD, *stage_args,
                                           rngs={} if key is None else {"dropout": key},
                                           mutable=["losses"])
            return y_bTD, moe_aux(state.get("losses", {}))

        dropout = cfg.dropout_rate or cfg.attention_dropout_rate or cfg.lora.dropout
        rng = None if deterministic or not dropout else self.make_rng("dropout")
        with lora.applied_at((*self.scope.path, "layers")):  # (traced inside `run`)
            x_BTD, aux = pipeline_parallel.run(
                stage_fn, self.variables["params"]["layers"], x_BTD, args, stages=stages,
                microbatches=microbatches, repeats=repeats, rng=rng,
                remat_policy=REMAT_POLICIES[cfg.remat_policy])
        # The stack's mean counts once per MoE layer in `moe_aux`'s mean over all the model's
        # layers (an MTP module's own MoE layers sow theirs beside it).
        moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers))
        for name, value in aux.items():
            self.sow("losses", f"moe_{name}", jnp.full((moe_layers,), value))
        return x_BTD
