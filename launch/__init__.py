"""Launching training on Cloud TPUs: `launch.tpu` (TPU VMs), `launch.gke` (GKE), `launch.aot`."""


def run_cli(main, positional: bool = False) -> None:
    """Runs `main(argv) -> exit status` as `transformer.utils.cli.run` does every command: bad input
    is one line on stderr and exit status 2, a failed step (RuntimeError) exit status 1;
    `positional`: main reads arguments that are not flags (a command, training's flags)."""
    from transformer.utils import cli

    cli.run(main, positional=positional)
