"""Where the sharded optimizer's iteration goes, against its link: the
`sharding` experiment's sharded variant (`overlap_optimizer(optimizer,
shard=True, overlap_forward=True)`, Adam, the experiment's model and batch)
alone on its ranks, 2 hosts x `--per-host` ranks over one shaped link.

Each iteration is timed with `time.monotonic_ns` around the forward, the
backward and the step (with `zero_grad`). The reduce-scatters come from the
wrapper's communication timeline (each bucket's launch and completion), the
all-gathers from the sharded optimizer's launches and their completion
callbacks. From these, per iteration:

- `reduce_scatter_busy_ms`, `all_gather_busy_ms`: how long at least one
  reduce-scatter (all-gather) was in flight;
- `comm_busy_ms`: how long at least one of either was in flight; `idle_ms`
  is the rest of the iteration: time in which the link can carry nothing;
- `link_ms_per_phase`: what one phase's bytes take at the link's rate (a
  ring's (n - 1) / n of the gradient bytes over each host's link), so that
  `2 * link_ms_per_phase` is the iteration's bound on this link;
- `first_gather_ms`: from a step's first all-gather launch to that
  all-gather's completion (how long the next forward's first layers wait
  for the link to fill).

    python -m benchmarks.sharding_profile [--link-gbit 1.5] [--per-host 2] [--model mlp] [--steps 30]

Prints one JSON line per rank (medians over the measured iterations), then
one with the medians over the ranks. Needs root (network namespaces) for a
link; without, or with `--link-gbit 0`, the loopback (no bound). A profile,
not a result: the completion callbacks take the GIL on Gloo's threads, and
on a shared machine a short run is noise.
"""

import argparse
import functools
import itertools
import json
import os
import statistics
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import torch.nn.functional as F

from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness import product
from benchmarks.harness.launcher import launch
from benchmarks.workloads import overlap_variants as ov
from benchmarks.workloads import sharding_variants as sv

WARMUP = 4  # the first iterations: the buckets' rebuild, the parameters moving into their storage
Interval = Tuple[int, int]  # monotonic ns


def busy_ns(intervals: List[Interval], begin: int, end: int) -> int:
    """How long within [begin, end] at least one of `intervals` was open."""
    clipped = sorted((max(a, begin), min(b, end)) for a, b in intervals if b > begin and a < end)
    total, reach = 0, begin
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


class GatherLog:
    """The sharded optimizer's all-gathers: (launch, completion) in monotonic ns."""

    def __init__(self):
        self.intervals: List[Interval] = []
        self.open: Dict[int, int] = {}
        self._keys = itertools.count()

    def install(self) -> None:
        product.wrap_sharded_all_gathers(self._logged)

    def _logged(self, launch_all_gather):
        def logged(output, shard, group=None, async_op=False):
            key, began = next(self._keys), time.monotonic_ns()
            self.open[key] = began
            work = launch_all_gather(output, shard, group=group, async_op=async_op)
            work.get_future().add_done_callback(lambda _, key=key: self._done(key))
            return work

        return logged

    def _done(self, key: int) -> None:
        self.intervals.append((self.open.pop(key), time.monotonic_ns()))


def reduce_scatters(trace: dict) -> List[Interval]:
    """Each bucket's communication in the wrapper's timeline, in ns."""
    return [(int(e["ts"] * 1e3), int((e["ts"] + e["dur"]) * 1e3)) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("tid", 0) >= 100]


def _rank_job(rank: int, world_size: int, job) -> dict:
    model, steps, cap, link_gbit = job
    log = GatherLog()
    log.install()
    step = sv.build(sv.OURS_SHARDED, model, "small", 0, rank, cap).step
    ddp, optimizer = step.model, step.optimizer
    iterations = []
    with tempfile.TemporaryDirectory() as directory:
        timeline = ddp.record_timeline(directory)
        for _ in range(WARMUP + steps):
            t0 = time.monotonic_ns()
            loss = F.cross_entropy(ddp(step.inputs), step.targets)
            t1 = time.monotonic_ns()
            loss.backward()
            t2 = time.monotonic_ns()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            iterations.append((t0, t1, t2, time.monotonic_ns()))
        ddp.finish_forward_tail()
        with open(timeline.stop()) as f:
            scattered = reduce_scatters(json.load(f))
    gathered = log.intervals
    rows = []
    for (t0, t1, t2, t3), after in zip(iterations[WARMUP:-1], iterations[WARMUP + 1:]):
        # An iteration's step launches the all-gathers the next forward waits for: its window ends there.
        launches = sorted(a for a, _ in gathered if t2 <= a <= t3)
        first = min((b for a, b in gathered if a == launches[0]), default=None) if launches else None
        rows.append({"forward_ms": (t1 - t0) / 1e6, "backward_ms": (t2 - t1) / 1e6, "step_ms": (t3 - t2) / 1e6,
                     "iteration_ms": (t3 - t0) / 1e6,
                     "reduce_scatter_busy_ms": busy_ns(scattered, t0, t3) / 1e6,
                     "all_gather_busy_ms": busy_ns(gathered, t0, t3) / 1e6,
                     "comm_busy_ms": busy_ns(scattered + gathered, t0, t3) / 1e6,
                     "first_gather_ms": None if first is None else (first - launches[0]) / 1e6})
    out = {key: _median([r[key] for r in rows]) for key in rows[0]}
    out["idle_ms"] = out["iteration_ms"] - out["comm_busy_ms"]
    out["link_ms_per_phase"] = _link_ms_per_phase(ddp, world_size, link_gbit)
    return out


def _median(values: list) -> Optional[float]:
    """The median of the values that are not None (None if none is)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _link_ms_per_phase(ddp, ranks: int, link_gbit: Optional[float]) -> float:
    """One phase's bytes over a host's link: a ring's (n - 1) / n of the gradient."""
    if not link_gbit:
        return 0.0
    gradient = ov.gradient_bytes(ddp.module)
    return (ranks - 1) / ranks * gradient * 8 / (link_gbit * 1e9) * 1e3


def profile(model: str, steps: int, per_host: int, link_gbit: Optional[float], cap: float,
            torchrun: bool = True) -> List[dict]:
    """Each rank's medians, then the medians over the ranks."""
    job = (model, steps, cap, link_gbit)
    if not link_gbit:
        ranks = launch(_rank_job, 2 * per_host, job)
    else:
        reason = hosts.cannot_make_namespaces()
        if reason:
            raise RuntimeError(f"sharding_profile --link-gbit: {reason}")
        with hosts.fake_hosts(2, "sp", link_gbit) as placed:
            enter = functools.partial(hosts.enter_rank, placed, per_host, torchrun=torchrun)
            ranks = launch(_rank_job, 2 * per_host, job, setup=enter)
    summary = {key: _median([r[key] for r in ranks]) for key in ranks[0]}
    return [*ranks, summary]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link-gbit", type=float, default=1.5, help="0: the loopback")
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--flat", action="store_true",
                   help="without torchrun's LOCAL_WORLD_SIZE: the all-gathers over the flat group, not host by host")
    args = p.parse_args(argv)
    rows = profile(args.model, args.steps, args.per_host, args.link_gbit, args.bucket_cap_mb, not args.flat)
    for rank, row in enumerate(rows):
        label = "all ranks (median)" if rank == len(rows) - 1 else f"rank {rank}"
        print(json.dumps({"ranks": label, **{k: None if v is None else round(v, 2) for k, v in row.items()}}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
