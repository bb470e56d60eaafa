"""Before a training's first step: its tokenizer and task, and the checks that stop a run whose
workdir or data cannot work (transformer.train.setup calls them before anything is written)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from transformer.data import inputs, pipeline
from transformer.models import default_model_config, family_of, transformer_config
from transformer.nn import lora, mixers
from transformer.parallel import pipeline_parallel
from transformer.training import checkpoint_manager, evaluation, finetune, progress
from transformer.training import placement as placement_lib
from transformer.training import workdir as workdir_lib
from transformer.utils import cli, fileio, keys


def resolve(config: ml_collections.ConfigDict, workdir: str | None):
    """(tokenizer, task): the tokenizer (the one saved in `workdir`, if given) and the labeled
    task, with the vocabulary size and a classifier's classes filled into `config` from them."""
    tokenizer = inputs.get_tokenizer(config, workdir)
    if not config.model.vocab_size:
        config.model.vocab_size = tokenizer.vocab_size
    elif config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={config.model.vocab_size}: expected >= the "
                         f"tokenizer's {tokenizer.vocab_size} ({tokenizer.num_sentinels} of them "
                         "sentinels: data.num_sentinels)")
    inputs.check_token_shards(config, tokenizer)
    task = inputs.labeled_task(config)  # labeled tasks hold out a test split (end of run)
    if task is not None and family_of(config).classifier(config.model):
        if not config.model.num_classes:
            config.model.num_classes = len(task.labels)
        elif config.model.num_classes != len(task.labels):  # labels past the head: NaN loss
            raise ValueError(f"model.num_classes={config.model.num_classes}: the task has "
                             f"{len(task.labels)} labels: expected {len(task.labels)} (or 0 "
                             "to take the task's)")
    return tokenizer, task


def check_processes_agree(config: ml_collections.ConfigDict, workdir: str, stream: dict) -> None:
    """One line, on every process, where the processes of a multi-process run were started with
    other settings, workdirs or data content (a host whose copy of the data differs): each
    would train its rows on other data or another schedule, silently, until a collective
    they no longer share fails with no word of why. Also where the workdir is a directory of
    each host's own (a local path on a multi-host slice): process 0's checkpoints would be
    invisible to the others, which waited on them until a timeout."""
    if jax.process_count() == 1:
        return
    mine = {**keys.dotted(config.to_dict()), "workdir": workdir,
            "data content fingerprint": stream["fingerprint"],
            _LOCK: workdir_lib.lock_id(workdir)}  # (process 0 took the lock: `workdir.hold`)
    rows = _allgather_text(json.dumps(mine, sort_keys=True, default=str))
    first, *others = [json.loads(row) for row in rows]
    for process, other in enumerate(others, 1):
        if differ := sorted(k for k in set(first) | set(other)
                            if k != _LOCK and first.get(k) != other.get(k)):
            shown = "; ".join(f"{key}: process 0 {first.get(key)!r}, process {process} "
                              f"{other.get(key)!r}" for key in differ[:3])
            raise ValueError(f"the processes were started differently ({shown}): expected "
                             "every process to run the same command on the same data")
    for process, other in enumerate(others, 1):
        if other[_LOCK] != first[_LOCK]:
            raise ValueError(
                f"workdir={workdir}: process {process} does not see the {workdir_lib.LOCK} "
                "process 0 holds there (a directory of its own host's?): expected a workdir "
                "every process shares (a gs:// bucket, or a filesystem every host mounts)")


_LOCK = "the workdir's lock id"


