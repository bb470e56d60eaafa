"""Cloud TPU VMs: create a slice, ship this working tree to every worker, train on all of them,
follow the logs, stop, delete; and recreate + resume after preemption.

    python -m launch.tpu create|run|status|logs|stop|delete --name=NAME --project=P --zone=Z \
        --accelerator=v5p-32 [--spot | --reserved] [--num_slices=N] [--dry_run] \
        [--restart_on_preemption] [--skip_aot] -- --config=experiments/gpt_tiny.py \
        --workdir=gs://BUCKET/run [--config.KEY=VALUE ...]

Everything after `--` is passed to `python -m transformer.train` on every worker. Before any
machine is created the run is validated (accelerator type, mesh sizes against the chip count,
global batch against the data-parallel size and the host count, a gs:// workdir for multi-host
runs) and, unless --skip_aot, the train step is compiled ahead of time for the slice
(`launch.aot`) to check that it fits in HBM. `--dry_run` prints every command, in order, and
runs none. Spot capacity and multi-slice jobs go through queued resources.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

from launch import accelerators

COMMANDS = ("create", "run", "status", "logs", "stop", "delete")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_DIR = "~/transformer"
# Slice states after which the slice is gone (preempted or failed) and must be recreated.
GONE = {"PREEMPTED", "SUSPENDED", "SUSPENDING", "FAILED", "TERMINATED", "NOT_FOUND",
        "DELETING", "STOPPED"}
READY = {"READY", "ACTIVE"}


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

    if launch.spot and launch.reserved:
        raise ValueError("--spot and --reserved: expected at most one")
    if launch.num_slices < 1:
        raise ValueError(f"num_slices={launch.num_slices}: expected >= 1")
    config = train_config(launch.train_args)
    workdir = train_flag(launch.train_args, "workdir")
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
        raise ValueError(f"{error}; on {launch.num_slices} x {launch.accelerator.name} "
                         f"({launch.processes} hosts)") from None


def train_flag(args: Sequence[str], name: str) -> str | None:
    """The value of --NAME=VALUE in the train arguments (the last one wins)."""
    value = None
    for arg in args:
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def train_config(args: Sequence[str]):
    """The experiment config the train arguments select, with their --config.KEY overrides."""
    from absl import flags
    from ml_collections import config_flags

    if not train_flag(args, "config"):
        raise ValueError("expected the train arguments after -- to include --config=FILE")
    argv = [sys.argv[0], *(a for a in args if a.startswith(("--config", "--workdir")))]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True,
                                    sys_argv=argv)
    flags.DEFINE_string("workdir", None, "", flag_values=values)
    try:
        values(argv)
        return values.config
    except (flags.Error, KeyError, AttributeError, TypeError) as error:
        from transformer.utils import cli  # one line, as the train command would say it

        raise ValueError(f"train arguments: {cli.message(error)}") from None


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


def ship_commands(launch: Launch) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """(pack, copies, installs): pack the working tree (tracked and untracked files, not
    ignored ones), copy it to every worker of each slice, unpack it there and install the
    project with its TPU extra."""
    archive = archive_path(launch)
    pack = ["sh", "-c", f"mkdir -p .launch && git ls-files -z --cached --others "
            f"--exclude-standard | tar -czf {archive} --null -T -"]
    copies = [_gcloud_tpus("tpu-vm", "scp", archive, f"{node}:~/transformer.tar.gz",
                           *launch.where(), "--worker=all") for node in launch.nodes]
    install = (f"rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && "
               f"tar -xzf ~/transformer.tar.gz -C {REMOTE_DIR} && cd {REMOTE_DIR} && "
               "python3 -m pip install -q -e '.[tpu]'")
    return pack, copies, ssh_commands(launch, install)


def train_remote(launch: Launch) -> str:
    """The shell command each worker runs: train under launch.worker (prefixed, logged)."""
    train = ["python3", "-m", "transformer.train", *launch.train_args]
    if launch.processes > 1:
        train.insert(3, "--jax_distributed")
    return (f"cd {REMOTE_DIR} && python3 -m launch.worker --log={launch.log_file} -- "
            + shlex.join(train))


def run_commands(launch: Launch) -> list[list[str]]:
    return ssh_commands(launch, train_remote(launch))


def logs_commands(launch: Launch) -> list[list[str]]:
    return ssh_commands(launch, f"tail -n 200 -F {launch.log_file}")


def stop_commands(launch: Launch) -> list[list[str]]:
    """SIGTERM to training on every worker: it saves a checkpoint and exits."""
    return ssh_commands(launch, "pkill -TERM -f 'python3 -m transformer.train' || true")


def aot_command(launch: Launch) -> list[str]:
    return [sys.executable, "-m", "launch.aot", f"--topology={launch.accelerator.name}",
            f"--num_slices={launch.num_slices}", *(a for a in launch.train_args
                                                   if a.startswith("--config"))]


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
        self.show(command)
        if self.dry_run:
            return "READY"
        result = subprocess.run(list(command), cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            return "NOT_FOUND"
        return result.stdout.strip() or "NOT_FOUND"


def slice_state(launch: Launch, runner: Runner) -> str:
    return runner.output(state_command(launch)).split()[0].upper()


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


def ship(launch: Launch, runner: Runner) -> None:
    pack, copies, installs = ship_commands(launch)
    runner.run(pack)
    runner.run_many(copies)
    runner.run_many(installs)


def run(launch: Launch, runner: Runner, *, restart_on_preemption: bool, max_restarts: int,
        poll_seconds: float = 30.0) -> int:
    """Slice -> ship the code -> train on all workers at once. With restart_on_preemption, a
    run whose slice was preempted or deleted recreates the slice and reruns the same command:
    training resumes from the latest complete checkpoint in the workdir."""
    restarts = 0
    while True:
        ensure_slice(launch, runner, poll_seconds)
        ship(launch, runner)
        code = runner.run_many(run_commands(launch), check=False)
        if code == 0:
            print(f"{launch.name}: training finished", file=runner.out, flush=True)
            return 0
        state = slice_state(launch, runner)
        if state not in GONE:
            print(f"{launch.name}: training failed (exit status {code}) on a {state} slice; "
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


def make_launch(flags_values, train_args: Sequence[str]) -> Launch:
    accelerator = accelerators.parse(flags_values.accelerator)
    for name in ("name", "project", "zone"):
        if not getattr(flags_values, name):
            raise ValueError(f"--{name}: expected a value")
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
    launch = make_launch(FLAGS, train_args)
    runner = Runner(FLAGS.dry_run)
    if command in ("create", "run"):
        if command == "run" or train_args:
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
        print(slice_state(launch, runner))
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
