"""Where a step's wall time goes in the `diloco` experiment, phase by phase,
on one link: the experiment's workload and ranks (2 hosts x 2 ranks), each
variant for `--steps` steps, timed with `time.perf_counter` around the
forward, the backward (with DDP's allreduce, which it waits for), the inner
optimizer's step and `DiLoCo.step` (apart on the steps that launch or merge a
sync and on the others), and inside the sync around each of DiLoCo's parts:
the pseudo-gradient, the encoding, the wait for the exchange (and, on its
thread, the decoding and the gather inside the host), the outer step and the
mix. Before each launch it adds a barrier over the outer group, timed: the
other hosts' lag, apart from the exchange. Then the same steps again with the
forward and backward under `no_sync()` (no allreduce: the computation alone),
which gives the allreduce's share. `--inner torch` builds torch's DDP inside
each host instead of ddp_ext's; `--inner-kwargs` passes ddp_ext's keyword
arguments (JSON).

    python -m benchmarks.diloco_profile [--link-gbit 0.1] [--variants torch,diloco_int8] [--steps 100]

Prints one JSON line per variant: milliseconds per step by phase, the mean
over the 4 ranks (and the slowest rank's total). Needs root (network
namespaces) for a link; without, the loopback. A profile, not a result:
the timers themselves cost microseconds per step, and on a shared machine
a short run is noise.
"""

import argparse
import collections
import contextlib
import functools
import json
import time

import torch
import torch.distributed as dist

from benchmarks.experiments import diloco as experiment
from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness.launcher import launch
from benchmarks.workloads import diloco_variants as dv
from benchmarks.workloads import stdlib_text
from benchmarks.workloads.char_transformer import loss

# DiLoCo's parts timed inside its step: (module, class, method) -> phase.
_SYNC_PARTS = (
    ("ddp_ext.diloco.outer_state", "FragmentState", "pseudo_gradient", "sync: pseudo-gradient"),
    ("ddp_ext.diloco.int8", "ErrorFeedback", "encode", "sync: encode"),
    ("ddp_ext.diloco.int4", "Int4ErrorFeedback", "encode", "sync: encode"),
    ("ddp_ext.diloco.exchange", "Exchange", "wait", "sync: wait for the exchange"),
    ("ddp_ext.diloco.exchange", "Exchange", "_finish",
     "sync: exchange's thread (all_gather wait, decode, host gather)"),
    ("ddp_ext.diloco.exchange", None, "mean_of", "sync: decode"),
    ("ddp_ext.diloco.host_split", "HostSplit", "gather", "sync: gather the host's parts"),
    ("ddp_ext.diloco.outer_state", "FragmentState", "outer_step", "sync: outer step"),
    ("ddp_ext.diloco.outer_state", "FragmentState", "mix_into_live", "sync: mix"),
)