def agreed(check, *args):
    """`check(*args)`, a start-up check of this process's own (its config, its files), run so
    that every process of a multi-process run stops if any fails: alone, the failing process
    stopped while the others waited for it in their next collective, for ever. Its error
    becomes one line, raised on every process: "process I failed its start-up checks: ...".
    Returns what `check` returns; with one process, exactly `check(*args)`."""
    if jax.process_count() == 1:
        return check(*args)
    try:
        result, failure = check(*args), ""
    except Exception as error:  # noqa: BLE001 - shared with the other processes first
        usage = isinstance(error, cli.USAGE_ERRORS)
        result, failure = None, ("usage " if usage else "runtime ") + cli.message(error)
    except BaseException:  # Ctrl-C or an exit in this process: the others are told, then it goes on
        _allgather_text("interrupted -")
        raise
    for process, text in enumerate(_allgather_text(failure)):
        if text:  # the first process that failed (each names its own values)
            kind, line = text.split(" ", 1)
            if kind == "interrupted":
                raise RuntimeError(f"process {process} was interrupted during its start-up "
                                   "checks")
            raise (ValueError if kind == "usage" else RuntimeError)(
                f"process {process} failed its start-up checks: {line}")
    return result


def _allgather_text(text: str) -> list[str]:
    """Every process's `text`, in process order (a collective: every process must call it)."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(text.encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.asarray(len(mine)))
    padded = np.zeros(max(int(lengths.max()), 1), np.uint8)  # (all empty: one byte each)
    padded[:len(mine)] = mine
    rows = multihost_utils.process_allgather(padded)
    return [bytes(row[:n]).decode() for row, n in zip(rows, lengths, strict=True)]


class Finished(Exception):
    """The workdir's run already reached config.steps: there is nothing to train."""


def finished_result(config: ml_collections.ConfigDict, workdir: str, done: Finished) -> dict:
    """What train_and_evaluate returns for a finished run (`done` says so, on process 0): its
    summary.json, and no state."""
    if jax.process_index() == 0:
        print(done)
    summary = json.loads((fileio.path(workdir) / "summary.json").read_text())
    return {"summary": summary, "state": None, "model": None, "tokenizer": None,
            "config": config}


def announce(run, mesh_summary: str, idle: Sequence[tuple[str, str]] = ()) -> None:
    """The lines a training's start prints: the run (model, size, batch, steps, workdir), a new
    data stream (also a `new_data` record), the layer types and their decode cache (where not
    all multi-head attention), what changed on resume (settings, the runtime, the data's
    path), the mesh and shardings, a labeled task's classes."""
    config, start_step, changes = run.config, run.start_step, run.manager.stream_changes
    active = ("" if run.active_params == run.num_params else
              f" ({run.active_params:,} active per token)")
    run.logger.print(f"{config.experiment}: {config.model.family}, {run.num_params:,} params"
                     f"{active}, batch {config.batch_size} x {config.seq_len}, "
                     f"steps {start_step}..{config.steps}, workdir {run.workdir}")
    for warning in unintended_settings(config, idle):
        run.logger.print(warning)
    if changes:
        run.logger.print(f"new_data: step {start_step}'s params continue on a new data stream, "
                         "from its start (" + "; ".join(changes) + ")")
        run.logger.write(start_step, "new_data", {"changes": changes})
    if lora.enabled(config):
        run.logger.print(lora.summary(config, run.state))
    if config.model.get("layer_types") or config.model.get("attention_kind", "mha") != "mha":
        run.logger.print(mixers.summary(transformer_config(config.model)))
    for change in getattr(run.manager, "compute_changes", ()):
        run.logger.print(f"changed on resume: {change} (allowed: the run continues from the "
                         "checkpoint's params and optimizer state)")
    for note in getattr(run.manager, "resume_notes", ()):  # (each says what it means itself)
        run.logger.print(f"changed on resume: {note}")
    run.logger.print(mesh_summary)
    stages = run.placement.mesh.shape.get(pipeline_parallel.STAGE_AXIS, 1)
    if schedule := pipeline_parallel.describe(stages, *run.placement.schedule):
        run.logger.print(schedule)
    if run.task is not None:
        run.logger.print(f"task {run.task.name}: {len(run.task.labels)} classes; examples per "
                         "class:\n" + run.task.balance())


