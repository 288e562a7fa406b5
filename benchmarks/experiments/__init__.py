"""One module per experiment of the paper's section 5, `faults` (ddp_ext's
own, see docs/RELIABILITY.md), `order` (section 6.2.1), `layerdrop`
(section 6.2.2), `timeline` (ddp_ext's communication timeline),
`compression` (gradient compression hooks), `scaleout` (ranks and hosts over
shaped links) and `recovery` (ddp_ext.fault_tolerance, see
docs/FAULT_TOLERANCE.md), `fixedcost` (ddp_ext's fixed cost per iteration), `instructions` (the
same, counted in instructions) and
`overlap` (ddp_ext's overlap_optimizer, see docs/OPTIMIZER_OVERLAP.md), `sharding` (its
shard=True, see docs/SHARDING.md) and `diloco`
(ddp_ext.DiLoCo against DDP over slow links, see docs/DILOCO.md). Each has
NAME, FIGURE, TITLE, run(options, progress) -> payload, table(data) -> markdown
and plot(data, path); optionally RUN_LENGTHS (its default run lengths, where they
differ from BenchOptions') and run_line(data) (how its run is described)."""

from benchmarks.experiment_names import NAMES
from benchmarks.experiments import (
    allreduce, breakdown, bucket, compare, compression, diloco, faults, fixedcost, instructions, layerdrop, nosync, order,
    recovery, overlap, roundrobin, scale, scaleout, sharding, timeline,
)

# In the order of NAMES (the order docs/BENCHMARKS.md presents them).
EXPERIMENTS = {
    module.NAME: module
    for module in (compare, allreduce, breakdown, bucket, scale, nosync, roundrobin, faults, order, layerdrop,
                   timeline, compression, scaleout, recovery, fixedcost, instructions, overlap, sharding, diloco)
}
assert tuple(EXPERIMENTS) == NAMES, f"experiment_names.NAMES {NAMES} differs from the modules {tuple(EXPERIMENTS)}"
