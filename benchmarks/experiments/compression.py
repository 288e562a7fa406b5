"""compression: gradient compression hooks, time, bytes and accuracy.

Per model, the variants of compression_variants.py train the same replica on
the same synthetic batch, alternating block by block (Note [Interleaved
measurement]) after enough unmeasured iterations for every hook to leave its
start-up behaviour (HookSettings.settle_iterations). Then, untimed:
- bytes: each variant over a process group that counts the input bytes of
  every allreduce and allgather of one rank, per iteration, once settled; for
  the adaptive hook also its own count (AdaptivePrecision.bytes_sent), which
  leaves out its small statistics allreduce;
- costs: each format's steps on one tensor the size of the gradients
  (codec_costs.py), what compression adds against what it saves.
Finally every variant trains on the digits (compression_convergence.py),
from CONVERGENCE_SEEDS seeds, every variant from the same ones.
"""

import dataclasses

import numpy as np
import torch.distributed as dist

from benchmarks.harness import stats
from benchmarks.workloads import codec_costs
from benchmarks.workloads.compression_convergence import train_and_test
from benchmarks.workloads.compression_variants import (
    ADAPTIVE, ADAPTIVE_VARIANTS, LABELS, OURS, QUICK_HOOKS, TORCH, VARIANTS, HookSettings, decisions,
    in_effect, wrap,
)
from benchmarks.harness.interleave import merge_ranks, run_interleaved
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions
from benchmarks.harness.recording_group import RecordingProcessGroup
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.training_step import TrainingStep

NAME = "compression"
FIGURE = "none (gradient compression hooks)"
TITLE = "Gradient compression: torch's hooks and ddp_ext's adaptive precision"
# 40 unmeasured iterations: past every variant's settle_iterations (30 for the
# adaptive hook's defaults, 10 for PowerSGD here).
RUN_LENGTHS = {"warmup": 40}
COUNTED_ITERATIONS = {False: 30, True: 2}  # bytes pass, after settling (30: three adaptive windows)
CONVERGENCE_SEEDS = {False: 3, True: 1}
COST_REPEATS = {False: 7, True: 2}
TARGETS = {"bytes": 0.35, "ms": 0.85, "accuracy_points": 0.5}
COLORS = {"torch": figures.COLORS["torch"], "torch_fp16": "tab:red", "torch_powersgd1": "tab:brown",
          "torch_powersgd4": "tab:pink", "ours": figures.COLORS["ours"], "ours_adaptive": "tab:green",
          "ours_adaptive_always": "tab:olive"}


def _hooks(options: BenchOptions) -> HookSettings:
    return QUICK_HOOKS if options.quick else HookSettings()


class _Watched:
    """A training step that notes its hook's bytes_sent when the timed blocks begin."""

    def __init__(self, step, state, warmup: int):
        self.step, self.state, self.warmup = step, state, warmup
        self.calls = 0
        self.sent_at_start = 0

    def __call__(self):
        if self.calls == self.warmup:
            self.sent_at_start = self.state.bytes_sent
        self.calls += 1
        return self.step()


def _timed(options, progress, model, workload, batch, hooks):
    steps, states = {}, {}
    for variant in VARIANTS:
        ddp, states[variant] = wrap(variant, workload.build(options.seed), hooks)
        steps[variant] = TrainingStep(ddp, batch)
    for variant in ADAPTIVE_VARIANTS:
        steps[variant] = _Watched(steps[variant], states[variant], options.warmup)
    samples = run_interleaved(steps, **options.run_lengths(), progress=progress, label=model)
    total = options.warmup + options.blocks * (options.discard_per_block + options.block_iterations)
    adaptive = {
        variant: {
            "decisions_in_timed_blocks": in_effect(decisions(states[variant]), options.warmup, total),
            "bytes_sent_per_iteration_timed": (states[variant].bytes_sent - steps[variant].sent_at_start)
            / (total - options.warmup),
        }
        for variant in ADAPTIVE_VARIANTS
    }
    return samples, adaptive


