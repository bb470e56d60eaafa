"""Hugging Face interop: checkpoints in (`convert`, `convert_llama`) and out (`export`,
`export_llama`, refusing by `allowlist` what they do not map), and the lm-evaluation-harness
adapter over params in memory (`harness`)."""
