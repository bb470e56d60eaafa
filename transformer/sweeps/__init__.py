"""Sweeps as a library (floor 7, over training): what a sweep is (`definition`: variants, seeds,
names, launch commands), the statistics of its report (`statistics`), the report itself
(`report`: a run directory's row, the tables of report.md) and its plots (`plots`); the
scaling-law fits of an IsoFLOP sweep (`isoflop`: Chinchilla's approach 2, `parametric`:
approach 3), whose report is `transformer.scaling`'s. Running the variants (transformer.train,
transformer.batched) is the command's: `transformer.sweep`."""
