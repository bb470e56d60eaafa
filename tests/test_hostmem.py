"""transformer.hostmem: which malloc a process runs under, and the start-of-run line."""

import ctypes.util
import os
import subprocess
import sys

import pytest

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


def test_advice_names_the_command_on_cpu_under_glibc():
    line = hostmem.advice("cpu", "glibc")
    assert "glibc malloc" in line and "LD_PRELOAD=" in line
    assert f"MALLOC_CONF={hostmem.JEMALLOC_CONF}" in line
    assert hostmem.advice("cpu", "tcmalloc") == "host allocator: tcmalloc"
    assert hostmem.advice("gpu", "glibc") is None
