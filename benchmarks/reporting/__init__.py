"""Turning measured results into files: summary JSON, PNG figures, markdown
tables, and docs/BENCHMARKS.md generated from the summaries and the prose
beside them. Imports from benchmarks.harness only; experiments are reached
through benchmarks.experiments' registry when rendering."""
