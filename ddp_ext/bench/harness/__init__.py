"""How a benchmark runs, whatever it measures: launching ranks, interleaving,
statistics, machine state, progress, options, hosts as network namespaces
(`hosts`), and `product`, the one module
that reaches into ddp_ext's private modules. Imports nothing from the other
parts of ddp_ext.bench."""
