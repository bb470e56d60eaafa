"""A run's checkpoints on disk: the directory layout, and what reads them without training.

This is the only module that knows the layout: WORKDIR/checkpoints/<step>/ with the items
`state` (params, optimizer state, step), `data` (the iterator position), `config` (the resolved
config), `stream` (`transformer.data.inputs.data_stream`, with the `RUNTIME` that wrote the step)
and, for a LoRA run, `lora_base`;
Orbax's WORKDIR/checkpoints/deleted/ for steps on their way out; the run's other files beside
(`RUN_FILES`). Saving and resuming a run: `checkpoint_manager.Manager`.

The readers (`saved_run`, `restore_params`, `read_params`, `params_metadata`,
`saved_lora_base`) create, clean up and delete nothing, so they are safe beside a training that
is writing the same workdir; a step that training deletes while it is read gives way to the
newest one where the caller asked for the latest (`read_newest`: a caller's reads of one step
are retried together), and what the read cut short leaves behind stays off stderr
(`quiet_cut_off_io`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jaxlib
import ml_collections
import orbax.checkpoint as ocp
from flax import traverse_util

from transformer.models import build_model
from transformer.nn import lora
from transformer.parallel import sharding
from transformer.training import optim, placement
from transformer.training import state as state_lib
from transformer.utils import fileio

CHECKPOINTS = "checkpoints"  # WORKDIR/checkpoints/<step>/{state,data,config}
LORA_BASE = "lora_base"  # a LoRA run's item naming its base: {"init_from", "fingerprint"}
JSON_ITEMS = ("data", "config", "stream", LORA_BASE)
DELETED = "deleted"  # WORKDIR/checkpoints/deleted/<step>: old steps on their way out
# Orbax's record of a complete step (JSON), naming the items it wrote ("item_handlers").
STEP_RECORD = "_CHECKPOINT_METADATA"

# What a run writes beside its checkpoints, set aside with them (a fresh run would append to its
# records, mix its TensorBoard events in, or overwrite its summary and tokenizer).
RUN_FILES = ("metrics.jsonl", "summary.json", "tensorboard", "tokenizer", "val_windows.npz",
             "goodput.json", "wandb.json", "wandb", "profile", "attention")
# ... and what `evaluate` wrote of its checkpoints (a fresh run's own would overwrite them).
RUN_FILE_PATTERNS = ("eval_*.json", "confusion_*.png")
# ... and the steps a run set aside itself (`checkpoint_manager.Manager._set_aside`).
SET_ASIDE = (f"{CHECKPOINTS}.nonfinite", f"{CHECKPOINTS}.damaged")


class MissingStep(ValueError):
    """A checkpoint step asked for that the workdir does not hold (its one line names the
    steps it does)."""


# The stream item's record of the runtime that wrote the step (`runtime`; a step saved before
# it has none). Not part of the data stream: never a difference on resume.
RUNTIME = "runtime"


def runtime(mesh=None) -> dict:
    """What decides a step's bits besides the checkpoint and the config: jax's and jaxlib's
    versions (other kernels and fusions), the backend, the device count and, given the config's
    `mesh` group, the axes it lays them out on (another layout, another reduction order).

    >>> runtime({"data": -1, "fsdp": 1})["mesh"]  # one device
    'one device'
    """
    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "backend": jax.default_backend(), "devices": jax.device_count()}
    if mesh is not None:
        sizes = sharding.mesh_shape(mesh, out["devices"])
        out["mesh"] = " x ".join(f"{axis}={n}" for axis, n in sizes.items() if n > 1) \
            or "one device"
    return out


def runtime_changes(saved_stream: dict | None, current: dict | None = None) -> list[str]:
    """One line naming how `current` (default: this process's `runtime`) differs from the
    runtime that wrote a checkpoint (recorded in its stream item, `saved_stream`), or none;
    none for a step saved before the record was. Allowed: the run resumes, but is no longer
    bit for bit the uninterrupted run.

    >>> runtime_changes({RUNTIME: {"jax": "0.10.2", "jaxlib": "0.10.2", "devices": 8}},
    ...                 {"jax": "0.12.0.1", "jaxlib": "0.12.0.1", "devices": 8})[0][:51]
    'jax 0.10.2 -> 0.12.0.1, jaxlib 0.10.2 -> 0.12.0.1 ('
    >>> runtime_changes({"fingerprint": "f0"})  # an older step's stream
    []
    """
    saved = (saved_stream or {}).get(RUNTIME)
    if not isinstance(saved, dict):
        return []
    current = runtime() if current is None else current
    changed = [f"{key} {saved[key]} -> {current.get(key)}" for key in current
               if key in saved and saved[key] != current[key]]
    return [", ".join(changed) + " (steps from here are not bit-identical to an uninterrupted "
            "run's)"] if changed else []


def set_aside(workdir: str) -> str | None:
    """Renames WORKDIR/checkpoints to checkpoints.set-aside-<time> and moves the run's other
    records into it (`RUN_FILES`, `RUN_FILE_PATTERNS`, and the steps it set aside as
    non-finite or damaged), for an explicit fresh start; returns the new path, or None if
    the workdir held none of them. A run that kept no checkpoint (killed before its first
    save, or diverged with every step set aside) is moved too. Nothing is deleted."""
    root, directory = fileio.path(workdir), fileio.path(workdir) / CHECKPOINTS
    names = [*RUN_FILES, *SET_ASIDE, *(found.name for pattern in RUN_FILE_PATTERNS
                                       for found in root.glob(pattern))]
    steps = directory.is_dir() and any(directory.iterdir())
    if not steps and not any((root / name).exists() for name in names):
        return None
    target = f"{directory}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
    if steps:
        fileio.move(directory, target)
    else:
        fileio.path(target).mkdir(parents=True)
    for name in names:
        if (root / name).exists():
            fileio.move(root / name, fileio.join(target, name))
    return target


def diverged_steps(workdir: str) -> list[str]:
    """What WORKDIR/checkpoints.nonfinite holds (steps a run set aside as non-finite)."""
    folder = fileio.path(workdir) / f"{CHECKPOINTS}.nonfinite"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def has_checkpoints(workdir: str) -> bool:
    """Whether `workdir` has a checkpoints directory (possibly with no complete step yet)."""
    return (fileio.path(workdir) / CHECKPOINTS).is_dir()


def complete_steps(workdir: str) -> list[int]:
    """The complete checkpoint steps of `workdir`, oldest first (none while its first save is
    still being written: a step directory Orbax has not yet renamed into place)."""
    if not has_checkpoints(workdir):
        return []
    with contextlib.closing(_reader(workdir)) as reader:
        return sorted(reader.all_steps())


def quiet_cut_off_io() -> None:
    """Keeps off stderr what a checkpoint read or write cut short leaves behind (installed once
    per process, by the readers and by a training's `checkpoint_manager.Manager`); the read is
    retried or named in one line (`read_newest`), the failed write is one `WriteError`:

    - tensorstore's "Event loop is closed" traceback for each transfer still in flight when
      Orbax's event loop closed on the failure (dozens for a step that a training deleted while
      it was read, or one that a full disk failed: `_quiet_closed_loop`);
    - Orbax's "Metadata file does not exist" warning of a step deleted meanwhile (a step that is
      there without its metadata is still warned of: `_not_a_deleted_step`);
    - the coroutines of a failed save's writes that never started, collected at exit.
    """
    absl = logging.getLogger("absl")
    if _not_a_deleted_step not in absl.filters:
        absl.addFilter(_not_a_deleted_step)
    if not getattr(sys.unraisablehook, "quiet_closed_loop", False):
        sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
        warnings.filterwarnings("ignore", r"coroutine '.*serialize.*' was never awaited",
                                RuntimeWarning)


def _quiet_closed_loop(hook):
    """`hook` (a sys.unraisablehook) without tensorstore's "Event loop is closed" errors, nor
    Orbax's per-array read coroutines closed unfinished (a read a deleted step cut short, or
    abandoned: their GeneratorExit re-raised as "Encountered error while reading array index"
    when they are collected, dozens of lines about a read that had already failed or ended)."""
    def quiet(unraisable):
        closed_loop = unraisable.exc_type is RuntimeError and \
            str(unraisable.exc_value) == "Event loop is closed"
        abandoned_read = isinstance(getattr(unraisable.exc_value, "__cause__", None),
                                    GeneratorExit) and \
            getattr(unraisable.object, "__name__", "") == "_read_array_index_and_device_put"
        if not (closed_loop or abandoned_read):
            hook(unraisable)
    quiet.quiet_closed_loop = True
    return quiet


_NO_METADATA = "Metadata file does not exist: %s"  # Orbax's warning, its argument the file


def _not_a_deleted_step(record: logging.LogRecord) -> bool:
    """False for Orbax's warning that DIR/<step>/_CHECKPOINT_METADATA does not exist where the
    step's folder is gone too (deleted while it was listed or read)."""
    if record.msg != _NO_METADATA or not isinstance(record.args, tuple) or not record.args:
        return True
    try:
        return fileio.path(str(record.args[0])).parent.exists()
    except Exception:  # noqa: BLE001 - a warning the check cannot judge is kept
        return True


