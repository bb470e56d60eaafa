"""Saving and resuming a run's Orbax checkpoints (`Manager`): train state, data iterator
position and the resolved config.

A checkpoint holds everything needed to continue exactly: params, optimizer state and step (the
per-step RNG is derived from the seed and the step), the data iterator's position (one global
batch index, the same on every process, so a run resumes on any number of processes), the config
and what defines the data stream (`transformer.data.inputs.data_stream`), with the jax and
jaxlib versions, backend, device count and mesh that wrote it (`checkpoint.RUNTIME`: a resume under
others is announced, its steps no longer bit for bit the uninterrupted run's). The tokenizer lives
beside the checkpoints in the workdir. Restoring checks that the structural settings of the
checkpoint and the current config agree, that the data stream is the same one the iterator
position belongs to and that the optimizer state holds the arrays the config builds (read from
the step's metadata first: a changed optimizer setting is not damage), and names every
difference.

A run deletes only the steps it saved itself, in this process, beyond `keep_checkpoints` (>= 1):
the checkpoints a workdir held when the run started are never deleted by it.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-write leaves no half-written step behind. A complete step whose files were later damaged
(truncated, deleted) fails to restore: `restore_latest` then falls back to the previous step
with a warning naming the error (moving the damaged step to WORKDIR/checkpoints.damaged/, so the
run can save that step again), and raises if no step is usable. It never starts fresh over a
workdir that holds checkpoints; `checkpoint.set_aside` (config `fresh_start=True`) moves them
out of the way instead, so nothing saved is deleted.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from collections.abc import Sequence

import jax
import ml_collections
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from transformer.data import inputs, tasks
from transformer.models import FAMILIES, MODEL_KEYS, default_model_config, transformer_config
from transformer.nn import lora
from transformer.nn.config import TransformerConfig
from transformer.training import checkpoint as checkpoint_lib
from transformer.training.checkpoint import CHECKPOINTS, DELETED, JSON_ITEMS, LORA_BASE, RUNTIME
from transformer.utils import fileio, keys

# Compute settings (params stay float whatever they are) that a resumed run announces changed.
_COMPUTE_SETTINGS = tuple(name for name, declared in MODEL_KEYS.items()
                          if not declared.structural)
# Model settings that may change between a checkpoint and the run restoring it: the fields
# declared `structural=False` (dropout, kernels, dtype, MoE loss weights, ...).
_NON_STRUCTURAL = {name for name, declared in keys.declarations(TransformerConfig)
                   if not declared.structural} | set(_COMPUTE_SETTINGS)
# Top-level settings that change the objective or which updates apply, or which validation
# windows a val loss averages (eval_steps: its curve changes meaning), and may change on resume
# (announced): not the run's bookkeeping (steps, log_every, eval_every, checkpoint_*).
_STEP_SETTINGS = ("label_smoothing", "max_grad_norm", "z_loss", "eval_steps")


def _model_settings(config: dict) -> dict:
    """A config's model group with nested groups flattened ("moe.top_k"); a key missing from an
    older config has its default (a checkpoint from before `moe` existed is dense)."""
    return {**keys.dotted(default_model_config().to_dict()),
            **keys.dotted(config.get("model", {}))}


def _read_model_settings(saved: dict, current: dict) -> tuple[dict, dict]:
    """`_model_settings` of both configs less the keys their family never reads
    (`Family.reads_key`, model.family kept) and the keys idle in both (`_idle`) where both name
    the same family (else every key): such a key changes nothing (the run's start warns so), so
    a change to it neither blocks a resume nor is announced."""
    saved_model, current_model = _model_settings(saved), _model_settings(current)
    family = FAMILIES.get(saved_model["family"])
    if family is None or saved_model["family"] != current_model["family"]:
        return saved_model, current_model
    idle = _idle(saved, family) & _idle(current, family)  # (moe.top_k without experts)
    return tuple({key: value for key, value in model.items()
                  if family.reads_key(key) and key not in idle}
                 for model in (saved_model, current_model))


def _idle(config: dict, family) -> set[str]:
    """The model keys that act only with a setting the config's stack leaves off, whatever
    their values (`TransformerConfig.idle_keys`); none where its model group builds no stack."""
    try:
        stack = transformer_config(ml_collections.ConfigDict(config.get("model", {})))
    except (ValueError, TypeError, AttributeError, KeyError):  # (e.g. an older checkpoint's
        return set()  # group that no longer builds: its keys are compared one by one)
    return set(stack.idle_keys(family.decoding == "encoder_decoder", set_only=False))


def structural_differences(saved: dict, current: dict) -> list[str]:
    """Model settings, the tokenizer and optimizer.name (its state's layout; "adamw" for a
    config from before the key) that differ between two resolved configs. Other optimizer
    settings and `steps` may change on resume (a WSD run continued to a larger `steps`),
    unless they change the state's arrays (`layout_changes`, refused by `Manager.restore`).
    A model key the family never reads is left out (`_read_model_settings`).

    >>> structural_differences({"model": {"num_layers": 4, "dropout_rate": 0.1}},
    ...                        {"model": {"num_layers": 6, "dropout_rate": 0.0}})
    ['model.num_layers: checkpoint 4, config 6']
    """
    differences = []
    saved_model, current_model = _read_model_settings(saved, current)
    for key in sorted(set(saved_model) | set(current_model)):
        if key in _NON_STRUCTURAL:
            continue
        if saved_model.get(key) != current_model.get(key):
            differences.append(f"model.{key}: checkpoint {saved_model.get(key)!r}, "
                               f"config {current_model.get(key)!r}")
    saved_tok = saved.get("data", {}).get("tokenizer")
    current_tok = current.get("data", {}).get("tokenizer")
    if saved_tok != current_tok:
        differences.append(f"data.tokenizer: checkpoint {saved_tok!r}, config {current_tok!r}")
    saved_opt, current_opt = (c.get("optimizer", {}).get("name", "adamw") for c in (saved, current))
    if saved_opt != current_opt:
        differences.append(f"optimizer.name: checkpoint {saved_opt!r}, config {current_opt!r}")
    return differences


def compute_changes(saved: dict, current: dict) -> list[str]:
    """The settings that may change on resume and did: the model's non-structural ones
    (quantization, dtype, dropout, kernels, ...), the loss, step and validation settings at the
    top level (`_STEP_SETTINGS`) and the optimizer's but its name (learning rate, schedule,
    weight decay, ...); a top-level or optimizer key both configs hold, a model key the family reads
    (`_read_model_settings`). Allowed, and announced.

    >>> compute_changes({"model": {}}, {"model": {"quantization": "int8"}})
    ["model.quantization: checkpoint '', config 'int8'"]
    >>> compute_changes({"optimizer": {"learning_rate": 0.001}},
    ...                 {"optimizer": {"learning_rate": 0.01}})
    ['optimizer.learning_rate: checkpoint 0.001, config 0.01']
    >>> compute_changes({"label_smoothing": 0.0, "z_loss": 1e-4, "steps": 10},
    ...                 {"label_smoothing": 0.1, "z_loss": 1e-4, "steps": 20})
    ['label_smoothing: checkpoint 0.0, config 0.1']
    """
    saved_model, current_model = _read_model_settings(saved, current)
    changes = [f"model.{key}: checkpoint {saved_model.get(key)!r}, config "
               f"{current_model.get(key)!r}" for key in sorted(_NON_STRUCTURAL)
               if saved_model.get(key) != current_model.get(key)]
    changes += [f"{key}: checkpoint {saved[key]!r}, config {current[key]!r}"
                for key in _STEP_SETTINGS if key in saved and key in current
                and saved[key] != current[key]]
    saved_opt, current_opt = (keys.dotted(c.get("optimizer", {})) for c in (saved, current))
    return changes + [f"optimizer.{key}: checkpoint {saved_opt[key]!r}, config "
                      f"{current_opt[key]!r}" for key in sorted(set(saved_opt) & set(current_opt))
                      if key != "name" and saved_opt[key] != current_opt[key]]


def layout_changes(saved: dict, current: dict) -> list[str]:
    """The changed settings that can lay the optimizer state out otherwise: the optimizer's
    (`compute_changes`; sgd's momentum adds a trace, adafactor's minimum size to factor splits
    its moments) and `nonfinite` ("skip" wraps the state in a skip counter).

    >>> layout_changes({"optimizer": {"momentum": 0.0}}, {"optimizer": {"momentum": 0.9}})
    ['optimizer.momentum: checkpoint 0.0, config 0.9']
    """
    changes = [c for c in compute_changes(saved, current) if c.startswith("optimizer.")]
    before, after = (c.get("nonfinite", "stop") for c in (saved, current))
    return changes + ([f"nonfinite: checkpoint {before!r}, config {after!r}"]
                      if before != after else [])


def _opt_layout(tree) -> dict[str, tuple]:
    """The optimizer state's arrays ("opt_state.1.0.mu.embed.embedding" -> shape) of a train
    state (as Orbax saves it) or of a checkpoint's state metadata (empty nodes left out: they
    hold nothing)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    names = ((".".join(ocp.tree.str_keypath(path)), leaf) for path, leaf in leaves)
    return {name: tuple(leaf.shape) for name, leaf in names if name.startswith("opt_state.")
            and getattr(leaf, "shape", None) is not None}


