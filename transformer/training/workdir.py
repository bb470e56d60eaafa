"""A training's hold on its workdir: one training at a time, and a failed start leaves no trace.

Two trainings writing one workdir destroy each other's records (metrics.jsonl rewritten under the
first's feet, checkpoints' temporary directories cleaned up mid-write), so `train` takes
WORKDIR/train.lock before it changes anything there, and holds it to the end:

- On a local or network disk: an exclusive `fcntl.flock` on the file, which names the holder
  (host, pid, start time). The kernel drops the lock when its process dies, however it dies, so a
  lock left by a dead process is taken over at once.
- In a bucket (gs://, no flock): a lease. The file names the holder and a heartbeat time that a
  thread renews every `HEARTBEAT` seconds. A lease is taken over when its heartbeat is older than
  `LEASE` seconds, or at once when it names this host and its pid is gone. Object stores have no
  compare-and-swap through epath, so two trainings started within the same second could both
  write a lease: each reads it back after `SETTLE` seconds and the one whose lease is no longer
  there stops.

Only process 0 of a multi-process run holds the lock; every process stops if it cannot. A
workdir this user cannot write (a finished run made read-only, resumed) stops the start at the
lock, in one line (`NotWritable`, exit 2).
Readers (evaluate, generate, visualize, export, harness, finetune's init_from) take no lock: they
open checkpoints read-only (transformer.training.checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import threading
import time
import uuid

import jax

from transformer.training import placement as placement_lib
from transformer.utils import fileio

LOCK = "train.lock"
HEARTBEAT = 30.0  # seconds between a lease's renewals
LEASE = 120.0  # a lease not renewed for this long belongs to a dead training
SETTLE = 2.0  # seconds before a new lease is read back


class WorkdirBusy(RuntimeError):
    """Another training holds the workdir."""


class NotWritable(ValueError):
    """The workdir (or the folder to make it in) cannot be written: bad usage, exit 2."""


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "id": uuid.uuid4().hex}


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since "
            f"{holder.get('since', '?')}")


def _pid_gone(holder: dict) -> bool:
    """Whether `holder` names a process of this host that no longer runs."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, under another user
        return False
    return False


class Lock:
    """WORKDIR/train.lock, held from `acquire` to `release` (see the module docstring)."""

    def __init__(self, workdir: str, lease: bool | None = None):
        """`lease`: use a lease file instead of flock (default: for remote workdirs)."""
        self.workdir, self.path = workdir, fileio.join(workdir, LOCK)
        self.lease = fileio.is_remote(workdir) if lease is None else lease
        self.owner = _owner()
        self.created = False
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _busy(self, holder: dict, how: str = "") -> WorkdirBusy:
        return WorkdirBusy(f"workdir={self.workdir} is in use by another training "
                           f"({_describe(holder)}{how}; {self.path}): wait for it to finish, stop "
                           "it, or use another workdir")

    def acquire(self) -> Lock:
        self.created = not fileio.path(self.workdir).exists()  # release(failed=True) removes it
        try:
            fileio.path(self.workdir).mkdir(parents=True, exist_ok=True)
            self._acquire_lease() if self.lease else self._acquire_flock()
        except OSError as error:  # a read-only workdir, folder above it, or disk
            if not isinstance(error, PermissionError) and error.errno != errno.EROFS:
                raise
            where = f": {error.filename}" if error.filename else ""
            raise NotWritable(f"workdir={self.workdir} is not writable ({error.strerror}{where}): "
                              "expected a directory this user can write (a training keeps its "
                              f"{LOCK}, checkpoints and logs there)") from error
        return self

    def _acquire_flock(self) -> None:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_json(os.pread(fd, 4096, 0))
            os.close(fd)
            raise self._busy(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(self.owner) + "\n").encode(), 0)
        self._fd = fd

    def _read_lease(self) -> dict:
        path = fileio.path(self.path)
        try:
            return _read_json(path.read_bytes())
        except FileNotFoundError:
            return {}

    def _write_lease(self) -> None:
        fileio.write_atomic(self.path, json.dumps({**self.owner, "heartbeat": time.time()}))

    def _acquire_lease(self) -> None:
        holder = self._read_lease()
        try:
            age = time.time() - float(holder.get("heartbeat", 0.0))
        except (TypeError, ValueError):  # a damaged lease: as good as none
            age = float("inf")
        if holder and age < LEASE and not _pid_gone(holder):
            raise self._busy(holder, f", renewed {age:.0f} s ago")
        self._write_lease()
        time.sleep(SETTLE)
        holder = self._read_lease()
        if holder.get("id") != self.owner["id"]:  # another training wrote its lease after ours
            raise self._busy(holder, ", started at the same time")
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name="transformer.training.workdir.lease")
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            with contextlib.suppress(OSError):  # a missed renewal: the next one may pass
                self._write_lease()

    def release(self, failed: bool = False) -> None:
        """Gives the workdir back (the lock file stays: unlinking a flock'ed file races with a
        training opening it). `failed`: the start or the run failed, so a workdir that this run
        created is removed if it holds nothing to keep: no checkpoint (also none set aside) and
        no logged metrics. A run stopped at step 1 leaves no workdir that looks like a run but
        cannot be resumed; one that logged steps keeps them to look at."""
        if failed and self.created and not fileio.is_remote(self.workdir) and \
                not _holds_results(self.workdir):
            shutil.rmtree(fileio.path(self.workdir), ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if self._read_lease().get("id") == self.owner["id"]:
                with contextlib.suppress(OSError):
                    fileio.path(self.path).unlink()


def lock_id(workdir: str) -> str:
    """The id of the training holding WORKDIR/train.lock, as this process reads it ("" where it
    finds none): every process of a run must read process 0's (`startup.
    check_processes_agree`), or the workdir is not one directory they share."""
    try:
        return str(_read_json(fileio.path(fileio.join(workdir, LOCK)).read_bytes()).get("id", ""))
    except OSError:
        return ""


def _holds_results(workdir: str) -> bool:
    """Whether `workdir` holds a checkpoint (checkpoints/, checkpoints.nonfinite/, ...) or a
    logged metric."""
    try:
        names = os.listdir(workdir)
        metrics = os.path.join(workdir, "metrics.jsonl")
        return any(name.startswith("checkpoints") for name in names) or \
            os.path.exists(metrics) and os.path.getsize(metrics) > 0
    except OSError:
        return True  # unreadable: keep it


def _read_json(data: bytes) -> dict:
    try:
        value = json.loads(data or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def hold(workdir: str) -> Lock:
    """WORKDIR/train.lock, taken by process 0 (every process raises if it could not be taken),
    and the workdir, made on every process."""
    lock, busy = Lock(workdir), None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except (WorkdirBusy, NotWritable) as error:
            busy = error
    if placement_lib.agreed(busy is not None):
        raise busy or WorkdirBusy(f"workdir={workdir} could not be locked by process 0 (in use "
                                  "by another training, or not writable)")
    fileio.path(workdir).mkdir(parents=True, exist_ok=True)
    return lock
