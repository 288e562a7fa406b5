"""Starts the ranks of a benchmark run with mpirun, over ddp_ext's MPI backend
(`--backend ddp_ext_mpi`): `launch(fn, world_size, job, threads, timeout)`,
as launcher.launch does with spawned processes over Gloo.

The parent pickles (fn, job, threads) into a temporary directory and runs
`mpirun -np N python -m benchmarks.harness.mpi_launcher DIR`; each rank joins the
default group with init_method "mpi://", runs fn(rank, world_size, job) and
pickles its return value, or its traceback, into DIR.
"""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, List

from benchmarks.harness.ranks import RanksFailed, values_in_rank_order

BACKEND = "ddp_ext_mpi"


def mpirun_command(world_size: int, argv: List[str]) -> List[str]:
    """mpirun starting `argv` on `world_size` ranks of this machine. Open MPI
    must be told to start more ranks than cores, and, as root, that running
    as root is meant (MPICH's mpirun needs neither); it must also not pin
    each rank to one core, where the rank's compute, its progress thread and
    a Gloo group's threads would then share it (spawned ranks are not pinned)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RanksFailed("--backend ddp_ext_mpi needs mpirun on PATH; install MPI (e.g. apt-get install "
                          "libopenmpi-dev openmpi-bin) and rebuild ddp_ext")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    flags = []
    if "Open MPI" in version:
        flags = ["--oversubscribe", "--bind-to", "none", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    return [mpirun, *flags, "-np", str(world_size), *argv]


def launch(fn: Callable[[int, int, Any], Any], world_size: int, job: Any, threads: int = 1,
           timeout: float = 3600.0) -> List[Any]:
    """fn(rank, world_size, job) on `world_size` MPI ranks; their return values in rank order."""
    print(f"starting {world_size} rank(s) with mpirun over {BACKEND}, {threads} thread(s) each", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory(prefix="ddp_ext_bench_mpi_") as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump((fn, job, threads, timeout), f)
        argv = [sys.executable, "-m", "benchmarks.harness.mpi_launcher", tmp]
        try:
            done = subprocess.run(mpirun_command(world_size, argv), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RanksFailed(f"benchmark ranks did not finish within {timeout:.0f} s") from None
        outcomes = {}
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
    return values_in_rank_order(outcomes, world_size,
                                f"benchmark ranks failed (mpirun exit status {done.returncode})",
                                "reported nothing", failed_anyway=done.returncode != 0)

def _rank_main(directory: str) -> None:
    import torch
    import torch.distributed as dist

    import ddp_ext  # noqa: F401  (registers ddp_ext_mpi and mpi://)

    with open(os.path.join(directory, "job.pkl"), "rb") as f:
        fn, job, threads, timeout = pickle.load(f)
    torch.set_num_threads(threads)
    dist.init_process_group(BACKEND, init_method="mpi://", timeout=timedelta(seconds=timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        outcome = (True, fn(rank, world_size, job))
    except BaseException:
        outcome = (False, traceback.format_exc())
    with open(os.path.join(directory, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(outcome, f)
    if outcome[0]:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
