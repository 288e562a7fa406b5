"""Spawned worlds shared by the tests of a session: `shared_world(n).run(fn, *args)`.

Starting ranks costs seconds each time (every rank imports torch and ddp_ext
and joins a process group). A shared world starts its ranks once per session
and world size, like `run_ranks` (tests/support/spawn.py) does, and keeps them: each
rank then runs the jobs it is sent, one after the other, in the same default
process group, and sends back each job's return value or traceback.

Use it where isolation between jobs is not what a test checks. A job that
fails on some rank, or hangs, ends the world (the ranks may disagree about
what comes next); the next job starts a fresh one. Jobs that replace the
default process group, or leave groups behind in doubt, use `run_ranks`.
"""

import atexit
import multiprocessing
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable, Dict, List

from tests.support.spawn import DEFAULT_TIMEOUT_S, RanksFailed, collect, report_crashes, stop


def _rank_loop(rank, world_size, store_path, jobs, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    report_crashes(store_path, rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        # Steps: take a job, run it, answer (rank, ok, value); None ends the loop.
        for job in iter(jobs.get, None):
            fn, args = job
            environment = dict(os.environ)  # a job's variables (LOCAL_WORLD_SIZE...) end with it
            try:
                # Plain pickle, as in run_ranks: tensors must outlive this process.
                results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
            finally:
                os.environ.clear()
                os.environ.update(environment)
    finally:
        dist.destroy_process_group()


class World:
    """`world_size` ranks that stay up and run one job at a time."""

    def __init__(self, world_size: int):
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory(prefix="ddp_ext_world_")
        store_path = self._store_path = os.path.join(self._tmp.name, "store")
        self._results = context.Queue()
        self._jobs = [context.Queue() for _ in range(world_size)]
        self._procs = [
            context.Process(
                target=_rank_loop, args=(rank, world_size, store_path, self._jobs[rank], self._results), daemon=True
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.jobs_run = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
        """Runs fn(rank, world_size, *args) on every rank; its return values by rank."""
        for jobs in self._jobs:
            jobs.put((fn, args))
        self.jobs_run += 1
        try:
            return collect(
                self._results, self._procs, timeout, what=f"job {self.jobs_run} of this shared world ",
                store_path=self._store_path,
            )
        except RanksFailed:
            self.close(graceful=False)  # ranks may be hung, or disagree about what comes next
            raise

    def close(self, graceful: bool = True) -> None:
        if graceful and self.alive():
            for jobs in self._jobs:
                jobs.put(None)
            for p in self._procs:
                p.join(timeout=10)
        stop(self._procs)
        self._tmp.cleanup()


_WORLDS: Dict[int, World] = {}


def shared_world(world_size: int) -> World:
    """The session's world of `world_size` ranks, started on first use (or
    again after a job ended the previous one)."""
    world = _WORLDS.get(world_size)
    if world is None or not world.alive():
        world = _WORLDS[world_size] = World(world_size)
    return world


@atexit.register
def _close_all() -> None:
    for world in _WORLDS.values():
        world.close()
