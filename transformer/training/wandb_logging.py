"""Weights & Biases (config.wandb, the optional `wandb` extra): a run's train and evaluation
records (the same as metrics.jsonl's), its resolved config and, at the end, its summary.json.

W&B is on when `wandb.project` is set (and its mode is not "disabled"), on process 0 only. The
mode is `wandb.mode`, else W&B's own setting: the WANDB_MODE environment variable, else online.
The run's W&B id is kept in WORKDIR/wandb.json, so a resumed training continues the same W&B
run. Online, a resumed run first sends the records metrics.jsonl kept that W&B's server lacks
(those a killed start had queued but not sent); offline, W&B cannot tell what the earlier
starts' files hold, so only new records are sent. Offline runs write under WORKDIR/wandb/
(upload them later with `wandb sync`). A sweep's
runs carry their variant (`wandb.variant`, set by transformer.sweep) and seed as config fields
and are grouped by variant.

W&B never stops or slows the training: its calls run in a background thread fed by a queue
(`wandb.init` may wait on the network), and the first failure (no network, a bad key, a
missing login) prints one warning line, after which the run goes on without W&B.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import sys
import threading
import uuid

import jax

from transformer.utils import fileio

MODES = ("online", "offline", "disabled")
# WANDB_MODE's other names for them (wandb.sdk's settings accept both)
_ALIASES = {"dryrun": "offline", "run": "online"}
ID_FILE = "wandb.json"  # {"id": ...}: the W&B run this workdir logs to
# After training, how long the end of the run (its last records, wandb.finish) may take.
FINISH_TIMEOUT = 120.0


def check(config) -> None:
    """One-line errors for config.wandb before anything runs: a W&B run needs a project, and
    the wandb package when it is on."""
    settings = config.get("wandb")
    if settings is None or mode(settings) == "disabled":
        return
    if settings.mode == "offline" and not settings.project:
        raise ValueError("wandb.mode='offline' with wandb.project='': expected a project name "
                         "(W&B logs only when wandb.project is set)")
    if mode(settings) not in MODES:
        raise ValueError(f"the environment's WANDB_MODE={mode(settings)!r}: expected one of "
                         f"{MODES}, or a wandb.mode")
    if settings.project and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"wandb.project={settings.project!r}: expected the wandb package "
                         "(pip install -e \".[wandb]\"), or wandb.project=''")


def mode(settings) -> str:
    """The run's W&B mode: `settings.mode` (config.wandb), else the WANDB_MODE environment
    variable W&B itself reads, else "online"."""
    chosen = settings.get("mode") or os.environ.get("WANDB_MODE", "").strip() or "online"
    return _ALIASES.get(chosen, chosen)


def enabled(config) -> bool:
    settings = config.get("wandb")
    return bool(settings and settings.project and mode(settings) != "disabled")


def run_id(workdir: str) -> str:
    """The workdir's W&B run id: the one saved in WORKDIR/wandb.json, else a new one (saved)."""
    path = fileio.path(workdir) / ID_FILE
    if path.exists():
        try:
            return json.loads(path.read_text())["id"]
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: a new run
    new = uuid.uuid4().hex[:16]
    fileio.write_atomic(str(path), json.dumps({"id": new}))
    return new


def init_arguments(config, workdir: str) -> dict:
    """wandb.init's arguments for this run (resuming the workdir's W&B run)."""
    settings = config.wandb
    fields = config.to_dict()
    if settings.variant:  # a sweep's run: grouped by variant, its seed beside it
        fields.update(variant=settings.variant)
    return dict(project=settings.project, entity=settings.entity or None,
                name=settings.name or config.experiment, mode=mode(settings),
                id=run_id(workdir), resume="allow", config=fields,
                group=settings.variant or None,
                dir=None if fileio.is_remote(workdir) else workdir)


class Sink:
    """The W&B side of metrics.MetricsLogger: `log` (one record), `summary` (summary.json's
    content) and `finish`; none of them waits on W&B."""

    def __init__(self, arguments: dict, warn=None, kept=()):
        """`kept`: metrics.jsonl's records from earlier starts (sent online where the W&B run
        lacks them)."""
        self.arguments = arguments
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self.queue: queue.Queue = queue.Queue()
        self.failed = False
        self.run = None
        self.thread = threading.Thread(target=self._work, name="wandb", daemon=True)
        self.thread.start()
        if kept:
            self.queue.put(("kept", list(kept)))

    def log(self, step: int, split: str, metrics: dict) -> None:
        values = _values(split, metrics)
        if values and not self.failed:
            self.queue.put(("log", step, values))

    def summary(self, summary: dict) -> None:
        if not self.failed:
            self.queue.put(("summary", summary))

    def finish(self, exit_code: int = 0, timeout: float = FINISH_TIMEOUT) -> None:
        self.queue.put(("finish", exit_code))
        self.thread.join(timeout)
        if self.thread.is_alive() and not self.failed:
            self.warn(f"warning: W&B: the run's end did not complete within {timeout:.0f} s; "
                      "what was not sent stays in its local files (wandb sync)")

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if not self.failed:
                try:
                    self._apply(item)
                except Exception as error:  # noqa: BLE001 - W&B never stops the training
                    self.failed = True
                    message = " ".join(str(error).split()) or type(error).__name__
                    self.warn(f"warning: W&B: {message} (training goes on without W&B)")
            if item[0] == "finish":
                return

    def _apply(self, item) -> None:
        if self.run is None:
            import wandb

            self.run = wandb.init(**self.arguments, settings=wandb.Settings(
                silent=True, console="off"))
        kind, *args = item
        if kind == "kept" and not self.run.offline:  # (offline, W&B's run.step is always 0)
            first = self.run.step  # online: the step after the last the server holds
            for record in args[0]:
                values = _values(record["split"], {k: v for k, v in record.items()
                                                   if k not in ("step", "split", "elapsed")})
                if values and record["step"] >= first:
                    self.run.log(values, step=record["step"])
        elif kind == "log":
            step, values = args
            if step >= self.run.step:  # a resumed W&B run already holds the earlier steps
                self.run.log(values, step=step)
        elif kind == "summary":
            self.run.summary.update(json.loads(json.dumps(args[0], default=str)))
        elif kind == "finish":
            self.run.finish(exit_code=args[0])


def _values(split: str, metrics: dict) -> dict:
    """A record's numbers as W&B keys ("train/loss")."""
    return {f"{split}/{name}": value for name, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def sink(config, workdir: str, logger) -> Sink | None:
    """The run's W&B sink on process 0 when config.wandb is on (else None); prints where it
    logs."""
    if not enabled(config) or jax.process_index() != 0:
        return None
    arguments = init_arguments(config, workdir)
    where = f" (files in {arguments['dir']}/wandb)" if arguments["dir"] else ""
    logger.print(f"W&B: {mode(config.wandb)} run {arguments['id']} in project "
                 f"{config.wandb.project}{where}")
    return Sink(arguments, warn=lambda line: print(logger.prefix + line, file=sys.stderr,
                                                   flush=True), kept=logger.kept)