def stream_differences(saved: dict, current: dict,
                       compared: Sequence[str] | None = None) -> list[str]:
    """What differs between two data streams (`inputs.data_stream` dicts), in their `compared`
    keys and the dotted keys under them (default: all; a mixture's "fingerprint" is a dict of
    its sources'). A different data.path with the same content fingerprint is data that
    moved, not a difference (`moved_data` names it). The runtime that wrote the checkpoint
    (`RUNTIME`) is no part of the stream. The embedded corpus's fingerprint (data.path '' in
    both) says why it changed (`_embedded_hint`).

    >>> stream_differences({"batch_size": 8, "data": {"path": "a"}, "fingerprint": "f0"},
    ...                    {"batch_size": 16, "data": {"path": "b"}, "fingerprint": "f0"})
    ['batch_size: checkpoint 8, config 16']
    """
    saved, current = (keys.dotted({k: v for k, v in stream.items() if k != RUNTIME})
                      for stream in (saved, current))
    differences = []
    under = tuple(compared or ())
    for key in sorted(k for k in set(saved) | set(current) if compared is None or k in under
                      or k.startswith(tuple(f"{c}." for c in under))):
        if key in (inputs.DOCUMENTS, inputs.TEST_FINGERPRINT, tasks.LABELS):
            # derived from the rest (older checkpoints lack them: the class names are compared
            # apart, `tasks.label_change`); never trained on
            continue
        if key in _MOVED and saved.get(_MOVED[key]) == current.get(_MOVED[key]):
            continue  # the same content elsewhere
        if saved.get(key) != current.get(key):
            what = "content fingerprint" if key == "fingerprint" else key
            differences.append(f"{what}: checkpoint {saved.get(key)!r}, config "
                               f"{current.get(key)!r}" + _embedded_hint(key, saved, current))
    return differences


