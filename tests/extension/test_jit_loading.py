"""The JIT path: a checkout without a prebuilt ddp_ext._C still imports, by
compiling the same sources with torch.utils.cpp_extension.load; the build says
what it does, and one killed mid-way does not leave the next import hanging."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

from ddp_ext import _build_info
from ddp_ext._build_lock import TORCH_LOCK_NAME
from ddp_ext._loader import jit_build_directory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in a fresh interpreter inside the copied checkout.
_IMPORT_ONLY = textwrap.dedent(
    """
    import os, sys
    # An editable install of another checkout would hand out its prebuilt _C.
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    import ddp_ext
    """
)
_PROBE = _IMPORT_ONLY + textwrap.dedent(
    """
    import torch, torch.distributed as dist
    assert ddp_ext._C.__name__ == "ddp_ext_jit", ddp_ext._C.__name__
    assert os.path.dirname(ddp_ext.__file__).startswith(os.getcwd()), ddp_ext.__file__
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    net = torch.nn.Linear(3, 2)
    ddp = ddp_ext.DistributedDataParallel(net)
    ddp(torch.ones(4, 3)).sum().backward()
    assert torch.equal(net.weight.grad, torch.ones(2, 3) * 4), net.weight.grad
    dist.destroy_process_group()
    print("jit ok", ddp_ext._C.torch_version)
    """
)

# Bounds, in seconds, for a build under load on a 2-core machine.
_BUILD_TIMEOUT_S = 900
_LOCK_APPEARS_S = 120


def _copy_checkout_without_binaries(dest):
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "build")
    shutil.copytree(os.path.join(ROOT, "ddp_ext"), os.path.join(dest, "ddp_ext"), ignore=ignore)
    for source in _build_info.SOURCES:
        top = source.split("/")[0]
        target = os.path.join(dest, top)
        if os.path.exists(target):
            continue
        if os.path.isdir(os.path.join(ROOT, top)):
            shutil.copytree(os.path.join(ROOT, top), target, ignore=ignore)
        else:
            shutil.copy(os.path.join(ROOT, top), target)


def _kill_build_midway(checkout, env, torch_lock):
    """Starts an import that JIT-builds, waits until torch's compile is under
    way, and kills the import with everything it started (as a notebook
    kernel restart does). Returns what the import had printed."""
    build = subprocess.Popen(
        [sys.executable, "-c", _IMPORT_ONLY], cwd=checkout, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + _LOCK_APPEARS_S
        while not os.path.exists(torch_lock):
            assert build.poll() is None, f"the build ended before it could be killed:\n{build.stdout.read()}"
            assert time.monotonic() < deadline, f"{torch_lock} did not appear within {_LOCK_APPEARS_S} s"
            time.sleep(0.2)
        time.sleep(3)  # the compiler is running now
        assert build.poll() is None, "the build finished before it could be killed"
    finally:
        with contextlib.suppress(ProcessLookupError):  # already gone if an assertion above failed
            os.killpg(build.pid, signal.SIGKILL)
        output, _ = build.communicate(timeout=30)
    return output


def test_killed_jit_build_then_fresh_import_builds_and_loads(tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    _copy_checkout_without_binaries(str(checkout))
    env = dict(os.environ, PYTHONPATH=str(checkout), TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", env["TORCH_EXTENSIONS_DIR"])
    build_dir = jit_build_directory()
    torch_lock = os.path.join(build_dir, TORCH_LOCK_NAME)

    killed_output = _kill_build_midway(checkout, env, torch_lock)
    # The first build says what it does and where its cache is.
    assert "compiling the native core now" in killed_output and build_dir in killed_output, killed_output
    assert os.path.exists(torch_lock), "the killed build should have left torch's lock file behind"

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=checkout, env=env, capture_output=True, text=True,
        timeout=_BUILD_TIMEOUT_S,
    )
    report = f"after {time.monotonic() - started:.0f} s\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    assert done.returncode == 0, report
    assert "jit ok" in done.stdout, report
    assert f"removing {torch_lock}, a stale lock file" in done.stderr, report
    assert "native core built in" in done.stderr, report
    assert not os.path.exists(torch_lock), report

    # Once built, an import reuses the cache and prints nothing.
    again = subprocess.run(
        [sys.executable, "-c", _IMPORT_ONLY], cwd=checkout, env=env, capture_output=True, text=True, timeout=120
    )
    # torch's own notice on importing torch.utils.cpp_extension, where a CUDA
    # build of torch finds the CUDA toolkit but no GPU, is not ddp_ext's.
    stderr = "".join(line for line in again.stderr.splitlines(True) if "No CUDA runtime is found" not in line)
    assert again.returncode == 0 and again.stdout == "" and stderr == "", again
