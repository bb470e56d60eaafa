"""Which malloc serves this process, and keeping XLA:CPU's scratch memory mapped across steps.

XLA:CPU allocates each execution's temporaries as one block by default (443.7 MB for GPT
6/6/384, batch 8 x 256) and frees it when the step ends. glibc malloc serves a block over 32 MiB
(its largest mmap threshold; its thread arenas grow in 64 MiB heaps) with a fresh mmap and
unmaps it on free, so every step page-faulted it in again: 109k minor faults and about 200 ms
of kernel time per 950 ms step on a 2-core EPYC. Two settings keep it, in the process itself:

- `SCRATCH_HEAP_BYTES`: the train steps' compiler option on CPU under glibc
  (`placement.GLIBC_CPU_OPTIONS`) that splits XLA's scratch memory into heaps of at most
  30 MiB, each under the threshold;
- `keep_freed_memory()`: under glibc, a fixed 32 MiB mmap threshold (glibc otherwise starts at
  128 KiB and raises it only as mapped blocks are freed), a 64 MiB top pad (glibc unmaps an
  emptied heap of a thread's arena otherwise) and a 2 GiB trim threshold (the main arena's
  free top is given back past it), and JAX running single-device CPU computations on the
  calling thread (`jax_cpu_enable_async_dispatch` off).

Either half alone falls short: the heaps alone left 35k-65k faults a step, the mallopt alone
all 109k. Under jemalloc the heaps only cost time (20-35 ms a step there). The calling thread
matters because JAX otherwise runs each computation on a thread of XLA's pool, one per core,
and glibc gives each thread its own arena, which keeps its own copy: 2-3 copies on 2 cores
(1.8-2.1 GB resident at 6/6/384, up to one copy per core on larger machines), each new
thread faulting its copy in afresh (198 MB in the fourth step of a CI run). On the calling
thread, every step allocates from the main arena. That step then faults 0-2 pages and holds
one copy (1.18-1.24 GB resident, as much as glibc holds as it starts) at the same speed:
834-854 ms against 833-858 ms on the pool, and 33.7-34.5 against 33.0-40.8 ms at 4/4/128
(three alternating processes each). jemalloc told never to return freed pages
(`JEMALLOC_CONF`, with LD_PRELOAD) faults 0-70 pages there, with 1.7-1.8 GB resident.
A step can still fault every time where one buffer is over 32 MiB (logits of a large
vocabulary on CPU): `python -m transformer.train` counts the page faults of a few of its steps
(`FaultWindow`) and, on CPU under glibc, names the jemalloc command when they reach 32 MB a
step.
"""

from __future__ import annotations

import ctypes.util
import os

JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
# The largest scratch heap XLA:CPU allocates (xla_multiheap_size_constraint_per_heap): under
# MMAP_THRESHOLD with room for malloc's alignment padding. A single buffer larger than this
# still gets a heap of its own.
SCRATCH_HEAP_BYTES = 30 * 2**20
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit (half its arena heap size)
# glibc unmaps an emptied arena heap only where the heap before it has this much room to
# spare, which a 64 MiB heap never has; the main heap, trimmed, keeps it too
TOP_PAD = 64 * 2**20
# glibc gives the main arena's free top back to the system above this; mallopt's largest value
TRIM_THRESHOLD = 2**31 - 1
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameters (<malloc.h>)
ASYNC_DISPATCH = "jax_cpu_enable_async_dispatch"


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


def keep_freed_memory() -> bool:
    """Under glibc, has malloc keep freed memory for the next train step: blocks up to
    MMAP_THRESHOLD come from its arenas, an arena heap whose blocks are all freed stays mapped,
    and JAX runs single-device CPU computations on the calling thread, so that one arena (the
    main one, trimmed only past TRIM_THRESHOLD) serves every step (the module docstring has
    the measurements). Process-wide and read when JAX starts its CPU client, so the CLIs call
    it at start-up, before any computation; a library does not. JAX_CPU_ENABLE_ASYNC_DISPATCH,
    if set, wins. Returns whether it applied (False under any other malloc)."""
    if allocator() != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # not in every Linux libc (musl)
    if mallopt is None:
        return False
    # mallopt returns 1 on success; setting any of these also fixes glibc's dynamic thresholds
    if not all(mallopt(param, value) for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TOP_PAD, TOP_PAD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))):
        return False
    if ASYNC_DISPATCH.upper() not in os.environ:
        import jax

        jax.config.update(ASYNC_DISPATCH, False)
    return True


def faulted_bytes() -> int:
    """Bytes this process has page-faulted in so far: minor faults (getrusage) x the page
    size; 0 where that is unavailable."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize()


class FaultWindow:
    """Page faults per train step, measured once over a window of logged steps: from the first
    log at least `skip` steps into the process (the first steps still map in what malloc then
    keeps: one CI run faulted 34 MB in its third step with the heaps kept) to the first log at
    least `span` steps later. An evaluation or save inside it restarts it after the pause.

    Example, from step 0 logging every step: `begin` at the log of step 4, `end` at the log of
    step 6, so steps 5-6 are counted; logging every 2 steps, the same; every 100, steps 101-200.
    """

    def __init__(self, step: int, skip: int = 4, span: int = 2):
        self._first, self._skip, self._span = step, skip, span
        self._start: tuple[int, int] | None = None  # (bytes faulted, step) where it began
        self._done = False

    def begin(self, step: int, pause: bool = False) -> None:
        """Starts the window at `step` (after its log and any evaluation or save) where it is
        due; restarts it after a `pause` (an evaluation or save) inside it."""
        if (not self._done and step - self._first >= self._skip
                and (self._start is None or pause)):
            self._start = (faulted_bytes(), step)

    def end(self, step: int) -> float | None:
        """At the log of `step`: bytes faulted per step over the window, once it spans `span`
        steps (None before that and after the first time)."""
        if self._done or self._start is None or step - self._start[1] < self._span:
            return None
        self._done = True
        return (faulted_bytes() - self._start[0]) / (step - self._start[1])


def advice(platform: str, faulted_bytes_per_step: float, name: str | None = None) -> str | None:
    """One line for a run on `platform` whose train steps each page-faulted in
    `faulted_bytes_per_step` (measured once the first steps have run): under glibc malloc on
    CPU, with at least MMAP_THRESHOLD faulted per step (glibc keeps freed blocks below it),
    the command that keeps XLA's scratch memory mapped. None otherwise: nothing to gain.

    >>> advice("cpu", 443.7e6, "jemalloc") is None
    True
    >>> advice("cpu", 4e6, "glibc") is None  # a small step's scratch memory is reused
    True
    """
    name = allocator() if name is None else name
    if platform != "cpu" or name != "glibc" or faulted_bytes_per_step < MMAP_THRESHOLD:
        return None
    library = ctypes.util.find_library("jemalloc")
    preload = (f"LD_PRELOAD={_path(library)}" if library else
               "LD_PRELOAD=libjemalloc.so.2 (apt install libjemalloc2)")
    return (f"host allocator: glibc malloc page-faulted {faulted_bytes_per_step / 1e6:,.0f} MB "
            "per train step (XLA's scratch memory, mapped afresh each step); to keep it: "
            f"{preload} MALLOC_CONF={JEMALLOC_CONF} (docs/performance.md: CPU runs)")


def _path(library: str) -> str:
    """find_library's soname as a path LD_PRELOAD loads from the usual library directories."""
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                      "/usr/lib", "/usr/local/lib"):
        candidate = os.path.join(directory, library)
        if os.path.exists(candidate):
            return candidate
    return library
