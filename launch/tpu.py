"""Cloud TPU VMs: create a slice, ship this working tree to every worker, train on all of them,
follow the logs, stop, delete; and recreate + resume after preemption.

    python -m launch.tpu create|run|status|logs|stop|delete --name=NAME --project=P --zone=Z \
        --accelerator=v5p-32 [--spot | --reserved] [--num_slices=N] [--dry_run] \
        [--restart_on_preemption] [--skip_aot] -- --config=experiments/gpt_tiny.py \
        --workdir=gs://BUCKET/run [--config.KEY=VALUE ...]

Everything after `--` is passed to `python -m transformer.train` on every worker, parsed
first as it parses it. Before any machine is created the run is validated (accelerator type,
mesh sizes against the chip count, global batch against the data-parallel size and the host
count, a workdir outside the shipped tree: gs:// for multi-host runs and
--restart_on_preemption, a git working tree holding the config), then, unless --skip_aot, the
train step is compiled ahead of time for the slice (`launch.aot`) to check that it fits in HBM,
and the tree is packed. `--dry_run` prints every command, in order, and runs none. Spot
capacity and multi-slice jobs go through queued resources. `run` exits with training's status:
143 when `stop` (SIGTERM) stopped it, its checkpoint saved.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from launch import accelerators

COMMANDS = ("create", "run", "status", "logs", "stop", "delete")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_DIR = "~/transformer"
# The workers' Python: the TPU VM images' python3 is 3.10 (Ubuntu 22.04) and the project needs
# >= 3.11, so each worker trains in a venv of Python 3.12 made by uv (a Python uv fetches where
# the image has none). Outside REMOTE_DIR, which every ship replaces, so it is made once. Both
# go unquoted into the remote commands: the workers' shell expands `~`.
VENV = "~/.venvs/transformer"
PYTHON = f"{VENV}/bin/python"
PYTHON_VERSION = "3.12"
# Slice states after which the slice is gone (preempted or failed) and must be recreated.
GONE = {"PREEMPTED", "SUSPENDED", "SUSPENDING", "FAILED", "TERMINATED", "NOT_FOUND",
        "DELETING", "STOPPED"}
READY = {"READY", "ACTIVE"}
# Training's exit status when a signal stopped it, its checkpoint saved: 128 + SIGTERM / SIGINT.
STOPPED = {128 + signal.SIGTERM, 128 + signal.SIGINT}
# TPU VM, queued resource and Kubernetes names (RFC 1035 labels).
NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class Launch:
    """What to launch where: the slice settings and the train command's arguments."""

    name: str
    project: str
    zone: str
    accelerator: accelerators.Accelerator
    runtime_version: str
    spot: bool = False
    reserved: bool = False
    num_slices: int = 1
    train_args: tuple[str, ...] = ()

    @property
    def queued(self) -> bool:
        """Spot and multi-slice capacity is requested as a queued resource."""
        return self.spot or self.num_slices > 1

    @property
    def nodes(self) -> list[str]:
        """The TPU VM node names: NAME, or NAME-0..N-1 for N slices."""
        return [self.name] if self.num_slices == 1 else \
            [f"{self.name}-{i}" for i in range(self.num_slices)]

    @property
    def processes(self) -> int:
        return self.accelerator.hosts * self.num_slices

    @property
    def log_file(self) -> str:
        return f"~/logs/{self.name}.log"

    def where(self) -> list[str]:
        return [f"--zone={self.zone}", f"--project={self.project}"]


