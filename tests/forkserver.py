"""The suite's CLI commands (`python -m transformer.<command> ...`) and check scripts (`python
tests/mesh_check.py ...`) forked from a process that has already imported the package, instead
of each starting a fresh interpreter.

A command spends about 3 CPU-seconds importing jax, flax, orbax, grain and transformer/ before it
reads a flag: most of what a bad-input or refused-resume case costs, and half of a tiny training.
The suite starts about 200 such commands, on two cores.

The server is a child of the test worker that imports `transformer.train` (which imports nearly
all of the package and of its dependencies), torch and transformers (which the HF commands import
when they run: about 3 CPU-seconds more), starts no backend, and then, for each command, forks.
The fork runs the command as `python -m` (or `python script.py`) does (`runpy`, `__main__`, the
command's argv, cwd, sys.path[0], environment and standard streams) and exits as that process
would: its exit code, or minus the signal that killed it. What the imports printed is printed
again by each fork, first, so a command's output is the same as from a fresh process. What a
fork cannot redo is the interpreter's start: the forks of one server share its str hash seed
(PYTHONHASHSEED), so two commands compared bitwise no longer differ in set iteration order; a
run with `TRANSFORMER_TESTS_FORK=0` (below) still checks that.

A server serves the environment it started with, up to the variables read after start-up
(XLA_FLAGS: XLA reads it when the backend starts). A command in another environment (a JAX_*
flag, which jax reads at import; another PYTHONPATH) gets a new server if the current one is
idle, else a fresh interpreter. So do commands other than `python -m` and `python script.py`,
commands whose output is a pipe to read while they run, and every command under
`TRANSFORMER_TESTS_FORK=0`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

# Read after start-up: XLA_FLAGS when the backend starts (which the server never does), PATH
# when the command runs a program (the tests' fake gcloud, FAKE_GCLOUD_DIR its folder), and
# pytest's name of the running test by nothing at all.
LATE_VARIABLES = frozenset({"XLA_FLAGS", "PATH", "FAKE_GCLOUD_DIR", "PYTEST_CURRENT_TEST"})
REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The imports a fork inherits: transformer.train imports nearly all of the package; the HF
# commands (export, init_from=hf, HF tokenizers) import torch and transformers when they run.
PRELOAD = ("transformer.train", "torch", "transformers")
ENABLED = os.environ.get("TRANSFORMER_TESTS_FORK", "1") != "0"


# --- the server (runs as `python tests/forkserver.py`) ------------------------------------------


def _serve() -> dict:
    """Imports PRELOAD, then forks one child per request line on stdin; writes one JSON line per
    event to the protocol fd: {"pid": p} when a child started, {"exited": p, "code": c} when it
    ended. Returns only in a child, with its request."""
    protocol = os.dup(1)  # the client reads events here; fds 1 and 2 now capture the imports
    captured = tempfile.TemporaryFile()
    os.dup2(captured.fileno(), 1)
    os.dup2(captured.fileno(), 2)
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    # The imports' objects (about 3 x 10^5 with torch and transformers) move to the collector's
    # permanent generation: else each fork's full collections walk all of them again, and
    # touching their headers copies their pages. Measured: tests/test_cli.py 36-46 s -> 22-29 s.
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    captured.seek(0)
    printed = captured.read()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.write(protocol, b'{"ready": true}\n')
    pending, running = b"", set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the client is gone
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(protocol)
                    os.close(devnull)
                    captured.close()
                    request["printed"] = printed
                    return request
                running.add(pid)
                os.write(protocol, json.dumps({"pid": pid}).encode() + b"\n")
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                os.write(protocol, json.dumps({"exited": pid, "code": code}).encode() + b"\n")


def _redirect(fd: int, target: str | None, flags: int) -> None:
    opened = os.open(target or os.devnull, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def _run_in_child(request: dict) -> None:
    """What `python -m <module> <args>` (or `python <script> <args>`) does, in the fork: its
    streams, cwd, environment, argv and sys.path[0], then the module (script) as __main__. An
    exception or SystemExit leaves through the interpreter's own exit, as in a fresh process."""
    _redirect(0, request["stdin"], os.O_RDONLY)
    _redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if request["stderr"] == "stdout":
        os.dup2(1, 2)
    else:
        _redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.write(2, request["printed"])  # what the imports printed (a fresh process prints it too)
    import runpy

    import numpy as np

    np.random.seed()  # its global generator was seeded once, in the server
    if "script" in request:  # `python path/to/script.py`: its folder is sys.path[0]
        sys.path[0] = os.path.dirname(os.path.realpath(request["script"]))
        runpy.run_path(request["script"], run_name="__main__")
        return
    sys.path[0] = os.getcwd()
    # `python -m` runs the module's code once, as __main__: the server's import of it is dropped
    sys.modules.pop(request["module"], None)
    # alter_sys: argv[0] becomes the module's file, as under `python -m`
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


# --- the client (imported by the tests) ----------------------------------------------------------


