"""overlap: ddp_ext's overlap_optimizer against stepping after the backward.

Variants of one training iteration run the same replica from the same seed
on the same batch, with the same bucket cap and Adam (foreach=True),
alternating block by block in the same ranks (Note [Interleaved
measurement]):

- `torch`: torch's DDP, optimizer.step() after the backward;
- `torch_in_backward`: torch's DDP after torch's private
  `_apply_optimizer_in_backward(Adam, ...)`, which steps each bucket's
  parameters in its communication hook. Its first iteration is tried before
  the timed ones; if it raises (on a machine without an accelerator, torch's
  end-of-backward callback asks for the accelerator's current stream), its
  rows have no time and carry the error as their `reason`;
- `ours`: ddp_ext, optimizer.step() after the backward;
- `ours_optimizer`: ddp_ext after `ddp.overlap_optimizer(optimizer)`, whose
  backward steps each bucket's parameters as soon as the bucket is reduced
  (docs/OPTIMIZER_OVERLAP.md); its optimizer phase is what the backward left
  to step (nothing, usually);
- `ours_overlap`: ddp_ext after `ddp.overlap_optimizer(optimizer,
  overlap_forward=True)`: the first layers' buckets go on the wire first at
  the end of the backward, which returns without them, and the next forward
  waits for each as it reads its parameters.

Models: the `compare` models at --preset, the `scaleout` MLP
and the `fixedcost` tiny MLP (`tiny`). Each variant draws its dropout masks
from a random stream of its own, seeded alike. At the end every rank
compares the parameters and buffers of ddp_ext with and without each line:
they saw the same data and steps, so they must be bitwise equal; the run
fails if they are not.

The bound of each configuration is max(computation, bytes / link rate)
(harness/iteration_bound.py). The computation is the median iteration of a
fifth variant, the bare model (`local`: forward, backward and Adam step, no
DDP), interleaved with the others in the same ranks: it runs under the same
load, each rank beside the others computing on the shared cores, which a
world-size-1 run would not. Its bytes are those a ring allreduce of the
float32 gradients sends from each rank; on the loopback nothing limits the
rate, and the bound is the computation alone.

Peak memory: after the timed blocks, one more iteration of each variant
runs under torch's profiler (harness/peak_memory.py): the most bytes of torch
CPU tensors it held above its start, the maximum over ranks. It counts what
torch's allocator hands out, not Gloo's own buffers.

Configurations: the ranks share the loopback; or with --link each host is a
network namespace whose link sends at the given rate (harness/fake_hosts.py,
as in `scaleout`), one rank per host, or --hosts H --ranks-per-host R, the
ranks of one host talking over its loopback. `rows` (one per model and
variant) carry the configuration. With --configs (harness/link_configs.py)
one run measures several configurations in turn, each its own launch of
ranks: `rows` and `targets` hold those of all, and `configs` each one's
per-model summaries (`models` of a run of one), or why it was `skipped`
(links need network namespaces, that is root).
"""

import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness import iteration_bound, link_configs, peak_memory, stats
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions, effective_bucket_cap_mb
from benchmarks.reporting import figures, markdown
from benchmarks.workloads import overlap_variants as ov
from benchmarks.workloads.overlap_variants import (LABELS, MLP, OURS_OPTIMIZER, OURS_OVERLAP, TINY, TORCH_IN_BACKWARD,
                                                   VARIANTS)
from benchmarks.workloads.presets import MODELS as PRESET_MODELS
from benchmarks.workloads.presets import Workload
from benchmarks.workloads.replicas import LOCAL, OURS, TORCH
from benchmarks.workloads.training_step import PHASES

NAME = "overlap"
FIGURE = "none (ddp_ext's own: the optimizer overlapped with communication)"
TITLE = "The optimizer overlapped with communication: overlap_optimizer vs a step after backward"

MIB = 2**20
# The peak memory target: overlap_optimizer at most this fraction of torch's DDP's peak, on the compare models.
PEAK_TARGET = 0.9