def validate(launch: Launch) -> None:
    """One-line errors for a run that cannot work on this slice, before anything is created."""
    import ml_collections  # noqa: F401 (the config machinery below needs it)

    from transformer import configs
    from transformer.parallel import sharding

    if launch.num_slices < 1:
        raise ValueError(f"num_slices={launch.num_slices}: expected >= 1")
    values = train_flags(launch.train_args)
    config, workdir = values.config, values.workdir
    if launch.processes > 1 and not (workdir or "").startswith("gs://"):
        raise ValueError(f"workdir={workdir!r}: a run on {launch.processes} hosts needs a "
                         "workdir every host sees: expected gs://BUCKET/PATH")
    chips = launch.accelerator.chips * launch.num_slices
    mesh = sharding.mesh_shape(config.mesh, chips)
    try:
        sharding.check_batch_split(config.batch_size, mesh,
                                   accumulation=config.optimizer.grad_accumulation_steps,
                                   processes=launch.processes, num_slices=launch.num_slices)
        configs.check_sequence_split(config, mesh)
        configs.check_pipeline(config, mesh)
        # then everything transformer.train checks, but the files the run reads on the slice
        configs.validate_config(config, chips, launch.processes, files=False,
                                this_backend=False)
    except ValueError as error:
        hosts = f"{launch.processes} host" + ("s" if launch.processes > 1 else "")
        raise ValueError(f"{error}; on {launch.num_slices} x {launch.accelerator.name} "
                         f"({hosts})") from None


def check_restartable(launch: Launch, restarter: str) -> None:
    """One line where a restart after a preemption, which reruns the same train command, would
    not resume: `fresh_start` would set the run aside and start over at every restart."""
    if train_flags(launch.train_args).config.get("fresh_start"):
        raise ValueError(f"--config.fresh_start=True with {restarter}: each restart after a "
                         "preemption reruns the same command and would start over from step "
                         "0: expected a launch without it (start over once by hand, or use "
                         "another workdir)")


def validate_run(launch: Launch, restart_on_preemption: bool) -> None:
    """`validate`, then what `run` needs besides: a workdir outside the shipped tree (a gs://
    one to resume on a recreated slice) and a working tree to ship that holds the config."""
    validate(launch)
    values = train_flags(launch.train_args)
    workdir = values.workdir or ""
    shown = f"--workdir={workdir}" if workdir else "no --workdir (runs/<experiment>)"
    if restart_on_preemption:
        check_restartable(launch, "--restart_on_preemption")
    if restart_on_preemption and not workdir.startswith("gs://"):
        raise ValueError(f"{shown} with --restart_on_preemption: a recreated slice starts "
                         "with empty disks, without the checkpoints to resume from: expected "
                         "--workdir=gs://BUCKET/PATH")
    if in_remote_dir(workdir):
        raise ValueError(f"{shown}: a workdir inside {REMOTE_DIR}, which every ship of the "
                         "code replaces, loses its checkpoints: expected --workdir=gs://"
                         "BUCKET/PATH")
    check_config_in_tree(values, "that run ships")


def check_config_in_tree(values, holder: str) -> None:
    """The parsed --config's file as a path relative to this checkout, of the files `run`
    ships, as the workers (or a GKE image, working there) read it; `holder`: who has the
    tree."""
    files = shipped_files()
    config_file = config_flags_filename(values)
    relative = os.path.relpath(os.path.abspath(config_file), REPO)  # as the workers read it
    if os.path.isabs(config_file) or relative != os.path.normpath(config_file) or \
            relative not in set(files):
        raise ValueError(f"--config={config_file}: not in the working tree {holder} "
                         f"({REPO}: tracked or untracked files, not ignored ones): expected "
                         "the config to be a file of the shipped tree, as a path relative "
                         "to it, e.g. experiments/gpt_tiny.py")


def in_remote_dir(workdir: str) -> bool:
    """Whether a workdir lies in REMOTE_DIR on the workers, which every ship deletes and unpacks
    anew: a relative one (the train command runs there), or one in the folder REMOTE_DIR names
    right under a home directory (~/, ~USER/, /home/USER/ or /root/ + transformer/...)."""
    if workdir.startswith("gs://"):
        return False
    if not workdir.startswith(("/", "~")):
        return True
    parts = [part for part in os.path.normpath(workdir).split("/") if part]
    home = 2 if parts[:1] == ["home"] else \
        1 if parts[:1] == ["root"] or workdir.startswith("~") else None
    return home is not None and parts[home:home + 1] == [REMOTE_DIR.removeprefix("~/")]


def config_flags_filename(values) -> str:
    """The experiment file of a parsed --config (without its `:ARG`)."""
    from ml_collections import config_flags

    return config_flags.get_config_filename(values["config"])


