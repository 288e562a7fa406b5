"""scaleout [paper Fig. 9/10 over links]: every DDP's cost as ranks and hosts grow.

Hosts are network namespaces on this machine joined by veth pairs (through a
bridge from 3 hosts), each host's sending shaped with tc to 1 or 10 Gbit/s
(benchmarks/harness/fake_hosts.py); ranks of one host talk over its loopback. Configurations:
1, 2 and 4 hosts of 1, 2 and 4 ranks, up to 8 ranks, the ranks numbered
host by host as torchrun numbers them (LOCAL_WORLD_SIZE / LOCAL_RANK set).
In each, the eight variants of workloads/scaleout_variants.py alternate
block by block (Note [Interleaved measurement]), then each runs a few more
iterations alone while every host counts the bytes it sends on its veth
(/proc/net/dev in its namespace): the bytes crossing the inter-host link.
Scaling efficiency = a variant's median at 1 rank / its median here (the
batch per rank is fixed, so ideal scaling keeps the time).

All ranks share the machine's cores: with more ranks than cores, compute
sharing, not the link, sets much of the time.
"""

import functools
import os

import torch
import torch.distributed as dist

from ddp_ext import hierarchy
from benchmarks.harness import stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.machine import usable_cores
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads import scaleout_variants as sv
from benchmarks.workloads.training_step import TrainingStep
from benchmarks.harness import fake_hosts as hosts

NAME = "scaleout"
FIGURE = "Fig. 9/10 over links"
TITLE = "Scaling out: ranks and hosts over shaped links"
RUN_LENGTHS = {"warmup": 10, "blocks": 3, "block_iterations": 4, "discard_per_block": 1}
# (hosts, ranks per host, link Gbit/s; None for one host, where nothing crosses a link)
CONFIGS = [(1, 1, None), (1, 2, None), (1, 4, None)] + [
    (h, r, g) for g in (1, 10) for h, r in ((2, 1), (2, 2), (2, 4), (4, 1), (4, 2))
]
QUICK_CONFIGS = [(2, 1, 1)]
BYTES_ITERATIONS = {False: 3, True: 1}


def _enter_host(placed, ranks_per_host, rank):
    """Runs first in each rank's process: into its host, with torchrun's variables."""
    hosts.enter_rank(placed, ranks_per_host, rank)
    os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_host), LOCAL_RANK=str(rank % ranks_per_host),
                      OMP_NUM_THREADS="1")


def _measure(rank, world_size, job):
    options, ranks_per_host, lengths, progress = job
    progress = progress.for_rank(rank)
    built = {v: sv.build(v, options.seed) for v in sv.VARIANTS}
    inputs = sv.batch(1000 * options.seed + rank)
    steps = {v: TrainingStep(ddp, inputs) for v, (ddp, _) in built.items()}
    samples = run_interleaved(steps, **lengths, progress=progress, label=f"{world_size} ranks")
    counts_link = rank % ranks_per_host == 0  # one rank per host reads its veth
    sent = []
    for v in sv.VARIANTS:
        dist.barrier()
        before = hosts.link_bytes()[1] if counts_link else 0
        for _ in range(BYTES_ITERATIONS[options.quick]):
            steps[v]()
        dist.barrier()
        sent.append((hosts.link_bytes()[1] - before) if counts_link else 0)
    total = torch.tensor(sent, dtype=torch.int64)
    dist.all_reduce(total)
    ddp, state = built[sv.OURS_ADAPTIVE]
    return {
        "samples": samples,
        "link_bytes_per_iteration": {v: int(b) / BYTES_ITERATIONS[options.quick]
                                     for v, b in zip(sv.VARIANTS, total.tolist())},
        "hierarchical_calls": hierarchy.hierarchical_calls(built[sv.OURS_HIERARCHY][0].reducer_group),
        "adaptive": {"formats": list(state.formats), "mode": state.mode, "int8_exchange": state.int8_exchange_used},
    }


def _lengths(options: BenchOptions) -> dict:
    return options.run_lengths()


def run(options: BenchOptions, progress) -> dict:
    reason = hosts.cannot_make_namespaces()
    if reason:
        progress.say(f"scaleout skipped: {reason}")
        return {"rows": [], "skipped": reason, "notes": [f"Not measured: {reason}."], "ranks": "none"}
    rows, extras = [], []
    for n, (host_count, per_host, gbit) in enumerate(QUICK_CONFIGS if options.quick else CONFIGS):
        world_size = host_count * per_host
        progress.say(f"{host_count} host(s) x {per_host} rank(s), link {gbit} Gbit/s")
        with hosts.fake_hosts(host_count, f"s{n}", gbit) as placed:
            per_rank = launch(_measure, world_size, (options, per_host, _lengths(options), progress), 1,
                              options.timeout_s, setup=functools.partial(_enter_host, placed, per_host))
        merged = merge_ranks([r["samples"] for r in per_rank])
        link = per_rank[0]["link_bytes_per_iteration"]
        for v in sv.VARIANTS:
            summary = stats.summarize(merged[v])
            rows.append({
                "hosts": host_count, "ranks_per_host": per_host, "ranks": world_size, "link_gbit": gbit,
                "variant": v, "ms": summary["median_ms"], "q25_ms": summary["q25_ms"], "q75_ms": summary["q75_ms"],
                "over_torch": stats.ratio(merged[v], merged[sv.TORCH])["ratio"],
                "link_bytes": link[v],
            })
        extras.append({"hosts": host_count, "ranks_per_host": per_host, "link_gbit": gbit,
                       "hierarchical_calls": per_rank[0]["hierarchical_calls"], "adaptive": per_rank[0]["adaptive"]})
    _add_efficiency(rows)
    return {"rows": rows, "configs": extras, "targets": targets(rows), "notes": _notes(),
            "ranks": "1 to 8 (per configuration)"}


