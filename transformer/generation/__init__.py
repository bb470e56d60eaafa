"""Decoding (floor 5, over models and data): sampling filters (`sampling`), the sampling loop
and its state (`loop`), beam search (`beam`), the models' prefill/step programs with `decode`
and `beam_search` (`programs`), and text in, texts out (`text`). The command that reads a
training workdir is `transformer.generate`, which re-exports these calls."""