def shipped_files() -> list[str]:
    """The files `run` ships: the working tree's tracked and untracked files, not ignored ones,
    as they are now (a tracked file deleted but not committed is left out)."""
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    try:
        result = subprocess.run(command, cwd=REPO, capture_output=True)
    except OSError as error:  # no git
        result = subprocess.CompletedProcess(command, 1, b"", os.fsencode(str(error)))
    if result.returncode:
        why = (os.fsdecode(result.stderr).strip().splitlines() or ["git failed"])[-1]
        raise ValueError(f"{REPO}: cannot list the working tree to ship ({why}): expected a "
                         "git checkout")
    names = dict.fromkeys(os.fsdecode(name) for name in result.stdout.split(b"\0") if name)
    return [name for name in names if os.path.lexists(os.path.join(REPO, name))]


def train_flags(args: Sequence[str]):
    """The train arguments parsed as transformer.train parses them, with its own flag
    definitions in a FlagValues of their own: one line for an unknown flag or key, a stray
    argument or a bad value."""
    from absl import flags

    from transformer import train
    from transformer.utils import cli

    # ml_collections reads the --config.KEY overrides from a list of arguments: these ones
    argv = ["transformer.train", *args]
    if not any(re.match(r"--?config(=|$)", arg) for arg in args):
        raise ValueError("expected the train arguments after -- to include --config=FILE")
    values = flags.FlagValues()
    try:
        train._define_flags(values, argv)
        rest = values(argv)
        if len(rest) > 1:
            raise ValueError(f"unexpected arguments {rest[1:]}: expected only flags "
                             "(--name=value)")
        cli.check_config_files(values)  # as transformer.train: a file that failed to load
    except (flags.Error, ValueError, KeyError, AttributeError, TypeError, OSError) as error:
        raise ValueError(f"train arguments: {cli.message(error)}") from None
    return values


def train_arguments(args: Sequence[str]) -> tuple[str, ...]:
    """The train arguments checked (`train_flags`), each flag written --NAME=VALUE (absl also
    takes `-NAME=VALUE` and `--NAME VALUE`): what the workers, the JobSet and launch.aot get
    (launch.aot takes the `--config` ones alone)."""
    values = train_flags(args)
    joined, i = [], 0
    while i < len(args):
        match = re.fullmatch(r"--?([\w.]+)(=.*)?", args[i], re.DOTALL)
        if not (match and match[1] in values):  # (e.g. --noFLAG: kept as it is)
            joined.append(args[i])
        elif match[2] is not None or values[match[1]].boolean or i + 1 == len(args):
            joined.append(f"--{match[1]}{match[2] or ''}")
        else:
            joined.append(f"--{match[1]}={args[i + 1]}")
            i += 1
        i += 1
    return tuple(joined)


# --- the gcloud commands --------------------------------------------------------------------


def _gcloud_tpus(*args: str) -> list[str]:
    return ["gcloud", "compute", "tpus", *args]


def create_commands(launch: Launch) -> list[list[str]]:
    a = launch.accelerator
    if launch.queued:
        command = _gcloud_tpus("queued-resources", "create", launch.name, *launch.where(),
                               f"--accelerator-type={a.name}",
                               f"--runtime-version={launch.runtime_version}")
        command += [f"--node-count={launch.num_slices}", f"--node-prefix={launch.name}"] \
            if launch.num_slices > 1 else [f"--node-id={launch.name}"]
        command += ["--spot"] if launch.spot else ["--reserved"] if launch.reserved else []
        return [command]
    command = _gcloud_tpus("tpu-vm", "create", launch.name, *launch.where(),
                           f"--accelerator-type={a.name}", f"--version={launch.runtime_version}")
    return [command + (["--reserved"] if launch.reserved else [])]


def state_command(launch: Launch) -> list[str]:
    if launch.queued:
        return _gcloud_tpus("queued-resources", "describe", launch.name, *launch.where(),
                            "--format=value(state.state)")
    return _gcloud_tpus("tpu-vm", "describe", launch.name, *launch.where(),
                        "--format=value(state)")


def delete_commands(launch: Launch) -> list[list[str]]:
    if launch.queued:
        return [_gcloud_tpus("queued-resources", "delete", launch.name, *launch.where(),
                             "--force", "--quiet")]
    return [_gcloud_tpus("tpu-vm", "delete", launch.name, *launch.where(), "--quiet")]


