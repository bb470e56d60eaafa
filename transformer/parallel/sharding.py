"""Device meshes, and the tables that define the mesh axes and map logical axis names onto them.

Params carry logical axis names (`embed`, `heads`, `mlp`, `vocab`, ... set where each param is
declared); activations get `activation_*` names at block boundaries. `LOGICAL_AXIS_RULES` maps
both onto the mesh axes of `MESH_AXIS_TABLE` (listed below, from the table).

An axis of size 1 is a no-op, so the same rules serve every mesh. A dimension that the mesh axes
mapped to it do not divide splits over the longest leading run of them that does (e.g. `embed`
over fsdp x expert when sequence=3 does not divide it), else stays replicated (2 KV heads over
tensor=4).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One axis of the device mesh: whether it splits the batch, whether it is the one axis that
    spans the slices of a multi-slice job (over DCN), its `config.mesh` default, and what it
    parallelizes (listed in this module's docstring)."""

    name: str
    shards_batch: bool
    spans_slices: bool
    default: int  # -1: the devices the other axes leave
    doc: str


MESH_AXIS_TABLE = (
    MeshAxis("data", shards_batch=True, spans_slices=True, default=-1,
             doc="pure data parallelism: the batch is split, params and optimizer state "
                 "replicated (across slices of a multi-slice job this is the DCN axis)"),
    MeshAxis("stage", shards_batch=False, spans_slices=True, default=1,
             doc="pipeline parallelism: the scanned layer stack split into consecutive blocks "
                 "of layers, one per stage, microbatches passed on from stage to stage "
                 "(pipeline_parallel); spans the slices of a multi-slice job when "
                 "mesh.data does not split over them"),
    MeshAxis("fsdp", shards_batch=True, spans_slices=False, default=1,
             doc="the batch is split *and* params/optimizer state are sharded on their `embed` "
                 "dimension (ZeRO-3 / fully sharded data parallelism: gathered per layer when "
                 "used)"),
    MeshAxis("expert", shards_batch=True, spans_slices=False, default=1,
             doc="expert parallelism: the experts of mixture-of-experts layers split (their "
                 "params, and the token buffers they compute on, moved there and back by an "
                 "all-to-all); elsewhere it acts like `fsdp` (the batch and the other params' "
                 "`embed` dimension split)"),
    MeshAxis("sequence", shards_batch=False, spans_slices=False, default=1,
             doc="sequence (context) parallelism: every activation's length dimension split; "
                 "attention crosses the split by gathering K and V or passing them round a ring "
                 "(transformer.nn.sequence_parallel); params and optimizer state sharded on their "
                 "`embed` dimension as by `fsdp` (as MaxText's context axis does), batch rows "
                 "repeated"),
    MeshAxis("tensor", shards_batch=False, spans_slices=False, default=1,
             doc="Megatron-style tensor parallelism: heads, MLP hidden units and the vocabulary "
                 "split"),
)
MESH_AXES = tuple(axis.name for axis in MESH_AXIS_TABLE)
BATCH_AXES = tuple(axis.name for axis in MESH_AXIS_TABLE if axis.shards_batch)
# The axes that may span the slices of a multi-slice job, in order of preference.
SLICE_AXES = tuple(axis.name for axis in MESH_AXIS_TABLE if axis.spans_slices)
SLICE_AXIS = SLICE_AXES[0]
EXPERT_AXIS = "expert"

if __doc__:  # None under python -OO
    __doc__ += "\nMesh axes:\n\n" + "".join(
        textwrap.fill(axis.doc, 96, initial_indent=f"    {axis.name:<10}",
                      subsequent_indent=" " * 14) + "\n" for axis in MESH_AXIS_TABLE)

LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    # activations (nn.with_logical_constraint at block boundaries)
    ("activation_batch", BATCH_AXES),
    # The head's logits and the loss run outside a pipeline's stages (transformer.parallel.
    # pipeline_parallel): split their rows over `stage` too, or every stage computes them all
    # (70B on two v5p-32: 2.4 GiB a chip less for GPipe, 2.0 circular; docs/cloud-tpu.md).
    ("activation_logits_batch", (*BATCH_AXES, "stage")),
    ("activation_length", "sequence"),
    # inside MoE layers, token buffers split over the experts instead of the batch
    ("activation_moe_batch", tuple(axis for axis in BATCH_AXES if axis != EXPERT_AXIS)),
    ("activation_expert", EXPERT_AXIS),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    # params
    # Outside the experts the expert axis shards like fsdp (MaxText does the same); inside,
    # it splits the experts, so their width uses fsdp alone. The sequence axis, whose devices
    # hold the same batch rows, shards the params like fsdp too (MaxText's context axis does).
    ("embed", ("fsdp", EXPERT_AXIS, "sequence")),
    ("expert", EXPERT_AXIS),
    ("expert_embed", ("fsdp", "sequence")),
    ("mlp_in", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("gates", None),
    ("classes", None),
    ("patch", None),
    ("projection", None),
    ("length", None),
    ("relpos_buckets", None),
    # token mixers (transformer.nn.mixers): a convolution's taps, a recurrent state's width, a
    # low-rank latent (MLA's kv and q ranks, the width of q_a, kv_a and their norms): small or
    # contracted over, replicated. MLA's up-projections q_b, k_b, v_b [latent_in, heads, kv]
    # are not small (DeepSeek-V3: 55M params a layer): their input axis splits like embed.
    ("conv", None),
    ("state", None),
    ("latent", None),
    ("latent_in", ("fsdp", EXPERT_AXIS, "sequence")),
    # The scanned layer stack's leading axis: split into pipeline stages.
    ("layers", "stage"),
    ("lora", None),  # a LoRA adapter's rank (transformer.nn.lora): small, replicated
)


