"""The lock around a JIT build, which a killed build cannot leave behind.

torch.utils.cpp_extension.load marks a build in progress with an empty file,
`<build dir>/lock`, and waits, without limit or a word, for that file to go
away. A build killed mid-way (a notebook kernel restarted during the build)
leaves the file there, and every later load waits forever.

ddp_ext therefore builds under a lock of its own: an flock(2) on
`<build dir>/ddp_ext_build.lock`, which the kernel releases when its holder
dies, however it dies. A process holding it knows that no other ddp_ext build
is running in that directory, so a `lock` file it finds there is stale: it
says so and removes it.
"""

import contextlib
import errno
import fcntl
import os
import sys
import time

TORCH_LOCK_NAME = "lock"  # the name torch.utils.cpp_extension gives its FileBaton
OWN_LOCK_NAME = "ddp_ext_build.lock"


class BuildLockTimeout(TimeoutError):
    pass


def _say(message: str) -> None:
    print(f"ddp_ext: {message}", file=sys.stderr, flush=True)


def _holder(f) -> str:
    f.seek(0)
    pid = f.read().strip()
    return f"process {pid}" if pid else "another process"


@contextlib.contextmanager
def build_lock(build_dir: str, timeout_s: float, poll_s: float = 0.5):
    """Holds ddp_ext's build lock on `build_dir` for the duration of the block,
    after removing a stale torch lock file. Waits at most `timeout_s` for a
    live build elsewhere, then raises BuildLockTimeout naming the files."""
    os.makedirs(build_dir, exist_ok=True)
    own_path = os.path.join(build_dir, OWN_LOCK_NAME)
    torch_path = os.path.join(build_dir, TORCH_LOCK_NAME)
    with open(own_path, "a+") as f:
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if not announced:
                _say(f"waiting for {_holder(f)}, which is building the native core in {build_dir}")
                announced = True
            if time.monotonic() >= deadline:
                raise BuildLockTimeout(
                    f"ddp_ext: gave up after {timeout_s:.0f} s waiting for {_holder(f)} to finish "
                    f"building the native core in {build_dir}. If no such build is running, remove "
                    f"{own_path} and {torch_path}, then import ddp_ext again."
                )
            time.sleep(poll_s)
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            if os.path.exists(torch_path):
                _say(f"removing {torch_path}, a stale lock file left by an interrupted build")
                os.remove(torch_path)
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)
