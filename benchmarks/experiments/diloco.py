"""diloco: time and bytes to a target loss, DiLoCo against DDP, over slow links.

Two hosts of two ranks (network namespaces joined by a veth pair, each
host's sending shaped with tc tbf to 100 Mbit/s or 1 Gbit/s:
harness/fake_hosts.py, as in `scaleout`; ranks numbered host by host with
LOCAL_WORLD_SIZE and LOCAL_RANK set as torchrun sets them) train a
character-level transformer (workloads/char_transformer.py) on the Python
standard library's source (workloads/stdlib_text.py), every variant of
workloads/diloco_variants.py in turn, in the same ranks, from the same
parameters on the same batches per rank.

torch's DDP runs `steps` steps; every other variant runs OVERRUN times as
many, so that a variant slower per token can still reach torch's final
loss. Rank 0 keeps a copy of the parameters all hosts agree on every
`eval_every` steps and at the step where torch's DDP stops (equal tokens),
with the wall time since the variant's start; after the variant they are
scored on a fixed held-out set (so scoring costs no training time). One rank
per host reads the bytes its host sent on its veth (/proc/net/dev in its
namespace) before and after the variant: the bytes across hosts, TCP/IP
headers included.

Per link and variant: held-out loss at equal tokens; wall time to torch's
DDP's final held-out loss (the first snapshot at or below it); bytes across
hosts per step. A configuration without a link (`link_gbit` None, all ranks
on the loopback, no namespaces) runs the same code and counts no link bytes:
the tests use it.
"""

import dataclasses
import functools
import math
import os
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness.launcher import launch
from benchmarks.harness.machine import usable_cores
from benchmarks.harness.options import BenchOptions
from benchmarks.reporting import figures, markdown
from benchmarks.workloads import diloco_variants as dv
from benchmarks.workloads import stdlib_text
from benchmarks.workloads.char_transformer import CharModelShape, CharTransformer, held_out_loss

NAME = "diloco"
FIGURE = "none (ddp_ext's own: DiLoCo across slow links)"
TITLE = "DiLoCo across slow links: loss against time, tokens and bytes, beside DDP"

HOSTS, RANKS_PER_HOST = 2, 2
LINKS_GBIT = (0.1, 1.0)
DEFAULT_STEPS = 500
OVERRUN = 1.5
TRAIN_BYTES, HELD_OUT_BYTES = 4_000_000, 400_000
EVAL_SEQUENCES = 64
EVAL_EVERY = 5  # steps between snapshots: streaming's fragments merge every H / F steps
# The targets, for the DiLoCo variants.
LOSS_BOUND = 1.02  # loss at equal tokens / torch's
TIME_BOUND = 0.2  # time to torch's final loss / torch's, at 100 Mbit/s
BYTES_BOUND = 0.01  # bytes across hosts per step / torch's
TIME_TARGET_LINK = 0.1


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one launch of ranks trains."""
    settings: dv.TrainSettings
    steps: int  # torch's DDP's; the equal-token point
    overrun: float
    eval_every: int
    seed: int

    def steps_of(self, variant: str) -> int:
        return self.steps if variant == dv.TORCH else math.ceil(self.steps * self.overrun)

    def eval_steps(self, variant: str) -> List[int]:
        last = self.steps_of(variant)
        return sorted({*range(self.eval_every, last + 1, self.eval_every), self.steps, last})

    def tokens(self, steps: int, ranks: int) -> int:
        return stdlib_text.tokens_seen(steps, ranks, self.settings.batch, self.settings.shape.context)


QUICK_PLAN = Plan(dv.TrainSettings(CharModelShape(width=32, layers=1, heads=2, context=16), batch=2, sync_every=4,
                                   fragments=2), steps=8, overrun=1.5, eval_every=4, seed=0)


def plan_for(options: BenchOptions) -> Plan:
    if options.quick:
        return dataclasses.replace(QUICK_PLAN, seed=options.seed)
    steps = options.steps or DEFAULT_STEPS
    return Plan(dv.TrainSettings(), steps=steps, overrun=OVERRUN, eval_every=EVAL_EVERY, seed=options.seed)


@dataclasses.dataclass
class _Job:
    plan: Plan
    variants: tuple
    ranks_per_host: int
    linked: bool
    train: torch.Tensor
    eval_inputs: torch.Tensor
    eval_targets: torch.Tensor
    progress: object


def _enter_host(placed, ranks_per_host, rank):
    """Runs first in each rank's process: into its host (if any), with torchrun's variables."""
    if placed is not None:
        hosts.enter_rank(placed, ranks_per_host, rank)
    os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_host), LOCAL_RANK=str(rank % ranks_per_host),
                      OMP_NUM_THREADS="1")


def _score(snapshots, shape, inputs, targets) -> List[float]:
    """Each snapshot's held-out loss (scored once where the parameters did
    not change since the one before: DiLoCo's between merges)."""
    model = CharTransformer(shape)
    scores, previous = [], None
    for _, _, parameters in snapshots:
        if previous is not None and all(torch.equal(a, b) for a, b in zip(parameters, previous)):
            scores.append(scores[-1])
            continue
        with torch.no_grad():
            for p, value in zip(model.parameters(), parameters, strict=True):
                p.copy_(value)
        scores.append(held_out_loss(model, inputs, targets))
        previous = parameters
    return scores


