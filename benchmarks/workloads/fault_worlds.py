"""Starts ranks that may die on purpose: `run_world(fn, world_size, job, ...)`.

Unlike harness.launcher.launch, a rank that is killed or raises does not fail the
run: every rank's outcome comes back (what fn returned, or the traceback of
what it raised, and the process's exit code), and ranks still running at the
deadline are killed and marked hung. Each rank joins a Gloo group through a
FileStore with the given process-group timeout.

Ranks are forked from a forkserver that imported torch and ddp_ext once, so
that the many short runs of the fault experiment (and of
tests/fault_tolerance/test_faults.py) do not each pay for importing torch: seconds per
process on a loaded machine.
"""

import dataclasses
import datetime
import multiprocessing
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

# torch._dynamo: both DDPs import it at construction or first forward (seconds).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ddp_ext"]
# After the last rank exits, how long to wait for results still in the pipe
# (an exiting process has flushed them; this is a margin).
DRAIN_S = 0.2


@dataclasses.dataclass
class RankOutcome:
    rank: int
    returned: bool = False  # fn returned; its value is in `value`
    value: Any = None
    error: Optional[str] = None  # traceback of an exception that escaped fn
    exitcode: Optional[int] = None  # None: still running at the deadline, then killed

    @property
    def hung(self) -> bool:
        return self.exitcode is None


def _rank_main(fn, rank, world_size, store_path, pg_timeout_s, job, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        value = fn(rank, world_size, job)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        # Exits with status 1 and its process group left as it is, as an
        # uncaught exception leaves a training script. Its traceback goes
        # back with the outcome, not to the console: a fault experiment
        # raises in a rank on purpose, many times.
        sys.exit(1)
    # Plain pickle: torch's multiprocessing pickler would share tensor storage
    # through file descriptors that die with this process.
    results.put((rank, True, pickle.dumps(value)))
    dist.destroy_process_group()


def context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts
    return ctx


def _drain(results, outcomes, timeout: float) -> None:
    try:
        while True:
            rank, ok, value = results.get(timeout=timeout)
            outcomes[rank].returned = ok
            if ok:
                outcomes[rank].value = pickle.loads(value)
            else:
                outcomes[rank].error = value
    except queue.Empty:
        pass


def run_world(fn: Callable[[int, int, Any], Any], world_size: int, job: Any, pg_timeout_s: float,
              deadline_s: float) -> List[RankOutcome]:
    """Runs fn(rank, world_size, job) on fresh ranks and returns every rank's
    outcome once all have exited, or `deadline_s` has passed (the rest are
    then killed). fn must be a module-level function; job and results picklable."""
    ctx = context()
    results = ctx.Queue()
    outcomes = [RankOutcome(rank) for rank in range(world_size)]
    with tempfile.TemporaryDirectory(prefix="ddp_ext_faults_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, rank, world_size, store_path, pg_timeout_s, job, results),
                        daemon=True)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + deadline_s
        try:
            # Drain while waiting: a rank blocks on exit until its results are read.
            while time.monotonic() < deadline and any(p.is_alive() for p in procs):
                _drain(results, outcomes, timeout=0.1)
            _drain(results, outcomes, timeout=DRAIN_S)
        finally:
            for outcome, proc in zip(outcomes, procs):
                outcome.exitcode = None if proc.is_alive() else proc.exitcode
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)
    return outcomes