# A path whose data may move (`stream_differences`): its fingerprint's key.
_MOVED = {"data.path": "fingerprint", "data.validation_path": "validation_fingerprint"}


def moved_data(saved: dict, current: dict) -> list[str]:
    """A line for each path of two data streams that differs while its content fingerprint
    matches: taken for the same data moved (`stream_differences`), and said so, since the
    fingerprint reads names, sizes and each file's first and last 4 KiB only.

    >>> moved_data({"data": {"path": "a"}, "fingerprint": "f0"},
    ...            {"data": {"path": "b"}, "fingerprint": "f0"})[0][:61]
    "data.path 'a' -> 'b' (the same names, sizes and ends: read as"
    """
    saved, current = keys.dotted(saved), keys.dotted(current)
    return [f"{key} {saved[key]!r} -> {current[key]!r} (the same names, sizes and ends: read "
            "as the same data moved; an edit in the middle of a file is not detected)"
            for key, fingerprint in _MOVED.items()
            if saved.get(key) and current.get(key) and saved[key] != current[key]
            and saved.get(fingerprint) is not None
            and saved.get(fingerprint) == current.get(fingerprint)]


def _embedded_hint(key: str, saved: dict, current: dict) -> str:
    """Why the embedded corpus's fingerprint changed (`key`: the differing key of two dotted
    streams): it is the running Python's own text. Checkpoints record no Python version, so
    this one's is named.

    >>> _embedded_hint("fingerprint", {"data.path": ""}, {"data.path": ""})[:52]
    ' (data.path is empty: the embedded corpus, which is '
    """
    if key != "fingerprint" or saved.get("data.path", None) != "" or \
            current.get("data.path", None) != "":
        return ""
    return (" (data.path is empty: the embedded corpus, which is the running Python's own "
            "documentation and standard library, and differs between Python versions; this is "
            f"Python {platform.python_version()}: resume under the Python that trained it)")


