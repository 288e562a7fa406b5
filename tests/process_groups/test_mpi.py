"""The MPI backend (ddp_ext_mpi), in jobs started by mpirun (tests/support/mpi/):
collectives bit for bit against Gloo's, both DDPs and a round-robin group of
MPI children against local training, a timeout, a killed rank, a thread
level too low; and, wherever MPI is or is not installed, what the loader
says without it."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.mpi import launch

ROOT = launch.ROOT
UNAVAILABLE = launch.why_not_available()
needs_mpi = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"MPI tests skipped: {UNAVAILABLE}")


def _passed(job, check):
    """The ranks that printed PASS for `check`."""
    return sorted(int(r) for r in re.findall(rf"PASS {check} rank (-?\d+)", job.stdout))


@needs_mpi
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_training_and_round_robin(world_size):
    checks = ["collectives", "subgroup", "training", "round_robin"]
    job = launch.run(world_size, checks)
    assert job.returncode == 0, job.stdout
    for check in checks:
        assert _passed(job, check) == list(range(world_size)), f"{check}:\n{job.stdout}"
    compared = {int(n) for n in re.findall(r"PASS collectives rank \d+: (\d+) cases", job.stdout)}
    assert len(compared) == 1 and compared.pop() > 150, job.stdout


@needs_mpi
def test_env_rendezvous_with_mpi_ranks():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = launch.run(2, ["env"], timeout_s=60, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert job.returncode == 0, job.stdout
    assert _passed(job, "env") == [0, 1], job.stdout


@needs_mpi
def test_timeout_fails_the_collective_and_the_group():
    started = time.monotonic()
    job = launch.run(2, ["timeout"], timeout_s=60)
    # Rank 0 leaves MPI unfinalized (a collective was abandoned), so mpirun
    # reports the job as failed (and may end rank 1 before it reports);
    # what matters is rank 0's error, in time.
    assert 0 in _passed(job, "timeout"), job.stdout
    elapsed = float(re.search(r"timed out after ([\d.]+) s", job.stdout).group(1))
    assert 1.9 <= elapsed < 10, job.stdout
    assert time.monotonic() - started < 60


@needs_mpi
def test_killed_rank_ends_the_job_within_a_bound():
    job = launch.run(2, ["killed"], timeout_s=120)
    ended = time.time()
    assert job.returncode != 0, job.stdout
    assert "survived the kill" not in job.stdout, job.stdout
    killed_at = float(re.search(r"KILLED_AT ([\d.]+)", job.stdout).group(1))
    # mpirun notices the death and ends the other ranks (measured: about 1 s).
    assert ended - killed_at < 30, f"the job ended {ended - killed_at:.1f} s after the kill:\n{job.stdout}"


@needs_mpi
def test_thread_level_too_low_is_refused():
    job = launch.run(1, ["thread_level"], timeout_s=60)
    assert job.returncode == 0 and "PASS thread_level" in job.stdout, job.stdout


_BLOCK_PREBUILT = textwrap.dedent(
    """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "ddp_ext._mpi":
                raise ModuleNotFoundError("blocked", name=name)
    sys.meta_path.insert(0, Block())
    """
)


def test_without_mpi_the_error_says_how_to_install_it():
    code = _BLOCK_PREBUILT + textwrap.dedent(
        """
        import ddp_ext, torch.distributed as dist
        try:
            dist.init_process_group("ddp_ext_mpi", init_method="mpi://")
        except ImportError as e:
            print(e)
        """
    )
    env = dict(os.environ, DDP_EXT_NO_MPI="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "the MPI backend needs MPI, and none was found" in done.stdout, done.stdout
    assert "apt-get install libopenmpi-dev openmpi-bin" in done.stdout, done.stdout


@needs_mpi
def test_jit_build_of_the_mpi_backend(tmp_path):
    code = _BLOCK_PREBUILT + textwrap.dedent(
        """
        from ddp_ext._loader import mpi_module
        module = mpi_module()
        assert module.__name__ == "ddp_ext_mpi_jit", module.__name__
        print("jit ok", module.library_version())
        """
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jit ok Open MPI" in done.stdout or "jit ok MPICH" in done.stdout, done.stdout
    assert "compiling the MPI backend now" in done.stderr and "the MPI backend built in" in done.stderr, done.stderr


def test_bench_backend_option_is_for_allreduce_and_compare_only():
    from benchmarks.__main__ import _options, _parser

    args = _parser().parse_args(["allreduce", "--backend", "ddp_ext_mpi"])
    assert _options(args, "allreduce").backend == "ddp_ext_mpi"
    assert _options(_parser().parse_args(["compare"]), "compare").process_group_backend() == "gloo"
    with pytest.raises(SystemExit, match="--backend ddp_ext_mpi is for allreduce and compare only"):
        _options(_parser().parse_args(["bucket", "--backend", "ddp_ext_mpi"]), "bucket")


@needs_mpi
def test_bench_allreduce_over_mpi_measures_mpi_gloo_and_round_robin(tmp_path):
    import json

    command = [sys.executable, "-m", "benchmarks", "allreduce", "--quick", "--backend", "ddp_ext_mpi",
               "--rr-groups", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "allreduce.json").read_text())
    assert list(data["series"]) == ["ddp_ext_mpi", "gloo", "rr2"]
    assert data["machine"]["backend"] == "ddp_ext_mpi"
    assert all(s["median_ms"] > 0 for by_size in data["series"].values() for s in by_size.values())


def test_mpich_style_compiler_wrapper_is_understood(tmp_path, monkeypatch):
    # MPICH's mpicc (and Intel MPI's, MVAPICH's) answers -compile_info and
    # -link_info, and refuses Open MPI's --showme:*.
    fake = tmp_path / "mpicc"
    fake.write_text(
        '#!/bin/sh\ncase "$1" in\n'
        '  -compile_info) echo "gcc -I/opt/mpich/include -DMPICH_FLAG" ;;\n'
        '  -link_info) echo "gcc -L/opt/mpich/lib -lmpich -Wl,-z,now" ;;\n'
        "  *) exit 1 ;;\nesac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("MPICC", str(fake))
    monkeypatch.delenv("DDP_EXT_NO_MPI", raising=False)
    from ddp_ext._mpi_build import find_mpi

    flags = find_mpi()
    assert flags.compile_args == ["-I/opt/mpich/include", "-DMPICH_FLAG"]
    assert flags.link_args == ["-L/opt/mpich/lib", "-lmpich", "-Wl,-z,now", "-Wl,-rpath,/opt/mpich/lib"]
    monkeypatch.setenv("DDP_EXT_NO_MPI", "1")
    assert find_mpi() is None