def _train_one(rank: int, variant: str, job: _Job) -> dict:
    plan, settings = job.plan, job.plan.settings
    trainer = dv.Trainer(variant, settings, plan.seed)
    generator = torch.Generator().manual_seed(1000 * plan.seed + rank)
    steps, eval_steps = plan.steps_of(variant), set(plan.eval_steps(variant))
    counts_link = job.linked and rank % job.ranks_per_host == 0
    dist.barrier()
    sent_before = hosts.link_bytes()[1] if counts_link else 0
    start = time.perf_counter()
    snapshots = [(0, 0.0, trainer.agreed_parameters())] if rank == 0 else []
    train_losses = []
    for step in range(1, steps + 1):
        inputs, targets = stdlib_text.random_batch(job.train, settings.batch, settings.shape.context, generator)
        train_losses.append(trainer.step(inputs, targets))
        if rank == 0 and step in eval_steps:
            snapshots.append((step, time.perf_counter() - start, trainer.agreed_parameters()))
        if step % max(1, steps // 4) == 0:
            job.progress.say(f"{variant}: step {step}/{steps}, training loss {train_losses[-1]:.3f}")
    dist.barrier()
    wall_s = time.perf_counter() - start
    sent = hosts.link_bytes()[1] - sent_before if counts_link else 0
    totals = torch.tensor([sent, trainer.outer_bytes_sent], dtype=torch.int64)
    dist.all_reduce(totals)
    formats, outer_s = trainer.adaptive_formats(), trainer.outer_s
    del trainer
    if rank != 0:
        return {}
    losses = _score(snapshots, settings.shape, job.eval_inputs, job.eval_targets)
    return {"steps": steps, "wall_s": wall_s, "link_bytes": int(totals[0]) if job.linked else None,
            "outer_bytes": int(totals[1]), "curve_steps": [s for s, _, _ in snapshots],
            "curve_wall_s": [t for _, t, _ in snapshots], "curve_loss": losses, "train_losses": train_losses,
            "adaptive_formats": formats, "outer_s": outer_s}


def _ranks(rank: int, world_size: int, job: _Job) -> dict:
    job.progress = job.progress.for_rank(rank)
    return {variant: _train_one(rank, variant, job) for variant in job.variants}


def run_link(plan: Plan, link_gbit: Optional[float], corpus: stdlib_text.Corpus, progress, timeout_s: float,
             ranks_per_host: int = RANKS_PER_HOST, host_count: int = HOSTS, variants=dv.VARIANTS) -> dict:
    """Every variant on one link (None: the loopback, no namespaces); returns rank 0's records by variant."""
    eval_inputs, eval_targets = stdlib_text.even_batch(corpus.held_out, EVAL_SEQUENCES, plan.settings.shape.context)
    job = _Job(plan, tuple(variants), ranks_per_host, link_gbit is not None, corpus.train, eval_inputs, eval_targets,
               progress)
    world_size = host_count * ranks_per_host
    if link_gbit is None:
        return launch(_ranks, world_size, job, 1, timeout_s,
                      setup=functools.partial(_enter_host, None, ranks_per_host))[0]
    with hosts.fake_hosts(host_count, f"d{int(link_gbit * 1000)}", link_gbit) as placed:
        return launch(_ranks, world_size, job, 1, timeout_s,
                      setup=functools.partial(_enter_host, placed, ranks_per_host))[0]


def first_time_at_or_below(curve_loss: List[float], curve_wall_s: List[float], target: float) -> Optional[float]:
    """The wall time of the first snapshot whose loss is at most `target`, or None."""
    return next((t for loss, t in zip(curve_loss, curve_wall_s) if loss <= target), None)


def loss_at(record: dict, step: int) -> float:
    return record["curve_loss"][record["curve_steps"].index(step)]


def summarize(link_gbit: Optional[float], by_variant: dict, plan: Plan, ranks: int) -> List[dict]:
    """One row per variant of one link's records."""
    torch_record = by_variant[dv.TORCH]
    target = loss_at(torch_record, plan.steps)
    # Read as the others' are: its first snapshot at or below its final loss (at the latest, its last step).
    torch_time = first_time_at_or_below(torch_record["curve_loss"], torch_record["curve_wall_s"], target)
    rows = []
    for variant, r in by_variant.items():
        reached = first_time_at_or_below(r["curve_loss"], r["curve_wall_s"], target)
        equal = loss_at(r, plan.steps)
        per_step = None if r["link_bytes"] is None else r["link_bytes"] / r["steps"]
        torch_per_step = None if torch_record["link_bytes"] is None else torch_record["link_bytes"] / torch_record["steps"]
        rows.append({
            "link_gbit": link_gbit, "variant": variant, "steps": r["steps"],
            "tokens": plan.tokens(r["steps"], ranks), "equal_tokens": plan.tokens(plan.steps, ranks),
            "loss_equal_tokens": equal, "loss_over_torch": equal / target, "final_loss": r["curve_loss"][-1],
            "wall_s": r["wall_s"], "ms_per_step": 1e3 * r["wall_s"] / r["steps"],
            "time_to_torch_loss_s": reached, "time_over_torch": None if reached is None else reached / torch_time,
            "link_bytes_per_step": per_step,
            "bytes_over_torch": None if not torch_per_step or per_step is None else per_step / torch_per_step,
            "outer_bytes_per_step": r["outer_bytes"] / r["steps"],
            "outer_ms_per_step": 1e3 * r.get("outer_s", 0.0) / r["steps"],
        })
    return rows


def targets(rows: List[dict]) -> List[dict]:
    """Each target for each DiLoCo variant and link it applies to: value, bound, met."""
    out = []

    def add(name, r, value, bound):
        out.append({"target": name, "variant": r["variant"], "link_gbit": r["link_gbit"], "value": value,
                    "bound": bound, "met": value is not None and value <= bound})

    for r in rows:
        if r["variant"] not in dv.OUTER_VARIANTS:
            continue
        add("loss at equal tokens / torch DDP's", r, r["loss_over_torch"], LOSS_BOUND)
        if r["link_bytes_per_step"] is not None:
            add("bytes across hosts per step / torch DDP's", r, r["bytes_over_torch"], BYTES_BOUND)
        if r["link_gbit"] == TIME_TARGET_LINK:
            add("time to torch DDP's final loss / torch DDP's time", r, r["time_over_torch"], TIME_BOUND)
    return out


def run(options: BenchOptions, progress) -> dict:
    plan = plan_for(options)
    corpus = stdlib_text.load(TRAIN_BYTES, HELD_OUT_BYTES)
    reason = hosts.cannot_make_namespaces()
    links = [None] if reason else ([1.0] if options.quick else list(LINKS_GBIT))
    if reason:
        progress.say(f"no links: {reason}; every rank on the loopback, no bytes counted")
    rows, curves, adaptive = [], {}, {}
    for link in links:
        progress.say(f"link {_link_name(link)}: {HOSTS} hosts x {RANKS_PER_HOST} ranks, {plan.steps} steps")
        records = run_link(plan, link, corpus, progress, options.timeout_s)
        rows += summarize(link, records, plan, HOSTS * RANKS_PER_HOST)
        curves[_link_name(link)] = {v: {k: r[k] for k in ("curve_steps", "curve_wall_s", "curve_loss")}
                                    for v, r in records.items()}
        adaptive[_link_name(link)] = records[dv.ADAPTIVE]["adaptive_formats"] if dv.ADAPTIVE in records else None
    settings = plan.settings
    return {
        "rows": rows, "targets": targets(rows), "curves": curves, "ranks": f"{HOSTS} hosts x {RANKS_PER_HOST}",
        "corpus": corpus.describe(), "plan": {**dataclasses.asdict(plan), "variants": {
            v: settings.describe(v) for v in dv.VARIANTS}},
        "parameters": dv.parameter_count(settings.shape),
        "adaptive_formats": adaptive,
        "notes": _notes(plan, corpus, reason),
        **({"skipped_links": reason} if reason else {}),
    }


def _link_name(link_gbit: Optional[float]) -> str:
    if link_gbit is None:
        return "loopback"
    return f"{link_gbit * 1000:g} Mbit/s" if link_gbit < 1 else f"{link_gbit:g} Gbit/s"


def _notes(plan: Plan, corpus: stdlib_text.Corpus, reason: Optional[str]) -> List[str]:
    s = plan.settings
    notes = [
        f"One machine of {usable_cores()} usable cores runs all 4 ranks (1 thread each): computation is slow "
        "and shared, so the link weighs less than on real hosts.",
        f"Model: {dv.parameter_count(s.shape) / 1e6:.2f} M parameters ({s.shape.layers} layers, width "
        f"{s.shape.width}, {s.shape.heads} heads, context {s.shape.context}); batch {s.batch} sequences per rank; "
        f"AdamW lr {s.lr}; outer optimizer Nesterov SGD lr {s.outer_lr}, momentum {s.outer_momentum}.",
        f"Text: the Python standard library's .py files, {corpus.train.numel() / 1e6:.1f} MB for training, "
        f"{corpus.held_out.numel() / 1e6:.2f} MB held out (other files; sha256 {corpus.digest}); held-out loss "
        f"(nats per character) on {EVAL_SEQUENCES} fixed sequences, every {plan.eval_every} steps.",
        f"torch's DDP runs {plan.steps} steps, the others {plan.steps_of(dv.DILOCO)}; `loss @ equal tokens` is at "
        f"step {plan.steps}. `time to torch's loss` is the wall time of the first snapshot at or below torch's "
        "DDP's held-out loss at its last step (snapshots every few steps: a coarse reading).",
        "link bytes/step: bytes both hosts sent on their veths, TCP/IP headers included; outer bytes/step: what "
        "DiLoCo's `bytes_sent` counts, summed over ranks; outer ms/step: rank 0's time in `DiLoCo.step` "
        "(launching, waiting for and merging exchanges) per step.",
    ]
    if reason:
        notes.append(f"Links not measured: {reason}.")
    return notes


def run_line(data: dict) -> str:
    p = data["plan"]
    variants = "; ".join(f"`{v}`: {text}" for v, text in p["variants"].items())
    return (f"seed {p['seed']}; {p['steps']} steps of torch's DDP, {math.ceil(p['steps'] * p['overrun'])} of the "
            f"others, in this order on each link: {variants}.")


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(data: dict) -> str:
    rows = []
    for r in data["rows"]:
        rows.append([_link_name(r["link_gbit"]), r["variant"], f"{r['ms_per_step']:.0f}",
                     f"{r['loss_equal_tokens']:.3f}", f"{r['loss_over_torch']:.3f}",
                     _fmt(r["time_to_torch_loss_s"], ".1f", "not reached"), _fmt(r["time_over_torch"], ".3f"),
                     _fmt(None if r["link_bytes_per_step"] is None else r["link_bytes_per_step"] / 1e3, ".1f"),
                     _fmt(r["bytes_over_torch"], ".4f"), f"{r['outer_bytes_per_step'] / 1e3:.1f}",
                     _fmt(r.get("outer_ms_per_step"), ".1f")])
    main = markdown.table(["link", "variant", "ms/step", "loss @ equal tokens", "/ torch", "time to torch's loss (s)",
                           "/ torch", "link kB/step", "/ torch", "outer kB/step", "outer ms/step"], rows)
    checks = [[t["target"], t["variant"], _link_name(t["link_gbit"]), _fmt(t["value"], ".4f", "not reached"),
               f"<= {t['bound']}", "met" if t["met"] else "not met"] for t in data.get("targets", [])]
    if not checks:
        return main
    return main + "\n\nTargets:\n\n" + markdown.table(["target", "variant", "link", "measured", "bound", ""], checks)


def plot(data: dict, path: str) -> None:
    """One row per link: held-out loss against wall time, and against tokens.
    Dashed: the 8- and 4-bit variants; dotted: torch's DDP's final loss."""
    names = list(data["curves"])
    figure, grid = figures.plt.subplots(len(names), 2, figsize=(8.0, 2.7 * len(names)), squeeze=False)
    per_step_tokens = {r["variant"]: r["tokens"] / r["steps"] for r in data["rows"]}
    for (by_time, by_tokens), name in zip(grid, names):
        curves = data["curves"][name]
        for variant, c in curves.items():
            style = {"label": variant, "linestyle": "--" if "_int" in variant else "-", "linewidth": 1.2}
            by_time.plot(c["curve_wall_s"], c["curve_loss"], **style)
            by_tokens.plot([s * per_step_tokens[variant] / 1e6 for s in c["curve_steps"]], c["curve_loss"], **style)
        target = [r["loss_equal_tokens"] for r in data["rows"]
                  if r["variant"] == dv.TORCH and _link_name(r["link_gbit"]) == name]
        losses = [x for c in curves.values() for x in c["curve_loss"] if math.isfinite(x)]
        # Down from torch's DDP's first snapshot: the start (about ln 256) would flatten the rest.
        top = curves[dv.TORCH]["curve_loss"][1] if dv.TORCH in curves else max(losses)
        for ax, label in ((by_time, "wall time (s)"), (by_tokens, "tokens (millions, all ranks)")):
            if target:
                ax.axhline(target[0], color="gray", linestyle=":", linewidth=1.0)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out loss (nats/char)")
            ax.set_title(name)
            ax.set_ylim(min(losses) - 0.02, top + 0.05)
    grid[0][0].legend(fontsize="x-small")
    figures.save(figure, path, TITLE)
