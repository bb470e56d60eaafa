"""Shared test settings."""

import atexit
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

import jax  # noqa: E402

# Threefry key derivation dominates compile time of tiny inits on CPU (~3x); the PRNG
# implementation is orthogonal to the math under test, so tests use the cheaper "rbg".
jax.config.update("jax_default_prng_impl", "rbg")
