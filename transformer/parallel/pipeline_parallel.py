"""Pipeline parallelism: the scanned layer stack split over the `stage` mesh axis.

The params stay as `nn.scan` lays them out, one tree with a leading axis of G layer groups
(`config.layer_period` layers each) whose logical name `layers` the rules map onto `stage`: a
checkpoint restores onto any stage count. Only the forward pass changes (`run`): with S stages,
R repeats (`pipeline.repeats`) and M microbatches (`pipeline.microbatches`), the groups are read
as [R, S, G / (S R)] (stage s holds groups r S Lps + s Lps + j, Lps = G / (S R)), the batch as M
microbatches, and one `lax.scan` runs M R + S - 1 iterations. In each, every stage applies its
Lps groups (those of the repeat its current microbatch is in) to the activation it holds (a
`vmap` over a [S, b, T, D] buffer split over `stage`); then the buffer shifts one stage on (a
collective permute), stage 0 taking the next microbatch, or, in later repeats, what the last
stage made of it one repeat before. Autodiff of that loop is GPipe: all forwards, then all
backwards. Stages idle (the bubble) for S - 1 of the M R + S - 1 iterations (`bubble_fraction`).

R = 1 is GPipe over contiguous layer blocks: stage s's params are its own shard of the stored
tree. R > 1 is the circular (interleaved) schedule: stage s holds R blocks of Lps groups spread
through the stack. Read in layer order, the stored layout (contiguous blocks of R Lps per stage)
would be resharded in every step: each device sends (S - 1) / S of its layer params, between
the slices when `stage` spans them (on TPU that also costs about 100 MiB of generated code per
70B-sized layer, docs/cloud-tpu.md). So training holds the layer params (and their optimizer
moments) *stage-major* (`to_stage_major`: stage s's R blocks contiguous, as `stage` splits
them), and the train and eval steps read them so (`reading_stage_major`); checkpoints and every
other reader keep layer order (transformer.training.placement converts at the boundaries).

    >>> to_stage_major(jnp.arange(8), stages=2, repeats=2)  # groups of 2 layers, Lps = 2
    Array([0, 1, 4, 5, 2, 3, 6, 7], dtype=int32)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

STAGE_AXIS = "stage"
FAMILIES = ("gpt", "prefix_lm")  # decoder-only stacks: the only ones pipelined

_SCHEDULE = contextvars.ContextVar("pipeline_schedule", default=(1, 1))
_IN_STAGE = contextvars.ContextVar("pipeline_in_stage", default=False)
_STAGE_MAJOR = contextvars.ContextVar("pipeline_stage_major", default=False)


def in_stage() -> bool:
    """Whether a pipeline stage is being traced here (inside the `vmap` over stages, where a
    `shard_map` cannot take the stage axis: MoE layers then dispatch by capacity buffers)."""
    return _IN_STAGE.get()


@contextlib.contextmanager
def schedule(microbatches: int = 1, repeats: int = 1):
    """The (microbatches, repeats) a stage-split stack traced inside this context runs with."""
    token = _SCHEDULE.set((microbatches, repeats))
    try:
        yield
    finally:
        _SCHEDULE.reset(token)


def current_schedule() -> tuple[int, int]:
    return _SCHEDULE.get()


def to_stage_major(x: jax.Array, stages: int, repeats: int, inverse: bool = False) -> jax.Array:
    """x's leading [G] layer-group axis from layer order to stage-major order (stage s's R
    blocks of G / (S R) groups contiguous: s R Lps + r Lps + j holds group r S Lps + s Lps + j),
    or back with `inverse`. The identity for GPipe (R = 1) or one stage."""
    shape = (repeats, stages) if not inverse else (stages, repeats)
    blocks = x.reshape(*shape, x.shape[0] // (stages * repeats), *x.shape[1:])
    return blocks.swapaxes(0, 1).reshape(x.shape)


def holds_stage_major(stages: int, repeats: int) -> bool:
    """Whether training holds a pipelined stack's params stage-major: only a circular schedule
    (R > 1) over S > 1 stages, where the two orders differ (`to_stage_major`)."""
    return stages > 1 and repeats > 1


def reading_stage_major(fn: Callable) -> Callable:
    """`fn`, with the pipelined stacks it traces reading their params stage-major
    (`to_stage_major`) rather than in layer order."""
    @functools.wraps(fn)  # (its name: a profile names the jitted step after it)
    def traced(*args, **kwargs):
        token = _STAGE_MAJOR.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _STAGE_MAJOR.reset(token)

    return traced


def stages_in_mesh() -> int:
    """The `stage` axis size of the mesh in context (1 without one): a stack traced there is
    pipelined when it is > 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or STAGE_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[STAGE_AXIS]


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of iterations a stage idles: (S - 1) / (M R + S - 1).

    >>> bubble_fraction(4, 8), bubble_fraction(4, 8, repeats=2)
    (0.2727272727272727, 0.15789473684210525)
    """
    return (stages - 1) / (microbatches * repeats + stages - 1)


def describe(stages: int, microbatches: int, repeats: int) -> str:
    """The start line's account of the schedule (empty without pipelining)."""
    if stages == 1:
        return ""
    kind = "GPipe" if repeats == 1 else f"circular, {repeats} repeats"
    return (f"pipeline: {stages} stages, {microbatches} microbatches ({kind}), bubble "
            f"{bubble_fraction(stages, microbatches, repeats):.1%} = (S-1)/(M*R+S-1)")


