"""transformer.utils.hostmem: which malloc a process runs under, keeping XLA's scratch memory mapped
between steps, and the line a run logs where it is not."""

import ctypes.util
import mmap
import os
import subprocess
import sys

import pytest
from test_train import REPO, cli_env, describe

from transformer.utils import hostmem

LIBC = "7f00-7f10 r-xp 00000000 08:01 42  /usr/lib/x86_64-linux-gnu/libc.so.6\n"


@pytest.mark.parametrize("extra, expected", [
    ("", "glibc"),
    ("7f20-7f30 r-xp 00000000 08:01 43  /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n",
     "jemalloc"),
    ("7f20-7f30 r-xp 00000000 08:01 44  /usr/lib/libtcmalloc_minimal.so.4.5.9\n", "tcmalloc"),
])
def test_allocator_reads_the_mappings(tmp_path, extra, expected):
    maps = tmp_path / "maps"
    maps.write_text(LIBC + extra)
    assert hostmem.allocator(str(maps)) == expected


def test_allocator_unknown_without_mappings(tmp_path):
    assert hostmem.allocator(str(tmp_path / "missing")) == "unknown"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_this_process_and_a_preloaded_one():
    """This test process runs on glibc malloc; a child with jemalloc preloaded is told apart."""
    if "LD_PRELOAD" not in os.environ:
        assert hostmem.allocator() == "glibc"
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        pytest.skip("no libjemalloc installed")
    child = subprocess.run(
        [sys.executable, "-c", "from transformer.utils import hostmem; print(hostmem.allocator())"],
        env={**os.environ, "LD_PRELOAD": hostmem._path(library)}, capture_output=True,
        text=True, check=True)
    assert child.stdout.strip() == "jemalloc"


def test_advice_names_the_command_only_where_glibc_faults_a_big_scratch_block():
    line = hostmem.advice("cpu", 443.7e6, "glibc")
    assert "page-faulted 444 MB per train step" in line and "LD_PRELOAD=" in line
    assert f"MALLOC_CONF={hostmem.JEMALLOC_CONF}" in line
    assert hostmem.advice("cpu", 40e6, "glibc") is not None
    assert hostmem.advice("cpu", 30e6, "glibc") is None  # under 32 MiB glibc keeps the block
    assert hostmem.advice("cpu", 443.7e6, "jemalloc") is None
    assert hostmem.advice("gpu", 443.7e6, "glibc") is None


def test_faulted_bytes_counts_fresh_pages():
    # A fresh anonymous mapping, each page written once: new pages whatever malloc keeps (a
    # bytearray may reuse freed heap pages once a test in this process ran keep_freed_memory).
    block = mmap.mmap(-1, 64 * 2**20)
    before = hostmem.faulted_bytes()
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert hostmem.faulted_bytes() - before >= 60 * 2**20
    block.close()


def _window(monkeypatch, first, steps, log_every, pauses=()):
    """Drives a FaultWindow as train.py's loop does, from step `first` to `steps`: each step
    faults its step number x 1 MB, so the window shows which steps it counted; returns (step
    logged, bytes per step) of the one measurement."""
    total = [0]
    monkeypatch.setattr(hostmem, "faulted_bytes", lambda: total[0])
    window, measured = hostmem.FaultWindow(first), []
    for step in range(first + 1, steps + 1):
        total[0] += step * 10**6
        logged, pause = step % log_every == 0, step in pauses
        if logged and (per_step := window.end(step)) is not None:
            measured.append((step, per_step))
        total[0] += 10**9 * pause  # an evaluation or save faults in its own memory
        if logged or pause:
            window.begin(step, pause=pause)
    assert len(measured) <= 1, measured
    return measured[0] if measured else None


def test_the_fault_window_skips_the_first_steps_and_spans_two(monkeypatch):
    # logging every step: steps 5-6 (the old third window was step 3 alone)
    assert _window(monkeypatch, 0, 20, 1) == (6, 5.5e6)
    assert _window(monkeypatch, 0, 20, 2) == (6, 5.5e6)  # logs at 4 and 6
    assert _window(monkeypatch, 0, 500, 100) == (200, 150.5e6)  # steps 101-200
    # a resumed run counts from its own first step
    assert _window(monkeypatch, 1000, 1020, 1) == (1006, 1005.5e6)
    # a save inside the window restarts it after the save: its faults are not the steps'
    assert _window(monkeypatch, 0, 20, 1, pauses={5}) == (7, 6.5e6)
    assert _window(monkeypatch, 0, 20, 2, pauses={4}) == (6, 5.5e6)  # after the save at 4
    # too few steps or a pause every step: no measurement, rather than a wrong one
    assert _window(monkeypatch, 0, 5, 1) is None
    assert _window(monkeypatch, 0, 20, 1, pauses=set(range(20))) is None


