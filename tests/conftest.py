"""Shared test settings."""

import atexit
import gc
import os
import shutil
import tempfile

# With the tpu extra installed, every process that starts JAX loads libtpu, which by default
# locks /tmp/libtpu_lockfile for the process's lifetime: the AOT tests' subprocesses need it too.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# One persistent XLA compilation cache per test session, shared with the CLI subprocesses
# (they inherit the environment): dozens of runs compile the same tiny train and eval steps.
# A compiled program is the same with or without the cache; `JAX_COMPILATION_CACHE_DIR=` (empty)
# turns it off.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="transformer-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
# Every program goes in (JAX's default keeps only compiles over 1 s, and most of the suite's
# tiny programs compile faster): a resumed run, or a second command on the same model,
# then loads what the first compiled.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# The CPU peak that MFU is measured against (metrics.measured_cpu_peak) is cached per machine.
# Measured while the suite loads every core, it would be a fraction of the machine's, so the
# session (and its subprocesses) cache it in a temporary file, never in the user's ~/.cache.
if "TRANSFORMER_CPU_PEAK_CACHE" not in os.environ:
    _peak = tempfile.mkdtemp(prefix="transformer-tests-cpu-peak-")
    atexit.register(shutil.rmtree, _peak, ignore_errors=True)
    os.environ["TRANSFORMER_CPU_PEAK_CACHE"] = os.path.join(_peak, "cpu_peak.json")


def _fast_compile_flags() -> str:
    """XLA flags that cut the suite's compile time (most of its time) by half: LLVM at -O0,
    XLA:CPU's older loop emitters, and each program's machine code emitted in one piece, each
    only if this jaxlib knows it (an unknown flag in XLA_FLAGS aborts every JAX process, and
    jaxlib 0.12 dropped the emitter flag).

    One piece: XLA:CPU splits a program's LLVM module into parts that compile on a thread pool.
    That saves wall time on an idle many-core machine; here the two test workers keep both
    cores busy, so only the splitting's own CPU time shows. With jaxlib 0.10.2, compiling the
    init and train step of the GPT of tests/mesh_check.py on one device and on 2 x 2 x 2 took
    4.2 to 4.6 CPU-seconds against 5.2 to 5.9 (medians of 5 and 7 interleaved runs on a 2-core
    Zen 4 EPYC); jaxlib 0.12.0.1 compiled them in the same time either way.

    They change how XLA:CPU turns a program into machine code (results may differ from a
    default build in the last bits), not the program: no test depends on code speed, and runs
    compared bitwise (resumes, meshes, the CLI's subprocesses, which inherit XLA_FLAGS) all
    compile with the same flags. The newest-jax CI tier keeps the default
    emitters. Tried in a subprocess (XLA reads XLA_FLAGS once, when JAX starts): all of them in
    one, then, if that fails, one at a time (each try starts JAX: 1.6 s)."""
    import subprocess
    import sys

    def known(*flags: str) -> bool:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
        return subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1)"],
                              env=env, capture_output=True).returncode == 0

    if known(*FAST_COMPILE):
        return " ".join(FAST_COMPILE)
    return " ".join(flag for flag in FAST_COMPILE if known(flag))


FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1")
# Decided once per session (pytest-xdist workers inherit the environment); set
# TRANSFORMER_TESTS_XLA_FLAGS= (empty) to compile as users do.
if "TRANSFORMER_TESTS_XLA_FLAGS" not in os.environ:
    os.environ["TRANSFORMER_TESTS_XLA_FLAGS"] = _fast_compile_flags()
    os.environ["XLA_FLAGS"] = " ".join(
        (os.environ.get("XLA_FLAGS", ""), os.environ["TRANSFORMER_TESTS_XLA_FLAGS"])).strip()

import jax  # noqa: E402

# Threefry key derivation dominates compile time of tiny inits on CPU (~3x); the PRNG
# implementation is orthogonal to the math under test, so tests use the cheaper "rbg".
jax.config.update("jax_default_prng_impl", "rbg")


# pytest-xdist (--dist loadfile) hands test files to the workers in collection order, which is
# alphabetical: a long file collected last (test_workdir.py) runs alone on one core at the end.
# The files that took longest in the full suite's profile go first, longest first, so that the
# short ones fill in at the end. A file's own tests keep their order.
LONGEST_FIRST = (
    "test_moe.py", "test_sharding.py", "test_batched.py", "test_sequence_parallel.py",
    "test_train.py", "test_workdir.py", "test_lora.py", "test_pipeline_parallel.py",
    "test_mixer_stacks.py", "test_export.py", "test_hf_finetune_cli.py", "test_hostmem.py",
    "test_sft.py", "test_optimizers.py", "test_quantization.py", "test_mtp.py",
    "test_model_knobs.py", "test_launch.py", "test_reliability.py", "test_sweep_seeds.py",
    "test_chunked_attention.py", "test_hf_init.py", "test_vision.py", "test_finetune.py")


def pytest_collection_finish(session):
    """The objects collection made (jax, torch, transformers, every test module: about 5 x 10^5)
    move to the collector's permanent generation (gc.freeze), so that the full collections
    the tests' tracing sets off walk only what the tests made. Measured on 149 in-process
    tests (`-k "test_models or test_layers or test_masks"`, two runs each way): the collector's
    own time 7.7-8.7 s -> 6.6-6.9 s, the run's 112-132 s -> 94-98 s."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
