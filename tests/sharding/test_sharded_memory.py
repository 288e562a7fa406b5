"""What sharding saves, counted on each rank in real multi-process runs over Gloo:
 - after a synchronising backward, the gradient bytes (every bucket's memory
   and shard, as the reducer reports them, plus every .grad's real storage)
   are at most the model's bytes / world_size plus one bucket;
 - the peak of all torch tensor bytes a rank holds (parameters, gradients,
   buckets, optimizer state, activations), with Adam at 4 ranks, against
   torch's DDP's with a plain optimizer, both measured the same way, with
   overlap_forward=False and True (the all-gathers behind the next forward,
   through the same two buffers):
   torch.profiler's memory events (profile_memory=True) from before the
   model is built, whose running "Total Allocated" counts every CPU tensor
   allocation and free since then. Per phase: the first iteration (one
   bucket for the whole model, to learn the gradient order, as torch's DDP
   lays it out), the second (the buckets rebuilt: the sharded state is
   re-cut for them, Note [Re-cutting the state] in ddp_ext/_shard_recut.py)
   and the iterations after (steady). Asserted: the steady peak at most 0.55
   of torch's DDP's; the rebuild's below the first iteration's (the re-cut
   holds no whole state: it is not the run's peak); the whole run's peak,
   the first two iterations included, at most torch's DDP's whole run's.
   Measured: steady 2.39 x the model against 5.13 (0.466; 2.39 to 2.45,
   0.466 to 0.478, with overlap_forward=True: the parameters in their buckets' storage, Note
   [Parameters in the bucket's storage] in ddp_ext/_shard_plan.py, no
   gather buffer and no copy of the rank's elements; 2.52 to 2.58 through
   two gather buffers, 3.19 with one temporary per bucket), the rebuild
   2.4 to 2.7 x depending on the rank, the first iteration 4.00 x (0.78 of
   torch's DDP's run): the parameters, one bucket of the whole model's
   all-gather buffer and Gloo's copy of it, and the shards.
"""

import gc
import math

import pytest
import torch
from torch import nn

from benchmarks.harness import peak_memory
from ddp_ext._shard_gradient import ShardGradient
from tests.support.worlds import shared_world

WIDTH, DEPTH = 256, 16
BUCKET_MB = 0.2  # one layer (257 KiB) per bucket
STEPS = 3
WARM_UP = 2  # iterations before the layout is rebuilt and the state exists


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def _wrapped(kind: str):
    # init_sync=False: every rank builds the same weights (one seed), and the
    # broadcast's temporary may be freed on a Gloo thread, which the
    # profiler's CPU count never subtracts (one model's bytes on a random
    # rank for the rest of the run).
    module = _model()
    if kind == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=BUCKET_MB, init_sync=False)
    else:
        import ddp_ext

        ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=BUCKET_MB, init_sync=False)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    if kind in SHARDED:
        ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0, overlap_forward=SHARDED[kind])
    return module, ddp, optimizer


def _gradient_bytes(module, ddp) -> int:
    held = sum(flat + shard for flat, shard in ddp.reducer._bucket_memory())
    for p in module.parameters():
        if p.grad is not None and not isinstance(p.grad, ShardGradient):
            held += p.grad.untyped_storage().nbytes()
    return held


def _gradients_job(rank, world_size):
    module, ddp, optimizer = _wrapped("sharded")
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    figures = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        (ddp(x) - y).square().mean().backward()
        figures.append(_gradient_bytes(module, ddp))
        placeholders = all(isinstance(p.grad, ShardGradient) for p in module.parameters())
        optimizer.step()
        optimizer.zero_grad()
    bucket_bytes = max(ddp.reducer.bucket_sizes())  # the largest bucket (the first iteration has one: the model)
    return figures, model_bytes, bucket_bytes, placeholders, len(ddp.reducer.bucket_sizes()), ddp.reducer.bucket_sizes()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_bytes_after_backward(world_size):
    for rank, (figures, model_bytes, bucket_bytes, placeholders, buckets, sizes) in enumerate(
            shared_world(world_size).run(_gradients_job)):
        padding = buckets * world_size * 4  # each shard rounds its bucket's length up to a multiple of the ranks
        bound = model_bytes / world_size + bucket_bytes + padding
        print(f"rank {rank} of {world_size}: gradient bytes after each backward {figures}, bound {bound:.0f} "
              f"(model {model_bytes}, buckets {sizes})")
        assert placeholders, "every used parameter's .grad is a ShardGradient after the backward"
        assert max(figures) <= bound, (rank, figures, bound)


PHASES = ("first", "rebuild", "steady")
SHARDED = {"sharded": False, "overlapped": True}  # kind: overlap_forward


def _phase(step: int) -> str:
    return PHASES[min(step, 2)]


