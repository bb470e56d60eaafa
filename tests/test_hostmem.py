"""transformer.hostmem: which malloc a process runs under, and the start-of-run line."""

import ctypes.util
import os
import subprocess
import sys

import pytest
from test_train import REPO, cli_env, describe

from transformer import hostmem

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
        [sys.executable, "-c", "from transformer import hostmem; print(hostmem.allocator())"],
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
    before = hostmem.faulted_bytes()
    block = bytearray(64 * 2**20)  # zero-filled: every page is touched
    assert hostmem.faulted_bytes() - before >= 60 * 2**20
    del block


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_a_cpu_run_with_a_big_step_logs_the_allocator_line_once(tmp_path):
    """Through the CLI: a GPT step with ~0.3 GB of scratch memory under glibc malloc logs the
    measured faults and the command, once; under jemalloc as advised it logs nothing."""
    env = cli_env()
    env.pop("LD_PRELOAD", None)
    flags = ["--config=experiments/gpt_tiny.py", "--config.steps=4", "--config.log_every=2",
             "--config.batch_size=64", "--config.seq_len=128", "--config.eval_every=4",
             "--config.eval_steps=1", "--config.checkpoint_every=4"]

    def run(name, env):
        return subprocess.run([sys.executable, "-m", "transformer.train",
                               f"--workdir={tmp_path / name}", *flags], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)

    glibc = run("glibc", env)
    assert glibc.returncode == 0, describe(glibc)
    lines = [line for line in glibc.stdout.splitlines() if "host allocator" in line]
    assert len(lines) == 1, glibc.stdout
    megabytes = float(lines[0].split("page-faulted ")[1].split(" MB")[0].replace(",", ""))
    assert megabytes >= 32 * 2**20 / 1e6, lines[0]
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        pytest.skip("no libjemalloc installed")
    kept = run("jemalloc", {**env, "LD_PRELOAD": hostmem._path(library),
                            "MALLOC_CONF": hostmem.JEMALLOC_CONF})
    assert kept.returncode == 0, describe(kept)
    assert "host allocator" not in kept.stdout, kept.stdout
