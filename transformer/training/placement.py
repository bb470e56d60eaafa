"""How a run lays its arrays and steps out on the devices: the mesh placement of states and
batches, the XLA compiler options of the jitted steps, and the multi-process helpers."""

from __future__ import annotations

import contextlib
import functools
import sys

import flax.linen as nn
import jax
import jaxlib.version
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from transformer.data import global_batches
from transformer.parallel import pipeline_parallel, sharding
from transformer.utils import hostmem

# XLA:CPU defaults for the jitted steps: XLA's own fusions (YNNPACK's dots, elementwise and
# reductions) with the memory-optimized scheduler. In float32 XLA's default scheduler computed
# each LayerNorm scale's [B, T, D] broadcast at the start of the step, for the backward pass's
# YNNPACK reductions, and kept it until then (GPT 6/6/384 scratch 444 MB with Eigen's dots,
# 520 with XLA's defaults, 463 with this scheduler). Measured side by side in one process on
# a 2-core Zen 5 EPYC (docs/performance.md): float32 step medians 7-14% faster than with
# Eigen's dots under jax 0.10.2 and 0.12 (best times 1-12%), and under 0.12 YNNPACK runs the
# attention core's small batched dots on both cores (fwd+bwd 16.4 -> 11.3 ms a 6/6/384 layer).
# bfloat16 6/6/384 steps: scratch 509 -> 426 MB (jax 0.10.2), 474 -> 310 MB (0.12), times level.
CPU_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
# CPU steps under glibc malloc: scratch memory in heaps glibc keeps between steps (hostmem's
# docstring). Under jemalloc, which keeps the one block anyway, the cap cost 20-35 ms of an
# 850 ms GPT 6/6/384 step.
GLIBC_CPU_OPTIONS = {"xla_multiheap_size_constraint_per_heap": hostmem.SCRATCH_HEAP_BYTES}
# XLA:TPU default for the jitted steps: lay the step's temporaries out by both of XLA's
# buffer-assignment orders and keep the smaller heap (its own default took the temporal one
# for a 70B circular pipeline: 29.38 GiB a chip where 26.15 GiB hold everything live at the
# peak; GPipe's heap is the same either way). Compiled ahead of time: docs/cloud-tpu.md.
TPU_OPTIONS = {"xla_tpu_buffer_assignment_algorithm": "BEST_OF_SPATIAL_TEMPORAL"}
# Whether this jaxlib's XLA:CPU can deadlock a mesh's collectives with many steps in flight
# (`Synchronous`): 0.10.2, 0.11.0 and 0.11.2 did past 32 a device; 0.12.0 and 0.12.0.1 did
# not at 200.
CPU_COLLECTIVES_STALL = jaxlib.version.__version_info__ < (0, 12)


