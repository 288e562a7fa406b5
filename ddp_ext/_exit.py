"""Process groups released before the interpreter's shutdown, so that a
finished training process exits with status 0. See the Note below.

Note [Exit after training]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The race is torch's (torch 2.13 with Python 3.11), and torch's DDP has it
too. Every collective a Gloo group runs is an AsyncWork that keeps the
ThreadLocalState of the thread that launched it, and a collective launched
during a backward pass keeps a Python object in it: torch's backward stashes
the current `contextvars.Context` in thread-local state for the length of the
pass (torch/autograd/graph.py, "context"), so the reducer's bucket allreduces
and a comm hook's `dist.all_reduce` (a `_register_fused_optim` optimizer's)
each hold one, and a comm hook's `then` callbacks hold Python functions. The
Gloo worker thread that ran the collective marks it done, which wakes the
training thread, and only then drops its own reference; when that is the
last one, the worker takes the GIL to release the Python object. If the
training thread got there first and the interpreter is already shutting
down, that worker is ended by Python 3.11 the way it ends every thread that
asks for the GIL during finalization, pthread_exit, and the unwinding through
torch's noexcept destructors calls std::terminate: "terminate called without
an active exception", SIGABRT, one rank of a job that had finished every
step. On a loaded machine the worker may wait long enough for this to
happen. A second form: an object that holds the last reference to a Gloo
group destroyed with the GIL held (ddp_ext's or torch's Reducer, freed when
the `main()` that built the model returns after destroy_process_group())
joins the worker threads while one waits for the GIL: the rank hangs, or, if
that happens during finalization, aborts as above.

What ddp_ext does:
- At exit, from an atexit function registered when ddp_ext is imported (so it
  runs after those the training script registers, before the interpreter's
  finalization refuses threads the GIL), it releases the backends of every
  Gloo group it can reach: the groups of torch.distributed's registry (the
  default group and those of new_group, whether torch's DDP or ddp_ext's
  uses them) and those ddp_ext's wrappers and groups were given or made,
  including ones already passed to destroy_process_group(). It calls
  ProcessGroup::release_resources with the GIL released
  (process_groups/exit_release.h): each Gloo backend no one else holds is
  destroyed, and its destructor joins its worker threads after they have
  released their last collectives, taking the GIL as they need it. After
  that no Gloo thread of these groups is left to ask for the GIL. Groups on
  other backends (NCCL, MPI) are left alone, and so is a Gloo backend that
  user code holds itself (`group._get_backend(...)`).
- The release waits at most DDP_EXT_EXIT_TIMEOUT_S seconds (default 10; 0:
  no release at exit): a collective still waiting for a peer that will never
  join holds a Gloo worker until the group's timeout, and a process that
  exits after an error must not wait that long. It then goes on with the
  exit as it would have without ddp_ext.
- The Reducer is deleted with the GIL released (DeleteWithoutGil in
  bindings/reducer.cpp), so dropping a DDP module whose Reducer holds the last
  reference to its group does not deadlock with a Gloo worker.
The groups are unusable after the release; an atexit function registered
before `import ddp_ext` runs after it and must not run collectives.
tests/wrapper/test_exit_status.py checks the exit status over many 2-rank runs, and
tests/support/exit_runs.py counts it over 200 (docs/RELIABILITY.md, "Exit status").
"""

import atexit
import datetime
import os
import sys
import weakref

import torch.distributed as dist

TIMEOUT_ENV = "DDP_EXT_EXIT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
# Backends whose release at exit is safe: Gloo, and ddp_ext's own composite
# backends (their member groups are Gloo groups).
RELEASABLE_BACKENDS = frozenset({"gloo", "round_robin", "ddp_ext_hierarchical"})

_tracked: "weakref.WeakSet" = weakref.WeakSet()


def track(*groups) -> None:
    """Remembers process groups (while they live) to release at exit."""
    for group in groups:
        if isinstance(group, dist.ProcessGroup):
            _tracked.add(group)


def timeout_s(environ=os.environ) -> float:
    raw = environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        print(f"ddp_ext: {TIMEOUT_ENV}={raw!r} is not a number of seconds; using {DEFAULT_TIMEOUT_S:g}",
              file=sys.stderr)
        return DEFAULT_TIMEOUT_S
    return max(0.0, value)


def _releasable(group: dist.ProcessGroup) -> bool:
    """Every backend of `group` is one of RELEASABLE_BACKENDS; False for a
    group whose backends are gone or cannot be read."""
    try:
        devices = group._device_types
        if not devices:
            return False
        return all(group._get_backend(device).name() in RELEASABLE_BACKENDS for device in devices)
    except Exception:  # noqa: BLE001 (released already, or a backend we do not know)
        return False


def groups_to_release():
    """The groups release_at_exit releases, each once."""
    found = {}
    if dist.is_available():
        from torch.distributed import distributed_c10d as c10d

        world = getattr(c10d, "_world", None)
        for group in list(getattr(world, "pg_map", {}) or {}):
            found[id(group)] = group
    for group in list(_tracked):
        found[id(group)] = group
    return [group for group in found.values() if _releasable(group)]


def release_at_exit() -> bool:
    """Releases the groups' backends (see the Note); True if that finished
    within the timeout (or there was nothing to release)."""
    seconds = timeout_s()
    if seconds <= 0:
        return True
    groups = groups_to_release()
    if not groups:
        return True
    from ddp_ext._native import core as _C

    return _C.release_process_groups(groups, datetime.timedelta(seconds=seconds))


def _at_exit() -> None:
    try:
        if not release_at_exit():
            print(f"ddp_ext: a Gloo process group was still busy after {timeout_s():g} s at exit "
                  f"({TIMEOUT_ENV}); exiting without waiting for it", file=sys.stderr)
    except Exception as error:  # noqa: BLE001 (never turn a clean exit into a failure)
        print(f"ddp_ext: releasing process groups at exit failed: {error}", file=sys.stderr)


atexit.register(_at_exit)