def _bytes(options, workload, batch, hooks, variant):
    group = RecordingProcessGroup(dist.distributed_c10d._get_default_group())
    ddp, state = wrap(variant, workload.build(options.seed), hooks, group)
    step = TrainingStep(ddp, batch)
    settle = hooks.settle_iterations(variant)
    for _ in range(settle):
        step()
    group.take_bytes()
    sent_before = state.bytes_sent if variant in ADAPTIVE_VARIANTS else 0
    counted = []
    for _ in range(COUNTED_ITERATIONS[options.quick]):
        step()
        counted.append(group.take_bytes())
    record = {"per_iteration": counted, "settle_iterations": settle}
    if variant in ADAPTIVE_VARIANTS:
        record["bytes_sent_per_iteration"] = (state.bytes_sent - sent_before) / len(counted)
        record["decisions"] = in_effect(decisions(state), settle, settle + len(counted))
    return record


def _measure(rank, world_size, job):
    options, progress = job
    progress = progress.for_rank(rank)
    hooks = _hooks(options)
    measured = {"models": {}, "convergence": {}}
    for model in options.models:
        workload = Workload(model, options.preset)
        batch = workload.batch(input_seed(options.seed, rank))
        samples, adaptive = _timed(options, progress, model, workload, batch, hooks)
        dist.barrier()
        counted = {v: _bytes(options, workload, batch, hooks, v) for v in VARIANTS}
        progress.say(f"{model}: bytes counted")
        numel = sum(p.numel() for p in workload.build(options.seed).parameters())
        costs = codec_costs.measure(numel, COST_REPEATS[options.quick], options.seed)
        measured["models"][model] = {"samples": samples, "adaptive": adaptive, "bytes": counted, "costs": costs}
        dist.barrier()
    for variant in VARIANTS:
        runs = [train_and_test(rank, world_size, variant, options.preset, options.seed + k, hooks, options.quick)
                for k in range(CONVERGENCE_SEEDS[options.quick])]
        measured["convergence"][variant] = runs
        if rank == 0:
            accuracies = ", ".join(f"{run['test_accuracy']:.1f}%" for run in runs)
            progress.say(f"convergence, {variant}: test accuracy {accuracies}")
    return measured


def _target(value: float, target: float, at_most: bool = True) -> dict:
    return {"value": value, "target": target, "met": bool(value <= target if at_most else abs(value) <= target)}


def _model_results(options, model, per_rank):
    merged = merge_ranks([r["models"][model]["samples"] for r in per_rank])
    first = per_rank[0]["models"][model]
    variants = {}
    for v in VARIANTS:
        counted = first["bytes"][v]
        variants[v] = {
            "ms": stats.median_ms(merged[v]),
            "summary": stats.summarize(merged[v]),
            "ratio_to_torch": stats.ratio(merged[v], merged[TORCH]),
            "bytes": float(np.mean(counted["per_iteration"])),
            "bytes_counted": counted,
        }
        if v in ADAPTIVE_VARIANTS:
            variants[v].update(first["adaptive"][v])
    slowest_costs = {step: max(r["models"][model]["costs"]["ms"][step] for r in per_rank)
                     for step in codec_costs.STEPS}
    return {
        "variants": variants,
        "samples_ms": {v: stats.values(merged[v]) for v in VARIANTS},
        "targets": {
            "adaptive_bytes_over_ours": _target(variants[ADAPTIVE]["bytes"] / variants[OURS]["bytes"],
                                                TARGETS["bytes"]),
            "adaptive_ms_over_torch": _target(variants[ADAPTIVE]["ratio_to_torch"]["ratio"], TARGETS["ms"]),
        },
        "costs": {**first["costs"], "ms": slowest_costs},
        "workload": Workload(model, options.preset).describe(),
    }


def _seed_result(runs, seed):
    """One seed's run of one variant, from every rank's record of it."""
    last_epoch = min(runs[0]["iterations_per_epoch"], runs[0]["iterations"])
    mean_losses = np.mean([run["losses"] for run in runs], axis=0)
    result = {"seed": seed, "final_loss": float(np.mean(mean_losses[-last_epoch:])),
              "test_accuracy": runs[0]["test_accuracy"], "test_loss": runs[0]["test_loss"],
              "losses": mean_losses.tolist()}
    if "decisions" in runs[0]:
        result["decisions"] = runs[0]["decisions"]
    return result