def ssh_commands(launch: Launch, remote: str) -> list[list[str]]:
    """`remote` run on every worker of every slice (one ssh per slice, run concurrently)."""
    return [_gcloud_tpus("tpu-vm", "ssh", node, *launch.where(), "--worker=all",
                         f"--command={remote}") for node in launch.nodes]


def archive_path(launch: Launch) -> str:
    return os.path.join(".launch", f"{launch.name}.tar.gz")


def file_list_path(launch: Launch) -> str:
    return os.path.join(".launch", f"{launch.name}.files")


# What each worker installs: validation runs here, where the test extras bring transformers and
# wandb, so a config needing them passed and then failed on every worker (probe p5, stop 110).
WORKER_EXTRAS = "tpu,chat,wandb"


def ship_commands(launch: Launch) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """(pack, copies, installs): pack the working tree (`shipped_files`, listed in
    `file_list_path` by `pack`), copy it to every worker of each slice, unpack it there and
    install the project with the extras a run may need there: tpu, chat (transformers:
    init_from="hf:DIR", SFT's chat template) and wandb (config.wandb)."""
    archive = archive_path(launch)
    pack = ["tar", "-czf", archive, "--null", f"--files-from={file_list_path(launch)}"]
    copies = [_gcloud_tpus("tpu-vm", "scp", archive, f"{node}:~/transformer.tar.gz",
                           *launch.where(), "--worker=all") for node in launch.nodes]
    install = (f"rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && "
               f"tar -xzf ~/transformer.tar.gz -C {REMOTE_DIR} && cd {REMOTE_DIR} && "
               f"{venv_remote()} && python3 -m uv pip install -q --python {PYTHON} "
               f"-e '.[{WORKER_EXTRAS}]'")
    return pack, copies, ssh_commands(launch, install)


def venv_remote() -> str:
    """The shell command that installs uv for the image's python3 (`python3 -m uv`: ~/.local/bin
    need not be on PATH) and makes the venv of Python PYTHON_VERSION at VENV, unless a ship
    before made it (`--clear`: what an interrupted one left)."""
    return (f"python3 -m pip install -q --user uv && (test -x {PYTHON} || "
            f"python3 -m uv venv -q --clear --python {PYTHON_VERSION} {VENV})")


def train_remote(launch: Launch) -> str:
    """The shell command each worker runs: train under launch.worker (prefixed, logged), both
    with the venv's Python."""
    train = ["-m", "transformer.train", *launch.train_args]
    if launch.processes > 1:
        train.insert(2, "--jax_distributed")
    # PYTHON unquoted (shlex would quote the `~`): the worker's shell expands it, for both
    return (f"cd {REMOTE_DIR} && {PYTHON} -m launch.worker --log={launch.log_file} -- "
            f"{PYTHON} " + shlex.join(train))


def run_commands(launch: Launch) -> list[list[str]]:
    return ssh_commands(launch, train_remote(launch))


def logs_commands(launch: Launch) -> list[list[str]]:
    return ssh_commands(launch, f"tail -n 200 -F {launch.log_file}")


def stop_commands(launch: Launch) -> list[list[str]]:
    """SIGTERM to training on every worker: it saves a checkpoint and exits (status 143).
    Anchored at the command's start, the pattern matches training alone: not the launch.worker
    that runs it (whose command line names it too), nor the shell running pkill. Training's
    command line starts with PYTHON as the shell expanded it: `~` is $HOME."""
    pattern = "^" + PYTHON.replace("~", "$HOME", 1).replace(".", "[.]") + \
        " -m transformer[.]train "
    return ssh_commands(launch, f'pkill -TERM -f "{pattern}" || true')