def differing_tensors(a: nn.Module, b: nn.Module) -> List[str]:
    """Names of the parameters and buffers of `a` that are not bitwise those of `b`."""
    named_b = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    return [name for name, t in [*a.named_parameters(), *a.named_buffers()]
            if name not in named_b or not torch.equal(t, named_b[name])]


def _measure(rank: int, world_size: int, job):
    options, progress = job
    progress = progress.for_rank(rank)
    cap = effective_bucket_cap_mb(options.single_bucket_cap())
    measured = {}
    for model in options.models:
        steps = {kind: ov.build(kind, model, options.preset, options.seed, rank, cap) for kind in ov.TIMED}
        unmeasured = {}
        reason = ov.first_iteration_failure(steps[TORCH_IN_BACKWARD])
        if reason:
            progress.say(f"{model}: {TORCH_IN_BACKWARD} not measured: {reason}")
            unmeasured[TORCH_IN_BACKWARD] = reason
            del steps[TORCH_IN_BACKWARD]
        samples = run_interleaved(steps, **options.run_lengths(), progress=progress, label=model)
        ours = steps[OURS].step.model.module
        differing = [f"{kind}: {name}" for kind in (OURS_OPTIMIZER, OURS_OVERLAP)
                     for name in differing_tensors(ours, steps[kind].step.model.module)]
        # Untimed, after the timed blocks: the profiler slows what it watches.
        peaks = {kind: peak_memory.peak_bytes(step) for kind, step in steps.items()}
        measured[model] = {"samples": samples, "differing": differing, "unmeasured": unmeasured,
                           "compared": len([*ours.parameters(), *ours.buffers()]), "peak_bytes": peaks,
                           "gradient_bytes": ov.gradient_bytes(ours)}
    return measured


def bitwise_check(model: str, per_rank: List[dict]) -> Dict[str, object]:
    """The summary's record of the check; raises if any rank differs."""
    differing = {rank: r["differing"] for rank, r in enumerate(per_rank) if r["differing"]}
    if differing:
        raise RuntimeError(
            f"overlap, {model}: ddp_ext with overlap_optimizer ended with parameters or buffers that are not "
            "bitwise those of ddp_ext without it: "
            + "; ".join(f"rank {rank}: {', '.join(names[:5])}" + (f" and {len(names) - 5} more" if len(names) > 5
                                                                   else "") for rank, names in differing.items()))
    return {"equal": True, "ranks": len(per_rank), "tensors_per_rank": per_rank[0]["compared"]}


def placement(options: BenchOptions) -> Tuple[int, int]:
    """(hosts, ranks per host): one host on the loopback; with a link, one
    rank per host unless --hosts / --ranks-per-host say otherwise."""
    if options.link_gbit is None:
        return 1, options.world_size
    per_host = options.ranks_per_host or 1
    count = options.hosts or options.world_size // per_host
    if count * per_host != options.world_size:
        raise ValueError(f"overlap: {count} hosts x {per_host} ranks is not --world-size {options.world_size}")
    return count, per_host


def link_name(link_gbit: Optional[float]) -> str:
    """A row's `link`: "loopback", or the shaped rate as "<N>gbit"."""
    return "loopback" if link_gbit is None else f"{link_gbit:g}gbit"


def _describe(model: str, preset: str) -> dict:
    if model in PRESET_MODELS:
        return Workload(model, preset).describe()
    module, batch = ov.model_and_batch(model, preset, 0, 0)
    params = sum(p.numel() for p in module.parameters())
    name = {MLP: "scaleout MLP", TINY: "fixedcost tiny MLP"}[model]
    return {"model": name, "parameters": params, "gradient_mib": round(params * 4 / MIB, 4),
            "input_shape_per_rank": list(batch[0].shape)}



def _launch(options: BenchOptions, progress) -> List[dict]:
    job = (options, progress)
    if options.link_gbit is None:
        return launch(_measure, options.world_size, job, options.threads, options.timeout_s)
    reason = hosts.cannot_make_namespaces()
    if reason:
        raise RuntimeError(f"overlap --link: {reason}")
    count, per_host = placement(options)
    with hosts.fake_hosts(count, "ov", options.link_gbit) as placed:
        return launch(_measure, options.world_size, job, options.threads, options.timeout_s,
                      setup=functools.partial(hosts.enter_rank, placed, per_host))


