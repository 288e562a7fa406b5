"""The benchmarks' uses of torch's profiler print nothing to the console
(Note [Quiet profiler] in benchmarks/harness/quiet_profiler.py).

Kineto decides its log level once per process, at its first start, so each
case runs in a fresh interpreter: the peak-memory measurement (overlap's) and
a profile as timeline's opens it must leave stdout to the caller and stderr
empty, where a plain torch.profiler.profile in the same interpreter prints
kineto's `profiler_start` / `profiler_stop` lines. The three interpreters
run side by side.
"""

import os
import subprocess
import sys

import pytest
import torch

from benchmarks.harness import quiet_profiler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEAK_MEMORY = """
import torch
from benchmarks.harness import peak_memory
for _ in range(3):
    print(peak_memory.peak_bytes(lambda: torch.ones(1024)))
"""

TIMELINE_PROFILE = """
import torch
from benchmarks.harness.quiet_profiler import quiet_profile
with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
    torch.ones(8).sum()
print(len(prof.events()) > 0)
"""

PLAIN_PROFILE = """
import torch
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
    torch.ones(8).sum()
"""


def _start(code: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != quiet_profiler.LEVEL_VARIABLE}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs():
    """The three interpreters' (stdout, stderr), started together: each
    spends most of its time importing torch."""
    started = {name: _start(code) for name, code in
               (("plain", PLAIN_PROFILE), ("peak", PEAK_MEMORY), ("timeline", TIMELINE_PROFILE))}
    try:
        finished = {name: proc.communicate(timeout=180) for name, proc in started.items()}
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()
    for name, proc in started.items():
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{finished[name][1]}"
    return finished


def test_plain_profile_prints_kinetos_lines(runs):
    # What the others must not print: if this fails, torch no longer prints
    # them, and the Note's account is out of date.
    stderr = runs["plain"][1]
    assert "profiler_start" in stderr and "profiler_stop" in stderr, stderr


def test_peak_memory_measurement_prints_only_its_results(runs):
    stdout, stderr = runs["peak"]
    assert stdout.split() == ["4096"] * 3
    assert stderr == "", f"the peak-memory measurement printed:\n{stderr}"


def test_timelines_profile_prints_nothing(runs):
    stdout, stderr = runs["timeline"]
    assert stdout.split() == ["True"]
    assert stderr == "", f"timeline's profile printed:\n{stderr}"


def test_the_level_is_left_as_found(monkeypatch):
    monkeypatch.delenv(quiet_profiler.LEVEL_VARIABLE, raising=False)
    with quiet_profiler.quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert os.environ[quiet_profiler.LEVEL_VARIABLE] == quiet_profiler.SILENT
    assert quiet_profiler.LEVEL_VARIABLE not in os.environ
    monkeypatch.setenv(quiet_profiler.LEVEL_VARIABLE, "1")  # the user's choice stands
    with quiet_profiler.quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert os.environ[quiet_profiler.LEVEL_VARIABLE] == "1"
    assert os.environ[quiet_profiler.LEVEL_VARIABLE] == "1"
