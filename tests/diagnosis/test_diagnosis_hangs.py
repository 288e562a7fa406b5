"""Hang attribution: a collective of the reducer that waits hang_timeout_s
makes every rank say who and what, through the store (Note [Hang
attribution] in reducer/observation/stall_watch.h, docs/DIAGNOSIS.md).

Multi-process over Gloo: a rank that skips a parameter without
find_unused_parameters, a rank that is late (with a warning hook that reads
the wrapper, and with warnings made errors), a rank that dies; and the
healthy run, which must say nothing. Bounds on the time to the error leave
room for a loaded two-core machine (SLACK_S) but are far below the process
group's timeout, which is what these runs ended with before.
"""

import datetime
import gc
import multiprocessing
import os
import re
import signal
import tempfile
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch._dynamo  # noqa: F401 - else the first forward imports it, seconds that would look like a late rank
import torch.distributed as dist
from torch import nn

import ddp_ext
from ddp_ext._diagnosis import resolve_hang_settings
from tests.support.spawn import run_ranks
from tests.support.models import SkippableNet

HANG_TIMEOUT_S = 2.0
SLACK_S = 4.0  # a loaded machine: scheduling, imports, the first forward
PG_TIMEOUT_S = 60.0
NOT_FINISHED = "Expected to have finished reduction in the prior iteration before starting a new one"


def _barrier_through_store(name, world_size):
    # Not a collective: the process group may be unusable after a hang.
    store = dist.distributed_c10d._get_default_store()
    store.add(name, 1)
    deadline = time.monotonic() + 60
    while int(store.add(name, 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)


def _first_step_outcome(rank, world_size, on_hang):
    """Rank-local: the time from the first backward to the error."""
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    last = rank == world_size - 1
    ddp = ddp_ext.DistributedDataParallel(
        SkippableNet(skip=last), process_group=group, hang_timeout_s=HANG_TIMEOUT_S, on_hang=on_hang
    )
    x = torch.randn(3, 4)
    outcome = ("no error", None, None)
    try:
        loss = ddp(x).pow(2).mean()
        start = time.monotonic()
        try:
            loss.backward()
            ddp(x)  # the rank that skipped raises at its next forward
        except RuntimeError as e:
            outcome = ("raised", str(e), time.monotonic() - start)
    finally:
        _barrier_through_store("first-step-done", world_size)
    return outcome


@pytest.mark.parametrize("world_size", [2, 3])
def test_skipped_parameter_is_named_on_every_rank_within_the_timeout(world_size):
    outcomes = run_ranks(_first_step_outcome, world_size, "auto", timeout=120)
    last = world_size - 1
    for rank, (what, message, seconds) in enumerate(outcomes):
        print(f"rank {rank}: {seconds if seconds is None else round(seconds, 2)} s\n{message}")
        assert what == "raised", f"rank {rank} did not raise"
        assert seconds < HANG_TIMEOUT_S + 1.0 + SLACK_S, f"rank {rank} took {seconds:.1f} s"
        for says in ("fc2.weight", "fc2.bias", f"rank {last}", "training step 1", NOT_FINISHED,
                     "find_unused_parameters=True"):
            assert says in message, f"rank {rank}: message lacks {says!r}:\n{message}"
        for wrong in ("fc0.", "fc1."):
            assert wrong not in message, f"rank {rank}: names {wrong}, which got gradients:\n{message}"
        if rank != last:
            # The ranks that waited say who lags. The last rank's next forward
            # proved their waits endless, so they raised at the first probe
            # after it, before the timeout (Note [Proven hangs]).
            assert f"rank {last} left parameters without a gradient" in message, message
            assert "raised without waiting for hang_timeout_s" in message, message
            assert f"hang_timeout_s={HANG_TIMEOUT_S:g}" in message, message


def test_without_diagnosis_the_waiting_rank_waits_for_the_process_group():
    """The control: hang_timeout_s=0 is torch's behaviour, the waiting rank
    waits until the process group's timeout (short here) and says only
    what the transport says."""
    outcomes = run_ranks(_first_step_without_diagnosis, 2, timeout=120)
    what, message, seconds = outcomes[0]
    print(f"rank 0: {seconds:.2f} s: {message}")
    assert what == "raised"
    assert seconds >= 4.0, f"raised after {seconds:.1f} s, before the process group's 5 s timeout"
    assert "fc2" not in message


def _first_step_without_diagnosis(rank, world_size):
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    ddp = ddp_ext.DistributedDataParallel(SkippableNet(skip=rank == 1), process_group=group, hang_timeout_s=0)
    x = torch.randn(3, 4)
    outcome = ("no error", None, None)
    loss = ddp(x).pow(2).mean()
    start = time.monotonic()
    try:
        loss.backward()
        ddp(x)
    except RuntimeError as e:
        outcome = ("raised", str(e), time.monotonic() - start)
    _barrier_through_store("control-done", world_size)
    return outcome


# --- A late rank: alive, elsewhere ----------------------------------------------------


def _late_rank(rank, world_size, on_hang, late_s, late_step=2):
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    ddp = ddp_ext.DistributedDataParallel(SkippableNet(), process_group=group, hang_timeout_s=1.0, on_hang=on_hang)
    x = torch.randn(3, 4) + rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        raised = None
        for step in range(4):
            if rank == 1 and step == late_step:
                time.sleep(late_s)  # "data loading"
            try:
                ddp(x).pow(2).mean().backward()
            except RuntimeError as e:
                raised = str(e)
                break
    _barrier_through_store(f"late-done-{on_hang}", world_size)
    grads = None if raised else [p.grad.clone() for p in ddp.parameters()]
    return raised, [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)], grads