def compiler_options(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> dict:
    """XLA options for the jitted steps on `mesh`: the CPU defaults (CPU_OPTIONS, and
    GLIBC_CPU_OPTIONS under glibc malloc) or the TPU ones (TPU_OPTIONS), then
    config.compiler_options (any XLA option, e.g. {"xla_cpu_multi_thread_eigen": False}), each
    judged by the XLA that compiles for the mesh's devices (XLA:TPU for an ahead-of-time
    topology on a CPU host)."""
    device = mesh.devices.flat[0]
    # this runtime's XLA (its default device) judges options for its own platform; another
    # platform's devices (an ahead-of-time topology) are judged by that platform's compiler
    judge = None if device.platform == jax.default_backend() else device
    defaults = {}
    if device.platform == "cpu":
        defaults |= CPU_OPTIONS
        if hostmem.allocator() == "glibc":
            defaults |= GLIBC_CPU_OPTIONS
    elif device.platform == "tpu":
        defaults |= TPU_OPTIONS
    defaults = _accepted(tuple(defaults.items()), judge) if defaults else {}
    return {**defaults, **user_compiler_options(config, judge)}


def user_compiler_options(config: ml_collections.ConfigDict, device=None) -> dict:
    """config.compiler_options, if the XLA compiling for `device` (this runtime's default
    device if None) knows them; else a one-line ValueError."""
    user = dict(config.get("compiler_options") or {})
    if user and (error := _rejection(tuple(sorted(user.items())), device)):
        raise ValueError(f"compiler_options={user}: XLA rejects them ({error})")
    return user


@functools.cache
def _rejection(options: tuple, device=None) -> str | None:
    """Why the XLA compiling for `device` (the default device if None) rejects `options`
    (compiling a one-op function with them), or None."""
    one = 1.0 if device is None else jax.ShapeDtypeStruct(
        (), np.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(lambda x: x + 1).lower(one).compile(compiler_options=dict(options))
    except Exception as e:  # noqa: BLE001 (XLA raises its own runtime error types)
        return str(e).splitlines()[0]
    return None


def _accepted(options: tuple, device=None) -> dict:
    """`options` if the XLA compiling for `device` knows them, else none (with a warning):
    defaults must not break a newer jaxlib or libtpu that renamed an experimental flag."""
    if error := _rejection(options, device):
        platform = (jax.default_backend() if device is None else device.platform).upper()
        print(f"warning: XLA rejects the default {platform} options {dict(options)} ({error}); "
              "compiling without them", file=sys.stderr)
        return {}
    return dict(options)


class Placement:
    """How a run lays out its arrays on the mesh: state shardings from the logical rules, batch
    rows over the data-parallel axes, and which global batch rows this process feeds.

    `compiler_options`: XLA options for the jitted steps (see `compiler_options`). On a CPU
    mesh of more than one device in this process, under a jaxlib before 0.12, the steps wait
    for their results (`synchronous`, see `Synchronous`).
    `schedule`: (microbatches, repeats) of the pipeline over a `stage` axis (see
    `transformer.parallel.pipeline_parallel`). With a circular schedule (repeats > 1) the
    train step reads the state in train order (`train_order`): the layer params and their
    moments stage-major; checkpoints and everything else read layer order (`layer_order`)."""

    def __init__(self, mesh: jax.sharding.Mesh, batch_size: int,
                 compiler_options: dict | None = None, schedule: tuple[int, int] = (1, 1)):
        self.mesh = mesh
        self.schedule = schedule
        self.batch_size = batch_size
        self.compiler_options = dict(compiler_options or {})
        # a CPU mesh of several devices in this process, under a jaxlib whose collectives can
        # stall: its steps wait for their results (Synchronous)
        self.synchronous = (mesh.devices.flat[0].platform == "cpu"
                            and len(mesh.local_devices) > 1 and CPU_COLLECTIVES_STALL)
        self.batch_sharding = sharding.batch_sharding(mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.rows = global_batches.process_rows(self.batch_sharding, batch_size)
        self._reorders = {}

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, devices=None) -> Placement:
        """The placement of `config`: its mesh over all (or the given) devices, its batch size
        and options."""
        mesh = sharding.make_mesh(config.mesh, devices)
        group = config.get("pipeline") or {}
        schedule = (group.get("microbatches", 1), group.get("repeats", 1))
        return cls(mesh, config.batch_size, compiler_options(config, mesh), schedule)

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return global_batches.make_global_batch(local_batch, self.batch_sharding, self.rows,
                                          batch_size=self.batch_size)

    @property
    def stage_major(self) -> bool:
        """Whether training holds the layer params stage-major: a circular pipeline."""
        return pipeline_parallel.holds_stage_major(
            self.mesh.shape.get(pipeline_parallel.STAGE_AXIS, 1), self.schedule[1])

    def train_order(self, tree):
        """A train state (or params) in layer order -> the order the train step reads (the
        stage-split leaves stage-major on a circular pipeline; else `tree` itself). Donates
        `tree`: one reshard, when a run starts or resumes."""
        return self._reorder(tree, inverse=False)

    def layer_order(self, tree):
        """`train_order`'s inverse (a new tree; `tree` is kept): what checkpoints hold."""
        return self._reorder(tree, inverse=True)

    def _reorder(self, tree, inverse: bool):
        if not self.stage_major:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        # The layers axis is the only one whose rule maps it onto `stage`
        chosen = [i for i, x in enumerate(leaves) if _split_over_stage(x)]
        shardings = tuple(leaves[i].sharding for i in chosen)
        if (inverse, shardings) not in self._reorders:  # (one compile per direction and tree)
            stages, repeats = self.mesh.shape[pipeline_parallel.STAGE_AXIS], self.schedule[1]
            self._reorders[inverse, shardings] = jax.jit(
                lambda xs: [pipeline_parallel.to_stage_major(x, stages, repeats, inverse)
                            for x in xs],
                out_shardings=list(shardings), donate_argnums=() if inverse else 0)
        moved = self._reorders[inverse, shardings]([leaves[i] for i in chosen])
        for i, x in zip(chosen, moved, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def reading_train_order(self, fn):
        """`fn` (a step to jit), tracing its pipelined stacks on params in train order."""
        return pipeline_parallel.reading_stage_major(fn) if self.stage_major else fn

    def jit_train_step(self, train_step, state_sharding):
        """The jitted (state, global batch) -> (state, metrics) on a state in train order
        (`train_order`); the input state is donated."""
        return self.paced(jax.jit(self.reading_train_order(train_step), donate_argnums=0,
                                  in_shardings=(state_sharding, self.batch_sharding),
                                  out_shardings=(state_sharding, self.replicated),
                                  compiler_options=self.compiler_options))

    def jit_eval_step(self, eval_step, params_sharding, train_order: bool = False):
        """The jitted (params, global batch) -> metrics, on params in layer order or, with
        `train_order`, in train order (a training run's own, `train_order`)."""
        if train_order:
            eval_step = self.reading_train_order(eval_step)
        return self.paced(jax.jit(eval_step, in_shardings=(params_sharding, self.batch_sharding),
                                  out_shardings=self.replicated,
                                  compiler_options=self.compiler_options))

    def paced(self, jitted):
        """`jitted` as this mesh's steps run: `Synchronous` if `synchronous`, else itself."""
        return Synchronous(jitted) if self.synchronous else jitted

    @contextlib.contextmanager
    def context(self):
        """The mesh, logical rules and pipeline schedule the model is traced under."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
                pipeline_parallel.schedule(*self.schedule):
            yield


class Synchronous:
    """A jitted step that returns only when its results are computed: a CPU mesh's steps under
    a jaxlib before 0.12.

    XLA:CPU admits 32 executions in flight per device (PjRt's `max_inflight_computations`).
    Under jaxlib 0.10.2, a mesh's collectives deadlocked once a device held more: three
    devices waited in a step's all-gather while the fourth device's launch of that step waited
    for an execution slot, until the rendezvous aborted the process (40 s). Streaming a sharded
    fwd+bwd with 31 calls unfinished never stalled, with 32 it stalled within seconds in every
    process, on 2, 4 and 8 devices, and never without a collective
    (benchmarks/cpu_mesh_collectives.py); without this wrapper 200 evaluation steps streamed
    on 8 devices aborted (tests/stream_check.py), and a 4-device CLIP run's abort in CI was the
    same rendezvous timeout. The 32-call stream stalled under jaxlib 0.11.0 and 0.11.2 too;
    under 0.12.0 and 0.12.0.1 it ran 200 deep. Waiting costs 4-10% a step on a CPU mesh,
    which is for trying a layout, not for speed. Attributes (`lower`, ...) are the jitted
    function's."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, *args, **kwargs):
        return jax.block_until_ready(self.jitted(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def _split_over_stage(x) -> bool:
    """Whether x's leading axis is split over `stage` (in a pipeline: the layer groups)."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    first = spec[0] if spec else None
    return pipeline_parallel.STAGE_AXIS in (first if isinstance(first, tuple) else (first,))


def fetch(tree):
    """Host copies of replicated arrays (also when they span processes)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def sync(name: str) -> None:
    """All processes wait here (a no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"transformer.train.{name}")


def agreed(flag: bool) -> bool:
    """Whether any process raised `flag`: every process must stop (and save) at the same step.

    Costs a tiny all-gather per call on multi-process runs; free on one process.
    """
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def local_mesh(config, doing: str):
    """(config, devices, note) for this machine's devices: the run's own mesh where they fit
    it and its batch splits over them (devices None: all), else data parallel over the most
    devices that divide the batch, the config's mesh set to it (a checkpoint restores onto any
    mesh), with a note saying so (else note None): "the run trained on mesh ...; `doing` data
    parallel over ...")."""
    devices = jax.devices()
    try:
        sizes = sharding.mesh_shape(config.mesh, len(devices))
        sharding.check_batch_split(config.batch_size, sizes)  # (a -1 axis takes more devices)
        return config, None, None
    except ValueError:
        if jax.process_count() > 1:  # every host must agree: the run's mesh or its error
            raise
    data = max(d for d in range(1, len(devices) + 1) if config.batch_size % d == 0)
    trained = sharding.describe_mesh({axis: config.mesh.get(axis, 1)
                                      for axis in sharding.MESH_AXES})
    config = config.copy_and_resolve_references()
    config.mesh.update({axis: data if axis == "data" else 1 for axis in sharding.MESH_AXES})
    return config, devices[:data], (f"note: the run trained on mesh {trained}; {doing} data "
                                     f"parallel over {data} of the {len(devices)} devices here")


def reading_mesh(config) -> jax.sharding.Mesh:
    """The mesh to read a run's checkpoint onto here: its own where this machine's devices hold
    it, else data parallel over them (`local_mesh`; a checkpoint restores onto any mesh), with
    local_mesh's note on stderr."""
    fitted, devices, note = local_mesh(config, "reading it")
    if note:
        print(note, file=sys.stderr)
    return sharding.make_mesh(fitted.mesh, devices)