def aot_command(launch: Launch) -> list[str]:
    """launch.aot for the slice, on the config the train arguments give as transformer.train
    reads them: its file and each override however it was given (`--config.KEY=VALUE`,
    `--noconfig.KEY`, a `--flagfile`'s), as --config.KEY=VALUE."""
    from ml_collections import config_flags

    from transformer.sweeps.definition import flag_value

    flag = train_flags(launch.train_args)["config"]
    overrides = config_flags.get_override_values(flag)  # {dotted key: value}
    return [sys.executable, "-m", "launch.aot", f"--topology={launch.accelerator.name}",
            f"--num_slices={launch.num_slices}",
            f"--config={config_flags.get_config_filename(flag)}",
            *(f"--config.{key}={flag_value(value)}" for key, value in overrides.items())]


# --- running them ---------------------------------------------------------------------------


class Runner:
    """Runs (or, dry, only prints) commands; `run_many` runs one command per slice at once."""

    def __init__(self, dry_run: bool, out=sys.stdout):
        self.dry_run, self.out = dry_run, out

    def show(self, command: Sequence[str]) -> None:
        print("$ " + shlex.join(command), file=self.out, flush=True)

    def run(self, command: Sequence[str], check: bool = True) -> int:
        self.show(command)
        if self.dry_run:
            return 0
        code = subprocess.call(list(command), cwd=REPO)
        if check and code:
            raise RuntimeError(f"command failed with exit status {code}: {shlex.join(command)}")
        return code

    def run_many(self, commands: Sequence[Sequence[str]], check: bool = True) -> int:
        for command in commands:
            self.show(command)
        if self.dry_run:
            return 0
        processes = [subprocess.Popen(list(c), cwd=REPO) for c in commands]
        codes = [p.wait() for p in processes]
        code = next((c for c in codes if c), 0)
        if check and code:
            raise RuntimeError(f"a command failed with exit status {code}: "
                               f"{shlex.join(commands[codes.index(code)])}")
        return code

    def output(self, command: Sequence[str]) -> str:
        """The command's output; "NOT_FOUND" where it fails saying so (gcloud describing a
        resource that does not exist), an error with its message where it fails otherwise."""
        self.show(command)
        if self.dry_run:  # a made-up state, for a dry run to go on (`status` prints none)
            return "READY"
        result = subprocess.run(list(command), cwd=REPO, capture_output=True, text=True)
        if result.returncode and "NOT_FOUND" in result.stderr:
            return "NOT_FOUND"
        if result.returncode:
            why = " ".join(result.stderr.split()) or "no message"
            raise RuntimeError(f"command failed with exit status {result.returncode}: "
                               f"{shlex.join(command)}: {why}")
        return result.stdout.strip()


def slice_state(launch: Launch, runner: Runner) -> str:
    """The slice's state, e.g. ACTIVE; NOT_FOUND if there is none (UNKNOWN: no state yet)."""
    return (runner.output(state_command(launch)).split() or ["UNKNOWN"])[0].upper()


def state_after_failure(launch: Launch, runner: Runner, poll_seconds: float,
                        reads: int = 4) -> str:
    """The slice's state after training failed: read up to `reads` times, 10 s apart at most,
    while it still looks READY (a preempted slice can take a moment to say so)."""
    state = slice_state(launch, runner)
    for _ in range(reads - 1):
        if state not in READY:
            break
        time.sleep(min(poll_seconds, 10.0))
        state = slice_state(launch, runner)
    return state


def wait_until_ready(launch: Launch, runner: Runner, poll_seconds: float,
                     timeout_seconds: float) -> None:
    start = time.monotonic()
    while True:
        state = slice_state(launch, runner)
        if state in READY:
            return
        if state in GONE - {"NOT_FOUND"} or time.monotonic() - start > timeout_seconds:
            raise RuntimeError(f"slice {launch.name} is {state}, not ready after "
                               f"{time.monotonic() - start:.0f} s")
        print(f"slice {launch.name}: {state}, waiting", file=runner.out, flush=True)
        time.sleep(poll_seconds)


def create(launch: Launch, runner: Runner, poll_seconds: float = 30.0,
           timeout_seconds: float = 6 * 3600) -> None:
    for command in create_commands(launch):
        runner.run(command)
    if launch.queued:  # queued resources are granted later: wait for ACTIVE
        wait_until_ready(launch, runner, poll_seconds, timeout_seconds)


