"""Entry point of the checks that run under mpirun: `mpirun -np N python -m
tests.support.mpi.main CHECK...` (tests/support/mpi/launch.py builds the command line).
Every rank runs each named check and prints `PASS <check> ...`; the first
failure prints its traceback and ends the job with status 1.

checks: collectives, subgroup, training, round_robin (one job, one
rendezvous), env (init_method="env://"),
timeout and thread_level (each alone: they leave MPI unusable), killed
(rank 1 kills itself in the middle of an allreduce).
"""

import faulthandler
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import ddp_ext  # noqa: F401  (registers ddp_ext_mpi and mpi://)


def _init():
    dist.init_process_group("ddp_ext_mpi", init_method="mpi://", timeout=timedelta(seconds=120))
    # A Gloo group over the same ranks, through the store mpi:// made.
    return dist.new_group(backend="gloo")


def collectives():
    from tests.support.mpi.collectives import check_collectives

    gloo = _init()
    mpi = dist.group.WORLD
    assert dist.get_backend(mpi) == "ddp_ext_mpi"
    compared = check_collectives(mpi, gloo, dist.get_rank(), dist.get_world_size())
    # The same on a subgroup over every rank but the last (its own communicator).
    return f"{compared} cases equal to Gloo's", gloo


def training(gloo):
    from tests.support.mpi.training import check_training

    return f"{check_training(dist.get_rank(), dist.get_world_size(), gloo)} trainings equal to local training"


def round_robin(gloo):
    from tests.support.mpi.training import check_round_robin

    check_round_robin(dist.get_rank(), dist.get_world_size(), gloo)
    return "round-robin group of 3 MPI children"


def subgroup(gloo):
    """A subgroup of ranks 1.. (its own communicator) next to the world."""
    size = dist.get_world_size()
    ranks = list(range(1, size))
    sub = dist.new_group(ranks, backend="ddp_ext_mpi")
    if dist.get_rank() in ranks:
        t = torch.ones(3)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((3,), float(len(ranks)))), t
    dist.barrier()
    return f"subgroup over ranks {ranks}"


def env():
    """init_method="env://" with RANK and WORLD_SIZE set to MPI's (the test
    sets MASTER_ADDR and MASTER_PORT)."""
    os.environ["RANK"] = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ["PMI_RANK"]
    os.environ["WORLD_SIZE"] = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ["PMI_SIZE"]
    dist.init_process_group("ddp_ext_mpi", init_method="env://")
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    size = dist.get_world_size()
    assert torch.equal(t, torch.full((3,), float(size * (size + 1) // 2))), t
    return f"rank {os.environ['RANK']} of {size} over env://"


def timeout():
    """Rank 0 allreduces on a group with a 2 s timeout; the others never join."""
    dist.init_process_group("ddp_ext_mpi", init_method="mpi://")
    group = dist.new_group(backend="ddp_ext_mpi", timeout=timedelta(seconds=2))
    if dist.get_rank() == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except RuntimeError as e:
            elapsed = time.monotonic() - started
            assert "timed out after 2000 ms" in str(e) and "now unusable" in str(e), str(e)
            assert isinstance(e, dist.DistBackendError), type(e)
        else:
            raise AssertionError("the allreduce did not time out")
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except RuntimeError as e:
            assert "timed out" in str(e), str(e)
        else:
            raise AssertionError("a group that timed out accepted another collective")
        return f"timed out after {elapsed:.1f} s"
    time.sleep(4)
    return "stayed away"


def killed():
    """Rank 1 dies (SIGKILL) while rank 0 waits in an allreduce with a 60 s
    timeout. Prints when it died, so the test can time the others' end."""
    dist.init_process_group("ddp_ext_mpi", init_method="mpi://", timeout=timedelta(seconds=60))
    dist.barrier()
    if dist.get_rank() == 1:
        print(f"KILLED_AT {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))
    return "survived the kill?"


def thread_level():
    """MPI initialized by someone else with MPI_THREAD_SINGLE: the backend refuses."""
    import ctypes
    import ctypes.util

    lib = ctypes.CDLL(ctypes.util.find_library("mpi"), mode=ctypes.RTLD_GLOBAL)
    provided = ctypes.c_int(-1)
    assert lib.MPI_Init_thread(None, None, 0, ctypes.byref(provided)) == 0  # MPI_THREAD_SINGLE is 0
    try:
        dist.init_process_group("ddp_ext_mpi", init_method="mpi://")
    except RuntimeError as e:
        assert "needs at least MPI_THREAD_SERIALIZED" in str(e) and "MPI_THREAD_SINGLE" in str(e), str(e)
    else:
        raise AssertionError("MPI_THREAD_SINGLE was accepted")
    lib.MPI_Finalize()
    return "refused MPI_THREAD_SINGLE"


def main(checks):
    # A hang prints every thread's stack and ends the job instead of waiting.
    faulthandler.dump_traceback_later(float(os.environ.get("DDP_EXT_MPI_CHECK_TIMEOUT_S", 240)), exit=True)
    torch.set_num_threads(1)
    gloo = None
    for check in checks:
        started = time.monotonic()
        try:
            if check == "collectives":
                result, gloo = collectives()
            elif check in ("training", "round_robin", "subgroup"):
                result = globals()[check](gloo)
            else:
                result = globals()[check]()
        except BaseException:
            print(f"FAIL {check} on rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')}\n{traceback.format_exc()}",
                  flush=True)
            sys.exit(1)
        rank = dist.get_rank() if dist.is_initialized() else -1
        print(f"PASS {check} rank {rank}: {result} ({time.monotonic() - started:.1f} s)", flush=True)
    if dist.is_initialized() and checks[-1] not in ("timeout",):
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
