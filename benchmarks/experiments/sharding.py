"""sharding: ddp_ext's sharded optimizer beside torch's DDP, torch's ZeRO and ddp_ext's overlaps.

Variants of one training iteration run the same replica from the same seed
on the same batch, with the same bucket cap and Adam (foreach=True),
alternating block by block in the same ranks (Note [Interleaved
measurement]), as in the `overlap` experiment, whose models, placements and
links (harness/link_configs.py) this one reuses:

- `torch`: torch's DDP, optimizer.step() after the backward;
- `torch_zero`: torch's DDP with torch's ZeroRedundancyOptimizer over Adam,
  stepped after the backward (its overlap_with_ddp is refused on Gloo): each
  rank steps the parameters it owns, then broadcasts them;
- `ours`: ddp_ext, optimizer.step() after the backward;
- `ours_overlap`: ddp_ext after `ddp.overlap_optimizer(optimizer,
  overlap_forward=True)`;
- `ours_sharded`: ddp_ext after `ddp.overlap_optimizer(optimizer, shard=True,
  overlap_forward=True)`: each bucket reduce-scattered, each rank stepping
  its shard, the parameters all-gathered behind the next forward
  (docs/SHARDING.md).

Per variant and configuration:
- ms: the median iteration, with its interquartile range and phases;
- bytes_per_rank: what a rank sent per iteration, counted by the kernel
  (harness/sent_bytes.py), over a few untimed iterations after the timed
  blocks, from and to a point where nothing is on the wire (the forward
  overlap's tail finished), the largest rank's;
- peak_mib: the most bytes of torch CPU tensors a rank held during an
  iteration, persistent state included (parameters, gradients, optimizer
  state, buckets, the batch): each variant built again under torch's
  profiler, three iterations, then five measured ones, the least of their
  peaks (peak_memory.held_peak_bytes: a tensor freed unseen, on a Gloo
  thread, counted until its address is allocated again, which only raises
  an iteration's figure), the largest rank's;
- bound_ms = max(forward + backward + optimizer / N, link): the bare
  model's (`local`, interleaved with the others in the same ranks) forward
  and backward, its Adam step divided among the N ranks, and a ring
  allreduce's bytes at the link's rate (0 on the loopback).

At the end every rank compares parameters and buffers: ddp_ext's with
overlap_forward against ddp_ext's without, bitwise, failing the run if they
differ; ddp_ext sharded and torch's ZeRO against torch's DDP, recorded
(bitwise equal, or the largest difference): at 2 ranks the sharded run must
be bitwise torch's DDP's and fails the run otherwise (Note [Exact sharded
steps] in ddp_ext/_sharded_optimizer.py says what holds at more).
"""

import functools
from typing import Dict, List, Optional

import torch
from torch import nn

import benchmarks.experiments.overlap as overlap
from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness import iteration_bound, link_configs, peak_memory, sent_bytes, stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions, effective_bucket_cap_mb
from benchmarks.reporting import figures, markdown
from benchmarks.workloads import sharding_variants as sv
from benchmarks.workloads.overlap_variants import LEARNING_RATE, OURS_OVERLAP
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH
from benchmarks.workloads.sharding_variants import LABELS, OURS_SHARDED, TIMED, TORCH_ZERO, VARIANTS
from benchmarks.workloads.training_step import PHASES

NAME = "sharding"
FIGURE = "none (ddp_ext's own: the optimizer sharded inside the drop-in)"
TITLE = "The sharded optimizer: overlap_optimizer(shard=True) beside torch's DDP and ZeroRedundancyOptimizer"

MIB = 2**20
COUNTED_ITERATIONS = 4  # per variant, for bytes_per_rank
PEAK_ITERATIONS = 5  # per variant, the least peak of these (after three)
TIME_TARGET_2X2 = 0.75  # ours_sharded / torch at 2 hosts x 2 ranks over a link, on the MLP
TIME_TARGET = 1.00  # ours_sharded / torch everywhere
BYTES_TARGET = 0.02  # |ours_sharded bytes / torch's - 1|
PEAK_TARGET = 0.55  # ours_sharded peak / torch's at 4 ranks


