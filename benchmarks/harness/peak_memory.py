"""Peak memory of one call on the CPU, from torch's profiler.

`held_peak_bytes(build)` (at the end) counts what the step holds too, not
only what an iteration adds.

`peak_bytes(fn)` runs `fn()` once under
`torch.profiler.profile(activities=[CPU], profile_memory=True)`, with
kineto's console lines off (Note [Quiet profiler] in
benchmarks/harness/quiet_profiler.py). Every allocation and free by torch's
CPU allocator during the call is a memory event carrying a signed byte count
(positive allocated, negative freed); their running sum, in time order, is
the memory the call holds above the level at its start, and its maximum is
the call's peak. It counts tensors from torch's allocator only: not memory
that libraries allocate themselves (Gloo's send and receive buffers, the
Python heap). Nor does it see the freeing of a block allocated before the
call: torch's allocator knows no size for it, and says so on stderr at the
first such free of a process (and now and then after: 2 lines for 1200
frees), "Memory block of unknown size was allocated before the profiling
started". So a call that frees 1 MiB of earlier tensors, then allocates 1
MiB, peaks at 1 MiB here, not 0. Profiling slows the call down: measure its
time elsewhere. On a loaded machine a rank has been seen to crash
(segmentation fault) inside this call, on a thread Python did not start: run
the experiment again.
"""

import json
import os
import tempfile
from typing import Callable, Iterable, Optional, Tuple

from torch.autograd.profiler_util import MEMORY_EVENT_NAME
from torch.profiler import ProfilerActivity, record_function

from benchmarks.harness.quiet_profiler import quiet_profile

CPU_DEVICE_TYPES = ("CPU", "MKLDNN", "IDEEP")  # DeviceType names of host memory, as the profiler counts it
CPU_DEVICE_CODES = (0, 2, 5)  # the same, as c10::DeviceType's numbers (the chrome trace's "Device Type")


def running_peak(changes: Iterable[Tuple[int, int]]) -> int:
    """The maximum of the running sum of (time, signed bytes) changes taken
    in time order, or 0 if it never rises above its start."""
    held = peak = 0
    for _, nbytes in sorted(changes, key=lambda change: change[0]):
        held += nbytes
        peak = max(peak, held)
    return peak


def peak_bytes(fn: Callable[[], object]) -> int:
    """Bytes of torch CPU tensors held at the peak of one call of `fn`, above the level at its start."""
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The raw events: prof.events() folds the allocations made inside an
    # operator into that operator, and keeps only the others as memory events.
    events = prof.profiler.kineto_results.events()
    return running_peak((e.start_ns(), e.nbytes()) for e in events
                        if e.name() == MEMORY_EVENT_NAME and e.device_type().name in CPU_DEVICE_TYPES)


MEASURED = "peak_memory.measured"  # the profiler's label of the iteration held_peak_bytes measures


def held_peak_bytes(build: Callable[[], Callable[[], object]], before: int = 2, measured: int = 1,
                    finish: Optional[Callable[[object], object]] = None) -> int:
    """Bytes of torch CPU tensors held at the peak of one iteration, counting
    everything the step holds: `build()` makes the step (model, wrapper,
    optimizer, batch) under the profiler, so that every tensor it keeps is
    counted from its allocation; `before` iterations run (the optimizer's
    state appears in the first), then the measured one. The level the
    running sum has reached when it starts (parameters, gradients, optimizer
    state, buckets, the batch) is part of its peak.

    The profiler sees a free only on a thread it profiles: a tensor that a
    Gloo thread frees last (one a collective held: a bucket, an all-gather's
    buffer) would stay counted for the rest of the run, by chance (a run of
    torch's DDP has measured 51, 60 and 68 MiB). So an allocation whose
    address is allocated again before it is seen freed counts as freed at
    that reuse (it was freed before it, unseen). A block freed unseen whose
    address is never reused stays counted: each iteration's figure can only
    be high. Which tensors a Gloo thread frees is a race, different in each
    iteration, while what an iteration really holds is the same once the
    state exists: so `measured` iterations run after the `before` ones, each
    measured alone, and the least of their peaks is returned. `finish(step)`,
    if given, runs last under the profiler: it waits for what the step left
    on the wire, since torch's profiler can crash when it stops while a
    Gloo thread launches a collective (a hierarchical allreduce's steps)."""
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build()
        for _ in range(before):
            step()
        for _ in range(measured):
            with record_function(MEASURED):
                step()
        if finish is not None:
            finish(step)
    events = trace_events(prof)
    marks = [e for e in events if e.get("name") == MEASURED and e.get("ph") == "X"]
    if len(marks) != measured:
        raise RuntimeError(f"held_peak_bytes: {len(marks)} events named {MEASURED!r}, not {measured}")
    memory = sorted((e for e in events if e.get("name") == MEMORY_EVENT_NAME
                     and e["args"].get("Device Type") in CPU_DEVICE_CODES), key=lambda e: e["ts"])
    changes = _with_unseen_frees(memory)
    return min(_held_peak(changes, mark["ts"], mark["ts"] + mark["dur"]) for mark in marks)


def trace_events(prof) -> list:
    """A finished profile's events as its chrome trace lists them (memory
    events with their addresses), through a temporary file."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def _with_unseen_frees(memory) -> list:
    """The (time, signed bytes) changes of the memory events, with a free
    added where an address is allocated again before it was seen freed."""
    live = {}  # address: the bytes allocated there, not yet seen freed
    changes = []
    for e in memory:
        nbytes, address, when = e["args"]["Bytes"], e["args"]["Addr"], e["ts"]
        if nbytes > 0:
            if address in live:
                changes.append((when, -live[address]))
            live[address] = nbytes
        else:
            live.pop(address, None)
        changes.append((when, nbytes))
    return changes


def _held_peak(changes, begin, end) -> int:
    changes = sorted(changes, key=lambda change: change[0])
    held, peak = 0, None
    for when, nbytes in changes:
        if when > end:
            break
        held += nbytes
        if when >= begin:
            peak = held if peak is None else max(peak, held)
    level = sum(n for when, n in changes if when < begin)
    return max(level, peak if peak is not None else level)
