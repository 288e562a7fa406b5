"""The experiments' names, in the order docs/BENCHMARKS.md presents them.

Apart from the experiment modules, so that the command line (and --help) can
list them without importing what the experiments need (the `bench` extra)."""

NAMES = ("compare", "allreduce", "breakdown", "bucket", "scale", "nosync", "roundrobin", "faults", "order", "layerdrop",
         "timeline", "compression", "scaleout", "recovery", "fixedcost", "instructions", "overlap", "sharding", "diloco")

# Experiments that train their own models rather than workloads.presets.MODELS, with
# those models' names (the default of --models for them).
OWN_MODELS = {"order": ("reversed", "grouped", "switching"), "layerdrop": ("bert",), "timeline": ("bert",), "scaleout": ("mlp",), "fixedcost": ("tinymlp",), "instructions": ("tinymlp",),
              "overlap": ("resnet50", "bert", "mlp", "tiny"), "sharding": ("mlp", "bert", "tiny"), "diloco": ("charlm",)}
