"""Shared test settings."""

import jax

# Threefry key derivation dominates compile time of tiny inits on CPU (~3x); the PRNG
# implementation is orthogonal to the math under test, so tests use the cheaper "rbg".
jax.config.update("jax_default_prng_impl", "rbg")
