"""What the benchmarks train and break: models, presets and synthetic
batches, the digits data set, a timed training step, the DDP set-ups under
comparison, and worlds of ranks that fail on purpose. Imports from
benchmarks.harness only."""
