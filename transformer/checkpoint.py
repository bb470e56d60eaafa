"""Orbax checkpoints of a run: train state, Grain iterator state and the resolved config.

A checkpoint holds everything needed to continue exactly: params, optimizer state and step (the
per-step RNG is derived from the seed and the step), the data iterator's position and the
config. The tokenizer lives beside the checkpoints in the workdir. Restoring checks that the
structural settings of the checkpoint and the current config agree, and names every difference.
"""

from __future__ import annotations

import os

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

# Model settings that may change between a checkpoint and the run restoring it.
_NON_STRUCTURAL = {"dropout_rate", "attention_dropout_rate", "remat_policy", "dtype",
                   "attention_impl"}


def structural_differences(saved: dict, current: dict) -> list[str]:
    """Model settings (and the tokenizer) that differ between two resolved configs.

    >>> structural_differences({"model": {"num_layers": 4, "dropout_rate": 0.1}},
    ...                        {"model": {"num_layers": 6, "dropout_rate": 0.0}})
    ['model.num_layers: checkpoint 4, config 6']
    """
    differences = []
    saved_model, current_model = saved.get("model", {}), current.get("model", {})
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
    return differences


class Manager:
    """Saves and restores a run's checkpoints under WORKDIR/checkpoints (async, keep-last-N)."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict):
        self.config = config
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.get("keep_checkpoints", 3), create=True,
            enable_async_checkpointing=True, cleanup_tmp_directories=True)
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler(),
                           "config": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, iterator) -> None:
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(iterator),
            config=ocp.args.JsonSave(self.config.to_dict())))

    def saved_config(self, step: int) -> dict:
        return self._manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]

    def restore(self, step: int, abstract_state, shardings, iterator=None):
        """The train state at `step` (and the iterator moved to where it was), or an error
        naming every structural difference between that checkpoint and the current config."""
        differences = structural_differences(self.saved_config(step), self.config.to_dict())
        if differences:
            raise ValueError(f"checkpoint {self.directory}/{step} does not match the config: "
                             + "; ".join(differences))
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state, shardings)
        items = {"state": ocp.args.StandardRestore(target)}
        if iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(iterator)
        return self._manager.restore(step, args=ocp.args.Composite(**items))["state"]

    def restore_latest(self, abstract_state, shardings, iterator=None):
        step = self.latest_step()
        if step is None:
            return None
        return self.restore(step, abstract_state, shardings, iterator)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def saved_run(workdir: str, step: int | None = None) -> tuple[int, ml_collections.ConfigDict]:
    """(step, resolved config) of checkpoint `step` (default: the latest complete one) of a
    training workdir, with one-line errors for a workdir without (that) checkpoint."""
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise FileNotFoundError(f"{workdir!r} holds no checkpoints: expected a training workdir")
    probe = Manager(workdir, ml_collections.ConfigDict())
    try:
        steps = probe.all_steps()
        if not steps:
            raise FileNotFoundError(f"{workdir!r} holds no complete checkpoint")
        step = max(steps) if step is None else step
        if step not in steps:
            raise ValueError(f"step={step}: expected one of the saved steps {steps}")
        return step, ml_collections.ConfigDict(probe.saved_config(step))
    finally:
        probe.close()
