"""The same training run on a GKE cluster with TPU node pools: a JobSet manifest, or the
equivalent `xpk workload create` command.

    python -m launch.gke --print --name=NAME --accelerator=v5p-32 [--num_slices=N] \
        --image=REGISTRY/IMAGE:TAG [--xpk --cluster=CLUSTER] -- --config=... --workdir=gs://...

The image must hold this project installed with the extras its runs need (`pip install -e
'.[tpu,chat,wandb]'`, as `launch.tpu` installs on each worker) for
its `python3`, Python 3.11 or newer, its working directory the project's checkout (the
manifest sets none; `--config` is a file of this checkout, relative to it). One replicated job
per slice (multi-host slices: GKE's Multislice), one pod per host, every pod running the same
train command with `--jax_distributed`; `kubectl apply -f` the printed manifest. Validation is
the same as `launch.tpu`'s; `--noprint` validates and prints nothing.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

from launch import accelerators, tpu

# GKE's names for the TPU generations (the cloud.google.com/gke-tpu-accelerator node label).
GKE_ACCELERATORS = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice",
                    "v5litepod": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice"}


def train_command(launch: tpu.Launch) -> list[str]:
    return ["python3", "-m", "transformer.train", "--jax_distributed", *launch.train_args]


def jobset_manifest(launch: tpu.Launch, image: str) -> str:
    """A JobSet (jobset.x-k8s.io/v1alpha2) running the train command on every host."""
    a = launch.accelerator
    hosts = a.hosts
    # a JSON string is a YAML double-quoted scalar: quotes, backslashes, any character
    command = ", ".join(json.dumps(part) for part in train_command(launch))
    return f"""apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: {launch.name}
  annotations:
    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool
spec:
  failurePolicy:
    # A failed pod fails its job and restarts the JobSet: training resumes from the workdir.
    # Training stopped by SIGTERM (a preempted or drained node) exits 143, a failure too.
    maxRestarts: 20
  replicatedJobs:
  - name: slice
    replicas: {launch.num_slices}
    template:
      spec:
        parallelism: {hosts}
        completions: {hosts}
        backoffLimit: 0
        template:
          spec:
            restartPolicy: Never
            nodeSelector:
              cloud.google.com/gke-tpu-accelerator: {GKE_ACCELERATORS[a.generation.name]}
              cloud.google.com/gke-tpu-topology: {a.topology}
            containers:
            - name: train
              image: {image}
              command: [{command}]
              ports:
              - containerPort: 8471
              - containerPort: 8080
              resources:
                limits:
                  google.com/tpu: {a.chips_per_host}
"""


def check_name(name: str | None, num_slices: int, accelerator) -> None:
    """--name, and the longest pod host name the JobSet makes from it (JOBSET-slice-J-P, each
    pod's DNS name), in 63 characters."""
    tpu.check_name(name, f"{name}-slice-{num_slices - 1}-{accelerator.hosts - 1}")


def xpk_command(launch: tpu.Launch, image: str, cluster: str) -> list[str]:
    """`xpk workload create`; without a project or zone, no flag for it: xpk uses gcloud's
    configured default."""
    where = [f"--{name}={value}" for name, value in
             (("project", launch.project), ("zone", launch.zone)) if value]
    return ["xpk", "workload", "create", f"--cluster={cluster}", f"--workload={launch.name}",
            f"--tpu-type={launch.accelerator.name}", f"--num-slices={launch.num_slices}",
            f"--docker-image={image}", *where,
            f"--command={shlex.join(train_command(launch))}"]


def main(argv: Sequence[str], flag_values=None) -> int:
    """Validates the launch, then prints its manifest or xpk command unless --noprint;
    `flag_values`, the parsed flags (absl's by default)."""
    from absl import flags

    FLAGS = flags.FLAGS if flag_values is None else flag_values
    train_args = list(argv[1:])
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if not FLAGS.image:
        raise ValueError("--image: expected a container image with the project installed")
    accelerator = accelerators.parse(FLAGS.accelerator)
    if FLAGS.num_slices > 1 and accelerator.hosts == 1:  # GKE's Multislice docs say so
        g = accelerator.generation
        smallest = min(n for n in g.chip_counts if n > g.max_single_host_chips)
        raise ValueError(f"--num_slices={FLAGS.num_slices} with --accelerator={accelerator.name}"
                         ", a single-host slice: GKE runs Multislice on multi-host TPU slices "
                         f"only: expected --num_slices=1 or {g.name}-"
                         f"{smallest * g.cores_per_chip} or larger")
    check_name(FLAGS.name, FLAGS.num_slices, accelerator)
    launch = tpu.Launch(FLAGS.name, FLAGS.project or "", FLAGS.zone or "", accelerator,
                        accelerator.generation.runtime_version, num_slices=FLAGS.num_slices,
                        train_args=tpu.train_arguments(train_args))
    tpu.validate(launch)
    values = tpu.train_flags(launch.train_args)
    # the pods run the command in the image's working directory, which must be this checkout
    tpu.check_config_in_tree(values, "the image is expected to hold as its working directory")
    tpu.check_restartable(launch, "a JobSet (it restarts preempted pods)")
    workdir = values.workdir or ""
    if not workdir.startswith("gs://"):  # a restarted pod's disk is a new one
        raise ValueError(f"workdir={workdir or None!r}: a pod restarted by the JobSet (a "
                         "preemption, exit 143) starts on a fresh disk, without the "
                         "checkpoints to resume: expected --workdir=gs://BUCKET/PATH")
    if FLAGS.xpk and not FLAGS.cluster:
        raise ValueError("--xpk: expected --cluster")
    if not FLAGS.print:
        return 0
    if FLAGS.xpk:
        print(shlex.join(xpk_command(launch, FLAGS.image, FLAGS.cluster)))
    else:
        print(jobset_manifest(launch, FLAGS.image), end="")
    return 0


if __name__ == "__main__":
    from absl import flags

    from launch import run_cli

    flags.DEFINE_bool("print", True, "Print the manifest (or the xpk command); --noprint only "
                      "validates the launch.")
    flags.DEFINE_string("name", None, "Job name.")
    flags.DEFINE_string("accelerator", None, "TPU type, e.g. v5p-32.")
    flags.DEFINE_integer("num_slices", 1, "Slices (multi-slice over DCN).")
    flags.DEFINE_string("image", None, "Container image with the project installed.")
    flags.DEFINE_bool("xpk", False, "Print the `xpk workload create` command instead.")
    flags.DEFINE_string("cluster", None, "With --xpk: the GKE cluster.")
    flags.DEFINE_string("project", None, "With --xpk: the project (default: gcloud's).")
    flags.DEFINE_string("zone", None, "With --xpk: the zone (default: gcloud's).")

    run_cli(main, positional=True)  # the training flags after --
