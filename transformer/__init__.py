"""A JAX/Flax Linen transformer research codebase.

Math as pure functions (`masks`, `positions`, `dense_attention.dot_product_attention`), Linen
modules where there are parameters (`attention.MultiHeadAttention`, `layers`).
"""