@pytest.mark.parametrize("on_hang", ["auto", "warn"])
def test_a_late_rank_is_named_in_a_warning_and_training_goes_on(on_hang):
    outcomes = run_ranks(_late_rank, 2, on_hang, 3.0, timeout=120)
    (raised0, warned0, grads0), (raised1, warned1, grads1) = outcomes
    assert raised0 is None and raised1 is None, (raised0, raised1)
    assert len(warned0) == 1, f"rank 0 warned {len(warned0)} times: {warned0}"
    assert "rank 1 did not reach the end of the backward of training step 3" in warned0[0], warned0[0]
    assert "reported nothing" in warned0[0] and "Still waiting" in warned0[0], warned0[0]
    assert warned1 == [], warned1
    for g0, g1 in zip(grads0, grads1):
        assert torch.equal(g0, g1)


def test_a_late_rank_raises_with_on_hang_raise():
    outcomes = run_ranks(_late_rank, 2, "raise", 3.0, timeout=120)
    (raised0, _, _), (raised1, _, _) = outcomes
    assert raised0 is not None and "rank 1 did not reach the end of the backward of training step 3" in raised0
    # Rank 1 comes back to collectives rank 0 left: it is told so, in seconds.
    assert raised1 is not None and "rank 0 raised an error in training step 3 and left the collectives" in raised1


def test_a_rank_late_for_the_first_rebuild_is_named_at_the_forward():
    # The first bucket rebuild broadcasts rank 0's gradient order at the
    # forward after the first backward (as torch's DDP does): the wait is there.
    outcomes = run_ranks(_late_rank, 2, "raise", 3.0, 1, timeout=120)
    (raised0, _, _), (raised1, _, _) = outcomes
    assert raised0 is not None and "rank 1 did not reach the forward of training step 2" in raised0, raised0
    assert "the broadcast of rank 0's gradient order (the first bucket rebuild)" in raised0, raised0
    assert raised1 is not None and "rank 0 raised an error in training step 2 and left the collectives" in raised1


# --- User code inside the report ------------------------------------------------------
# The hang handler runs user code: warnings.warn calls the warning filters and
# showwarning, which may read the wrapper (Note [Hang attribution],
# "Reporting without the lock"). With the reducer's lock held through it, a
# read on that thread deadlocked.