def ensure_slice(launch: Launch, runner: Runner, poll_seconds: float = 30.0) -> None:
    """A ready slice: kept if ready, waited for while provisioning, created if absent, and
    deleted then created if preempted or failed."""
    state = "NOT_FOUND" if runner.dry_run else slice_state(launch, runner)
    if state in READY:
        return
    if state in GONE and state != "NOT_FOUND":
        for command in delete_commands(launch):
            runner.run(command, check=False)
    if state in GONE:
        create(launch, runner, poll_seconds)
    else:
        wait_until_ready(launch, runner, poll_seconds, 6 * 3600)


def pack(launch: Launch, runner: Runner) -> None:
    """Packs the working tree as it is now (`shipped_files`) into `archive_path`."""
    files = shipped_files()
    if not runner.dry_run:
        os.makedirs(os.path.join(REPO, ".launch"), exist_ok=True)
        with open(os.path.join(REPO, file_list_path(launch)), "wb") as f:
            f.write(b"".join(os.fsencode(name) + b"\0" for name in files))
    runner.run(ship_commands(launch)[0])


def copy_and_install(launch: Launch, runner: Runner) -> int:
    """Copies the packed code to every worker and installs it there: the first failure's exit
    status, 0 for none (a slice preempted meanwhile fails them: `run` reads its state)."""
    _, copies, installs = ship_commands(launch)
    return runner.run_many(copies, check=False) or runner.run_many(installs, check=False)


def run(launch: Launch, runner: Runner, *, restart_on_preemption: bool, max_restarts: int,
        poll_seconds: float = 30.0) -> int:
    """Pack the code -> slice -> ship -> train on all workers at once. With
    restart_on_preemption, a run whose slice was preempted or deleted recreates the slice and
    reruns the same command: training resumes from the latest complete checkpoint in the
    workdir. Training stopped by a signal on a live slice (`stop`) is left stopped."""
    pack(launch, runner)  # first: a tree that cannot be packed leaves nothing created
    restarts = 0
    while True:
        ensure_slice(launch, runner, poll_seconds)
        code = copy_and_install(launch, runner)  # (a spot slice may go during the install)
        step = "shipping the code" if code else "training"
        code = code or runner.run_many(run_commands(launch), check=False)
        if code == 0:
            print(f"{launch.name}: " + ("dry run: the commands above, nothing was run"
                                        if runner.dry_run else "training finished"),
                  file=runner.out, flush=True)
            return 0
        state = state_after_failure(launch, runner, poll_seconds)
        if state not in GONE and code in STOPPED and step == "training":
            print(f"{launch.name}: training was stopped by {signal.Signals(code - 128).name} "
                  "(e.g. `python -m launch.tpu stop`), its checkpoint saved; the slice is "
                  f"{state}: run the same command again to resume", file=runner.out, flush=True)
            return code
        if state not in GONE:
            print(f"{launch.name}: {step} failed (exit status {code}) on a {state} slice; "
                  f"see `python -m launch.tpu logs --name={launch.name} ...`", file=runner.out,
                  flush=True)
            return code
        if not restart_on_preemption or restarts >= max_restarts:
            print(f"{launch.name}: the slice is {state}" + (
                f" after {restarts} restarts" if restart_on_preemption else
                " (pass --restart_on_preemption to recreate it and resume)"),
                file=runner.out, flush=True)
            return code
        restarts += 1
        print(f"{launch.name}: the slice is {state}: recreating it and resuming (restart "
              f"{restarts}/{max_restarts})", file=runner.out, flush=True)


# --- command line ---------------------------------------------------------------------------


def check_name(name: str | None, longest: str | None = None) -> None:
    """A TPU VM, queued resource or JobSet name (it also goes unquoted into shell commands);
    `longest`, the longest name made from it (a slice's node NAME-7, a pod's host name), must
    fit in 63 characters too: the cloud would refuse it only after the compile and the upload."""
    if not name:
        raise ValueError("--name: expected a value")
    if not NAME.fullmatch(name):
        raise ValueError(f"--name={name}: expected lowercase letters, digits and hyphens, "
                         "starting with a letter, not ending with a hyphen, at most 63 "
                         "characters (a TPU and Kubernetes name)")
    if longest and len(longest) > 63:
        raise ValueError(f"--name={name}: the name {longest} made from it has {len(longest)} "
                         f"characters: expected a name of at most {63 - len(longest) + len(name)}"
                         " (TPU and Kubernetes names end at 63)")