def _finished(step) -> nn.Module:
    """The variant's module with every pending all-gather or step finished."""
    wrapped = step.step.model
    if hasattr(wrapped, "finish_forward_tail"):
        wrapped.finish_forward_tail()
    return wrapped.module


def largest_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the parameters and buffers of `a` and `b` (0.0: bitwise equal)."""
    named_b = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    worst = 0.0
    for name, t in [*a.named_parameters(), *a.named_buffers()]:
        other = named_b[name]
        if not torch.equal(t, other):
            gap = (t.detach().double() - other.detach().double()).abs().max() if t.is_floating_point() else 1.0
            worst = max(worst, float(gap))
    return worst


def _measure(rank: int, world_size: int, job):
    options, progress = job
    progress = progress.for_rank(rank)
    cap = effective_bucket_cap_mb(options.single_bucket_cap())
    measured = {}
    for model in options.models:
        def make(kind):
            return sv.build(kind, model, options.preset, options.seed, rank, cap)

        steps = {kind: make(kind) for kind in TIMED}
        samples = run_interleaved(steps, **options.run_lengths(), progress=progress, label=model)
        counted = {kind: sent_bytes.per_iteration(steps[kind], COUNTED_ITERATIONS,
                                                  functools.partial(_finished, steps[kind])) for kind in VARIANTS}
        modules = {kind: _finished(steps[kind]) for kind in VARIANTS}
        differing = [f"{OURS_OVERLAP}: {name}" for name in overlap.differing_tensors(modules[OURS],
                                                                                    modules[OURS_OVERLAP])]
        against_torch = {kind: largest_difference(modules[kind], modules[TORCH])
                         for kind in (OURS, OURS_SHARDED, TORCH_ZERO)}
        del steps, modules
        # Untimed, after the timed blocks: the profiler slows what it watches.
        # Three iterations before the measured ones: the sharded run's third step
        # is the first on a settled layout, where its parameters move into their buckets' storage.
        peaks = {kind: peak_memory.held_peak_bytes(functools.partial(make, kind), before=3, measured=PEAK_ITERATIONS,
                                                   finish=_finished)
                 for kind in VARIANTS}
        module, _ = sv.ov.model_and_batch(model, options.preset, options.seed, rank)
        measured[model] = {"samples": samples, "differing": differing, "against_torch": against_torch,
                           "compared": len([*module.parameters(), *module.buffers()]), "peak_bytes": peaks,
                           "sent_bytes": counted, "gradient_bytes": sv.ov.gradient_bytes(module)}
    return measured


def equality(model: str, per_rank: List[dict], world_size: int) -> Dict[str, object]:
    """The summary's record of the comparisons; raises where a run must be bitwise and is not."""
    overlap.bitwise_check(model, per_rank)
    against = {kind: max(r["against_torch"][kind] for r in per_rank) for kind in per_rank[0]["against_torch"]}
    if world_size == 2 and against[OURS_SHARDED] != 0.0:
        raise RuntimeError(f"sharding, {model}: at 2 ranks ddp_ext sharded ended with parameters that are not "
                           f"bitwise torch's DDP's (largest difference {against[OURS_SHARDED]:.3g})")
    return {"overlap_vs_ours_bitwise": True, "largest_difference_to_torch": against,
            "bitwise_to_torch": {kind: diff == 0.0 for kind, diff in against.items()},
            "ranks": len(per_rank), "tensors_per_rank": per_rank[0]["compared"]}


def _launch(options: BenchOptions, progress) -> List[dict]:
    job = (options, progress)
    if options.link_gbit is None:
        return launch(_measure, options.world_size, job, options.threads, options.timeout_s)
    reason = hosts.cannot_make_namespaces()
    if reason:
        raise RuntimeError(f"sharding --link: {reason}")
    count, per_host = overlap.placement(options)
    with hosts.fake_hosts(count, "sh", options.link_gbit) as placed:
        return launch(_measure, options.world_size, job, options.threads, options.timeout_s,
                      setup=functools.partial(hosts.enter_rank, placed, per_host, torchrun=True))


