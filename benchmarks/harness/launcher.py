"""Starts the ranks of one benchmark run: `launch(fn, world_size, job)`.

Every rank is a fresh process (multiprocessing 'spawn', so no state leaks from
the parent) that fixes its thread count, joins a Gloo process group through a
FileStore in a temporary directory (no ports to pick), runs
`fn(rank, world_size, job)` and sends back what it returns. If any rank fails,
the run stops and the error shows every failed rank's traceback.
"""

import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

from benchmarks.harness import mpi_launcher
from benchmarks.harness.ranks import RanksFailed, values_in_rank_order

__all__ = ["RanksFailed", "launch"]

BACKEND = "gloo"
# Ranks that stop reporting for this long are considered hung.
DEFAULT_TIMEOUT_S = 3600.0
# After one rank fails, how long the others get to report their own errors.
GRACE_AFTER_FAILURE_S = 10.0


def _rank_main(fn, rank, world_size, store_path, threads, job, results, backend=BACKEND, setup=None):
    if setup is not None:
        setup(rank)  # first of all: it may move this process into another network namespace
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, job)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _collect(procs, results, timeout: float) -> dict:
    """Outcomes by rank: (ok, value or traceback)."""
    outcomes = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in outcomes and proc.exitcode not in (None, 0) and results.empty():
                    outcomes[rank] = (False, f"rank {rank} died with exit code {proc.exitcode}")
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
            continue
        outcomes[rank] = (ok, value)
        if not ok:
            deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
    return outcomes


def launch(fn: Callable[[int, int, Any], Any], world_size: int, job: Any, threads: int = 1,
           timeout: float = DEFAULT_TIMEOUT_S, backend: str = BACKEND,
           setup: Optional[Callable[[int], None]] = None) -> List[Any]:
    """Runs fn(rank, world_size, job) on `world_size` ranks with `threads`
    intra-op threads each; returns the ranks' return values in rank order.
    With backend "nccl" each rank first makes cuda:(rank % GPUs) current.

    fn must be a module-level function and job and the return values picklable.
    setup(rank), if given (picklable too), runs first in each rank's process,
    before torch is imported (e.g. benchmarks.harness.fake_hosts.enter).
    backend "ddp_ext_mpi" starts the ranks with mpirun instead (mpi_launcher).
    """
    if backend == mpi_launcher.BACKEND:
        return mpi_launcher.launch(fn, world_size, job, threads, timeout)
    print(f"starting {world_size} rank(s) over {backend}, {threads} thread(s) each", file=sys.stderr, flush=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ddp_ext_bench_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            context.Process(target=_rank_main,
                            args=(fn, rank, world_size, store_path, threads, job, results, backend, setup),
                            daemon=True)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            outcomes = _collect(procs, results, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)
    return values_in_rank_order(outcomes, world_size, "benchmark ranks failed",
                                f"did not finish within {timeout:.0f} s")