def _reader(workdir: str, **item_handlers) -> ocp.CheckpointManager:
    """A manager that only reads WORKDIR/checkpoints: it creates, cleans up and deletes nothing,
    so it is safe beside a training that is writing there (Orbax's temporary directories of a
    step being saved are the training's; `all_steps` lists only the complete steps)."""
    quiet_cut_off_io()
    # (Orbax's read_only=True means the same, with a warning line on every command.)
    options = ocp.CheckpointManagerOptions(create=False, cleanup_tmp_directories=False,
                                           max_to_keep=None, enable_async_checkpointing=False)
    for _ in range(_READS - 1):  # it lists the steps: one deleted meanwhile is a missing file
        with contextlib.suppress(FileNotFoundError):
            return ocp.CheckpointManager(fileio.join(workdir, CHECKPOINTS), options=options,
                                         item_handlers=item_handlers)
    return ocp.CheckpointManager(fileio.join(workdir, CHECKPOINTS), options=options,
                                 item_handlers=item_handlers)


# Tries of a reader racing a training that saves (and with keep_checkpoints=1 deletes) a step
# about as often as a reader lists and reads one; Orbax's listing is not atomic either.
_READS = 10


def _gone(workdir: str, step: int | None) -> bool:
    """Whether checkpoint `step` has left WORKDIR/checkpoints (a training deleted it): the one
    sign of a step deleted mid-read, which Orbax reports as any of several errors (a missing
    file, "Found incomplete checkpoint", a truncated read)."""
    return step is not None and not fileio.path(
        fileio.join(workdir, CHECKPOINTS, str(step))).exists()


