"""Runs a command on one TPU VM worker, prefixing each output line with the worker (and slice)
and appending it to a log file that `python -m launch.tpu logs` tails.

    VENV/bin/python -m launch.worker --log=~/logs/NAME.log -- VENV/bin/python -m transformer.train

(VENV: the workers' venv, `launch.tpu.VENV`.) The worker id comes from TPU_WORKER_ID or the
VM's hostname (Cloud TPU names worker i "t1v-n-...-w-i"); the slice id of a multi-slice job
from MEGASCALE_SLICE_ID, which a TPU VM keeps in its `tpu-env` metadata rather than in an ssh
session's environment. The exit status is the command's (128 + N for a command killed by
signal N, as a shell reports it; 127 for a command that is not there, 126 for one that cannot
run). SIGTERM and SIGINT are passed on to the command, which keeps its output flowing until it
exits: training saves a checkpoint first. SIGHUP (the ssh session ending) is ignored, by the
command too.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys

# A Cloud TPU VM's host name: where its metadata server holds `tpu-env`.
TPU_VM_HOSTNAME = re.compile(r"t1v-n-[0-9a-f]+-w-(\d+)")


def tpu_env_value(key: str, timeout: float = 2.0) -> str | None:
    """`key` in this TPU VM's `tpu-env` metadata (lines of `KEY: 'VALUE'`), None where there is
    no such key or no metadata server answers within `timeout` seconds. The server's IP (no
    DNS lookup to hang), or $GCE_METADATA_IP as JAX and the Google clients read it; no proxy."""
    import urllib.request

    host = os.environ.get("GCE_METADATA_IP", "169.254.169.254")
    request = urllib.request.Request(
        f"http://{host}/computeMetadata/v1/instance/attributes/tpu-env",
        headers={"Metadata-Flavor": "Google"})
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except (OSError, ValueError):  # (URLError, HTTPError and timeouts are OSErrors)
        return None
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() == key:
            return value.strip().strip("'\"")
    return None


def worker_label(environ=os.environ, hostname: str | None = None) -> str:
    """"worker 3", or "slice 1 worker 3" on a multi-slice job. An empty variable counts as
    unset; MEGASCALE_SLICE_ID unset is read from the metadata, on a TPU VM alone.

    >>> worker_label({"MEGASCALE_SLICE_ID": "1"}, "t1v-n-0a1b2c3d-w-3")
    'slice 1 worker 3'
    """
    hostname = hostname or socket.gethostname()
    worker = environ.get("TPU_WORKER_ID")
    if not worker:
        match = re.search(r"-w-(\d+)$", hostname)
        worker = match[1] if match else "0"
    slice_id = environ.get("MEGASCALE_SLICE_ID") or (
        tpu_env_value("MEGASCALE_SLICE_ID") if TPU_VM_HOSTNAME.fullmatch(hostname) else None)
    return f"slice {slice_id} worker {worker}" if slice_id else f"worker {worker}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True, help="File to append the prefixed output to.")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("expected a command after --")
    log_path = os.path.expanduser(args.log)
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    prefix = f"[{worker_label()}] "
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    attached = True
    with open(log_path, "a", buffering=1) as log:
        try:
            process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, errors="replace",
                                       bufsize=1, start_new_session=True)
        except OSError as error:  # as a shell: 127 not found, 126 found but not runnable
            line = f"{prefix}launch.worker: {command[0]}: {error.strerror}: expected a " \
                "command that exists and can run\n"
            log.write(line)
            sys.stderr.write(line)
            return 127 if isinstance(error, FileNotFoundError) else 126
        # The command is in a session of its own, so a signal meant for it reaches only this
        # process: pass each one on once. A handler, not SIG_IGN: the command would inherit an
        # ignored signal. Dying here instead would break the command's output pipe, and the
        # command with it, before it saved a checkpoint.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signum, frame: process.send_signal(signum))
        for line in process.stdout:  # until the command exits (a signal interrupts no read)
            log.write(prefix + line)
            if attached:
                try:
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()
                except OSError:  # the ssh session is gone: keep logging to the file
                    attached = False
        code = process.wait()
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell


if __name__ == "__main__":
    sys.exit(main())