def bound_ms(summary: dict, ranks: int, link_gbit: Optional[float]) -> float:
    """max(forward + backward + optimizer / N of the bare model, a ring allreduce's bytes at the link's rate)."""
    local = summary["phases_ms"][LOCAL]
    computation = local["forward"] + local["backward"] + local["optimizer"] / ranks
    return max(computation, iteration_bound.link_ms(summary["gradient_bytes"], ranks, link_gbit))


def rows_of(model: str, summary: dict, hosts_count: int, per_host: int, link_gbit: Optional[float]) -> List[dict]:
    """One row per variant of `model` in one configuration, from its per-model summary."""
    ranks = hosts_count * per_host
    bound = bound_ms(summary, ranks, link_gbit)
    torch_ms = summary["summary"][TORCH]["median_ms"]
    torch_peak, torch_bytes = summary["peak_mib"][TORCH], summary["bytes_per_rank"][TORCH]
    rows = []
    for kind in VARIANTS:
        ms, peak, sent = summary["summary"][kind]["median_ms"], summary["peak_mib"][kind], summary["bytes_per_rank"][kind]
        rows.append({"model": model, "hosts": hosts_count, "ranks_per_host": per_host, "ranks": ranks,
                     "link": overlap.link_name(link_gbit), "variant": kind,
                     "computation_ms": summary["computation_ms"],
                     "link_ms": iteration_bound.link_ms(summary["gradient_bytes"], ranks, link_gbit),
                     "bound_ms": bound, "ms": ms, "q25_ms": summary["summary"][kind]["q25_ms"],
                     "q75_ms": summary["summary"][kind]["q75_ms"], "ratio_to_torch": ms / torch_ms,
                     "over_bound": ms / bound, "peak_mib": peak, "peak_ratio_to_torch": peak / torch_peak,
                     "bytes_per_rank": sent, "bytes_ratio_to_torch": sent / torch_bytes if torch_bytes else None})
    return rows


def run(options: BenchOptions, progress) -> dict:
    if not options.configs:
        return run_one(options, progress)
    rows, sections, notes, skipped = [], {}, [], []
    for config in map(link_configs.parse_one, options.configs):
        reason = config.cannot_run()
        if reason:
            progress.say(f"{config.name}: skipped: {reason}")
            sections[config.name] = {"skipped": reason}
            skipped.append(f"{config.name} not measured: {reason}")
            continue
        progress.say(f"configuration {config.name}")
        alone = config.options(options)
        one = run_one(alone, progress)
        count, per_host = overlap.placement(alone)
        sections[config.name] = {"hosts": count, "ranks_per_host": per_host, "models": one["models"]}
        rows += one["rows"]
        notes += one["notes"]
    ranks = sorted({r["ranks"] for r in rows})
    return {"rows": rows, "targets": targets(rows), "configs": sections, "notes": [*dict.fromkeys(notes), *skipped],
            **({"ranks": ", ".join(map(str, ranks))} if ranks else {})}


def run_one(options: BenchOptions, progress) -> dict:
    """The configuration of options.link_gbit, .hosts and .ranks_per_host."""
    options.single_bucket_cap()
    count, per_host = overlap.placement(options)
    per_rank = _launch(options, progress)
    models, rows = {}, []
    for model in options.models:
        merged = merge_ranks([r[model]["samples"] for r in per_rank])
        models[model] = {
            "summary": {kind: stats.summarize(merged[kind]) for kind in TIMED},
            "phases_ms": {kind: {p: stats.median_ms(merged[kind], p) for p in (*PHASES, "total")} for kind in TIMED},
            "sharded_over_torch": stats.ratio(merged[OURS_SHARDED], merged[TORCH]),
            "zero_over_torch": stats.ratio(merged[TORCH_ZERO], merged[TORCH]),
            "overlap_over_torch": stats.ratio(merged[OURS_OVERLAP], merged[TORCH]),
            "ours_over_torch": stats.ratio(merged[OURS], merged[TORCH]),
            "computation_ms": stats.median_ms(merged[LOCAL]),
            "gradient_bytes": per_rank[0][model]["gradient_bytes"],
            "peak_mib": {kind: max(r[model]["peak_bytes"][kind] for r in per_rank) / MIB for kind in VARIANTS},
            "bytes_per_rank": {kind: max(r[model]["sent_bytes"][kind] for r in per_rank) for kind in VARIANTS},
            "equality": equality(model, [r[model] for r in per_rank], options.world_size),
            "samples_ms": {kind: stats.values(merged[kind]) for kind in TIMED},
            "workload": {**overlap._describe(model, options.preset),
                         "optimizer": f"Adam (foreach) lr {LEARNING_RATE}"},
        }
        rows += rows_of(model, models[model], count, per_host, options.link_gbit)
    return {"rows": rows, "targets": targets(rows), "models": models, "notes": _notes(options)}