def _add_efficiency(rows) -> None:
    single = {r["variant"]: r["ms"] for r in rows if r["ranks"] == 1}
    for r in rows:
        r["efficiency"] = single[r["variant"]] / r["ms"] if r["variant"] in single else None


def _row(rows, variant, host_count, per_host, gbit):
    for r in rows:
        if (r["variant"], r["hosts"], r["ranks_per_host"], r["link_gbit"]) == (variant, host_count, per_host, gbit):
            return r
    return None


def targets(rows) -> list:
    """Each target, per configuration it applies to: the value, and whether it was met."""
    out = []

    def add(name, config, value, bound, at_most=True):
        out.append({"target": name, "config": config, "value": value, "bound": bound,
                    "met": bool(value <= bound if at_most else value >= bound)})

    for r in rows:
        config = f"{r['hosts']}x{r['ranks_per_host']} @ {r['link_gbit']} Gbit/s"
        if r["hosts"] < 2 or r["ranks_per_host"] < 2:
            continue
        flat = _row(rows, sv.OURS, r["hosts"], r["ranks_per_host"], r["link_gbit"])
        torch_row = _row(rows, sv.TORCH, r["hosts"], r["ranks_per_host"], r["link_gbit"])
        if r["variant"] == sv.OURS:
            add("ddp_ext without hooks / torch DDP time", config, r["over_torch"], 1.0)
        if r["variant"] == sv.OURS_HIERARCHY:
            add("hierarchy: flat / hierarchical time (never below 1)", config, flat["ms"] / r["ms"], 1.0, at_most=False)
            if (r["hosts"], r["ranks_per_host"], r["link_gbit"]) == (2, 2, 1):
                add("hierarchy: flat / hierarchical time at 2x2, 1 Gbit/s", config, flat["ms"] / r["ms"], 1.3,
                    at_most=False)
        if r["variant"] == sv.OURS_ADAPTIVE and r["ranks"] in (4, 8) and r["link_gbit"] == 1:
            if flat["link_bytes"] > 0:
                add("adaptive: link bytes / float32's", config, r["link_bytes"] / flat["link_bytes"], 0.35)
            add("adaptive / torch DDP time", config, r["ms"] / torch_row["ms"], 0.6)
        if r["variant"] == sv.OURS_LAYERDROP and r["link_gbit"] == 1:
            add("layer drop p=0.5 / torch DDP time", config, r["over_torch"], 0.8)
    return out


def _notes() -> list:
    return [
        f"One machine of {usable_cores()} usable cores runs every rank (1 thread each): with more ranks than "
        "cores, computation slows down as ranks are added, whatever the link.",
        "Links: tc tbf on each host's veth (rate only; this kernel has no netem, so no delay is added). "
        "Ranks of one host talk over its loopback.",
        f"Model: an MLP of {sum(p.numel() for p in sv.ScaleoutMLP(0.0).parameters()) / 1e6:.2f} M parameters, "
        f"batch {sv.BATCH} per rank; hooks start early (adaptive warm-up {sv.HOOKS.adaptive_warmup}, windows of "
        f"{sv.HOOKS.adaptive_check_every}; PowerSGD from iteration {sv.HOOKS.start_powerSGD_iter}).",
        "link MB/it: bytes all hosts sent on their veths per iteration (Gloo's payloads and TCP/IP headers).",
    ]


def table(data: dict) -> str:
    if not data["rows"]:
        return f"Not measured: {data.get('skipped', 'no configuration ran')}."
    rows = []
    for r in data["rows"]:
        gbit = "-" if r["link_gbit"] is None else f"{r['link_gbit']:g}"
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        rows.append([str(r["hosts"]), str(r["ranks_per_host"]), gbit, r["variant"], f"{r['ms']:.1f}",
                     markdown.ratio(r["over_torch"]), f"{r['link_bytes'] / 1e6:.2f}", eff])
    main = markdown.table(["hosts", "ranks/host", "link Gbit/s", "variant", "ms (median)", "/ torch",
                           "link MB/it", "efficiency"], rows)
    checks = [[t["target"], t["config"], f"{t['value']:.3f}", f"{'<=' if 'never' not in t['target'] and 'flat /' not in t['target'] else '>='} {t['bound']}",
               "met" if t["met"] else "not met"] for t in data.get("targets", [])]
    if not checks:
        return main
    return main + "\n\nTargets:\n\n" + markdown.table(["target", "configuration", "measured", "bound", ""], checks)


def plot(data: dict, path: str) -> None:
    """One panel per host count and link, time against ranks, one line per variant."""
    panels = sorted({(r["hosts"], r["link_gbit"]) for r in data["rows"]}, key=lambda k: (k[1] or 0, k[0]))
    figure, axes = figures.panels(max(1, len(panels)), width_per_panel=4.0)
    for ax, (host_count, gbit) in zip(axes, panels):
        for v in sv.VARIANTS:
            points = sorted((r["ranks"], r["ms"]) for r in data["rows"]
                            if r["variant"] == v and r["hosts"] == host_count and r["link_gbit"] == gbit)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=sv.LABELS[v])
        ax.set_xticks(sorted({r["ranks"] for r in data["rows"] if r["hosts"] == host_count}))
        ax.set_xlabel("ranks (all on the machine's shared cores)")
        ax.set_ylabel("per-iteration time (ms), median")
        ax.set_title(f"{host_count} host(s)" + ("" if gbit is None else f", link {gbit:g} Gbit/s"))
    axes[0].legend(fontsize="x-small")
    figures.save(figure, path, TITLE + " (shared, loaded machine: noisy)")