def check_workdir(config: ml_collections.ConfigDict, workdir: str,
                   manager: checkpoint_manager.Manager) -> None:
    """Before anything is written: the latest checkpoint must match the config (model, data
    stream) and not be past config.steps."""
    latest = _newest_readable(manager)
    if latest is None:
        return
    saved_init = manager.saved_config(latest).get("init_from", "")
    if config.get("init_from", "") != saved_init:  # resuming a fine-tune keeps its init_from
        resume = f"init_from={saved_init!r}" if saved_init else "no init_from"
        raise ValueError(f"init_from={config.init_from!r}: {workdir} already holds checkpoint "
                         f"{latest} (trained from init_from={saved_init!r}): expected {resume} "
                         "to resume it, fresh_start=True to set it aside and start from "
                         "init_from, or another workdir")
    if latest > config.steps:
        raise ValueError(f"steps={config.steps}: {workdir} already holds step {latest}: expected "
                         f"steps >= {latest} (or fresh_start=True, or another workdir)")


def _newest_readable(manager: checkpoint_manager.Manager) -> int | None:
    """The newest step whose config and data stream read and match (`Manager.check`; a
    mismatch is an error); None if there is none. A damaged step (a truncated or missing
    file) is passed over here: `restore_latest` then falls back past it, sets it aside and
    says so."""
    for step in reversed(manager.all_steps()):
        try:
            manager.check(step)
            return step
        except checkpoint_manager.ConfigMismatch:
            raise
        except Exception:  # noqa: BLE001 - damaged files raise many types
            continue
    return None


def check_finished(config: ml_collections.ConfigDict, workdir: str, step: int) -> None:
    """Raises `Finished` when the restored `step` is the last and summary.json says so: its
    step, and the after-training evaluations run (a summary without that key predates it: a
    finished run). A signal during the last step leaves them to this rerun."""
    path = fileio.path(workdir) / "summary.json"
    summary = json.loads(path.read_text()) if step == config.steps and path.exists() else {}
    if summary.get("step") == step and not progress.unfinished(summary, step):
        raise Finished(f"{workdir} already finished at step {step} (summary.json); nothing "
                       "to do: raise steps to train further, or set fresh_start=True")


def check_splits(config: ml_collections.ConfigDict, tokenizer, placement) -> None:
    """Every split the run evaluates yields at least one batch (at every length it is
    evaluated at), so a data problem stops the run before its first step, not at its first
    evaluation."""
    splits = ["validation"] + (["test"] if inputs.has_test_split(config) else [])
    lengths = [config.seq_len] + [n for n in config.get("eval_seq_lens") or ()
                                  if evaluable(config, n, tokenizer)]
    # A mixture evaluates each source's validation split on its own.
    mixture = inputs.source_configs(config)
    for split, one, where in [("validation", c, f"data.sources {name!r}")
                              for name, c in mixture.items()] or \
            [(split, config, "data.path") for split in splits]:
        for seq_len in lengths if split == "validation" else lengths[:1]:
            at = ml_collections.ConfigDict(one.to_dict())
            at.seq_len = seq_len
            iterator = iter(inputs.get_dataset(at, tokenizer, split, num_epochs=1, shuffle=False,
                                               rows=placement.rows))
            empty = placement_lib.agreed(next(iterator, None) is None)
            getattr(iterator, "close", lambda: None)()
            if empty:
                entry = "" if seq_len == config.seq_len else " (an eval_seq_lens entry)"
                raise ValueError(
                    f"the {split} split yields no batch of {config.batch_size} x "
                    f"{seq_len}{entry}: expected more {split} text ({where}, "
                    f"data.validation_fraction={config.data.validation_fraction}) or a smaller "
                    "batch_size / seq_len")


def evaluable(config: ml_collections.ConfigDict, seq_len: int, tokenizer=None) -> bool:
    """Whether `run_eval.after_training` evaluates at `seq_len` (it skips lengths the model
    cannot run at)."""
    return skip_reason(config, seq_len, tokenizer) is None