def targets(rows: List[dict]) -> List[dict]:
    """ours_sharded's targets in each configuration: time, bytes, and (at 4 ranks) peak memory."""
    out = []

    def check(r, target, value, bound, met):
        out.append({"target": target, "model": r["model"], "config": _config(r), "value": value, "bound": bound,
                    "met": met})

    for r in rows:
        if r["variant"] != OURS_SHARDED:
            continue
        shaped_2x2 = r["link"] != "loopback" and (r["hosts"], r["ranks_per_host"]) == (2, 2) and r["model"] == "mlp"
        limit = TIME_TARGET_2X2 if shaped_2x2 else TIME_TARGET
        check(r, f"sharded time / torch DDP's <= {limit:.2f}", r["ratio_to_torch"], limit,
              r["ratio_to_torch"] <= limit)
        if r["bytes_ratio_to_torch"] is not None:
            check(r, f"sharded bytes per rank within {BYTES_TARGET:.0%} of torch DDP's", r["bytes_ratio_to_torch"],
                  1 + BYTES_TARGET, abs(r["bytes_ratio_to_torch"] - 1) <= BYTES_TARGET)
        if r["ranks"] == 4:
            check(r, f"sharded peak memory / torch DDP's <= {PEAK_TARGET}", r["peak_ratio_to_torch"], PEAK_TARGET,
                  r["peak_ratio_to_torch"] <= PEAK_TARGET)
    return out


def _notes(options: BenchOptions) -> List[str]:
    notes = ["ms: median per iteration (the slowest rank's iteration); / torch: its ratio to torch's DDP. "
             "bound = max(forward + backward + optimizer / N, link): the bare model's phases (forward, backward, "
             "Adam step, no DDP) interleaved with the variants in the same ranks, its Adam step divided among "
             "the N ranks; link is what a ring allreduce sends from each rank, 2 (n - 1) / n x the float32 "
             "gradient bytes, at the link's rate (0 on the loopback).",
             "bytes/rank: what a rank sent per iteration, counted by the kernel (wchar of /proc/self/io: every "
             "byte Gloo hands its sockets), over 4 untimed iterations after the timed blocks, the largest rank's.",
             "peak MiB: the most bytes of torch CPU tensors a rank held during an iteration, persistent state "
             "included (parameters, gradients, optimizer state, buckets, batch): each variant built again under "
             "torch's profiler, the least peak of iterations 4 to 8, the largest rank's; not Gloo's own buffers; a "
             "tensor freed on a Gloo thread (unseen by the profiler) counted until its address is reused.",
             "equality: ddp_ext with overlap_forward against ddp_ext without (bitwise, or the run fails); ddp_ext "
             "sharded and torch's ZeroRedundancyOptimizer against torch's DDP (bitwise, or the largest "
             "difference; at 2 ranks the sharded run fails unless bitwise)."]
    if options.link_gbit is not None:
        count, per_host = overlap.placement(options)
        notes.append(f"Links: {count} hosts of {per_host} rank(s), each host a network namespace on this machine "
                     f"whose link sends shaped to {options.link_gbit:g} Gbit/s with tc tbf (rate only, no delay "
                     "added); ranks of one host talk over its loopback, and all ranks share this machine's cores.")
    return notes


def _config(row: dict) -> str:
    return f"{row['hosts']}x{row['ranks_per_host']} {row['link']}"


