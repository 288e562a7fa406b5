"""allreduce [paper Fig. 2a/b]: total time to allreduce a fixed number of
float32 values split into tensors of 1K ... all elements.

All tensors of one split are allreduced asynchronously and then awaited
together, as DDP does with its buckets. Measured on the plain Gloo group and on
ddp_ext's round-robin groups (rrN: N Gloo children taking turns). With
--backend ddp_ext_mpi (ranks started by mpirun) on ddp_ext's MPI group, a Gloo
group over the same ranks beside it, and round-robin groups of MPI children. Every
repetition visits every (split, group) once, so groups and splits interleave;
the group measured first rotates from one repetition to the next.
Tensors hold zeros (summing floats costs the same whatever their value) so
repeated reduction cannot overflow.
"""

import time

import torch
import torch.distributed as dist

from benchmarks.harness import round_robin, stats
from benchmarks.harness.interleave import merge_ranks, rotated
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown

NAME = "allreduce"
FIGURE = "Fig. 2a/b"
TITLE = "Total allreduce time vs elements per allreduce"
# Thousands of 1K-element allreduces per measurement: fewer repetitions keep preset small within minutes.
RUN_LENGTHS = {"warmup": 1, "blocks": 6}

GLOO = "gloo"
# float32 values reduced in total: the paper used 60M.
TOTAL_ELEMENTS = {"small": 2**22, "paper": 60_000_000}
QUICK_TOTAL_ELEMENTS = 2**16
SMALLEST_SPLIT = 1024


def total_elements(options: BenchOptions) -> int:
    if options.allreduce_elements:
        return options.allreduce_elements
    return QUICK_TOTAL_ELEMENTS if options.quick else TOTAL_ELEMENTS[options.preset]


def splits(total: int) -> list:
    """Elements per tensor: 1K, 4K, 16K, ... and finally all of them in one tensor."""
    sizes = []
    size = SMALLEST_SPLIT
    while size < total:
        sizes.append(size)
        size *= 4
    return sizes + [total]


def group_names(options) -> list:
    """The groups measured, in the order _groups makes them."""
    names = [options.process_group_backend()] + ([GLOO] if options.process_group_backend() != GLOO else [])
    return names + ([round_robin.label(n) for n in options.rr_groups] if options.round_robin else [])


def _groups(options):
    groups = {options.process_group_backend(): dist.distributed_c10d._get_default_group()}
    if options.process_group_backend() != GLOO:
        groups[GLOO] = dist.new_group(backend=GLOO)
    if options.round_robin:
        for n in options.rr_groups:
            groups[round_robin.label(n)] = round_robin.new_round_robin_group(n, options.process_group_backend())
    assert list(groups) == group_names(options)
    return groups


def _time_allreduce(tensors, group) -> float:
    dist.barrier()
    start = time.perf_counter()
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    return (time.perf_counter() - start) * 1e3


def _measure(rank, world_size, job):
    options, progress = job
    progress = progress.for_rank(rank)
    total = total_elements(options)
    groups = _groups(options)
    tensors = {size: [torch.zeros(min(size, total - start)) for start in range(0, total, size)]
               for size in splits(total)}
    for name, group in groups.items():
        for size in tensors:
            for _ in range(options.warmup):
                _time_allreduce(tensors[size], group)
    # Shaped like interleave.run_interleaved's output: {variant: [[sample]]} with one sample per block.
    measured = {f"{name}/{size}": [] for name in groups for size in tensors}
    for repetition in range(options.blocks):
        for size in tensors:
            for name in rotated(list(groups), repetition):
                measured[f"{name}/{size}"].append([{"total": _time_allreduce(tensors[size], groups[name])}])
        progress.say(f"repetition {repetition + 1}/{options.blocks}")
    return measured


def run(options: BenchOptions, progress) -> dict:
    if options.round_robin:
        round_robin.require_round_robin()  # fail before starting any rank
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s,
                      options.process_group_backend())
    merged = merge_ranks(per_rank)
    names = group_names(options)
    total = total_elements(options)
    series = {name: {str(size): stats.summarize(merged[f"{name}/{size}"]) for size in splits(total)}
              for name in names}
    notes = [f"{total:,} float32 values ({total * 4 / 2**20:.1f} MiB) per measurement; time = slowest rank's, "
             "from launching the first allreduce to the last wait() returning."]
    if not options.round_robin:
        notes.append("Round-robin groups were not measured (--no-round-robin).")
    elif options.process_group_backend() != GLOO:
        notes.append(f"rrN: round-robin groups of N {options.process_group_backend()} children.")
    return {"series": series, "total_elements": total, "notes": notes}


def run_line(data: dict) -> str:
    o = data["options"]
    return (f"{o['warmup']} warm-up and {o['blocks']} measured repetitions; every repetition times each "
            "(split, group) pair once, splits and groups alternating.")


def table(data: dict) -> str:
    names = list(data["series"])
    sizes = list(data["series"][names[0]])
    total = data["total_elements"]
    rows = [[f"{int(size):,}", f"{-(-total // int(size)):,}", *(markdown.ms_iqr(data["series"][n][size]) for n in names)]
            for size in sizes]
    return markdown.table(["elements per allreduce", "allreduces", *(f"{n} ms (IQR)" for n in names)], rows)


def plot(data: dict, path: str) -> None:
    figure, (ax,) = figures.panels(1, width_per_panel=7.0)
    for name, by_size in data["series"].items():
        sizes = [int(s) for s in by_size]
        line, = ax.plot(sizes, [by_size[str(s)]["median_ms"] for s in sizes], marker="o", label=name)
        ax.fill_between(sizes, [by_size[str(s)]["q25_ms"] for s in sizes], [by_size[str(s)]["q75_ms"] for s in sizes],
                        color=line.get_color(), alpha=0.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("float32 elements per allreduce")
    ax.set_ylabel("total time (ms), median and IQR")
    ax.legend(fontsize="small")
    figures.save(figure, path, f"{TITLE} ({data['total_elements']:,} values, {data['options']['world_size']} ranks)")
