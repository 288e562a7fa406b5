"""Benchmarks of ddp_ext against torch's DDP, after section 5 of the PyTorch
Distributed paper: `python -m benchmarks --help`, and docs/BENCHMARKS.md.

Layout, each layer importing only those below it:

- `__main__` (command line) and `runner` (one experiment: measure, then write);
- `experiments/`: one module per experiment (what to measure, how to show it);
- `reporting/`: result files, tables, figures, and docs/BENCHMARKS.md;
- `workloads/`: models, data, training steps, the DDP set-ups compared, fault
  worlds and fault injection;
- `harness/`: launching ranks (spawned, or with mpirun), interleaved
  measurement, statistics, machine state, progress, finished runs kept
  through a failure, torch's profiler kept quiet, the recording process
  group, hosts as network namespaces, and `product`, the one seam into ddp_ext's private modules.
"""
