"""Hugging Face interop: checkpoints in (`convert`) and the lm-evaluation-harness adapter."""