def _convergence_results(options, per_rank):
    results = {}
    for v in VARIANTS:
        seeds = [_seed_result([r["convergence"][v][k] for r in per_rank], options.seed + k)
                 for k in range(len(per_rank[0]["convergence"][v]))]
        accuracies = [s["test_accuracy"] for s in seeds]
        first = per_rank[0]["convergence"][v][0]
        results[v] = {
            "final_loss": float(np.mean([s["final_loss"] for s in seeds])),
            "test_accuracy": float(np.mean(accuracies)),
            "test_accuracy_range": [min(accuracies), max(accuracies)],
            "test_loss": float(np.mean([s["test_loss"] for s in seeds])),
            "seeds": seeds,
            "iterations": first["iterations"],
            "test_images": first["test_images"],
        }
    for v in ADAPTIVE_VARIANTS:
        results[v]["accuracy_vs_ours_points"] = _target(
            results[v]["test_accuracy"] - results[OURS]["test_accuracy"], TARGETS["accuracy_points"], at_most=False)
        results[v]["accuracy_vs_ours_points_per_seed"] = [
            s["test_accuracy"] - o["test_accuracy"] for s, o in zip(results[v]["seeds"], results[OURS]["seeds"])]
    return results


def run(options: BenchOptions, progress) -> dict:
    hooks = _hooks(options)
    needed = max(hooks.settle_iterations(v) for v in VARIANTS)
    if options.warmup < needed and not options.quick:
        progress.say(f"warning: --warmup {options.warmup} < {needed}: timed blocks include hooks' start-up")
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    models = {model: _model_results(options, model, per_rank) for model in options.models}
    convergence = _convergence_results(options, per_rank)
    return {"models": models, "convergence": convergence, "hooks": dataclasses.asdict(hooks),
            "settle_iterations": needed, "notes": _notes(options, hooks, convergence)}


def _notes(options, hooks, convergence):
    from benchmarks.workloads.compression_convergence import BATCH_SIZE, EPOCHS, LEARNING_RATE, TEST_FRACTION

    any_run = convergence[TORCH]
    return [
        f"Variants: torch's DDP without a hook, with fp16_compress_hook, with powerSGD_hook (PowerSGDState with "
        f"matrix_approximation_rank 1 or 4, start_powerSGD_iter {hooks.start_powerSGD_iter}, other arguments "
        f"torch's defaults; run one bucket at a time, see benchmarks/workloads/in_order_hook.py); ddp_ext without a "
        f"hook; ddp_ext with AdaptivePrecision (warmup_iterations {hooks.adaptive_warmup}, check_every "
        f"{hooks.adaptive_check_every}, otherwise its defaults), and the same with off_when_slower=False "
        "(never off: it compresses whatever it costs).",
        f"Every variant runs {options.warmup} unmeasured iterations before the timed blocks; the hooks settle "
        f"after at most {max(hooks.settle_iterations(v) for v in VARIANTS)} (PowerSGD compresses from iteration "
        f"{hooks.start_powerSGD_iter}; the adaptive hook has run and measured its first compressed window after "
        f"{hooks.adaptive_warmup + hooks.adaptive_check_every}).",
        "/ torch DDP: median over all measured iterations against torch's DDP without a hook, [min-max] over "
        "back-to-back block pairs. MiB/iter: mean input bytes of one rank's allreduces and allgathers per "
        f"iteration, counted by a wrapping process group over {COUNTED_ITERATIONS[options.quick]} untimed "
        "iterations after the variant settled (includes the adaptive hook's statistics allreduce and ddp_ext's "
        "small control allreduce).",
        f"Targets: ddp_ext + adaptive bytes / ddp_ext bytes <= {TARGETS['bytes']}, ms / torch DDP ms <= "
        f"{TARGETS['ms']}, test accuracy within {TARGETS['accuracy_points']} points of ddp_ext without a hook.",
        f"Convergence: the narrow ResNet-50 of nosync's convergence run on the digits, {BATCH_SIZE} images per "
        f"rank, SGD with learning rate {LEARNING_RATE}, {any_run['iterations']} iterations "
        f"({EPOCHS if not options.quick else 'under one'} epoch(s)); each of {len(any_run['seeds'])} seed(s) "
        f"({', '.join(str(s['seed']) for s in any_run['seeds'])}) fixes the test split, the initial parameters "
        "and the data order, "
        "the same for every variant. final_loss: mean training loss of the last epoch; test accuracy on "
        f"{any_run['test_images']} held-out digits ({TEST_FRACTION:.0%}); both the mean over the seeds, with "
        "the range of the accuracy.",
    ]


