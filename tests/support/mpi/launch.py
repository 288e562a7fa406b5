"""Runs tests/support/mpi/main.py under mpirun: `run(world_size, checks)`, with the
benchmark's mpirun command line (benchmarks.harness.mpi_launcher.mpirun_command:
more ranks than cores, as root, not pinned)."""

import os
import shutil
import subprocess
import sys
from typing import List, Optional

from benchmarks.harness.mpi_launcher import mpirun_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def why_not_available() -> Optional[str]:
    """None where the MPI tests can run, else why they cannot."""
    if shutil.which("mpirun") is None:
        return "no mpirun on PATH (install MPI: apt-get install libopenmpi-dev openmpi-bin)"
    try:
        import ddp_ext._mpi  # noqa: F401
    except ImportError as e:
        return f"ddp_ext._mpi was not built ({e}); rebuild ddp_ext where mpicc is on PATH"
    return None


def command(world_size: int, checks: List[str]) -> List[str]:
    argv = [sys.executable, "-W", "ignore::FutureWarning", "-m", "tests.support.mpi.main", *checks]
    return mpirun_command(world_size, argv)


def run(world_size: int, checks: List[str], timeout_s: float = 240, **env) -> subprocess.CompletedProcess:
    """The mpirun job's result, stdout and stderr together in .stdout; `env`
    adds environment variables."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               DDP_EXT_MPI_CHECK_TIMEOUT_S=str(timeout_s - 20), **env)
    return subprocess.run(command(world_size, checks), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
