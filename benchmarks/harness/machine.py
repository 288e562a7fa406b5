"""What a result was measured on: recorded next to every number the suite writes."""

import datetime
import os
import platform
import subprocess

import torch

import ddp_ext


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return -1.0


# Changes under docs/ and benchmarks/results/ leave a commit clean: documentation
# and the published results do not change what is measured, and `--out
# benchmarks/results` rewrites tracked result files while `all` is still running
# its next experiment.
NOT_MEASURED = ("docs", "benchmarks/results")


def git_commit(directory: str = None) -> str:
    """HEAD's short hash of the checkout holding `directory` (default: this package), with "+dirty"
    when tracked files outside docs/ and benchmarks/results/ have uncommitted changes ("+unknown"
    when git cannot tell); "unknown" outside a checkout."""
    here = directory or os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--",
                                ":(top)", *(f":(top,exclude){path}" for path in NOT_MEASURED)],
                               capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip() or "unknown"
        if commit != "unknown" and dirty.returncode != 0:
            return commit + "+unknown"
        return commit + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_average() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def usable_cores() -> int:
    """Cores this process may run on (fewer than os.cpu_count() under an affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def describe_gpus() -> dict:
    """The GPUs ranks run on: names, count, CUDA version."""
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"device": f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names),
            "cuda": torch.version.cuda}


def describe_machine(backend: str, threads_per_rank: int, device: str = "cpu") -> dict:
    """Cores, memory, software versions and the process-group backend (and
    the GPUs, with device "cuda")."""
    gpus = describe_gpus() if device == "cuda" else {}
    return {
        **gpus,
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ddp_ext": ddp_ext.__version__,
        "ddp_ext_commit": git_commit(),
        "backend": backend,
        "threads_per_rank": threads_per_rank,
        "load_average_at_start": load_average(),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