class ForkedProcess:
    """The subset of subprocess.Popen the tests use, for a forked command."""

    def __init__(self, server: _Server, args: list[str], pid: int):
        self.server, self.args, self.pid = server, args, pid
        self.returncode: int | None = None
        self.stdout = self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it exited between the poll and the kill, as
                pass  # Popen.send_signal allows

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self, env: dict[str, str]):
        self.key = _key(env)
        self.process = subprocess.Popen(
            [sys.executable, __file__], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=REPO)
        self.codes: dict[int, int] = {}
        self.started: list[int] = []
        self.forked: set[int] = set()
        self.gone = False
        self.changed = threading.Condition()
        self.lock = threading.Lock()  # one request at a time: its pid is the next "pid" event
        ready = self.process.stdout.readline()
        if json.loads(ready or b"{}").get("ready") is not True:
            raise RuntimeError("tests/forkserver.py did not start")
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        for line in self.process.stdout:
            event = json.loads(line)
            with self.changed:
                if "pid" in event:
                    self.started.append(event["pid"])
                else:
                    self.codes[event["exited"]] = event["code"]
                self.changed.notify_all()
        with self.changed:  # the server exited: no more exit codes will come
            self.gone = True
            self.changed.notify_all()

    def start(self, request: dict) -> int:
        with self.lock, self.changed:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            self.changed.wait_for(lambda: self.started or self.gone)
            if not self.started:
                raise RuntimeError("tests/forkserver.py exited instead of forking")
            pid = self.started.pop()
            self.forked.add(pid)
            return pid

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.codes or self.gone, timeout)
            if pid not in self.codes and self.gone:
                raise RuntimeError(f"tests/forkserver.py exited before its fork {pid} did")
            return self.codes.get(pid)

    def busy(self) -> bool:
        """Whether a command it forked still runs."""
        with self.changed:
            return not self.codes.keys() >= self.forked

    def close(self) -> None:
        if not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.wait()


_server: _Server | None = None


def _server_for(env: dict[str, str]) -> _Server | None:
    """This worker's server for `env`, or None. A server serves the environment it started with,
    up to LATE_VARIABLES; where the tests' environment has changed since (a library imported by a
    test sets a variable), an idle server is replaced, a busy one leaves the command to a fresh
    interpreter."""
    global _server
    key = _key(env)
    if _server is None or _server.process.poll() is not None or (
            _server.key != key and not _server.busy()):
        if _server is not None:
            _server.close()
        _server = _Server(env)
    return _server if _server.key == key else None


def _key(env: dict[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if k not in LATE_VARIABLES)


def _path(stream, name: str) -> str | None:
    """A stream argument of Popen as a path the fork opens; raises TypeError for a pipe or fd."""
    if stream == subprocess.DEVNULL or (stream is None and name == "stdin"):
        return None  # /dev/null: the test worker's own stdin is xdist's channel
    if stream is None:
        return "inherit"  # the worker's stdout or stderr: not forked
    if stream == subprocess.STDOUT and name == "stderr":
        return "stdout"
    if hasattr(stream, "name") and isinstance(stream.name, str):
        stream.flush()
        return os.path.abspath(stream.name)
    raise TypeError(f"{name}={stream!r} cannot be forked")


def command_target(args) -> dict | None:
    """{"module": m, "args": rest} for `[sys.executable, "-m", m, *rest]`, {"script": path,
    "args": rest} for `[sys.executable, "path.py", *rest]`, else None."""
    args = [os.fspath(a) for a in args]
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-m":
        return {"module": args[2], "args": args[3:]}
    if len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py"):
        return {"script": args[1], "args": args[2:]}  # a relative path: from the command's cwd
    return None


def Popen(args, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, **kwargs):
    """subprocess.Popen, forked from the server where the command allows it (module docstring)."""
    target, env = command_target(args), dict(os.environ if env is None else env)
    streams = None
    # text/errors/encoding apply only to pipes, which are never forked; any other Popen option
    # (start_new_session, preexec_fn, ...) gets a fresh interpreter
    if ENABLED and target and not set(kwargs) - {"text", "errors", "encoding"}:
        try:
            streams = {name: _path(stream, name) for name, stream in
                       (("stdin", stdin), ("stdout", stdout), ("stderr", stderr))}
        except TypeError:
            streams = None
    if streams and "inherit" not in streams.values() and (server := _server_for(env)):
        request = {**target, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()), **streams}
        return ForkedProcess(server, list(args), server.start(request))
    return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                            **kwargs)


def run(args, *, capture_output=False, timeout=None, check=False, text=None, errors=None,
        encoding=None, env=None, cwd=None, stdin=None, stdout=None, stderr=None, **kwargs):
    """subprocess.run, forked from the server where the command allows it: its output is
    captured (in files the fork writes) or goes to files."""
    to_files = capture_output or all(
        stream not in (None, subprocess.PIPE) for stream in (stdout, stderr))
    if not (ENABLED and command_target(args) and to_files) or kwargs:
        return subprocess.run(args, capture_output=capture_output, timeout=timeout, check=check,
                              text=text, errors=errors, encoding=encoding, env=env, cwd=cwd,
                              stdin=stdin, stdout=stdout, stderr=stderr, **kwargs)
    with tempfile.TemporaryDirectory(prefix="forked-") as logs, contextlib.ExitStack() as files:
        if capture_output:
            paths = [os.path.join(logs, "stdout"), os.path.join(logs, "stderr")]
            stdout, stderr = (files.enter_context(open(path, "w")) for path in paths)
        process = Popen(args, env=env, cwd=cwd, stdin=stdin or subprocess.DEVNULL,
                        stdout=stdout, stderr=stderr)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        output = error = None
        if capture_output:
            output, error = (open(path, "rb").read() for path in paths)
            if text or errors or encoding:  # as a text-mode pipe reads it: universal newlines
                output, error = (b.decode(encoding or "utf-8", errors or "strict")
                                 .replace("\r\n", "\n").replace("\r", "\n")
                                 for b in (output, error))
    result = subprocess.CompletedProcess(list(args), code, output, error)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    _request = _serve()
    sys.argv = [_request.get("module") or _request["script"], *_request["args"]]
    _run_in_child(_request)
