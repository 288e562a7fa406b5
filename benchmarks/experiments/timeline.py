"""timeline: one iteration of each DDP, drawn bucket by bucket.

The preset's BERT-like model (--models) on every rank. After the warm-up iterations,
one iteration of ddp_ext with its communication timeline on
(DistributedDataParallel.record_timeline: the reducer's own record of each
gradient, each bucket's launch and completion and the wait at the end of the
backward), and one iteration of torch's DDP under torch.profiler, whose trace
is all torch offers: on CPU over Gloo it holds a `c10d::allreduce_` range
where each bucket's allreduce is launched (in the autograd thread) and a
`gloo:all_reduce` range on the Gloo worker thread that ran it (its end is the
completion), plus autograd's `AccumulateGrad` ranges (a gradient is ready when
its range ends). Times are relative to the start of the `loss.backward()`
call, which the bench marks in both.

Also the cost of recording: ddp_ext's per-iteration time with the timeline
off and on, in blocks that alternate (Note [Interleaved measurement]); each
"on" block records, then stops and writes its file outside the timed
iterations.
"""

import json
import os
import tempfile
import time

import numpy as np
import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ext import DistributedDataParallel as OurDDP
from benchmarks.harness.launcher import launch
from benchmarks.harness.options import BenchOptions
from benchmarks.harness.quiet_profiler import quiet_profile
from benchmarks.reporting import figures, markdown
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.training_step import LEARNING_RATE

NAME = "timeline"
FIGURE = "none (ddp_ext's communication timeline)"
TITLE = "Communication timeline: one iteration, bucket by bucket"
RUN_LENGTHS = {"warmup": 3, "blocks": 6, "block_iterations": 5, "discard_per_block": 1}
OFF, ON = "off", "on"
BACKWARD_RANGE = "benchmarks::backward"


class _Step:
    """One iteration; marks the start of loss.backward() on the monotonic clock
    (the timeline's) and as a torch.profiler range."""

    def __init__(self, model, batch):
        self.model = model
        self.inputs, self.targets = batch
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        self.backward_start_ns = None

    def __call__(self) -> float:
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.model(self.inputs), self.targets)
        with torch.autograd.profiler.record_function(BACKWARD_RANGE):
            self.backward_start_ns = time.monotonic_ns()
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) * 1e3