def saved_run(workdir: str, step: int | None = None) -> tuple[int, ml_collections.ConfigDict]:
    """(step, resolved config) of checkpoint `step` (default: the latest complete one) of a
    training workdir, with one-line errors for a workdir without (that) checkpoint."""
    if not has_checkpoints(workdir):
        raise FileNotFoundError(f"{workdir!r} holds no checkpoints: expected a training workdir "
                                "that has saved one")
    for attempt in range(_READS):
        last, chosen = attempt == _READS - 1, None
        try:
            with contextlib.closing(_reader(workdir, config=ocp.JsonCheckpointHandler())) as probe:
                steps = sorted(probe.all_steps())
                if not steps and not last:  # a listing that raced a save's rename
                    time.sleep(0.02)
                    continue
                chosen = max(steps, default=None) if step is None else step
                if chosen not in steps:
                    break
                return chosen, ml_collections.ConfigDict(probe.restore(
                    chosen, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])
        except Exception as error:  # noqa: BLE001 - a training deleted a step while it was
            # listed or read (then `step`, if given, is among the saved steps no more: below)
            if last or not (isinstance(error, FileNotFoundError) or _gone(workdir, chosen)):
                raise
    if not steps:
        raise FileNotFoundError(f"{workdir!r} holds no complete checkpoint")
    raise MissingStep(f"step={chosen}: expected one of the saved steps {steps}")