def _where(options: dict) -> str:
    if options.get("configs"):
        return ", ".join(options["configs"])
    if options.get("link_gbit") is None:
        return f"{options['world_size']} ranks on the loopback"
    count, per_host = placement(BenchOptions(**options))
    return f"{count} hosts x {per_host} rank(s), {options['link_gbit']:g} Gbit/s links"


def rows_of(model: str, summary: dict, hosts_count: int, per_host: int, link_gbit: Optional[float]) -> List[dict]:
    """One row per variant of `model` in one configuration, from its per-model summary."""
    ranks = hosts_count * per_host
    computation = summary["computation_ms"]
    bound = iteration_bound.bound_ms(computation, summary["gradient_bytes"], ranks, link_gbit)
    torch_ms = summary["summary"][TORCH]["median_ms"]
    torch_peak = summary["peak_mib"][TORCH]
    rows = []
    for kind in VARIANTS:
        row = {"model": model, "hosts": hosts_count, "ranks_per_host": per_host, "ranks": ranks,
               "link": link_name(link_gbit), "variant": kind, "computation_ms": computation,
               "link_ms": iteration_bound.link_ms(summary["gradient_bytes"], ranks, link_gbit), "bound_ms": bound}
        if kind in summary["unmeasured"]:
            row.update(ms=None, ratio_to_torch=None, over_bound=None, peak_mib=None, peak_ratio_to_torch=None,
                       reason=summary["unmeasured"][kind])
        else:
            ms = summary["summary"][kind]["median_ms"]
            peak = summary["peak_mib"][kind]
            row.update(ms=ms, q25_ms=summary["summary"][kind]["q25_ms"], q75_ms=summary["summary"][kind]["q75_ms"],
                       ratio_to_torch=ms / torch_ms, over_bound=ms / bound, peak_mib=peak,
                       peak_ratio_to_torch=peak / torch_peak if torch_peak > 0 else None)
        rows.append(row)
    return rows


def run(options: BenchOptions, progress) -> dict:
    return run_configs(options, progress) if options.configs else run_one(options, progress)


def run_configs(options: BenchOptions, progress) -> dict:
    """Each of options.configs in turn (a launch of ranks each), in one result: every configuration's rows and
    targets, its per-model summaries under `configs`, the notes of all; a configuration that cannot run here
    is `skipped`, with the reason in the notes."""
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
        count, per_host = placement(alone)
        sections[config.name] = {"hosts": count, "ranks_per_host": per_host, "models": one["models"]}
        rows += one["rows"]
        notes += one["notes"]
    ranks = sorted({r["ranks"] for r in rows})
    return {"rows": rows, "targets": targets(rows), "configs": sections, "notes": [*dict.fromkeys(notes), *skipped],
            **({"ranks": ", ".join(map(str, ranks))} if ranks else {})}


def run_one(options: BenchOptions, progress) -> dict:
    """The configuration of options.link_gbit, .hosts and .ranks_per_host."""
    options.single_bucket_cap()
    count, per_host = placement(options)
    per_rank = _launch(options, progress)
    models, rows = {}, []
    for model in options.models:
        merged = merge_ranks([r[model]["samples"] for r in per_rank])
        kinds = [k for k in ov.TIMED if k in merged]
        models[model] = {
            "summary": {kind: stats.summarize(merged[kind]) for kind in kinds},
            "phases_ms": {kind: {p: stats.median_ms(merged[kind], p) for p in (*PHASES, "total")} for kind in kinds},
            "optimizer_over_torch": stats.ratio(merged[OURS_OPTIMIZER], merged[TORCH]),
            "optimizer_over_ours": stats.ratio(merged[OURS_OPTIMIZER], merged[OURS]),
            "overlap_over_torch": stats.ratio(merged[OURS_OVERLAP], merged[TORCH]),
            "ours_over_torch": stats.ratio(merged[OURS], merged[TORCH]),
            "computation_ms": stats.median_ms(merged[LOCAL]),
            "gradient_bytes": per_rank[0][model]["gradient_bytes"],
            "peak_mib": {kind: max(r[model]["peak_bytes"][kind] for r in per_rank) / MIB for kind in kinds},
            "unmeasured": per_rank[0][model]["unmeasured"],
            "bitwise_equal": bitwise_check(model, [r[model] for r in per_rank]),
            "samples_ms": {kind: stats.values(merged[kind]) for kind in kinds},
            "workload": {**_describe(model, options.preset), "optimizer": f"Adam (foreach) lr {ov.LEARNING_RATE}"},
        }
        rows += rows_of(model, models[model], count, per_host, options.link_gbit)
    return {"rows": rows, "targets": targets(rows), "models": models, "notes": _notes(options, models)}