def _not_orbax_error(record: logging.LogRecord) -> bool:
    """Orbax logs each failed background write with its traceback, once per thread involved
    (four of them for one step); the run reports it as one `WriteError` line instead."""
    return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


logging.getLogger("absl").addFilter(_not_orbax_error)
# ... and asyncio, for each write of the failed step still in flight ("Task exception was never
# retrieved", with a traceback).
logging.getLogger("asyncio").addFilter(
    lambda record: not (record.levelno >= logging.ERROR and "orbax" in record.getMessage()))


class WriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions): the run stops (exit 1)."""


def _cause(error: BaseException) -> str:
    """The root cause of a failed write, short: the OS error's text where one is named
    (tensorstore reports `... [os_error_code='28']` inside a long message).

    >>> _cause(ValueError("OUT_OF_RANGE: Error writing ... [os_error_code='28']"))
    'No space left on device'
    """
    error = checkpoint_lib.root_cause(error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if code := re.search(r"os_error_code='?(\d+)", str(error)):
        return os.strerror(int(code.group(1)))
    return checkpoint_lib.first_line(error)[:300]


class ConfigMismatch(ValueError):
    """A checkpoint was written by a different model, tokenizer or data stream than the config
    asks for."""


class Manager:
    """Saves and restores a run's checkpoints under WORKDIR/checkpoints (async, keep-last-N)."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict,
                 stream: dict | None = None):
        """`stream`: the run's `inputs.data_stream`, saved with each step and compared on
        restore (None: a manager that only reads)."""
        self.config, self.stream = config, stream
        checkpoint_lib.quiet_cut_off_io()  # a failed write's tracebacks
        self.stream_changes: list[str] = []  # set by restore under new_data=True
        self.compute_changes: list[str] = []  # set by restore: compute_changes
        # set by restore, announced as they are: another runtime (`checkpoint.runtime_changes`),
        # data moved (`moved_data`)
        self.resume_notes: list[str] = []
        self._keep = config.get("keep_checkpoints", 3)
        self._written: list[int] = []  # steps this manager saved: the only ones it may delete
        self.pruned: list[int] = []  # the steps it deleted (keep_checkpoints)
        self._pending: int | None = None  # the step written last (possibly still in progress)
        self._failed = False  # a write failed and was reported
        self.lora_base: dict | None = None  # a LoRA run's base record (saved, or restored)
        self.base_source: str | None = None  # init_from as loaded: "DIR@STEP" for a workdir
        # Orbax keeps every step (max_to_keep=None); `_prune` deletes this run's old ones. A
        # deleted step is first renamed into WORKDIR/checkpoints/deleted/ (one atomic rename),
        # then removed from there: a run stopped mid-removal never leaves a half-deleted step
        # that looks like a checkpoint.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=False, enable_async_checkpointing=True,
            cleanup_tmp_directories=True, todelete_subdir=DELETED)
        self.workdir, self.directory = workdir, fileio.join(workdir, CHECKPOINTS)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           **{item: ocp.JsonCheckpointHandler() for item in JSON_ITEMS}})

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, iterator) -> None:
        if step in self._manager.all_steps():
            return
        self._confirm_pending()  # the previous step's write, if it failed
        try:
            self._prune()
            self._empty_deleted()
            fileio.path(self.directory).mkdir(parents=True, exist_ok=True)  # the first save's
            self._written.append(step)
            items = {"state": ocp.args.StandardSave(state),
                     "data": ocp.args.JsonSave(iterator.get_state()),
                     "config": ocp.args.JsonSave(self.config.to_dict())}
            if self.stream is not None:
                items["stream"] = ocp.args.JsonSave(
                    {**self.stream, RUNTIME: checkpoint_lib.runtime(self.config.mesh)})
            if lora.enabled(self.config):  # the adapters, and the name of their base
                if self.lora_base is None:
                    # the step a workdir base was read at: the adapters' base stays that
                    # step when the base workdir trains on
                    self.lora_base = {"init_from": self.base_source or self.config.init_from,
                                      "fingerprint": lora.fingerprint(state.params)}
                items["state"] = ocp.args.StandardSave(state.replace(
                    params=lora.adapters_only(state.params)))
                items[LORA_BASE] = ocp.args.JsonSave(
                    {k: self.lora_base[k] for k in ("init_from", "fingerprint")})
            self._pending = step
            self._manager.save(step, args=ocp.args.Composite(**items))
        except Exception as error:  # noqa: BLE001 - tensorstore and Orbax raise many types
            raise self._write_error(step, error) from error

    def check_for_errors(self, step: int | None = None) -> None:
        """Raises `WriteError` if the step written in the background failed; free while it is
        still being written (called after every train step, so a failed save stops the run at
        once). `step`: the run's step now, named in the error when training went on past the
        failed write while it ran."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            written = self._pending
            try:
                self._confirm_pending()
            except WriteError as error:
                if step is None or step <= written:
                    raise
                trained = f"steps {written + 1}-{step}" if step > written + 1 else f"step {step}"
                raise WriteError(f"{error}; the run stopped at step {step}: a checkpoint is "
                                 "written while training goes on, and the write failed after "
                                 f"{trained} had trained (not saved)") from error.__cause__

    def _confirm_pending(self) -> None:
        """Waits for the step being written, then raises `WriteError` unless it is complete
        (Orbax raises some failures here, and only logs others, leaving the temporary
        directory: so the step's final directory is looked for)."""
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - tensorstore and Orbax raise many types
            raise self._write_error(step, error) from error
        if step is not None and jax.process_index() == 0 and \
                not (fileio.path(self.directory) / str(step)).exists():
            raise self._write_error(step, RuntimeError("the write did not complete"))

    def _prune(self) -> None:
        """Deletes the steps this manager saved beyond the newest `keep_checkpoints` (all of
        them committed: called after `wait_until_finished`)."""
        old, self._written = self._written[:-self._keep], self._written[-self._keep:]
        self.pruned += old
        for step in old:
            if step in self._manager.all_steps():
                self._manager.delete(step)

    def _write_error(self, step: int | None, error: Exception) -> WriteError:
        self._failed = True  # reported once: close() then only closes
        if step in self._written:
            self._written.remove(step)
        return WriteError(f"writing checkpoint step {step} to {self.directory} failed "
                          f"({_cause(error)}); the complete checkpoints {self.all_steps()} are "
                          "intact")

    def saved_config(self, step: int) -> dict:
        return self._manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]

    def saved_stream(self, step: int) -> dict | None:
        """The data stream saved with `step` (None for checkpoints written before streams were
        saved); FileNotFoundError (damage) where it was saved and is gone."""
        if "stream" not in (self._manager.item_metadata(step) or {}):
            if checkpoint_lib.wrote_stream(self.directory, step):
                raise FileNotFoundError(f"{self.directory}/{step}/stream: the step's data "
                                        "stream item is missing (Orbax recorded writing it)")
            return None
        return self._manager.restore(step, args=ocp.args.Composite(
            stream=ocp.args.JsonRestore()))["stream"]

    def check(self, step: int) -> list[str]:
        """Raises ConfigMismatch naming, in one line, every structural difference between
        checkpoint `step` and the config and every difference in the data stream unless the
        config says new_data=True; returns the data-stream differences (empty when it is the
        same). A labeled task's class names other than the checkpoint's are refused under
        new_data=True too (`tasks.label_change`). A missing or unreadable item raises another
        error (damage)."""
        where = f"checkpoint {self.directory}/{step}"
        saved_config = self.saved_config(step)
        differences = structural_differences(saved_config, self.config.to_dict())
        self.compute_changes = compute_changes(saved_config, self.config.to_dict())
        problems = ["does not match the config: " + "; ".join(differences)] \
            if differences else []
        stream, self.resume_notes, change = [], [], None
        if self.stream is not None:
            saved = self.saved_stream(step)
            stream = ["the checkpoint records no data stream (an older version wrote it)"] \
                if saved is None else stream_differences(saved, self.stream)
            # (data read from its start, under new_data, moved or not)
            self.resume_notes = checkpoint_lib.runtime_changes(
                saved, checkpoint_lib.runtime(self.config.mesh)) + (
                [] if stream else moved_data(saved, self.stream))
            if change := tasks.label_change((saved or {}).get(tasks.LABELS),
                                            self.stream.get(tasks.LABELS)):
                problems.append(change + ": expected data that gives the same classes in the "
                                "same order (new_data=True too); or fine-tune from its "
                                "pretraining source in another workdir")
        if stream and not self.config.get("new_data") and not change:  # (new_data: no help)
            problems.append(
                "was trained on another data stream: " + "; ".join(stream) + ". Expected the "
                "same data and settings to resume its position; set new_data=True to continue "
                "its params on this data from the stream's start")
        if problems:
            raise ConfigMismatch(f"{where} " + "; and it ".join(problems))
        return stream

    def restore(self, step: int, abstract_state, shardings, iterator=None):
        """The train state at `step` (and the iterator moved to where it was), or an error
        naming every difference between that checkpoint and the config (`check`). Under
        new_data=True a different data stream leaves the iterator at its start and the
        differences in `stream_changes`."""
        self.stream_changes = self.check(step)
        if self.stream_changes:
            iterator = None
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state, shardings)
        adapters = lora.enabled(self.config)
        if adapters:  # a LoRA checkpoint holds the adapters: finetune.with_lora_base adds the base
            target = target.replace(params=lora.adapters_only(target.params))
        self._check_layout(step, target)
        items = {"state": ocp.args.StandardRestore(target)}
        if iterator is not None:
            items["data"] = ocp.args.JsonRestore()
        if adapters:
            items[LORA_BASE] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        if jax.tree.structure(restored["state"]) != jax.tree.structure(target):
            # The same config, another optimizer-state layout: params in other groups (a muP
            # or Muon run with MLA, Mamba 2, MoE or MTP saved before 2026-12-05's regrouping)
            # restore with holes (None) that the first step would fail on.
            raise ConfigMismatch(self._regrouped(step))
        if iterator is not None:
            iterator.set_state(restored["data"])
        if adapters:
            self.lora_base = dict(restored[LORA_BASE], step=step)
        return restored["state"]

    def _check_layout(self, step: int, target) -> None:
        """Raises ConfigMismatch when checkpoint `step`'s optimizer state holds other arrays
        than `target`'s (a changed optimizer setting: Orbax would refuse every step alike, as
        if damaged). Read from the step's metadata, before restoring anything."""
        saved = (self._manager.item_metadata(step) or {}).get("state")
        if saved is None:  # no metadata to compare: the restore itself checks
            return
        saved, wanted = _opt_layout(saved), _opt_layout(ocp.tree.serialize_tree(
            target, keep_empty_nodes=True))
        if saved == wanted:
            return
        changes = layout_changes(self.saved_config(step), self.config.to_dict())
        if not changes:  # the same settings: this version groups the params otherwise
            raise ConfigMismatch(self._regrouped(step))
        differ = sorted(set(saved.items()) ^ set(wanted.items()))
        raise ConfigMismatch(
            f"checkpoint {self.directory}/{step}: its optimizer state is laid out otherwise "
            f"than this config builds ({len(differ)} arrays differ, e.g. {differ[0][0]}): "
            "changed settings alter it (" + "; ".join(changes) + "): expected their saved "
            "values to resume it, or start a new run from its params with init_from in "
            "another workdir")

    def _regrouped(self, step: int) -> str:
        return (f"checkpoint {self.directory}/{step}: its optimizer state groups the params "
                "otherwise than this version does (muP's hidden matrices or Muon's): expected "
                "the same groups; finish the run with the version that saved it, or start a "
                "new run from its params with init_from in another workdir")

    def restore_latest(self, abstract_state, shardings, iterator=None):
        """The newest usable checkpoint's state (None if there are none), falling back past
        damaged ones with a warning; an error if every one is unusable. A checkpoint of a
        different model is an error at once (it is not damage)."""
        failures, damaged = [], []
        for step in reversed(self.all_steps()):
            try:
                state = self.restore(step, abstract_state, shardings, iterator)
            except ConfigMismatch:
                raise
            except Exception as error:  # noqa: BLE001 - damaged files raise many types
                reason = checkpoint_lib.first_line(error)[:300]
                failures.append(f"step {step} ({reason})")
                logging.warning("checkpoint %s/%d is unusable (%s); trying the previous one",
                                self.directory, step, reason)
                damaged.append(step)
                continue
            if damaged:
                self._set_aside(damaged, "damaged", "unusable")
            return state
        if failures:
            raise RuntimeError(f"no usable checkpoint in {self.directory}: " +
                               "; ".join(failures) + ". Fix or move them, or set "
                               "fresh_start=True to set them aside and start from step 0")
        if diverged := checkpoint_lib.diverged_steps(self.workdir):
            # (a start from step 0 here would append to, and cut, the diverged run's records)
            raise ValueError(f"workdir={self.workdir!r}: its run diverged and kept no good "
                             f"checkpoint ({self.directory}.nonfinite holds {diverged}): "
                             "expected fresh_start=True to set that run aside and start over, "
                             "or another workdir")
        return None

    def _set_aside(self, steps: list[int], kind: str, what: str) -> str:
        """Moves step directories to WORKDIR/checkpoints.<kind>/<step>-<time> (kept for
        inspection, out of the way of the steps this run will save again); returns that
        folder."""
        target = f"{self.directory}.{kind}"
        if jax.process_index() == 0:
            fileio.path(target).mkdir(parents=True, exist_ok=True)
            for step in steps:
                name = f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                fileio.move(fileio.join(self.directory, str(step)), fileio.join(target, name))
                # (the nonfinite error names them itself)
                logging.log(logging.WARNING if kind == "damaged" else logging.INFO,
                            "moved the %s checkpoint %d to %s/%s", what, step, target, name)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"transformer.training.checkpoint.set_aside_{kind}")
        self._manager.reload()
        return target

    def set_aside_from(self, step: int) -> tuple[list[int], str]:
        """Moves the steps >= `step` that this run saved to WORKDIR/checkpoints.nonfinite/:
        their params led to a NaN/Inf, so none of them is a good checkpoint to resume (steps the
        workdir held before this run are left in place). Returns (the moved steps, where)."""
        self._confirm_pending()
        bad = [s for s in self._written if s >= step and s in self._manager.all_steps()]
        self._written = [s for s in self._written if s < step]
        if not bad:
            return [], ""
        return bad, self._set_aside(bad, "nonfinite", "non-finite")

    def _empty_deleted(self) -> None:
        """Removes the steps Orbax set aside for deletion (only between writes: it renames
        into the folder while a save finishes)."""
        deleted = fileio.path(self.directory) / DELETED
        if jax.process_index() == 0 and deleted.exists():
            deleted.rmtree()

    def close(self) -> None:
        if self._failed:  # already reported by save/check_for_errors
            return
        try:
            self._confirm_pending()
            # Orbax removes leftover temporary steps in a thread started with the manager and
            # awaits it only before a save: a manager closed unsaved (a run refused at start-up)
            # must await it too, or the thread runs into interpreter shutdown.
            getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
            if self._written:  # a manager that only reads may share the folder with a run
                self._prune()
                self._empty_deleted()
        finally:
            self._manager.close()