def saved_stream(workdir: str, step: int, or_newer: bool = False) -> dict | None:
    """The data stream (`inputs.data_stream`) saved with checkpoint `step` (`or_newer`: the
    newest one's, if a training beside it deleted `step` meanwhile, `read_newest`); None for one
    saved before streams were (`wrote_stream`). A step that was saved with one and lost it is
    damaged: FileNotFoundError naming it (with `or_newer`, `read_newest`'s one-line error for an
    unreadable step, unless a newer step replaced it meanwhile)."""
    def read(chosen: int) -> dict | None:
        # (by its folder: Orbax's item_metadata warns of every item it has no handler for)
        folder = fileio.path(fileio.join(workdir, CHECKPOINTS, str(chosen)))
        if not folder.exists():  # deleted meanwhile: `read_newest` reads the newest
            raise FileNotFoundError(str(folder))
        if not (folder / "stream").exists():
            if wrote_stream(fileio.join(workdir, CHECKPOINTS), chosen):
                raise FileNotFoundError(f"{folder / 'stream'} is missing, though Orbax recorded "
                                        f"writing it: checkpoint {chosen} is damaged (not an "
                                        "older version's, which saved no stream)")
            return None
        with contextlib.closing(_reader(workdir, stream=ocp.JsonCheckpointHandler())) as probe:
            return probe.restore(chosen, args=ocp.args.Composite(
                stream=ocp.args.JsonRestore()))["stream"]

    return read_newest(workdir, step, read, or_newer=or_newer)


def wrote_stream(directory: str, step: int) -> bool:
    """Whether checkpoint `step` of `directory` (a WORKDIR/checkpoints) was saved with a data
    stream item: as Orbax's record of the items it wrote into the step says (written as the
    step completed), or, where that record is gone, whether any step in the folder holds one
    (a version that saves streams wrote them). Otherwise an older version wrote it."""
    folder = fileio.path(directory)
    try:
        record = json.loads((folder / str(step) / STEP_RECORD).read_text())
        if isinstance(record.get("item_handlers"), dict):
            return "stream" in record["item_handlers"]
    except (OSError, ValueError, AttributeError):
        pass
    # (step folders are named by their number; Orbax's temporary ones and DELETED are not)
    return any((other / "stream").exists() for other in folder.iterdir() if other.name.isdigit())


def read_newest(workdir: str, step: int | None, read: Callable[[int], Any],
                or_newer: bool = False) -> Any:
    """`read(step)` of checkpoint `step`, or of the newest one when `step` is None: a training
    writing the workdir may delete the step being read (its keep_checkpoints), and then `read`
    runs again, whole, on the then-newest step (also for a given `step` with `or_newer`), so
    that all it reads comes from the one step it is given. A step that stays the newest and
    cannot be read is one line naming it; so is a given `step` deleted while it was read."""
    for attempt in range(_READS):
        chosen, listed = step, False
        try:
            chosen, _ = saved_run(workdir, step)
            listed = True
            return read(chosen)
        except Exception as error:  # noqa: BLE001 - a step deleted mid-read fails in many ways
            if not (step is None or or_newer) or chosen is None:
                if listed and _gone(workdir, chosen):
                    raise ValueError(
                        f"step={chosen}: checkpoint {chosen} of {workdir} was deleted while it "
                        "was read (the training writing it keeps only its newest "
                        "keep_checkpoints): expected a step it keeps, or no step (the "
                        "newest)") from error
                raise
            try:
                newest = saved_run(workdir)[0]
            except Exception:  # noqa: BLE001
                newest = None
            if newest == chosen or attempt == _READS - 1:  # not replaced by a newer step
                raise _unreadable(workdir, chosen, error) from error
            step = None
            logging.info("checkpoint %d was deleted while it was read; reading the newest",
                         chosen)


def root_cause(error: BaseException) -> BaseException:
    """The innermost `__cause__` of `error`: the one that names the bad file."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def first_line(error: BaseException) -> str:
    """"Type: its message's first line" of `error`'s root cause."""
    error = root_cause(error)
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _unreadable(workdir: str, step: int, error: BaseException) -> RuntimeError:
    """A damaged checkpoint's error in one line: the step, the root cause's first line, and
    how to read another (training itself falls back past it: checkpoint_manager)."""
    reason = first_line(error)[:200]
    return RuntimeError(f"checkpoint {step} of {workdir} cannot be read ({reason}): expected a "
                        "complete checkpoint (read an older step: --step=STEP, or "
                        "init_from=WORKDIR@STEP)")


class SavedParams(NamedTuple):
    step: int
    config: ml_collections.ConfigDict  # the run's resolved config
    params: Any


