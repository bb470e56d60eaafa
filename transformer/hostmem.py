"""Which malloc serves this process, and what that costs an XLA:CPU train step.

XLA:CPU allocates each execution's temporaries as one block (443.7 MB for GPT 6/6/384, batch
8 x 256) and frees it when the step ends. glibc malloc serves a block that size with a fresh
mmap and unmaps it on free (its arenas keep only blocks under 32-64 MB), so every step
page-faults it in again: 109k minor faults and about 200 ms of kernel time per 950 ms step on
a 2-core EPYC. jemalloc told never to return freed pages (`JEMALLOC_CONF`) reuses the block:
under 10 faults, 5 ms of kernel time and 830-900 ms steps, for resident memory that stays at
the step's peak (1.7 GB there, against 1.2 GB). Beside nanoGPT in one process
(`benchmarks/train_throughput.py`) it left PyTorch's step as it was; jemalloc's
`oversize_threshold:0`, which also keeps the block, slowed PyTorch's by 10-40%.

The allocator is chosen when the process starts (LD_PRELOAD), so this module only reports it
and says how to change it: `python -m transformer.train` counts the page faults of its first
logged steps and, on CPU under glibc, names the command when they reach 32 MB a step.
"""

from __future__ import annotations

import ctypes.util
import os

JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def allocator(maps_path: str = "/proc/self/maps") -> str:
    """"jemalloc" or "tcmalloc" when one is loaded into this process (LD_PRELOAD), else "glibc"
    on Linux, or "unknown" where the process's mappings cannot be read (macOS)."""
    try:
        with open(maps_path) as maps:
            text = maps.read()
    except OSError:
        return "unknown"
    for name in ("jemalloc", "tcmalloc"):
        if f"lib{name}" in text:
            return name
    return "glibc"


def faulted_bytes() -> int:
    """Bytes this process has page-faulted in so far: minor faults (getrusage) x the page
    size; 0 where that is unavailable."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize()


def advice(platform: str, faulted_bytes_per_step: float, name: str | None = None) -> str | None:
    """One line for a run on `platform` whose train steps each page-faulted in
    `faulted_bytes_per_step` (measured over steps after the first): under glibc malloc on CPU,
    with at least 32 MB faulted per step (glibc keeps freed blocks below that), the command
    that keeps XLA's scratch memory mapped. None otherwise: nothing to gain.

    >>> advice("cpu", 443.7e6, "jemalloc") is None
    True
    >>> advice("cpu", 4e6, "glibc") is None  # a small step's scratch memory is reused
    True
    """
    name = allocator() if name is None else name
    if platform != "cpu" or name != "glibc" or faulted_bytes_per_step < 32 * 2**20:
        return None
    library = ctypes.util.find_library("jemalloc")
    preload = (f"LD_PRELOAD={_path(library)}" if library else
               "LD_PRELOAD=libjemalloc.so.2 (apt install libjemalloc2)")
    return (f"host allocator: glibc malloc page-faulted {faulted_bytes_per_step / 1e6:,.0f} MB "
            "per train step (XLA's scratch memory, mapped afresh each step); to keep it: "
            f"{preload} MALLOC_CONF={JEMALLOC_CONF} (README: CPU runs)")


def _path(library: str) -> str:
    """find_library's soname as a path LD_PRELOAD loads from the usual library directories."""
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                      "/usr/lib", "/usr/local/lib"):
        candidate = os.path.join(directory, library)
        if os.path.exists(candidate):
            return candidate
    return library
