"""Runs tests/mpi/main.py under mpirun: `run(world_size, checks)`.

Open MPI refuses to run as root unless told twice (CI runs as root), and
`--oversubscribe` lets it start more ranks than the machine has cores.
"""

import os
import shutil
import subprocess
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    flags = ["--oversubscribe"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    if "Open MPI" not in subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout:
        flags = []  # MPICH's mpirun (Hydra) oversubscribes and runs as root without being told
    return ["mpirun", *flags, "-np", str(world_size), sys.executable, "-W", "ignore::FutureWarning",
            "-m", "tests.mpi.main", *checks]


def run(world_size: int, checks: List[str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    """The mpirun job's result, stdout and stderr together in .stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               DDP_EXT_MPI_CHECK_TIMEOUT_S=str(timeout_s - 20))
    return subprocess.run(command(world_size, checks), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
