"""A JAX/Flax Linen transformer research codebase.

Rooms on floors, each importing only from below (docs/api.md, tests/test_imports.py): `utils`,
`parallel`, `nn` (math as pure functions: `nn.masks`, `nn.positions`,
`nn.dense_attention.dot_product_attention`; Linen modules where there are params:
`nn.attention.MultiHeadAttention`, `nn.blocks`), `models`, `data`, `generation`, `hf`,
`training`, `sweeps`, and the commands at the top (`python -m transformer.train`, ...).
"""


def load(source: str, step: int | None = None, merge_lora: bool = False):
    """A trained model ready to use (`transformer.loaded.Loaded`: `logits`, `score`,
    `generate`), from a training workdir or a Hugging Face directory (`hf:DIR`)."""
    from transformer.loaded import load as load_source

    return load_source(source, step, merge_lora)
