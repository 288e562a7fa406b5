"""Turning measured results into files: summary JSON, PNG figures, markdown
tables, and docs/BENCHMARKS.md generated from the summaries and the prose
beside them. Imports from ddp_ext.bench.harness only; experiments are reached
through ddp_ext.bench.experiments' registry when rendering."""
