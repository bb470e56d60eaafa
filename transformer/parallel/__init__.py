"""Parallelism: the device mesh, logical axis rules and shardings (`sharding`), and pipeline
stages over the scanned layer stack (`pipeline_parallel`)."""
