"""tests/forkserver.py: a forked command behaves as the same command in a fresh interpreter."""

import signal
import subprocess
import sys
import textwrap

import forkserver
import pytest
from test_train import cli_env

# What these tests check is the fork: with forking off for the session there is none
pytestmark = pytest.mark.skipif(not forkserver.ENABLED, reason="TRANSFORMER_TESTS_FORK=0")

PROBE = textwrap.dedent("""
    import os, sys, time
    test = os.environ.get("PYTEST_CURRENT_TEST")  # differs from the server's (and is read late)
    print(__name__, sys.argv[1:], os.getcwd(), sys.path[0], test, flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    action = sys.argv[1]
    if action == "devices":
        import jax
        import jax.numpy as jnp
        print(jax.device_count(), jnp.zeros(1).dtype)
    elif action == "raise":
        raise ValueError("probe failed")
    elif action == "sleep":
        print("sleeping", flush=True)
        time.sleep(60)
    elif action == "random":
        import numpy as np
        print(np.random.randint(2**31))
    elif action == "gc":
        import gc
        print(gc.get_freeze_count(), len(gc.get_objects()))
    elif action == "kill":
        os.kill(os.getpid(), 9)
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
""")


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def forked(probe, *args, env=None, command=("-m", "probe"),
           cwd=None) -> subprocess.CompletedProcess:
    """The probe forked from the server (asserted) with stdout and stderr read back."""
    outputs = [probe / "stdout.txt", probe / "stderr.txt"]
    with open(outputs[0], "w") as stdout, open(outputs[1], "w") as stderr:
        process = forkserver.Popen([sys.executable, *command, *args], cwd=cwd or probe,
                                   env=env or cli_env(), stdout=stdout, stderr=stderr)
    assert isinstance(process, forkserver.ForkedProcess)
    code = process.wait(120)
    return subprocess.CompletedProcess(args, code, *(path.read_text() for path in outputs))


def both(probe, *args):
    """The probe's result forked and from a fresh interpreter, on the same arguments."""
    fresh = subprocess.run([sys.executable, "-m", "probe", *args], cwd=probe, env=cli_env(),
                           capture_output=True, text=True, timeout=120)
    return forked(probe, *args), fresh


@pytest.mark.parametrize("args", [("exit", "3"), ("raise",), ("kill",),
                                  pytest.param(("devices",), marks=pytest.mark.slow)])
def test_a_forked_command_prints_and_exits_as_a_fresh_one(probe, args):
    forked, fresh = both(probe, *args)
    assert forked.stdout == fresh.stdout and forked.returncode == fresh.returncode
    test = f"{__name__}.py::{test_a_forked_command_prints_and_exits_as_a_fresh_one.__name__}"
    assert forked.stdout.startswith(f"__main__ {list(args)} {probe} {probe} tests/{test}")
    if args[0] == "raise":  # the traceback's frames differ: the fork's starts in the server
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == \
            "ValueError: probe failed"
    else:
        assert forked.stderr == fresh.stderr == "to stderr\n"
    assert forked.returncode == {"exit": 3, "raise": 1, "kill": -9, "devices": 0}[args[0]]


def test_a_forked_script_runs_as_python_script_py_does(probe, tmp_path_factory):
    """`python path/to/probe.py` from another directory: __main__, the script's argv, the cwd,
    and the script's folder (not the cwd) as sys.path[0], as in a fresh interpreter."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    command = [str(probe / "probe.py")]
    fork = forked(probe, "exit", "3", command=command, cwd=elsewhere)
    fresh = subprocess.run([sys.executable, *command, "exit", "3"], cwd=elsewhere, env=cli_env(),
                           capture_output=True, text=True, timeout=120)
    assert (fork.stdout, fork.stderr, fork.returncode) == (
        fresh.stdout, fresh.stderr, fresh.returncode)
    assert fork.stdout.startswith(f"__main__ ['exit', '3'] {elsewhere} {probe} ")
    assert fork.returncode == 3


@pytest.mark.slow
def test_xla_flags_are_the_forks_own_and_a_jax_variable_gets_its_own_server(probe):
    """XLA reads XLA_FLAGS when the fork starts its backend, so 4 forced devices fork from the
    same server. jax reads JAX_ENABLE_X64 at import: another value gets a server started with
    it, or, while a command of the current server still runs, a fresh interpreter."""
    assert forked(probe, "devices", env=cli_env(4)).stdout.splitlines()[-1] == "4 float32"
    first, x64 = forkserver._server, {**cli_env(), "JAX_ENABLE_X64": "1"}
    assert forked(probe, "devices", env=x64).stdout.splitlines()[-1] == "1 float64"
    assert forkserver._server is not first
    with open(probe / "sleep.txt", "w") as out:
        sleeping = forkserver.Popen([sys.executable, "-m", "probe", "sleep"], cwd=probe, env=x64,
                                    stdout=out, stderr=subprocess.DEVNULL)
    try:
        fresh = forkserver.run([sys.executable, "-m", "probe", "devices"], cwd=probe,
                               env=cli_env(), capture_output=True, text=True, timeout=120)
        assert fresh.stdout.splitlines()[-1] == "1 float32"
        assert isinstance(sleeping, forkserver.ForkedProcess) and sleeping.poll() is None
    finally:
        sleeping.kill()
    assert sleeping.wait(60) == -signal.SIGKILL


@pytest.mark.slow
def test_a_signal_reaches_the_fork_and_its_code_is_minus_the_signal(probe):
    with open(probe / "out.txt", "w") as out:
        process = forkserver.Popen([sys.executable, "-m", "probe", "sleep"], cwd=probe,
                                   env=cli_env(), stdout=out, stderr=subprocess.DEVNULL)
    assert isinstance(process, forkserver.ForkedProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.2)
    while "sleeping" not in (probe / "out.txt").read_text():
        assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == -signal.SIGTERM and process.poll() == -signal.SIGTERM


def test_forks_draw_different_unseeded_numbers_as_fresh_processes_do(probe):
    draws = {forked(probe, "random").stdout for _ in range(2)}
    assert len(draws) == 2


def test_a_fork_never_walks_the_servers_imports_in_its_collections(probe):
    """The server's heap is frozen before it forks (gc.freeze): what the collector still tracks
    in a fork is what the command made, a small part of it."""
    frozen, tracked = map(int, forked(probe, "gc").stdout.splitlines()[-1].split())
    assert frozen > 10 * tracked, (frozen, tracked)


@pytest.mark.slow
def test_a_bad_flag_of_the_preloaded_train_command_gets_the_fresh_processes_one_line(tmp_path):
    """The server imported transformer.train: the fork runs its code again as __main__, with no
    runpy warning in between."""
    command = [sys.executable, "-m", "transformer.train", "--config=experiments/gpt_tiny.py",
               f"--workdir={tmp_path}", "--config.steps=-1"]
    forked = forkserver.run(command, cwd=forkserver.REPO, env=cli_env(), capture_output=True,
                            text=True, timeout=120)
    fresh = subprocess.run(command, cwd=forkserver.REPO, env=cli_env(), capture_output=True,
                           text=True, timeout=120)
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr == fresh.stderr and len(fresh.stderr.splitlines()) == 1, forked.stderr
