"""Sweeps as a library (floor 7, over training): what a sweep is (`definition`: variants, seeds,
names, launch commands), the statistics of its report (`statistics`), the report itself
(`report`: a run directory's row, the tables of report.md) and its plots (`plots`). Running
the variants (transformer.train, transformer.batched) is the command's: `transformer.sweep`."""