def _peaks(kind: str, rank: int) -> dict:
    """The peak tensor bytes of each phase, and of the whole run ("run")."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # what an earlier run left must not be freed inside this one
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        module, ddp, optimizer = _wrapped(kind)
        for step in range(WARM_UP + STEPS):
            x, y = _batch(step, rank)
            with torch.profiler.record_function(_phase(step)):
                (ddp(x) - y).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        moved = getattr(getattr(ddp, "_optimizer_overlap", None), "reshard_seconds", None)
        if kind == "overlapped":
            ddp.finish_forward_tail()  # the last step's all-gathers, left behind a forward that never comes
        del module, ddp, optimizer
        gc.collect()  # what the run held, reference cycles included, is freed here, on this thread
    events = peak_memory.trace_events(prof)
    spans = {phase: sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == phase and e.get("ph") == "X")
             for phase in PHASES}
    assert [len(spans[phase]) for phase in PHASES] == [1, 1, STEPS], spans
    peaks = _peaks_of(sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]), spans)
    peaks["reshard_seconds"] = moved
    return peaks


def _peaks_of(memory, spans) -> dict:
    """The running total of the bytes allocated in the session, its peak in
    each phase and in the whole run. The profiler counts a free only on a
    thread it profiles: a tensor a Gloo thread frees last (one a collective's
    work held: the broadcast at construction, an all-gather's) would stay
    counted for the rest of the run. Everything the run holds is freed at its
    end (the `del`), on this thread; so a tensor never seen freed (or whose
    address is allocated again before it is seen freed) was freed
    by a Gloo thread, once its collective was waited for: within the
    iteration that allocated it (every collective is waited for in its
    iteration here). It is counted until that iteration's end (or the first
    iteration's start, if allocated while the wrapper was built)."""
    ends = sorted(hi for phase in PHASES for _, hi in spans[phase])
    first = spans["first"][0][0]
    live = {}  # address: the change that allocated it
    changes = []  # (time, bytes)
    unseen = []  # (the change that allocated it, the latest it was freed by)
    for e in memory:
        nbytes, address = e["args"]["Bytes"], e["args"]["Addr"]
        if nbytes > 0:
            if address in live:  # its address is used again: it was freed unseen
                unseen.append((live[address], e["ts"]))
            live[address] = len(changes)
            changes.append((e["ts"], nbytes))
        elif address in live:  # (a free of what an earlier session allocated is not this run's)
            del live[address]
            changes.append((e["ts"], nbytes))
    unseen += [(at, math.inf) for at in live.values()]
    unmatched = 0
    for at, latest in unseen:
        ts, nbytes = changes[at]
        end = next((hi for hi in ends if hi >= ts), ts)
        changes.append((first if ts < first else min(end, latest), -nbytes))
        unmatched += nbytes
    changes.sort(key=lambda change: change[0])
    peaks = {phase: 0 for phase in PHASES + ("run",)}
    total = 0
    for ts, nbytes in changes:
        total += nbytes
        peaks["run"] = max(peaks["run"], total)
        for phase in PHASES:
            if any(lo <= ts <= hi for lo, hi in spans[phase]):
                peaks[phase] = max(peaks[phase], total)
    peaks["unmatched"] = unmatched
    return peaks


def _peak_job(rank, world_size):
    return {kind: _peaks(kind, rank) for kind in ("torch", *SHARDED)}


def test_peak_at_4_ranks_with_adam():
    model_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    for rank, peaks in enumerate(shared_world(4).run(_peak_job)):
        torch_ddp = peaks["torch"]
        for kind in SHARDED:
            sharded = peaks[kind]
            shown = "; ".join(f"{phase} {torch_ddp[phase] / model_bytes:.2f} and {sharded[phase] / model_bytes:.2f} "
                              f"(ratio {sharded[phase] / torch_ddp[phase]:.3f})" for phase in PHASES + ("run",))
            print(f"rank {rank}, {kind} (overlap_forward={SHARDED[kind]}): peak tensor bytes, torch's DDP and "
                  f"sharded, x the model ({model_bytes} bytes): {shown} (freed by Gloo threads: "
                  f"{torch_ddp['unmatched']} and {sharded['unmatched']} bytes); moving the state to the rebuilt "
                  f"buckets took {sharded['reshard_seconds'] * 1000:.0f} ms")
        for kind in SHARDED:
            sharded = peaks[kind]
            assert sharded["steady"] <= 0.55 * torch_ddp["steady"], (rank, kind, peaks)
            assert sharded["rebuild"] < sharded["first"], (rank, kind, peaks)  # the re-cut is not the run's peak
            assert sharded["run"] <= torch_ddp["run"], (rank, kind, peaks)