def _mib(value: float) -> str:
    return f"{value / 2**20:.3f}" if value < 2**20 else f"{value / 2**20:.2f}"


def _timing_table(data):
    rows = []
    for model, r in data["models"].items():
        ours_bytes = r["variants"][OURS]["bytes"]
        for v, m in r["variants"].items():
            rows.append([model, LABELS[v], markdown.ms_iqr(m["summary"]), markdown.ratio_spread(m["ratio_to_torch"]),
                         _mib(m["bytes"]), markdown.ratio(m["bytes"] / ours_bytes)])
    headers = ["model", "variant", "ms (IQR)", "/ torch DDP [block range]", "MiB/iter", "bytes / ddp_ext bytes"]
    return markdown.table(headers, rows)


def _windows_text(records):
    parts = []
    for d in records:
        counts = {f: d["formats"].count(f) for f in ("fp32", "fp16", "int8") if f in d["formats"]}
        formats = ", ".join(f"{n} {f}" for f, n in counts.items()) or "-"
        parts.append(f"{d['iteration']}: {d['mode']} ({formats})")
    return "; ".join(parts) or "-"


def _costs_text(records):
    last = records[-1] if records else {}
    full, compressed = last.get("full_cost_ms"), last.get("compressed_cost_ms")
    return f"{markdown.ms(full)} / {markdown.ms(compressed)}"


def _adaptive_table(data):
    rows = []
    for model, r in data["models"].items():
        for v in ADAPTIVE_VARIANTS:
            m = r["variants"][v]
            counted = m["bytes_counted"]
            rows.append([model, LABELS[v], _windows_text(m["decisions_in_timed_blocks"]),
                         _costs_text(m["decisions_in_timed_blocks"]), _mib(m["bytes_sent_per_iteration_timed"]),
                         _mib(m["bytes"]), _mib(counted["bytes_sent_per_iteration"]),
                         _windows_text(counted["decisions"])])
    for v in ADAPTIVE_VARIANTS:
        for run in data["convergence"][v]["seeds"]:
            records = run["decisions"]
            modes = ", ".join(f"{m} x{sum(d['mode'] == m for d in records)}"
                              for m in sorted({d["mode"] for d in records}))
            rows.append([f"digits, seed {run['seed']}", LABELS[v], f"windows: {modes}; last "
                         + _windows_text(records[-1:]), _costs_text(records), "-", "-", "-", "-"])
    headers = ["run", "variant", "windows in effect in the timed blocks (from iteration: mode (formats))",
               "cost full / compressed ms", "bytes_sent MiB/iter (timed)", "counted MiB/iter",
               "bytes_sent MiB/iter (counted pass)", "windows in the counted pass"]
    return markdown.table(headers, rows)


def _costs_table(data):
    rows = []
    for model, r in data["models"].items():
        ms = r["costs"]["ms"]
        fp16 = sum(ms[s] for s in codec_costs.STEPS[1:3])
        int8 = sum(ms[s] for s in codec_costs.STEPS[3:])
        rows.append([model, f"{r['costs']['numel'] * 4 / 2**20:.1f}", *(markdown.ms(ms[s]) for s in codec_costs.STEPS),
                     markdown.ms(fp16), markdown.ms(int8)])
    headers = ["model", "MiB fp32", *(f"{s} ms" for s in codec_costs.STEPS), "fp16 total ms", "int8 total ms"]
    return markdown.table(headers, rows)


