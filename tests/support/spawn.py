"""The one way tests start ranks: `run_ranks(fn, world_size, *args)`.

Each rank is a fresh process (multiprocessing 'spawn') that joins a Gloo
process group through a FileStore in a temporary directory (no fixed ports),
runs `fn(rank, world_size, *args)` and sends back its return value or its
traceback. If any rank fails or the run exceeds its time limit, the test fails
with every rank's traceback, instead of hanging.
"""

import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

DEFAULT_TIMEOUT_S = 180.0

_crash_report = None  # a rank's open file for faulthandler: it must outlive the call


def report_crashes(store_path: str, rank: int) -> None:
    """On a rank: a fatal signal (a segfault) writes every thread's Python
    stack to a file beside the store, which `collect` adds to the rank's
    "died" message."""
    import faulthandler

    global _crash_report
    _crash_report = open(_crash_path(store_path, rank), "w")
    faulthandler.enable(file=_crash_report, all_threads=True)


def _crash_path(store_path: str, rank: int) -> str:
    return f"{store_path}.crash-{rank}"


def _crash_stacks(store_path: Optional[str], rank: int) -> str:
    if store_path is None:
        return ""
    try:
        with open(_crash_path(store_path, rank)) as report:
            text = report.read().strip()
    except OSError:
        return ""
    return f"; its threads' Python stacks when it died:\n{text}" if text else ""


def _rank_main(fn, rank, world_size, store_path, args, results, backend="gloo"):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    report_crashes(store_path, rank)
    try:
        if "nccl" in backend:
            # NCCL binds a rank to the current device when it first communicates.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle: torch's multiprocessing pickler would share tensor
        # storage through file descriptors that die with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


class RanksFailed(AssertionError):
    pass


def collect(results, procs, timeout: float, what: str = "", store_path: Optional[str] = None) -> List[Any]:
    """Waits for one (rank, ok, value) per process on `results` and returns the
    values by rank; raises RanksFailed with every rank's traceback if a rank
    failed, died or did not answer within `timeout` seconds (with the stacks
    of a rank that died, where it ran `report_crashes(store_path, rank)`)."""
    world_size = len(procs)
    outcomes = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
            if dead:
                # Give the queue a moment: a dying rank may still be flushing.
                time.sleep(0.5)
                if results.empty():
                    for r in dead:
                        outcomes[r] = (
                            False,
                            f"rank {r} died with exit code {procs[r].exitcode}" + _crash_stacks(store_path, r),
                        )
            continue
        outcomes[rank] = (ok, pickle.loads(value) if ok else value)
        if not ok:
            # One rank failed; give the others a few seconds to report theirs.
            deadline = min(deadline, time.monotonic() + 10.0)
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        message = "\n".join(failures)
        if missing:
            message += f"\nranks {missing} did not finish {what}within {timeout:.0f} s (hang?)"
        raise RanksFailed(message)
    return [outcomes[r][1] for r in range(world_size)]


def stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_ranks_with_a_victim(fn: Callable, world_size: int, timeout_s: float = 150.0):
    """Like run_ranks, but the last rank is meant to die: the survivors'
    values by rank (None: no answer within `timeout_s`, a hang), and the
    victim's exit code."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ddp_ext_store_") as tmp:
        procs = [
            context.Process(
                target=_rank_main, args=(fn, r, world_size, os.path.join(tmp, "store"), (), results), daemon=True
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            values = {}
            deadline = time.monotonic() + timeout_s
            while len(values) < world_size - 1 and time.monotonic() < deadline:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    continue
                assert ok, f"rank {rank} failed:\n{value}"
                values[rank] = pickle.loads(value)
            procs[-1].join(timeout=10)
            return [values.get(r) for r in range(world_size - 1)], procs[-1].exitcode
        finally:
            stop(procs)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, backend: str = "gloo"
) -> List[Any]:
    """Runs fn on `world_size` fresh ranks and returns their return values by rank.

    fn must be defined at module level (it is pickled by reference) and its
    return value must be picklable. See tests/support/worlds.py for ranks that are
    started once and shared. `backend` is the default group's ("nccl": each
    rank first makes cuda:rank % device_count its current device). Ranks are
    spawned, never forked, so a parent that initialised CUDA is no hazard.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ddp_ext_store_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            context.Process(
                target=_rank_main, args=(fn, rank, world_size, store_path, args, results, backend), daemon=True
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return collect(results, procs, timeout, store_path=store_path)
        finally:
            stop(procs)


def _each(rank, world_size, fn, firsts, args):
    return [fn(rank, world_size, first, *args) for first in firsts]


def run_ranks_for_each(
    fn: Callable[..., Any], world_size: int, firsts: Sequence[Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> List[List[Any]]:
    """Runs fn(rank, world_size, first, *args) for each of `firsts`, one after
    the other on the same fresh ranks (one start instead of one each, e.g.
    for ddp_ext and then torch's DDP): for each of `firsts`, the return
    values by rank. Each call must set up its own seeds and groups: it
    follows the one before it in the same processes."""
    by_rank = run_ranks(_each, world_size, fn, list(firsts), args, timeout=timeout)
    return [[values[i] for values in by_rank] for i in range(len(firsts))]
