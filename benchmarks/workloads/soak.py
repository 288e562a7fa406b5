"""Memory over a long run: `soak(rank, world_size, job)` trains the fault
experiment's MLP (fault_injection.build_model, one bucket per layer) for
job.iterations iterations, sampling the process's resident set size (RSS)
and the number of Python objects the garbage collector tracks."""

import dataclasses
import gc
import os
import time
from typing import Sequence, Tuple

import numpy as np

from benchmarks.workloads import fault_injection


@dataclasses.dataclass(frozen=True)
class SoakJob:
    wrapper: str  # one of fault_injection.WRAPPERS
    iterations: int = 2000
    sample_every: int = 20
    # Positive control: keep a tensor of this many bytes alive per iteration
    # (a leak), to check that the slope check sees one.
    leak_bytes: int = 0


def rss_bytes() -> int:
    """Resident set size of this process (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(rank: int, world_size: int, job: SoakJob) -> dict:
    """samples: (iteration, RSS bytes, gc-tracked objects) after every
    job.sample_every iterations, the first after iteration 0; seconds: the
    loop's wall time; parameter_sum: to compare ranks."""
    import torch

    model = fault_injection.build_model()
    ddp = fault_injection.wrap(job.wrapper, model, bucket_cap_mb=fault_injection.BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.empty(fault_injection.BATCH, fault_injection.WIDTH)
    samples, leaked = [], []
    started = time.perf_counter()
    for i in range(job.iterations):
        inputs.normal_(generator=generator)
        ddp(inputs).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if job.leak_bytes:
            leaked.append(torch.ones(job.leak_bytes // 4))
        if i == 0:
            # Free the garbage of start-up and of the first iteration (lazy
            # initialisation) now: its collection would otherwise fall at
            # some later iteration and show as a drop in the object count.
            gc.collect()
        if i % job.sample_every == 0:
            samples.append((i, rss_bytes(), len(gc.get_objects())))
    seconds = time.perf_counter() - started
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"samples": samples, "seconds": seconds, "parameter_sum": digest}


def slope_per_100(samples: Sequence[Tuple[int, ...]], column: int = 1, from_iteration: int = 0) -> float:
    """Least-squares slope of samples[column] against the iteration, per 100
    iterations, over the samples at or after `from_iteration`."""
    kept = [(s[0], s[column]) for s in samples if s[0] >= from_iteration]
    x, y = np.array(kept, dtype=float).T
    return float(np.polyfit(x, y, 1)[0] * 100)