def mesh_shape(mesh_config: ml_collections.ConfigDict | dict, num_devices: int) -> dict[str, int]:
    """The mesh axis sizes, with a -1 entry filled by the devices the others leave.

    >>> mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8)
    {'data': 4, 'stage': 1, 'fsdp': 2, 'expert': 1, 'sequence': 1, 'tensor': 1}
    """
    sizes = {axis.name: mesh_config.get(axis.name, axis.default) for axis in MESH_AXIS_TABLE}
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"mesh.{axis}={size!r}: expected a positive int or -1")
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"mesh {describe_mesh(sizes)}: expected at most one axis set to -1")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise ValueError(f"mesh {describe_mesh(sizes)}: the other axes ({known} devices) must "
                             f"divide the {num_devices} devices available")
        sizes[fill[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {describe_mesh(sizes)} = {math.prod(sizes.values())} devices: "
                         f"expected the {num_devices} devices available (set one axis to -1 "
                         "to fill the rest)")
    return sizes


def describe_mesh(sizes: dict[str, int]) -> str:
    """E.g. "data=4 x stage=1 x fsdp=2 x expert=1 x sequence=1 x tensor=1"."""
    return " x ".join(f"{axis}={size}" for axis, size in sizes.items())


def num_slices(devices) -> int:
    """How many TPU slices (ICI islands joined by DCN) `devices` span; 1 off multi-slice TPU."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def make_mesh(mesh_config: ml_collections.ConfigDict | dict, devices=None) -> Mesh:
    """The mesh of `mesh_config` (axes `MESH_AXES`) over all (or the given) devices.

    Axes are `Auto` (GSPMD propagates shardings from the logical rules). When the devices span
    several slices, one axis is split across slices (DCN) and everything else stays inside a
    slice (ICI): `data` when it is a multiple of the number of slices, else `stage`
    (`slice_axis`).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(mesh_config, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    slices = num_slices(devices)
    if slices > 1:
        across = slice_axis(sizes, slices)
        ici = tuple(size // slices if axis == across else size for axis, size in sizes.items())
        dcn = tuple(slices if axis == across else 1 for axis in sizes)
        # With more axes than the slice has physical ones, some axis must split a physical one.
        array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                     allow_split_physical_axes=True)
        return Mesh(array, MESH_AXES, axis_types=axis_types)
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=axis_types,
                         devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches: rows split over every data-parallel axis (`BATCH_AXES`)."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def data_parallel_size(mesh: Mesh | dict[str, int]) -> int:
    """How many ways a batch splits: the product of the `BATCH_AXES` sizes of a mesh or dict.

    >>> data_parallel_size({"data": 2, "fsdp": 4, "tensor": 8})
    8
    """
    sizes = mesh if isinstance(mesh, dict) else mesh.shape
    return math.prod(sizes.get(axis, 1) for axis in BATCH_AXES)


def check_batch_split(batch_size: int, mesh_sizes: dict[str, int], *, accumulation: int = 1,
                      processes: int = 1, num_slices: int = 1) -> None:
    """One-line errors unless `batch_size` rows split into `accumulation` micro-batches, over
    `processes` hosts, and each micro-batch over the data-parallel axes of `mesh_sizes` (as
    `mesh_shape` gives them), whose slice-spanning axis must split over `num_slices`.

    >>> sizes = {"data": 4, "fsdp": 2, "tensor": 2}
    >>> check_batch_split(32, sizes, accumulation=4)
    >>> check_batch_split(32, sizes, accumulation=8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: batch_size=32: expected a multiple of the data-parallel size 8 x ...
    """
    if accumulation < 1 or batch_size % (accumulation * processes):
        raise ValueError(f"batch_size={batch_size}: expected a multiple of "
                         f"grad_accumulation_steps={accumulation} x processes={processes}")
    _check_slices(mesh_sizes, num_slices)
    data_parallel = data_parallel_size(mesh_sizes)
    if batch_size // accumulation % data_parallel:
        axes = " x ".join(f"mesh.{axis}" for axis in BATCH_AXES)
        raise ValueError(f"batch_size={batch_size}: expected a multiple of the data-parallel "
                         f"size {data_parallel} x grad_accumulation_steps={accumulation} (each "
                         f"micro-batch of {batch_size // accumulation} rows splits over {axes})")


def _check_slices(mesh_sizes: dict[str, int], slices: int) -> None:
    slice_axis(mesh_sizes, slices)


def slice_axis(mesh_sizes: dict[str, int], slices: int) -> str:
    """The axis that spans `slices` slices: the first of `SLICE_AXES` (data, then stage) that
    is a multiple of it.

    >>> slice_axis({"data": 1, "stage": 2, "fsdp": 16}, 2)
    'stage'
    """
    for axis in SLICE_AXES:
        if mesh_sizes.get(axis, 1) % slices == 0:
            return axis
    raise ValueError(f"mesh.{SLICE_AXIS}={mesh_sizes[SLICE_AXIS]}: expected a multiple of "
                     f"num_slices={slices} (data parallelism spans the slices; or mesh.stage "
                     "a multiple, pipeline stages across them)")


def mesh_spec(logical: PartitionSpec | None, shape: tuple[int, ...], mesh, rules) -> PartitionSpec:
    """Logical names -> mesh axes for one array. A dimension the mapped mesh axes do not divide
    splits over the longest leading run of them that does (none: whole).

    >>> mesh = jax.sharding.AbstractMesh((1, 1, 2, 1, 3, 1), MESH_AXES)  # fsdp=2, sequence=3
    >>> tuple(mesh_spec(PartitionSpec("embed", "mlp"), (12, 4), mesh, LOGICAL_AXIS_RULES))
    (('fsdp', 'expert', 'sequence'), 'tensor')
    >>> tuple(mesh_spec(PartitionSpec("embed", "mlp"), (8, 4), mesh, LOGICAL_AXIS_RULES))
    (('fsdp', 'expert'), 'tensor')
    """
    if not logical or not shape:  # (an unboxed leaf's spec is empty)
        return PartitionSpec()
    mesh_axes = nn.logical_to_mesh_axes(tuple(logical), rules)
    spec = []
    for size, axes in zip(shape, mesh_axes, strict=True):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        while names and size % math.prod(mesh.shape[a] for a in names):
            names = names[:-1]
        spec.append(None if not names else axes if isinstance(axes, str) else names)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """`with_sharding_constraint` by logical names under the current mesh and rules.

    A no-op outside `jax.set_mesh(...)` + `nn.logical_axis_rules(...)` (e.g. in unit tests and
    single-device tools); dimensions the mapped mesh axes do not divide stay unsharded.
    """
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(
        x, mesh_spec(PartitionSpec(*names), x.shape, mesh, rules))


def traced_split(logical: str, axis: str) -> int:
    """How many ways the logical dimension `logical` is split over mesh axis `axis` where this
    is traced: that axis's size when the mesh in context has it and the rules map `logical`
    onto it, else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or axis not in mesh.axis_names or not rules:
        return 1
    mapped = nn.logical_to_mesh_axes((logical,), rules)[0]
    names = (mapped,) if isinstance(mapped, str) else tuple(mapped or ())
    return mesh.shape[axis] if axis in names else 1


ACTIVATIONS = ("activation_batch", "activation_length", "activation_embed")
LOGITS = ("activation_logits_batch", "activation_length", "activation_vocab")


def logical_shardings(boxed_tree, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedShardings for a tree whose leaves may be `nn.LogicallyPartitioned` boxes.

    Unboxed leaves (step counters, ...) are replicated. The result matches `nn.unbox(tree)`.
    """
    is_box = lambda x: isinstance(x, nn.Partitioned)
    # optax.masked / multi_transform state keeps a param's box around an empty MaskedNode; a
    # state leaf of another rank than its param keeps it too (adafactor's factored row and
    # column statistics): unboxed, so replicated (they are a param's size over one dimension).
    boxed_tree = jax.tree.map(
        lambda x: x.value if is_box(x) and len(getattr(x.value, "shape", ())) != len(x.names)
        else x, boxed_tree, is_leaf=is_box)
    specs = nn.get_partition_spec(boxed_tree)
    shapes = jax.tree.map(lambda x: x.value.shape if is_box(x) else np.shape(x), boxed_tree,
                          is_leaf=is_box)
    return jax.tree.map(
        lambda spec, shape: NamedSharding(mesh, mesh_spec(spec, shape, mesh, rules)),
        specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)


def sharded_init(init: Callable, mesh: Mesh, *args, rules=LOGICAL_AXIS_RULES):
    """(abstract state, shardings, jitted init) for `init(*args)` returning a boxed tree.

    The jitted init creates each array directly in its shards: nothing is materialized whole on
    one device.
    """
    boxed = jax.eval_shape(init, *args)
    shardings = logical_shardings(boxed, mesh, rules)
    abstract = nn.unbox(boxed)
    jitted = jax.jit(lambda *a: nn.unbox(init(*a)), out_shardings=shardings)
    return abstract, shardings, jitted


def bytes_per_device(abstract_tree, shardings) -> int:
    """The bytes one device holds of a tree laid out by `shardings` (shards are even)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings),
                              strict=True):
        shard = sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def summary(mesh: Mesh, abstract_state, shardings, batch_size: int) -> str:
    """Mesh shape, per-device params/optimizer bytes, global and per-device batch."""
    params = bytes_per_device(abstract_state.params, shardings.params)
    optimizer = bytes_per_device(abstract_state.opt_state, shardings.opt_state)
    total_params = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(abstract_state.params))
    data = data_parallel_size(mesh)
    return (f"mesh {describe_mesh(mesh.shape)} ({mesh.size} devices, "
            f"{jax.process_count()} process(es)); "
            f"per device: params {format_bytes(params)} (of {format_bytes(total_params)}), "
            f"optimizer {format_bytes(optimizer)}; batch {batch_size} global, "
            f"{batch_size // data} per data-parallel shard")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None, cluster: bool = False) -> bool:
    """Starts JAX's multi-controller runtime when asked to, or on a multi-host TPU slice.

    With a coordinator address (e.g. "127.0.0.1:1234" for several processes on one machine)
    every process passes the same address and process count and its own id; CPU processes then
    exchange collectives over gloo. With `cluster` (what `launch.tpu` passes on multi-host
    slices) or when the environment names several TPU workers, the arguments are detected from
    the cluster environment. Returns whether the runtime was started. Call it before any other
    JAX call.
    """
    if coordinator_address:
        if num_processes is None or process_id is None:
            raise ValueError(f"coordinator_address={coordinator_address!r}: expected "
                             "num_processes and process_id too")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id}: expected 0 <= id < num_processes="
                             f"{num_processes}")
        if process_id != 0:  # process 0 serves the address; the others connect to it
            _wait_for_coordinator(coordinator_address)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
        check_devices_per_process(jax.devices())
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")
    several_hosts = len(hosts) > 1 and all(re.fullmatch(r"[\w.:-]+", h) for h in hosts)
    if cluster or several_hosts or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        try:
            jax.distributed.initialize()
        except ValueError as error:  # jax found no cluster: "coordinator_address should be ..."
            if "coordinator_address" not in str(error):
                raise
            raise ValueError("--jax_distributed: no cluster environment found (a Cloud TPU VM "
                             "slice or a GKE TPU pod sets one): expected a TPU slice, or "
                             "--coordinator_address, --num_processes and --process_id") from None
        check_devices_per_process(jax.devices())
        return True
    return False


# How long a process other than 0 waits for process 0 to listen at --coordinator_address (as
# long as jax.distributed's own wait, which was silent, then aborted with a C++ trace: hosts
# started by hand may start minutes apart), and when it says it is waiting.
COORDINATOR_WAIT_S = 300
COORDINATOR_NOTICE_S = 10


def _wait_for_coordinator(address: str) -> None:
    """Returns once something accepts TCP connections at `address` ("HOST:PORT"); says it is
    waiting after `COORDINATOR_NOTICE_S` seconds, and raises one line after
    `COORDINATOR_WAIT_S` seconds of trying."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address={address}: expected HOST:PORT")
    start = time.monotonic()
    noticed = False
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return
        except OSError:  # refused (not started yet), unreachable, or a name that does not resolve
            waited = time.monotonic() - start
            if waited >= COORDINATOR_WAIT_S:
                break
            if waited >= COORDINATOR_NOTICE_S and not noticed:
                print(f"waiting for process 0 to listen at coordinator_address={address} (at "
                      f"most {COORDINATOR_WAIT_S} s)", file=sys.stderr, flush=True)
                noticed = True
            time.sleep(min(1.0, COORDINATOR_WAIT_S / 10))
    raise ConnectionError(f"coordinator_address={address}: nothing listening after "
                          f"{COORDINATOR_WAIT_S} s: expected process 0 to be started with the "
                          "same address")


def check_devices_per_process(devices) -> None:
    """One line unless every process has the same number of `devices` (the global ones): a
    mesh and every batch split assume it (uneven hosts failed in a collective, "cannot
    reshape array of size 5 into shape (2,2)")."""
    counts: dict[int, int] = {}
    for device in devices:
        counts[device.process_index] = counts.get(device.process_index, 0) + 1
    first, *rest = sorted(counts.items())
    if other := next(((p, n) for p, n in rest if n != first[1]), None):
        raise ValueError(f"process {first[0]} has {first[1]} devices, process {other[0]} has "
                         f"{other[1]}: expected the same count on every process")