def _timed(totals, phase, method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[phase] += time.perf_counter() - started
    return wrapper


_TOTALS = collections.defaultdict(float)  # this rank's seconds by phase, for the run in progress
_instrumented = False


def _barrier_first(totals, method):
    """Exchange.__init__ after a barrier over its group, timed: how long this
    rank waits for the other hosts to reach the sync (their lag)."""
    @functools.wraps(method)
    def wrapper(self, values, group, *args, **kwargs):
        started = time.perf_counter()
        dist.barrier(group=group)
        totals["sync: other hosts' lag (a barrier the profile adds)"] += time.perf_counter() - started
        return method(self, values, group, *args, **kwargs)
    return wrapper


def _instrument() -> None:
    """Times DiLoCo's parts into _TOTALS (once per process)."""
    global _instrumented
    if _instrumented:
        return
    _instrumented = True
    import importlib
    for module_name, class_name, method_name, phase in _SYNC_PARTS:
        module = importlib.import_module(module_name)
        owner = module if class_name is None else getattr(module, class_name)
        setattr(owner, method_name, _timed(_TOTALS, phase, getattr(owner, method_name)))
    from ddp_ext.diloco.exchange import Exchange
    Exchange.__init__ = _barrier_first(_TOTALS, Exchange.__init__)


def _run(rank: int, variant: str, plan: experiment.Plan, train: torch.Tensor, steps: int, no_sync: bool) -> dict:
    settings = plan.settings
    _instrument()
    _TOTALS.clear()
    totals = _TOTALS
    trainer = dv.Trainer(variant, settings, plan.seed)
    generator = torch.Generator().manual_seed(1000 * plan.seed + rank)
    syncing = set()
    if trainer.outer is not None:
        schedule = trainer.outer._schedule
        for step in range(1, steps + 1):
            if schedule.launches_at(step):
                syncing |= {step, schedule.merge_step(step)}
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        inputs, targets = stdlib_text.random_batch(train, settings.batch, settings.shape.context, generator)
        skip = trainer.ddp.no_sync() if no_sync else contextlib.nullcontext()
        with skip:  # around the forward too: DDP decides there whether the backward syncs
            t0 = time.perf_counter()
            value = loss(trainer.ddp(inputs), targets)
            t1 = time.perf_counter()
            trainer.optimizer.zero_grad()
            value.backward()
            t2 = time.perf_counter()
        trainer.optimizer.step()
        t3 = time.perf_counter()
        if trainer.outer is not None:
            trainer.outer.step()
        t4 = time.perf_counter()
        value.item()
        t5 = time.perf_counter()
        totals["forward"] += t1 - t0
        totals["backward" + (" (no allreduce)" if no_sync else "")] += t2 - t1
        totals["inner optimizer step"] += t3 - t2
        totals["DiLoCo.step, sync steps" if step in syncing else "DiLoCo.step, other steps"] += t4 - t3
        totals["loss.item()"] += t5 - t4
    dist.barrier()
    totals["wall"] = time.perf_counter() - start
    return {phase: 1e3 * seconds / steps for phase, seconds in totals.items()}


def _inner_ddp(inner: str, kwargs: dict):
    """The DDP the DiLoCo variants build inside each host: ddp_ext's with
    `kwargs`, or torch's."""
    import ddp_ext
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    ours = ddp_ext.DistributedDataParallel

    def make(module, process_group=None):
        if inner == "torch":
            return TorchDDP(module, process_group=process_group)
        return ours(module, process_group=process_group, **kwargs)
    return make


def _ranks(rank: int, world_size: int, job) -> dict:
    plan, train, variants, steps, inner, inner_kwargs = job
    if inner != "ddp_ext" or inner_kwargs:
        dv.ddp_ext.DistributedDataParallel = _inner_ddp(inner, inner_kwargs)
    out = {}
    for variant in variants:
        out[variant] = _run(rank, variant, plan, train, steps, no_sync=False)
        out[variant + " no_sync"] = _run(rank, variant, plan, train, steps, no_sync=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--link-gbit", type=float, default=experiment.TIME_TARGET_LINK)
    parser.add_argument("--variants", default=f"{dv.TORCH},{dv.DILOCO_INT8},{dv.STREAMING_INT8},{dv.DILOCO_INT4}")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inner", choices=("ddp_ext", "torch"), default="ddp_ext",
                        help="the DDP inside each host of the DiLoCo variants")
    parser.add_argument("--inner-kwargs", default="{}", help="JSON: keyword arguments of ddp_ext's inner DDP")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in dv.VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(dv.VARIANTS)}")
    plan = experiment.Plan(dv.TrainSettings(), steps=args.steps, overrun=1.0, eval_every=args.steps, seed=args.seed)
    corpus = stdlib_text.load(experiment.TRAIN_BYTES, experiment.HELD_OUT_BYTES)
    world_size = experiment.HOSTS * experiment.RANKS_PER_HOST
    job = (plan, corpus.train, variants, args.steps, args.inner, json.loads(args.inner_kwargs))
    link = None if hosts.cannot_make_namespaces() else args.link_gbit
    setup = functools.partial(experiment._enter_host, None, experiment.RANKS_PER_HOST)
    if link is None:
        by_rank = launch(_ranks, world_size, job, 1, 3600.0, setup=setup)
    else:
        with hosts.fake_hosts(experiment.HOSTS, f"p{int(link * 1000)}", link) as placed:
            setup = functools.partial(experiment._enter_host, placed, experiment.RANKS_PER_HOST)
            by_rank = launch(_ranks, world_size, job, 1, 3600.0, setup=setup)
    for name in by_rank[0]:
        phases = sorted({p for r in by_rank for p in r[name]})
        mean = {p: round(sum(r[name].get(p, 0.0) for r in by_rank) / len(by_rank), 2) for p in phases}
        print(json.dumps({"link_gbit": link, "variant": name, "inner": args.inner, "inner_kwargs": args.inner_kwargs,
                          "steps": args.steps, "ms_per_step": mean,
                          "slowest_rank_wall_ms": round(max(r[name]["wall"] for r in by_rank), 2)}), flush=True)


if __name__ == "__main__":
    main()