def restore_params(workdir: str, step: int | None = None,
                   mesh: jax.sharding.Mesh | None = None, or_newer: bool = False) -> SavedParams:
    """The params of checkpoint `step` (default: the latest) of a training workdir, read
    straight into their shardings on `mesh` (default: the run's mesh over this runtime's
    devices); the optimizer state is read only for a schedule-free run (`read_params`).
    `or_newer`: `step` was the newest when chosen, and if a training deletes it meanwhile, the
    then-newest step is read (see `SavedParams.step` for the one read)."""
    def read(step: int) -> SavedParams:
        _, config = saved_run(workdir, step)
        where = placement.reading_mesh(config) if mesh is None else mesh
        abstract, shardings, _ = state_lib.initial_state(config, build_model(config.model), where)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract.params, shardings.params)
        if lora.enabled(config):  # the adapters alone (finetune.restore_params adds the base)
            target = lora.adapters_only(target)
        return SavedParams(step, config, read_params(workdir, step, target, config))

    return read_newest(workdir, step, read, or_newer)


def params_metadata(workdir: str, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """(step, {"/"-joined param name: its shape and dtype metadata}) of a saved checkpoint."""
    def read(step: int) -> tuple[int, dict[str, Any]]:
        with contextlib.closing(_params_manager(workdir)) as manager:
            metadata = manager.item_metadata(step)["state"]["params"]
        return step, {"/".join(k): v
                      for k, v in traverse_util.flatten_dict(dict(metadata)).items()}

    return read_newest(workdir, step, read)


def read_params(workdir: str, step: int, target, config: ml_collections.ConfigDict | None = None):
    """The saved params named in `target` (a nested dict of `jax.ShapeDtypeStruct`s with
    shardings, possibly a subset of the checkpoint's), read into those shardings. A
    schedule-free run's are its evaluation params (`_schedule_free_params`). `config`: the
    step's saved config, if the caller has read it (`saved_run`)."""
    config = saved_run(workdir, step)[1] if config is None else config
    if config.optimizer.get("name", "adamw") == "schedule_free_adamw":
        return _schedule_free_params(workdir, step, target, config)
    manager = _params_manager(workdir)
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), target)
    try:
        return manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            {"params": target}, restore_args={"params": restore_args},
            partial_restore=True)))["state"]["params"]
    finally:
        manager.close()


def _schedule_free_params(workdir: str, step: int, target, config: ml_collections.ConfigDict):
    """`read_params` of a schedule_free_adamw run (`config`, its saved one): its whole train
    state is read (on the mesh of `target`'s shardings), for optim.eval_params, which needs the
    optimizer state's z."""
    mesh = jax.tree.leaves(target)[0].sharding.mesh
    abstract, shardings, _ = state_lib.initial_state(config, build_model(config.model), mesh,
                                                     optimizer=optim.make_optimizer(config))
    full = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
    handlers = {item: ocp.JsonCheckpointHandler() for item in JSON_ITEMS}
    with contextlib.closing(_reader(workdir, state=ocp.StandardCheckpointHandler(),
                                    **handlers)) as manager:
        state = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(full)))["state"]
    params = traverse_util.flatten_dict(optim.eval_params(state, config))
    return traverse_util.unflatten_dict({
        key: jax.device_put(params[key], wanted.sharding)
        for key, wanted in traverse_util.flatten_dict(target).items()})


def _params_manager(workdir: str) -> ocp.CheckpointManager:
    # Every item has its handler, though only the state is read: Orbax warns about items it
    # finds without one (six lines before an init_from error).
    return _reader(workdir, state=ocp.PyTreeCheckpointHandler(),
                   **{item: ocp.JsonCheckpointHandler() for item in JSON_ITEMS})


def saved_lora_base(workdir: str, step: int) -> dict:
    """The base a LoRA checkpoint names: {"init_from", "fingerprint", "step"}."""
    with contextlib.closing(_reader(workdir, **{LORA_BASE: ocp.JsonCheckpointHandler()})) as r:
        return dict(r.restore(step, args=ocp.args.Composite(
            **{LORA_BASE: ocp.args.JsonRestore()}))[LORA_BASE], step=step)
