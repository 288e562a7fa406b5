"""Benchmarks of ddp_ext against torch's DDP, after section 5 of the PyTorch
Distributed paper: `python -m ddp_ext.bench --help`, and docs/BENCHMARKS.md.

Layout: __main__ (command line) -> runner (one experiment: measure, then write)
-> experiments/<name>.py (what to measure and how to show it) -> launcher
(spawned Gloo ranks), interleave (side-by-side blocks), training_step,
replicas (ddp_ext / torch DDP / local), workloads and models/ (ResNet-50,
BERT-like encoder), stats, and reporting/ (JSON, PNG, markdown, the docs).
"""