def _late_rank_with_reading_warning_hook(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    ddp = ddp_ext.DistributedDataParallel(SkippableNet(), process_group=group, hang_timeout_s=1.0, on_hang="warn")
    ddp.watch_stragglers(every=1)
    x = torch.randn(3, 4) + rank
    seen = []

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "did not reach the end of the backward" not in str(message):
            return
        # From inside the report, on the thread that waits: reads go through...
        seen.append(("straggler_report", type(ddp.straggler_report()).__name__))
        seen.append(("iteration", ddp._get_ddp_logging_data()["iteration"]))
        seen.append(("phase", ddp.reducer.phase))
        # ...and a change raises rather than pull the state from under the wait.
        try:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            seen.append(("registered", None))
        except RuntimeError as e:
            seen.append(("refused", str(e)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = showwarning
        for step in range(4):
            if rank == 1 and step == 2:
                time.sleep(3.0)
            ddp(x).pow(2).mean().backward()
    _barrier_through_store("reading-hook-done", world_size)
    return seen, [p.grad.clone() for p in ddp.parameters()], len(ddp._comm_hooks)


def test_a_warning_hook_may_read_the_wrapper_while_it_waits():
    outcomes = run_ranks(_late_rank_with_reading_warning_hook, 2, timeout=120)
    (seen0, grads0, hooks0), (seen1, grads1, hooks1) = outcomes
    print(seen0)
    kinds = [kind for kind, _ in seen0]
    assert kinds == ["straggler_report", "iteration", "phase", "refused"], seen0
    # torch's `iteration`: the third forward sampled iteration 2.
    assert seen0[1][1] == 2 and seen0[2][1] == "reducing", seen0
    assert "from inside its own hang report" in seen0[3][1], seen0[3][1]
    assert hooks0 == hooks1 == 0 and seen1 == []
    for g0, g1 in zip(grads0, grads1):
        assert torch.equal(g0, g1)


def _late_rank_with_warnings_as_errors(rank, world_size):
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    ddp = ddp_ext.DistributedDataParallel(SkippableNet(), process_group=group, hang_timeout_s=1.0, on_hang="warn")
    x = torch.randn(3, 4) + rank
    raised = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            for step in range(4):
                if rank == 1 and step == 2:
                    time.sleep(3.0)
                ddp(x).pow(2).mean().backward()
        except RuntimeError as e:
            raised = str(e)
    _barrier_through_store("warnings-as-errors-done", world_size)
    return raised


def test_a_filter_that_makes_the_warning_an_error_raises_it():
    raised0, raised1 = run_ranks(_late_rank_with_warnings_as_errors, 2, timeout=120)
    assert raised0 is not None and "rank 1 did not reach the end of the backward of training step 3" in raised0, raised0
    # Rank 0 left the collectives, and rank 1 is told so, as with on_hang="raise".
    assert raised1 is not None and "rank 0 raised an error in training step 3 and left the collectives" in raised1


# --- A dead rank ------------------------------------------------------------------------


def _dying_rank_main(rank, world_size, store_path, results):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    victim = world_size - 1
    torch.manual_seed(0)
    net = SkippableNet()
    ddp = ddp_ext.DistributedDataParallel(net, hang_timeout_s=HANG_TIMEOUT_S, bucket_cap_mb=1e-9)
    if rank == victim:
        # Dies in its backward of step 2, after the buckets of fc2 and fc1 left.
        net.fc0.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL) if ddp.reducer.training_steps == 2 else g)
    x = torch.randn(3, 4)
    start = None
    try:
        for _ in range(3):
            loss = ddp(x).pow(2).mean()
            start = time.monotonic()
            loss.backward()
        results.put((rank, "no error", None))
    except RuntimeError as e:
        results.put((rank, str(e), time.monotonic() - start))


def test_a_dead_rank_is_named_by_the_survivors():
    world_size = 3
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ddp_ext_store_") as tmp:
        procs = [
            context.Process(target=_dying_rank_main, args=(r, world_size, os.path.join(tmp, "store"), results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            outcomes = {}
            deadline = time.monotonic() + 120
            while len(outcomes) < world_size - 1 and time.monotonic() < deadline:
                try:
                    rank, message, seconds = results.get(timeout=1.0)
                    outcomes[rank] = (message, seconds)
                except Exception:
                    pass
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    assert procs[-1].exitcode == -signal.SIGKILL, f"the victim ended with {procs[-1].exitcode}"
    assert sorted(outcomes) == [0, 1], f"survivors that answered: {sorted(outcomes)}"
    for rank, (message, seconds) in outcomes.items():
        print(f"rank {rank}: {seconds} s\n{message}")
        assert message != "no error"
        # Ranks on one host: the survivors can tell a dead process from a busy one.
        assert "DistributedDataParallel: rank 2 died during training step 2" in message, message
        assert re.search(r"rank 2: reported nothing within \d\.\d s \(its process is gone\)", message), message
        # The transport's own error is kept: this rank's, or, when this rank's
        # wait was not paired with the dead one (it waits on, and its next
        # probe finds the survivor that raised: Note [Proven hangs]), the
        # other survivor's.
        assert "gloo" in message.lower() or "failed, and left the collectives" in message, message
        assert seconds < 1.0 + SLACK_S, f"rank {rank} took {seconds:.1f} s"


# --- No false alarms, nothing left behind -------------------------------------------------


def _healthy(rank, world_size, iterations):
    torch.manual_seed(0)
    threads_before = threading.active_count()
    net = SkippableNet()
    ddp = ddp_ext.DistributedDataParallel(net, hang_timeout_s=HANG_TIMEOUT_S)
    diagnosis = ddp._hang_diagnosis
    x = torch.randn(3, 4) + rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(iterations):
            ddp(x).pow(2).mean().backward()
    alerts = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
    threads_during = threading.active_count()
    collected = weakref.ref(ddp)
    del ddp
    gc.collect()
    return dict(
        alerts=alerts,
        messages=list(diagnosis.messages),
        threads=(threads_before, threads_during, threading.active_count()),
        wrapper_freed=collected() is None,
        diagnosis_freed=sys_getrefcount_is_small(diagnosis),
    )


def sys_getrefcount_is_small(obj) -> bool:
    import sys

    # This frame's name, getrefcount's argument: nothing else, once the reducer is gone.
    return sys.getrefcount(obj) <= 3


def test_healthy_training_says_nothing_and_leaves_nothing_behind():
    for rank, out in enumerate(run_ranks(_healthy, 2, 200, timeout=180)):
        assert out["alerts"] == [] and out["messages"] == [], f"rank {rank}: false alarm: {out}"
        before, during, after = out["threads"]
        assert before == during == after, f"rank {rank}: threads {out['threads']}: diagnosis must start none"
        assert out["wrapper_freed"], f"rank {rank}: the diagnosis kept the wrapper alive"
        assert out["diagnosis_freed"], f"rank {rank}: the reducer's handler outlived it"


# --- Settings ---------------------------------------------------------------------------


def test_settings_keywords_environment_and_validation(monkeypatch):
    monkeypatch.delenv("DDP_EXT_HANG_TIMEOUT_S", raising=False)
    monkeypatch.delenv("DDP_EXT_ON_HANG", raising=False)
    default = resolve_hang_settings(None, None)
    assert (default.timeout_s, default.on_hang, default.on) == (60.0, "auto", True)
    assert resolve_hang_settings(0, "warn").on is False
    assert resolve_hang_settings(2.5, "raise").timeout_s == 2.5
    monkeypatch.setenv("DDP_EXT_HANG_TIMEOUT_S", "7")
    monkeypatch.setenv("DDP_EXT_ON_HANG", "warn")
    assert resolve_hang_settings(2.5, "raise") == type(default)(7.0, "warn")
    monkeypatch.setenv("DDP_EXT_HANG_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="DDP_EXT_HANG_TIMEOUT_S"):
        resolve_hang_settings(None, None)
    monkeypatch.delenv("DDP_EXT_HANG_TIMEOUT_S")
    monkeypatch.delenv("DDP_EXT_ON_HANG")
    for bad in (-1, float("nan"), float("inf"), "x"):
        with pytest.raises(ValueError, match="hang_timeout_s"):
            resolve_hang_settings(bad, None)
    with pytest.raises(TypeError, match="hang_timeout_s"):
        resolve_hang_settings(True, None)
    with pytest.raises(ValueError, match="on_hang"):
        resolve_hang_settings(None, "ignore")


def test_keywords_reach_the_wrapper(single_process_group):
    with pytest.raises(ValueError, match="on_hang"):
        ddp_ext.DistributedDataParallel(nn.Linear(2, 2), on_hang="maybe")
    ddp = ddp_ext.DistributedDataParallel(nn.Linear(2, 2), hang_timeout_s=5)
    assert ddp._hang_settings.timeout_s == 5.0
    assert ddp._hang_diagnosis is None  # a world of one waits for nobody