def _ours_iteration(trace: dict, t0_ns: int) -> dict:
    """Bucket launches and completions, gradients and the end of backward, in
    ms from the backward call, from ddp_ext's timeline."""
    t0 = t0_ns / 1000.0  # the trace is in microseconds

    def rel(ts):
        return (ts - t0) / 1000.0

    events = trace["traceEvents"]
    buckets = {}
    for e in events:
        if e["ph"] == "X" and e["name"].startswith("bucket "):
            buckets[e["args"]["bucket"]] = {"bytes": e["args"]["bytes"], "launch_ms": rel(e["ts"]),
                                            "done_ms": rel(e["ts"] + e["dur"])}
    (backward,) = [e for e in events if e["ph"] == "X" and e["name"] == "backward"]
    (wait,) = [e for e in events if e["ph"] == "X" and e["name"] == "wait for buckets"]
    return {
        "buckets": [buckets[b] for b in sorted(buckets)],
        "ready_ms": sorted(rel(e["ts"]) for e in events if e["name"] == "gradient ready"),
        "first_gradient_ms": rel(backward["ts"]),
        "backward_end_ms": rel(backward["ts"] + backward["dur"]),
        "wait_ms": [rel(wait["ts"]), rel(wait["ts"] + wait["dur"])],
    }


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _torch_iteration(trace: dict) -> dict:
    """The same, as far as torch.profiler's trace of torch's DDP shows it
    (recorded with record_shapes, which gives each allreduce's size; the
    model's gradients are float32)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    (backward,) = [e for e in events if e["name"] == BACKWARD_RANGE]
    t0 = backward["ts"]

    def rel(ts):
        return (ts - t0) / 1000.0

    launches = sorted((e["ts"], 4 * _numel(e["args"]["Input Dims"][0][0])) for e in events
                      if e["name"] == "c10d::allreduce_" and e["ts"] >= t0)
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "gloo:all_reduce" and e["ts"] >= t0)
    # Gloo runs a process group's work in the order it was queued: the k-th
    # run is the k-th launch.
    buckets = [{"bytes": size, "launch_ms": rel(launch), "start_ms": rel(run[0]), "done_ms": rel(run[1])}
               for (launch, size), run in zip(launches, runs)]
    ready = sorted(rel(e["ts"] + e["dur"]) for e in events
                   if e["name"] == "torch::autograd::AccumulateGrad" and e["ts"] >= t0)
    return {
        "buckets": buckets,
        "ready_ms": ready,
        "first_gradient_ms": ready[0] if ready else None,
        "backward_end_ms": rel(backward["ts"] + backward["dur"]),
        "launches_seen": len(launches),
        "runs_seen": len(runs),
    }


def _measure(rank, world_size, job):
    options, progress = job
    workload = Workload(options.models[0], options.preset)
    batch = workload.batch(input_seed(options.seed, rank))
    cap = options.single_bucket_cap()
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    result = {}
    with tempfile.TemporaryDirectory(prefix="ddp_ext_timeline_") as tmp:
        ours = _Step(OurDDP(workload.build(options.seed), **kwargs), batch)
        for _ in range(options.warmup):
            ours()
        timeline = ours.model.record_timeline(tmp, iterations=1)
        ours()
        with open(timeline.stop()) as f:
            ours_trace = json.load(f)
        result["ours"] = _ours_iteration(ours_trace, ours.backward_start_ns)
        result["ours"]["parameters"] = len(list(ours.model.parameters()))

        theirs = _Step(TorchDDP(workload.build(options.seed), **kwargs), batch)
        for _ in range(options.warmup):
            theirs()
        # Note [Quiet profiler] in benchmarks/harness/quiet_profiler.py: no kineto lines on the console.
        with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            theirs()
        path = os.path.join(tmp, f"torch-rank{rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            torch_trace = json.load(f)
        result["torch"] = _torch_iteration(torch_trace)

        # The cost of recording: blocks off and on, alternating.
        samples = {OFF: [], ON: []}
        for block in range(options.blocks):
            for mode in (OFF, ON) if block % 2 == 0 else (ON, OFF):
                recording = ours.model.record_timeline(os.path.join(tmp, "cost")) if mode == ON else None
                for i in range(options.discard_per_block + options.block_iterations):
                    ms = ours()
                    if i >= options.discard_per_block:
                        samples[mode].append(ms)
                if recording is not None:
                    recording.stop()
            if rank == 0:
                progress.say(f"cost block {block + 1}/{options.blocks}")
        result["cost_ms"] = samples
    return result


def _summary(samples: list) -> dict:
    q25, median, q75 = np.percentile(samples, [25, 50, 75])
    return {"median_ms": float(median), "q25_ms": float(q25), "q75_ms": float(q75), "iterations": len(samples)}


def run(options: BenchOptions, progress) -> dict:
    per_rank = launch(_measure, options.world_size, (options, progress), options.threads, options.timeout_s)
    off = [ms for r in per_rank for ms in r["cost_ms"][OFF]]
    on = [ms for r in per_rank for ms in r["cost_ms"][ON]]
    notes = [
        "Times in ms from the start of `loss.backward()` on rank 0. ddp_ext: launch = the hook launching the "
        "bucket's allreduce, done = the Work's future completing (on Gloo's thread); torch DDP: launch = "
        "`c10d::allreduce_` in torch.profiler's trace, done = the end of the `gloo:all_reduce` range that ran it.",
        "One iteration each, on a shared 2-core machine: the shape (when buckets leave, how long they take, how "
        "long the end of backward waits) is what this shows; single timings move from run to run. torch's "
        "iteration runs under torch.profiler, which records every operator and slows it; ddp_ext's timeline "
        "records only ddp_ext's own events. The bucket layouts differ: each DDP's own after its warm-up.",
        "timeline cost: median per-iteration time of ddp_ext with the timeline off and on, blocks alternating, "
        "both ranks' iterations pooled; one short run on a shared machine.",
    ]
    return {
        "model": options.models[0],
        "workload": Workload(options.models[0], options.preset).describe(),
        "ranks_data": per_rank,
        "cost": {"off": _summary(off), "on": _summary(on),
                 "ratio_on_off": float(np.median(on) / np.median(off))},
        "notes": notes,
    }


def run_line(data: dict) -> str:
    o = data["options"]
    return (f"preset `{o['preset']}`, model {data['model']}, seed {o['seed']}; per DDP {o['warmup']} warm-up "
            f"iterations, then one recorded iteration; then the timeline's cost: {o['blocks']} blocks per mode "
            f"(off, on) of {o['discard_per_block']} discarded + {o['block_iterations']} measured iterations, "
            "alternating.")


def _mib(value) -> str:
    return f"{value / 2**20:.2f}"


def table(data: dict) -> str:
    rank0 = data["ranks_data"][0]
    rows = []
    for kind, label in (("ours", "ddp_ext"), ("torch", "torch DDP")):
        r = rank0[kind]
        for k, b in enumerate(r["buckets"]):
            rows.append([f"{label}: bucket {k}", _mib(b["bytes"]), markdown.ms(b["launch_ms"]),
                         markdown.ms(b["done_ms"]), markdown.ms(b["done_ms"] - b["launch_ms"])])
        rows.append([f"{label}: backward returns", "", "", markdown.ms(r["backward_end_ms"]), ""])
    cost = data["cost"]
    text = markdown.table(["DDP: bucket", "MiB", "launch ms", "completion ms", "in flight ms"], rows)
    text += "\n\n" + markdown.table(
        ["ddp_ext per-iteration time", "timeline off", "timeline on", "on / off"],
        [["median ms (q25-q75)", markdown.ms_iqr(cost["off"]), markdown.ms_iqr(cost["on"]),
          markdown.ratio(cost["ratio_on_off"])]])
    return text


def plot(data: dict, path: str) -> None:
    rank0 = data["ranks_data"][0]
    figure, axes = figures.panels(2, width_per_panel=7.0, height=3.5)
    end = max(rank0[k]["backward_end_ms"] for k in ("ours", "torch"))
    for ax, (kind, label) in zip(axes, (("ours", "ddp_ext (its timeline)"), ("torch", "torch DDP (torch.profiler)"))):
        r = rank0[kind]
        rows = ["backward"] + [f"bucket {k}" for k in range(len(r["buckets"]))]
        color = figures.COLORS[kind]
        first = r["first_gradient_ms"] or 0.0
        ax.barh(0, r["backward_end_ms"], left=0, color="tab:gray", alpha=0.4, label="backward call")
        ax.vlines(r["ready_ms"], -0.35, 0.35, color="black", linewidth=0.5, label="gradient ready")
        if kind == "ours":
            w0, w1 = r["wait_ms"]
            ax.barh(0, w1 - w0, left=w0, height=0.4, color="tab:red", label="end-of-backward wait")
        for k, b in enumerate(r["buckets"]):
            ax.barh(k + 1, b["done_ms"] - b["launch_ms"], left=b["launch_ms"], color=color)
            ax.text(b["done_ms"], k + 1, f" {_mib(b['bytes'])} MiB", va="center", fontsize="x-small")
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.4)
        ax.set_xlabel(f"ms from loss.backward() (first gradient at {first:.1f} ms)")
        ax.set_title(label)
        ax.legend(fontsize="x-small", loc="upper right")
    figures.save(figure, path, f"{TITLE} (rank 0 of {data['options']['world_size']}, {data['model']})")