def skip_reason(config: ml_collections.ConfigDict, seq_len: int, tokenizer=None) -> str | None:
    """Why `run_eval.after_training` skips `seq_len` (`evaluation.check_eval_seq_len`'s line),
    or None where it evaluates there."""
    try:
        evaluation.check_eval_seq_len(config, seq_len, tokenizer)
    except ValueError as error:
        return str(error)
    return None


def fresh_state(config: ml_collections.ConfigDict, init, shardings, is_main: bool):
    """(step 0's train state, the source its params came from): `init` from the seed, with
    init_from's params loaded over it (the report of what was loaded, new and dropped printed
    on process 0), and init_from with the step it read ("DIR@STEP"; None without init_from)."""
    state = init(jax.random.key(config.seed))
    if not config.get("init_from"):
        return state, None
    params, report = finetune.load_params(config.init_from, state.params, shardings.params)
    if is_main:
        print(report)
    return state.replace(params=params), report.source


def unread_settings(model: ml_collections.ConfigDict) -> list[str]:
    """`KEY=VALUE` for each model key set off its default that the family never reads
    (`Family.reads`), by dotted key.

    >>> model = default_model_config()
    >>> model.update(family="lstm", d_model=64, num_heads=8, position="none")
    >>> model.mla.kv_lora_rank = 16
    >>> unread_settings(model)
    ['mla.kv_lora_rank=16', 'num_heads=8', "position='none'"]
    """
    family = family_of(model)
    if family.reads is None:
        return []
    defaults = keys.dotted(default_model_config())
    # dotted: a group's one changed key is named (mla.kv_lora_rank=16), not the whole group
    return [f"{key}={value!r}" for key, value in keys.dotted(model).items()
            if not family.reads_key(key) and value != defaults.get(key)]


def unintended_settings(config: ml_collections.ConfigDict,
                        idle: Sequence[tuple[str, str]] = ()) -> list[str]:
    """Legal values that are surely not what was meant, each as a one-line warning the run
    prints at its start: a key that acts only with another one left off (legal in a sweep's
    shared base config, where a variant sets the other; `idle`: those its declaration says,
    `config_keys.idle_settings`), and values that defeat themselves."""
    model, out = config.model, []
    # (a ViT's only stack, its image tower, reads patch positions instead: models.vision)
    if (model.family == "vit" and model.get("patch_position") != "none"
            and model.get("position") != default_model_config().position):
        idle = [*idle, (f"model.position={model.get('position')!r}", "model.patch_position='none'")]
    out += [f"warning: {setting} has no effect without {needs}" for setting, needs in idle]
    warmup = config.optimizer.get("warmup_steps", 0)
    if warmup > config.steps:
        out.append(f"warning: optimizer.warmup_steps={warmup} > steps={config.steps}: the "
                   f"warmup is shortened to the run's {config.steps} steps: the rate rises "
                   "over all of them and never decays")
    if unread := unread_settings(config.model):
        out.append(f"warning: model.family={model.family!r} never reads {', '.join(unread)}: "
                   + ("it changes" if len(unread) == 1 else "they change") + " nothing")
    if pipeline.objective_for(config) == "mlm" and family_of(config).decoding in (
            "causal", "recompute"):  # (a legal ablation, surely not what a user meant)
        out.append(f"warning: data.objective='mlm' with model.family={model.family!r}: each "
                   "target is its own position's input token, which a causal model reads (kept "
                   "or swapped in 20% of them), with no context to its right")
    for seq_len in config.get("eval_seq_lens") or ():  # (skipped after training: say so now)
        if (reason := skip_reason(config, seq_len)) is not None:
            out.append(f"warning: the eval_seq_lens entry {seq_len} will be skipped after "
                       f"training: {reason}")
    if 0 < (cap := config.model.get("attention_softcap", 0.0)) < 1:
        out.append(f"warning: model.attention_softcap={cap}: every attention logit is squashed "
                   "into (-cap, cap), so attention is nearly uniform (Gemma 2 caps at 50)")
    return out