def targets(rows: List[dict]) -> List[dict]:
    """Per compare model and configuration: overlap_optimizer's peak memory over torch's DDP's, and whether
    it is at most PEAK_TARGET."""
    out = []
    for r in rows:
        if r["variant"] == OURS_OPTIMIZER and r["model"] in PRESET_MODELS and r["peak_ratio_to_torch"] is not None:
            out.append({"target": f"overlap_optimizer peak memory / torch DDP's <= {PEAK_TARGET}",
                        "model": r["model"], "config": _config(r), "value": r["peak_ratio_to_torch"],
                        "bound": PEAK_TARGET, "met": r["peak_ratio_to_torch"] <= PEAK_TARGET})
    return out


def _notes(options: BenchOptions, models: dict) -> List[str]:
    notes = ["ms: median per iteration (the slowest rank's iteration); / torch: its ratio to torch's DDP. "
             "bound = max(computation, link): computation is the median iteration of the bare model (forward, "
             "backward, Adam step, no DDP) interleaved with the variants in the same ranks; link is what a ring "
             "allreduce sends from each rank, 2 (n - 1) / n x the float32 gradient bytes, at the link's rate "
             "(0 on the loopback, where the bound is the computation alone). / bound: ms / bound.",
             "peak MiB: the most bytes of torch CPU tensors one iteration held above its start (torch's profiler, "
             "one untimed iteration per variant after the timed ones, the largest rank's); not Gloo's own buffers.",
             "phases: medians per phase; with overlap_optimizer the backward includes stepping each bucket, and "
             "the optimizer phase is what it left (zero_grad, usually). ratio [min-max]: the medians' ratio over "
             "all measured iterations, and its range over back-to-back block pairs. bitwise: parameters and "
             "buffers of ddp_ext with and without overlap_optimizer (and with overlap_forward=True), compared on "
             "every rank at the end of the run. With overlap_forward the forward phase includes waiting for the "
             "first layers' buckets and stepping them."]
    reasons = sorted({r for m in models.values() for r in m["unmeasured"].values()})
    notes += [f"{TORCH_IN_BACKWARD} not measured: {reason}" for reason in reasons]
    if options.link_gbit is not None:
        count, per_host = placement(options)
        notes.append(f"Links: {count} hosts of {per_host} rank(s), each host a network namespace on this machine "
                     f"whose link sends shaped to {options.link_gbit:g} Gbit/s with tc tbf (rate only, no delay "
                     "added); ranks of one host talk over its loopback, and all ranks share this machine's cores.")
    return notes


def _config(row: dict) -> str:
    return f"{row['hosts']}x{row['ranks_per_host']} {row['link']}"


def table(data: dict) -> str:
    lines = []
    for r in data["rows"]:
        measured = r["ms"] is not None
        lines.append([r["model"], _config(r), LABELS[r["variant"]],
                      markdown.ms(r["ms"]) if measured else "not measured",
                      markdown.ratio(r["ratio_to_torch"]) if measured else "-", markdown.ms(r["bound_ms"]),
                      markdown.ratio(r["over_bound"]) if measured else "-",
                      f"{r['peak_mib']:.3g}" if measured else "-",
                      markdown.ratio(r["peak_ratio_to_torch"]) if r.get("peak_ratio_to_torch") else "-"])
    main = markdown.table(["model", "hosts x ranks, link", "variant", "ms (median)", "/ torch", "bound ms",
                           "/ bound", "peak MiB", "peak / torch"], lines)
    checks = [[t["model"], t["config"], t["target"], markdown.ratio(t["value"]), "met" if t["met"] else "not met"]
              for t in data.get("targets", [])]
    if checks:
        main += "\n\nTargets:\n\n" + markdown.table(["model", "hosts x ranks, link", "target", "measured", ""],
                                                      checks)
    return main + "\n\n" + _phase_tables(data)