def check(*, stages: int, microbatches: int, repeats: int, layer_groups: int,
          shard_rows: int | None = None) -> None:
    """One-line errors for a schedule that cannot run: groups must split into stages x repeats
    blocks, microbatches must divide `shard_rows` (the rows of a data-parallel shard in one
    step), and the circular schedule needs microbatches >= stages (stage 0 takes a microbatch's
    next repeat once the last stage has finished it)."""
    for name, value in (("microbatches", microbatches), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline.{name}={value!r}: expected a positive int")
    if layer_groups % (stages * repeats):
        raise ValueError(f"mesh.stage={stages} x pipeline.repeats={repeats}: expected their "
                         f"product to divide the {layer_groups} scanned layer groups "
                         "(num_layers / the layer period)")
    if shard_rows is not None and shard_rows % microbatches:
        raise ValueError(f"pipeline.microbatches={microbatches}: expected a divisor of the "
                         f"{shard_rows} rows each data-parallel shard gets per (accumulation) "
                         "step")
    if repeats > 1 and microbatches < stages:
        raise ValueError(f"pipeline.microbatches={microbatches} with pipeline.repeats="
                         f"{repeats}: expected microbatches >= mesh.stage={stages} (the "
                         "circular schedule)")


def _constrain(x: jax.Array, dim: int | None, batch_dim: int | None = None) -> jax.Array:
    """x split over `stage` on `dim` (None: on none), its other dimensions left to the
    partitioner; with `batch_dim`, that one over the data-parallel axes."""
    from transformer.parallel import sharding  # (sharding does not import this module)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or STAGE_AXIS not in mesh.axis_names:  # (tests of the schedule, no mesh)
        return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    if dim is not None:
        spec[dim] = STAGE_AXIS
    if batch_dim is not None:
        axes = tuple(a for a in sharding.BATCH_AXES if mesh.shape.get(a, 1) > 1)
        spec[batch_dim] = axes if axes and x.shape[batch_dim] % sharding.data_parallel_size(
            dict(mesh.shape)) == 0 else PartitionSpec.UNCONSTRAINED
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def _split_rows(tree, batch: int, microbatches: int):
    """Each leaf with `batch` leading rows -> [M, b, ...] (microbatch m: rows m, m + M, ...:
    each data-parallel shard's rows split alike, so no row moves); others kept as they are."""
    def split(x):
        if isinstance(x, jax.Array | jnp.ndarray) and x.ndim and x.shape[0] == batch > 1:
            return x.reshape(batch // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        return x
    return jax.tree.map(split, tree)


def _take_rows(tree, split_tree, m):
    """Microbatch m of each leaf `_split_rows` split (the others whole)."""
    return jax.tree.map(lambda x, s: x if s is x else s[m], tree, split_tree)


def run(stage_fn: Callable, params, x_BTD: jax.Array, args, *, stages: int, microbatches: int,
        repeats: int, rng: jax.Array | None = None, remat_policy: Callable | None = None):
    """The stack over the pipeline: `stage_fn(params, x_bTD, args, rng)` -> (y_bTD, aux) applies
    Lps layer groups (params with a leading [Lps] axis) to a microbatch, `aux` a dict of scalars
    (each a mean over those groups). `params` has a leading [G] axis, in layer order (inside
    `reading_stage_major`: stage-major). Returns (y_BTD, aux averaged over every (microbatch,
    stage, repeat); MoE layers weigh their token means for that, `MoEFeedForward._per_token`).
    `remat_policy`: each iteration's stages are rematerialised under it
    (`jax.checkpoint`): the backward pass keeps their inputs, not the repeat's params each
    picked (R > 1) nor what the policy does not save."""
    S, M, R = stages, microbatches, repeats
    batch = x_BTD.shape[0]
    groups = jax.tree.leaves(params)[0].shape[0]
    check(stages=S, microbatches=M, repeats=R, layer_groups=groups, shard_rows=batch)
    lps = groups // (S * R)

    # The stages' axis of the blocks: stage-major params are [S, R, Lps, ...] as stored, each
    # stage's its own shard; layer order is read as [R, S, Lps, ...], resharded over `stage`
    # (for GPipe, R = 1, the two orders are one: read as layer order).
    axis = 0 if _STAGE_MAJOR.get() and holds_stage_major(S, R) else 1
    staged = jax.tree.map(lambda p: _constrain(p.reshape(
        *((S, R) if axis == 0 else (R, S)), lps, *p.shape[1:]), axis), params)
    split_args = _split_rows(args, batch, M)
    # The store holds, per microbatch, what stage 0 reads next: the input at first, then each
    # repeat's output of the last stage (written S - 1 iterations after stage 0 read it, read
    # again M >= S iterations after): after the loop, the stack's outputs.
    store = _split_rows(x_BTD, batch, M)

    def stage(p, x_bTD, m, r, key):
        p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), p)
        token = _IN_STAGE.set(True)
        try:
            return stage_fn(p, x_bTD, _take_rows(args, split_args, m), key)
        finally:
            _IN_STAGE.reset(token)

    if remat_policy is not None:
        stage = jax.checkpoint(stage, policy=remat_policy, prevent_cse=False)
    vmapped = jax.vmap(stage, in_axes=(axis, 0, 0, 0, 0 if rng is not None else None),
                       spmd_axis_name=STAGE_AXIS if stages_in_mesh() > 1 else None)

    def iteration(carry, t):
        buffer, store, aux_sum = carry
        work = t - jnp.arange(S)  # the (microbatch, repeat) item each stage works on
        valid = (work >= 0) & (work < M * R)
        work = jnp.clip(work, 0, M * R - 1)
        m, r = work % M, work // M
        # The store's rows stay split over the data-parallel axes through its dynamic read and
        # write: left to itself XLA's partitioner gathered the whole store onto every chip (70B
        # circular40 on two v5p-32: 5.2 GiB a chip less with these constraints).
        buffer = _constrain(buffer.at[0].set(_constrain(store[m[0]], None, 0)), 0, 1)
        keys = None if rng is None else jax.vmap(
            lambda i: jax.random.fold_in(rng, i))(t * S + jnp.arange(S))
        out, aux = vmapped(staged, buffer, m, r, keys)
        out = _constrain(out, 0, 1)
        last = jnp.where(valid[-1], _constrain(out[-1], None, 0),
                         _constrain(store[m[-1]], None, 0))
        store = _constrain(store.at[m[-1]].set(last), None, 1)
        aux_sum = {k: aux_sum[k] + jnp.sum(jnp.where(valid, v, 0)) for k, v in aux.items()}
        # roll on the stage-split axis: a collective permute, stage s's output to stage s + 1
        return (jnp.roll(out, 1, axis=0), store, aux_sum), None

    buffer = _constrain(jnp.zeros((S, *store.shape[1:]), x_BTD.dtype), 0, 1)
    aux_shapes = jax.eval_shape(lambda: vmapped(staged, buffer, jnp.zeros(S, int),
                                                jnp.zeros(S, int), None if rng is None else
                                                jax.random.split(rng, S))[1])
    aux_sum = {k: jnp.zeros((), v.dtype) for k, v in aux_shapes.items()}
    (_, store, aux_sum), _ = jax.lax.scan(iteration, (buffer, store, aux_sum),
                                          jnp.arange(M * R + S - 1))
    y_BTD = store.swapaxes(0, 1).reshape(x_BTD.shape)
    return y_BTD, {k: v / (M * R * S) for k, v in aux_sum.items()}