def make_launch(flags_values, train_args: Sequence[str]) -> Launch:
    slices = flags_values.num_slices
    check_name(flags_values.name, f"{flags_values.name}-{slices - 1}" if slices > 1 else None)
    for name in ("project", "zone"):
        if not getattr(flags_values, name):
            raise ValueError(f"--{name}: expected a value")
    for name, least in (("num_slices", 1), ("max_restarts", 0), ("poll_seconds", 0)):
        if getattr(flags_values, name) < least:
            raise ValueError(f"--{name}={getattr(flags_values, name)}: expected a number >= "
                             f"{least}")
    if flags_values.spot and flags_values.reserved:  # (create would drop --reserved)
        raise ValueError("--spot and --reserved: expected at most one")
    accelerator = accelerators.parse(flags_values.accelerator)
    return Launch(flags_values.name, flags_values.project, flags_values.zone, accelerator,
                  flags_values.runtime_version or accelerator.generation.runtime_version,
                  flags_values.spot, flags_values.reserved, flags_values.num_slices,
                  tuple(train_args))


def main(argv: Sequence[str]) -> int:
    from absl import flags

    FLAGS = flags.FLAGS
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise ValueError(f"command {argv[1:2]}: expected one of {', '.join(COMMANDS)}")
    command, train_args = argv[1], list(argv[2:])
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if train_args and command not in ("create", "run"):
        raise ValueError(f"{command}: unexpected arguments {train_args}: expected only flags "
                         "(train arguments after -- go to run or create)")
    launch = make_launch(FLAGS, train_args)
    runner = Runner(FLAGS.dry_run)
    if command == "run" or train_args:  # all checked before anything is compiled or created
        launch = dataclasses.replace(launch, train_args=train_arguments(train_args))
        if command == "run":
            validate_run(launch, FLAGS.restart_on_preemption)
        else:
            validate(launch)
        if command == "run" and not FLAGS.skip_aot:
            runner.run(aot_command(launch))
    if command == "create":
        ensure_slice(launch, runner, FLAGS.poll_seconds)
        return 0
    if command == "run":
        return run(launch, runner, restart_on_preemption=FLAGS.restart_on_preemption,
                   max_restarts=FLAGS.max_restarts, poll_seconds=FLAGS.poll_seconds)
    if command == "status":
        state = slice_state(launch, runner)
        print("(dry run: the state is not read)" if runner.dry_run else state)
        return 0
    if command == "logs":
        return runner.run_many(logs_commands(launch), check=False)
    if command == "stop":
        return runner.run_many(stop_commands(launch), check=False)
    for delete in delete_commands(launch):
        runner.run(delete)
    return 0


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("name", None, "TPU VM (or queued resource) name.")
    flags.DEFINE_string("project", None, "Google Cloud project.")
    flags.DEFINE_string("zone", None, "Zone, e.g. us-east5-a.")
    flags.DEFINE_string("accelerator", None, "TPU type: v4-8, v5p-32, v5litepod-16, v6e-8, ...")
    flags.DEFINE_string("runtime_version", None, "TPU VM image (default: the generation's).")
    flags.DEFINE_bool("spot", False, "Spot (preemptible) capacity, via a queued resource.")
    flags.DEFINE_bool("reserved", False, "Use the project's reservation.")
    flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN (multi-slice data parallel).")
    flags.DEFINE_bool("dry_run", False, "Print every command in order and run none.")
    flags.DEFINE_bool("restart_on_preemption", False, "run: recreate a preempted slice and rerun "
                      "(training resumes from the latest checkpoint).")
    flags.DEFINE_integer("max_restarts", 20, "run: give up after this many recreations.")
    flags.DEFINE_float("poll_seconds", 30.0, "How often to poll a slice's state.")
    flags.DEFINE_bool("skip_aot", False, "run: skip the ahead-of-time compile check.")


if __name__ == "__main__":
    from launch import run_cli

    _define_flags()
    run_cli(main, positional=True)  # the command, then the training flags
