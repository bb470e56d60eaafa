"""Data: sources, tokenizers and Grain pipelines."""