def _convergence_table(data):
    conv = data["convergence"]
    rows = []
    for v, r in conv.items():
        low, high = r["test_accuracy_range"]
        rows.append([LABELS[v], f"{r['final_loss']:.4f}", f"{r['test_accuracy']:.2f} [{low:.2f}-{high:.2f}]",
                     ", ".join(f"{s['test_accuracy']:.2f}" for s in r["seeds"]),
                     f"{r['test_accuracy'] - conv[OURS]['test_accuracy']:+.2f}", f"{r['test_loss']:.4f}"])
    headers = ["variant", "final_loss", "test_accuracy % [min-max]", "per seed", "vs ddp_ext (points)", "test loss"]
    return markdown.table(headers, rows)


def _targets_lines(data):
    lines = []
    for model, r in data["models"].items():
        for name, t in r["targets"].items():
            lines.append(f"- {model}: {name} = {t['value']:.3f} (target <= {t['target']}): "
                         f"{'met' if t['met'] else 'not met'}")
    t = data["convergence"][ADAPTIVE]["accuracy_vs_ours_points"]
    per_seed = ", ".join(f"{d:+.2f}" for d in data["convergence"][ADAPTIVE]["accuracy_vs_ours_points_per_seed"])
    lines.append(f"- digits: adaptive test accuracy - ddp_ext's = {t['value']:+.2f} points, mean over seeds "
                 f"({per_seed}) (target within {t['target']}): {'met' if t['met'] else 'not met'}")
    return "\n".join(lines)


def table(data: dict) -> str:
    return "\n\n".join([
        _timing_table(data),
        "Targets:\n\n" + _targets_lines(data),
        "What the adaptive hook ran (full / compressed cost: its last measured exposed cost per iteration):\n\n"
        + _adaptive_table(data),
        "Each format's steps on one tensor the size of the gradients (median of the slowest rank):\n\n"
        + _costs_table(data),
        "Convergence on the digits:\n\n" + _convergence_table(data),
    ])


def plot(data: dict, path: str) -> None:
    models = list(data["models"])
    figure, axes = figures.panels(3, width_per_panel=5.5, height=4.5)
    time_ax, bytes_ax, loss_ax = axes
    width = 0.8 / len(VARIANTS)
    xs = np.arange(len(models))
    for k, v in enumerate(VARIANTS):
        offset = (k - (len(VARIANTS) - 1) / 2) * width
        summaries = [data["models"][m]["variants"][v]["summary"] for m in models]
        time_ax.bar(xs + offset, [s["median_ms"] for s in summaries], width, color=COLORS[v], label=LABELS[v],
                    yerr=[[s["median_ms"] - s["q25_ms"] for s in summaries],
                          [s["q75_ms"] - s["median_ms"] for s in summaries]])
        bytes_ax.bar(xs + offset, [data["models"][m]["variants"][v]["bytes"] / 2**20 for m in models], width,
                     color=COLORS[v])
        conv = data["convergence"][v]
        loss_ax.plot(conv["seeds"][0]["losses"], color=COLORS[v], linewidth=1,
                     label=f"{LABELS[v]}: {conv['test_accuracy']:.1f}%")
    for ax, label in ((time_ax, "median per-iteration latency (ms), IQR bars"), (bytes_ax, "MiB sent per iteration")):
        ax.set_xticks(xs, models)
        ax.set_ylabel(label)
    bytes_ax.set_yscale("log")
    time_ax.set_ylim(0, time_ax.get_ylim()[1] * 1.5)  # room for the legend above the bars
    time_ax.legend(fontsize="x-small", ncol=2)
    loss_ax.set_xlabel("iteration")
    loss_ax.set_ylabel("training loss (mean over ranks)")
    loss_ax.set_title(f"digits: loss (seed {data['convergence'][TORCH]['seeds'][0]['seed']}), "
                      "mean test accuracy")
    loss_ax.legend(fontsize="x-small")
    figures.save(figure, path, f"{TITLE} ({data['options']['world_size']} ranks, {data['options']['preset']} preset)")