def _phase_tables(data: dict) -> str:
    """The phase table of a run of one configuration, or one per configuration of a --configs run."""
    if "configs" not in data:
        return _phase_table(data["models"])
    return "\n\n".join(f"Configuration `{name}`: skipped ({section['skipped']})" if "skipped" in section
                        else f"Phases, configuration `{name}`:\n\n{_phase_table(section['models'])}"
                        for name, section in data["configs"].items())


def _phase_table(models: dict) -> str:
    rows = []
    for model, r in models.items():
        for kind in r["summary"]:
            phases = r["phases_ms"][kind]
            ratios = {OURS_OPTIMIZER: [markdown.ratio_spread(r["optimizer_over_torch"]),
                                       markdown.ratio_spread(r["optimizer_over_ours"])],
                      OURS_OVERLAP: [markdown.ratio_spread(r["overlap_over_torch"]), ""]}.get(kind, ["", ""])
            bitwise = ("equal" if r["bitwise_equal"]["equal"] else "DIFFERENT") if kind in (OURS_OPTIMIZER,
                                                                                              OURS_OVERLAP) else ""
            rows.append([model, LABELS[kind], markdown.ms_iqr(r["summary"][kind]),
                         *(markdown.ms(phases[p]) for p in PHASES), *ratios, bitwise])
    return markdown.table(["model", "implementation", "ms per iteration (IQR)", *(f"{p} ms" for p in PHASES),
                           "with the line / torch [block range]",
                           "overlap_optimizer / ddp_ext [block range]",
                           "bitwise vs ddp_ext"], rows)


COLORS = {**figures.COLORS, TORCH_IN_BACKWARD: "tab:red", OURS_OPTIMIZER: "tab:green", OURS_OVERLAP: "tab:purple"}


def plot(data: dict, path: str) -> None:
    """One panel per model: per configuration, a bar per variant (its median
    per-iteration time) and the bound as a black line across them."""
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    # One panel alone is wider, for the title.
    figure, axes = figures.panels(max(1, len(models)), width_per_panel=5.0 if len(models) > 1 else 8.0)
    width = 0.8 / len(VARIANTS)
    for ax, model in zip(axes, models):
        rows = [r for r in data["rows"] if r["model"] == model]
        configs = list(dict.fromkeys(_config(r) for r in rows))
        for i, kind in enumerate(VARIANTS):
            for x, config in enumerate(configs):
                row = next(r for r in rows if r["variant"] == kind and _config(r) == config)
                position = x - 0.4 + (i + 0.5) * width
                if row["ms"] is None:
                    ax.text(position, 0, "not measured", ha="center", va="bottom", fontsize="x-small", rotation=90,
                            color=COLORS[kind])
                    continue
                ax.bar(position, row["ms"], width, color=COLORS[kind], label=LABELS[kind] if x == 0 else None)
        for x, config in enumerate(configs):
            bound = next(r["bound_ms"] for r in rows if _config(r) == config)
            ax.hlines(bound, x - 0.45, x + 0.45, colors="black", label="bound" if x == 0 else None)
        top = max(max(r["ms"] or 0.0, r["bound_ms"]) for r in rows)
        ax.set_ylim(0, 1.4 * top)  # room for the legend above the bars
        ax.set_xticks(range(len(configs)), configs, fontsize="small", rotation=30 if len(configs) > 2 else 0)
        ax.set_title(model, fontsize="small")
        ax.set_ylabel("per-iteration time (ms), median")
    axes[0].legend(fontsize="x-small", loc="upper left", ncol=2)
    figures.save(figure, path, f"overlap_optimizer vs a step after backward ({_where(data['options'])}, "
                               f"{data['options']['preset']} preset)")
