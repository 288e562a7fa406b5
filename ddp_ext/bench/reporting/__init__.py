"""Turning measured results into files: JSON, PNG figures, markdown tables and docs."""