def table(data: dict) -> str:
    lines = [[r["model"], _config(r), LABELS[r["variant"]], markdown.ms(r["ms"]), markdown.ratio(r["ratio_to_torch"]),
              markdown.ms(r["bound_ms"]), markdown.ratio(r["over_bound"]), f"{r['bytes_per_rank'] / MIB:.3g}",
              markdown.ratio(r["bytes_ratio_to_torch"]) if r["bytes_ratio_to_torch"] else "-",
              f"{r['peak_mib']:.3g}", markdown.ratio(r["peak_ratio_to_torch"])] for r in data["rows"]]
    main = markdown.table(["model", "hosts x ranks, link", "variant", "ms (median)", "/ torch", "bound ms", "/ bound",
                           "MiB sent/rank", "bytes / torch", "peak MiB", "peak / torch"], lines)
    checks = [[t["model"], t["config"], t["target"], markdown.ratio(t["value"]), "met" if t["met"] else "not met"]
              for t in data.get("targets", [])]
    if checks:
        main += "\n\nTargets:\n\n" + markdown.table(["model", "hosts x ranks, link", "target", "measured", ""], checks)
    return main + "\n\n" + _phase_tables(data)


def _phase_tables(data: dict) -> str:
    if "configs" not in data:
        return _phase_table(data["models"])
    return "\n\n".join(f"Configuration `{name}`: skipped ({section['skipped']})" if "skipped" in section
                       else f"Phases, configuration `{name}`:\n\n{_phase_table(section['models'])}"
                       for name, section in data["configs"].items())


def _phase_table(models: dict) -> str:
    rows = []
    for model, r in models.items():
        differences = r["equality"]["largest_difference_to_torch"]
        for kind in r["summary"]:
            phases = r["phases_ms"][kind]
            spread = {OURS_SHARDED: r["sharded_over_torch"], TORCH_ZERO: r["zero_over_torch"],
                      OURS_OVERLAP: r["overlap_over_torch"], OURS: r["ours_over_torch"]}.get(kind)
            same = "" if kind not in differences else ("bitwise" if differences[kind] == 0.0
                                                        else f"differs by {differences[kind]:.2g}")
            rows.append([model, LABELS[kind], markdown.ms_iqr(r["summary"][kind]),
                         *(markdown.ms(phases[p]) for p in PHASES),
                         markdown.ratio_spread(spread) if spread else "", same])
    return markdown.table(["model", "implementation", "ms per iteration (IQR)", *(f"{p} ms" for p in PHASES),
                           "/ torch [block range]", "parameters vs torch DDP"], rows)


COLORS = {**figures.COLORS, TORCH_ZERO: "tab:red", OURS_OVERLAP: "tab:purple", OURS_SHARDED: "tab:green"}


def plot(data: dict, path: str) -> None:
    """One panel per model: per configuration, a bar per variant (its median
    per-iteration time) and the bound as a black line across them."""
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    figure, axes = figures.panels(max(1, len(models)), width_per_panel=5.0 if len(models) > 1 else 8.0)
    width = 0.8 / len(VARIANTS)
    for ax, model in zip(axes, models):
        rows = [r for r in data["rows"] if r["model"] == model]
        configs = list(dict.fromkeys(_config(r) for r in rows))
        for i, kind in enumerate(VARIANTS):
            for x, config in enumerate(configs):
                row = next(r for r in rows if r["variant"] == kind and _config(r) == config)
                ax.bar(x - 0.4 + (i + 0.5) * width, row["ms"], width, color=COLORS[kind],
                       label=LABELS[kind] if x == 0 else None)
        for x, config in enumerate(configs):
            bound = next(r["bound_ms"] for r in rows if _config(r) == config)
            ax.hlines(bound, x - 0.45, x + 0.45, colors="black", label="bound" if x == 0 else None)
        ax.set_ylim(0, 1.4 * max(max(r["ms"], r["bound_ms"]) for r in rows))
        ax.set_xticks(range(len(configs)), configs, fontsize="small", rotation=30 if len(configs) > 2 else 0)
        ax.set_title(model, fontsize="small")
        ax.set_ylabel("per-iteration time (ms), median")
    axes[0].legend(fontsize="x-small", loc="upper left", ncol=2)
    figures.save(figure, path, f"the sharded optimizer beside torch's DDP and ZeRO ({overlap._where(data['options'])}, "
                               f"{data['options']['preset']} preset)")