# A jitted fwd+bwd whose scratch memory (68 MiB) is many 4 MiB activations, as a train step's
SCRATCH_STEPS = """
import sys, jax, jax.numpy as jnp
from transformer.training import placement
from transformer.utils import hostmem
options = {}
if sys.argv[1] == "keep":
    assert hostmem.keep_freed_memory()
    options = placement.GLIBC_CPU_OPTIONS

def loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x)

ws, x = [jnp.eye(128) * 0.5 + 0.01] * 16, jnp.ones((8192, 128))
step = jax.jit(jax.grad(loss)).lower(ws, x).compile(compiler_options=options)
for _ in range(2):  # malloc maps in what it will keep
    jax.block_until_ready(step(ws, x))
faults = []
for _ in range(9):
    before = hostmem.faulted_bytes()
    jax.block_until_ready(step(ws, x))
    faults.append(hostmem.faulted_bytes() - before)
print(step.memory_analysis().temp_size_in_bytes, sorted(faults)[4],  # the median step's
      int(jax.config.values[hostmem.ASYNC_DISPATCH]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps") or "LD_PRELOAD" in os.environ,
                    reason="Linux glibc malloc only")
def test_kept_scratch_memory_is_not_faulted_in_again():
    """glibc as it starts page-faults XLA's whole scratch block in again every step; with
    keep_freed_memory and the CPU compiler options, every step after the first two faults in
    (almost) nothing: they all run on the calling thread, so one malloc arena keeps one copy
    (on XLA's pool each thread's arena faulted its own copy in, 198 MB in the fourth step of a
    CI run). JAX_CPU_ENABLE_ASYNC_DISPATCH, set by the user, wins."""
    def faulted(mode, **env):
        child = subprocess.run([sys.executable, "-c", SCRATCH_STEPS, mode], cwd=REPO,
                               env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
                               capture_output=True, text=True, timeout=300)
        assert child.returncode == 0, describe(child)
        temp, per_step, on_pool = map(float, child.stdout.split())
        assert temp > 64 * 2**20  # over glibc's largest mmap threshold, as one block
        return temp, per_step, on_pool

    temp, per_step, on_pool = faulted("glibc")
    assert per_step >= 0.9 * temp and on_pool, (temp, per_step)  # every step
    temp, per_step, on_pool = faulted("keep")
    # The median step: a step that now and then faults a few MiB (3.5 MiB a step over 8 on
    # jax 0.12 in CI) does not count; a steady refault does (glibc with its own top pad, 49 MiB).
    # A thread's new arena faulting its copy in once is caught by `on_pool`.
    assert per_step < temp / 16 and not on_pool, (temp, per_step)
    assert faulted("keep", JAX_CPU_ENABLE_ASYNC_DISPATCH="1")[2]


def test_keep_freed_memory_leaves_other_allocators_alone(monkeypatch):
    monkeypatch.setattr(hostmem, "allocator", lambda: "jemalloc")
    assert hostmem.keep_freed_memory() is False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_a_cpu_run_logs_the_allocator_line_only_where_steps_fault(tmp_path):
    """Through the CLI, under glibc: a GPT step with ~0.2 GB of scratch memory in heaps it
    keeps logs no allocator line; the same step with its scratch memory as one block (no
    heap size cap) logs the faults it measured and the command, once; under jemalloc as
    advised, that step logs nothing."""
    env = cli_env()
    env.pop("LD_PRELOAD", None)
    one_block = tmp_path / "one_block.py"
    one_block.write_text(f"""import runpy


def get_config():
    config = runpy.run_path({str(REPO / "experiments" / "gpt_tiny.py")!r})["get_config"]()
    config.compiler_options = {{"xla_multiheap_size_constraint_per_heap": -1}}
    return config
""")
    # The faults are counted over steps 5-6 (hostmem.FaultWindow). No samples.
    flags = ["--config.steps=6", "--config.log_every=2", "--config.batch_size=32",
             "--config.seq_len=128", "--config.eval_every=6", "--config.eval_steps=1",
             "--config.checkpoint_every=6", "--config.samples=0"]

    def run(name, config, env):
        result = subprocess.run([sys.executable, "-m", "transformer.train", f"--config={config}",
                                 f"--workdir={tmp_path / name}", *flags], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, describe(result)
        return [line for line in result.stdout.splitlines() if "host allocator" in line]

    assert run("kept", "experiments/gpt_tiny.py", env) == []
    lines = run("one_block", one_block, env)
    assert len(lines) == 1, lines
    megabytes = float(lines[0].split("page-faulted ")[1].split(" MB")[0].replace(",", ""))
    assert megabytes >= 32 * 2**20 / 1e6, lines[0]
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        pytest.skip("no libjemalloc installed")
    assert run("jemalloc", one_block, {**env, "LD_PRELOAD": hostmem._path(library),
                                       "MALLOC_CONF": hostmem.JEMALLOC_CONF}) == []
