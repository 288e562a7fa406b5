"""How a benchmark runs, whatever it measures: launching ranks, interleaving,
statistics, machine state, progress, options, and `product`, the one module
that reaches into ddp_ext's private modules. Imports nothing from the other
parts of the benchmarks. Hosts as network namespaces are in
benchmarks/harness/fake_hosts.py, which the tests use as well."""
