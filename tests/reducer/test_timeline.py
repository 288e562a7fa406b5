"""The communication timeline (DistributedDataParallel.record_timeline,
DDP_EXT_TIMELINE; Note [Communication timeline] in reducer/observation/timeline.h).

Multi-process (2 ranks over Gloo): one Chrome trace per rank, valid, holding
for one iteration one backward, each parameter's ready instant once, each
bucket's launch and completion (seen when awaited where a backend's Work has
no future), the end-of-backward wait; nothing recorded when off; recording
that starts after a forward or stops after N iterations; communication hooks
and rebuilds show up; torch.profiler sees ddp_ext's ranges while the timeline
records; recording changes no result; and a merged trace puts every rank
side by side, aligned on their first step check.
One process: with DDP_EXT_TIMELINE set, the file is written when it exits.
"""

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddp_ext
from ddp_ext import _timeline
from tests.support.harness import same_bits
from tests.support.worlds import shared_world

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


class _Swapped(nn.Module):
    """Registers `last` first but runs it last: its gradients arrive first,
    not last as the construction layout expects, so the buckets are rebuilt
    after the first iterations."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.last = nn.Linear(16, 4)
        self.first = nn.Linear(16, 16)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


def _step(ddp, opt, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 16, generator=gen)
    opt.zero_grad()
    ddp(x).square().mean().backward()
    opt.step()


def _wrap(model, **kwargs):
    # A small cap: several buckets.
    return ddp_ext.DistributedDataParallel(model, bucket_cap_mb=0.002, **kwargs)


def _record(rank: int, world_size: int, directory: str, warmup: int, recorded: int, model: str = "mlp",
            hook: bool = False, with_env: bool = False) -> Dict[str, Any]:
    ddp = _wrap(_Swapped() if model == "swapped" else _model())
    if hook:
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(warmup):
        _step(ddp, opt, rank, step)
    if with_env:
        os.environ[_timeline.ENV_VAR] = directory
        os.environ[_timeline.ITERATIONS_ENV_VAR] = str(recorded)
        try:
            ddp = _wrap(ddp.module)  # the variables are read when a wrapper is built
        finally:
            del os.environ[_timeline.ENV_VAR], os.environ[_timeline.ITERATIONS_ENV_VAR]
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        timeline = ddp._timeline
    else:
        timeline = ddp.record_timeline(directory, iterations=recorded)
    first_buckets = len(ddp.bucket_indices())  # a new wrapper's are torch's first buckets
    for step in range(warmup, warmup + recorded + with_env):
        _step(ddp, opt, rank, step)  # under DDP_EXT_TIMELINE_ITERATIONS, one more: its forward stops the recording
    assert timeline.recording != with_env
    path = timeline.stop()
    with open(path) as f:
        trace = json.load(f)
    return {
        "path": path,
        "trace": trace,
        "names": [n for n, _ in ddp.module.named_parameters()],
        "buckets": first_buckets if with_env else len(ddp.bucket_indices()),  # the recorded iteration's
        "rebuilds": ddp.reducer.rebuilds,
    }


def _events(trace, ph=None, name=None) -> List[Dict[str, Any]]:
    return [e for e in trace["traceEvents"] if (ph is None or e["ph"] == ph) and (name is None or e["name"] == name)]


def _check_one_iteration(result: Dict[str, Any], rank: int) -> None:
    trace = result["trace"]
    for event in trace["traceEvents"]:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(event), event
        assert event["pid"] == rank
        if event["ph"] == "X":
            assert "dur" in event, event  # clamped at 0 when written, so only its presence can fail
    (backward,) = _events(trace, "X", "backward")
    ready = _events(trace, "i", "gradient ready")
    assert sorted(e["args"]["parameter"] for e in ready) == sorted(result["names"])
    for e in ready:
        assert backward["ts"] <= e["ts"] <= backward["ts"] + backward["dur"]
    launches = [e for e in _events(trace, "X") if e["name"].startswith("launch bucket ")]
    comms = [e for e in _events(trace, "X") if e["name"].startswith("bucket ")]
    assert sorted(e["args"]["bucket"] for e in launches) == list(range(result["buckets"]))
    assert sorted(e["args"]["bucket"] for e in comms) == list(range(result["buckets"]))
    by_bucket = {e["args"]["bucket"]: e for e in launches}
    for comm in comms:
        launch = by_bucket[comm["args"]["bucket"]]
        assert comm["ts"] == launch["ts"]
        assert comm["args"]["bytes"] > 0
    (wait,) = _events(trace, "X", "wait for buckets")
    (finalize,) = _events(trace, "X", "finalize backward")
    assert finalize["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= finalize["ts"] + finalize["dur"] + 1e-3
    assert len(_events(trace, "X", "forward")) == 1
    assert trace["otherData"]["dropped_events"] == 0


def test_one_iteration_one_trace_per_rank():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_record, directory, 2, 1)
        assert sorted(os.listdir(directory)) == [_timeline.file_name(r) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert os.path.basename(result["path"]) == f"timeline-rank{rank}.json"
        _check_one_iteration(result, rank)


def test_environment_variable_records():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_record, directory, 1, 1, "mlp", False, True)
    for rank, result in enumerate(results):
        _check_one_iteration(result, rank)


_EXITING_SCRIPT = """
import os, sys, tempfile, torch, torch.distributed as dist
import ddp_ext
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
ddp = ddp_ext.DistributedDataParallel(torch.nn.Linear(4, 2))
ddp(torch.randn(3, 4)).sum().backward()
sys.exit(0)  # no stop(): the file is written when the process exits
"""


def test_environment_variable_writes_at_exit(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env[_timeline.ENV_VAR] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _EXITING_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / _timeline.file_name(0)) as f:
        trace = json.load(f)
    assert len(_events(trace, "X", "backward")) == 1
    assert len(_events(trace, "i", "gradient ready")) == 2


def test_comm_hook_time_is_recorded():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_record, directory, 1, 1, "mlp", True)
    for rank, result in enumerate(results):
        _check_one_iteration(result, rank)
        hooks = [e for e in _events(result["trace"], "X") if e["name"].startswith("comm hook bucket ")]
        assert len(hooks) == result["buckets"]


def test_rebuilds_are_recorded():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_record, directory, 0, 4, "swapped")
    for result in results:
        assert result["rebuilds"] >= 1
        assert len(_events(result["trace"], "X", "rebuild buckets")) == result["rebuilds"]
        assert len(_events(result["trace"], "X", "backward")) == 4


class _DoneWork(dist.Work):
    """A finished Work with no future, as some backends return."""

    def wait(self, timeout=None):
        return True


class _NoFutureGroup(dist.ProcessGroup):
    """Reduces through `inner` at once and returns Works without futures."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner

    def allreduce(self, tensors, *opts):
        self.inner.allreduce(tensors, *opts).wait()
        return _DoneWork()

    def broadcast(self, tensors, *opts):
        return self.inner.broadcast(tensors, *opts)

    def allgather(self, outputs, inputs, *opts):
        return self.inner.allgather(outputs, inputs, *opts)


def _without_futures(rank: int, world_size: int, directory: str) -> List[str]:
    ddp = _wrap(_model(), process_group=_NoFutureGroup(dist.group.WORLD))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.record_timeline(directory) as timeline:
        _step(ddp, opt, rank, 0)
    with open(timeline.path) as f:
        trace = json.load(f)
    buckets = [e for e in _events(trace, "X") if e["name"].startswith("bucket ")]
    assert len(buckets) == len(ddp.bucket_indices())
    return [e["args"].get("completion") for e in buckets]


def test_completion_seen_when_awaited_without_a_future():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_without_futures, directory)
    for completions in results:
        assert completions and set(completions) == {"seen when awaited"}


def _iterations_and_off(rank: int, world_size: int, directory: str) -> Dict[str, Any]:
    ddp = _wrap(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, rank, 0)
    nothing, dropped = ddp.reducer._take_timeline()
    files_when_off = os.listdir(directory)
    timeline = ddp.record_timeline(directory, iterations=2)
    for step in range(1, 5):
        _step(ddp, opt, rank, step)
    # Written at the forward after the second recorded backward, without stop().
    written = os.path.exists(timeline.path)
    still_recording = timeline.recording
    after, _ = ddp.reducer._take_timeline()
    with open(timeline.path) as f:
        trace = json.load(f)
    return {"nothing": nothing, "dropped": dropped, "files_when_off": files_when_off, "written": written,
            "still_recording": still_recording, "after": after,
            "backwards": len(_events(trace, "X", "backward"))}


def test_off_by_default_and_stops_after_iterations():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_iterations_and_off, directory)
    for result in results:
        assert result["nothing"] == [] and result["dropped"] == 0
        assert result["files_when_off"] == []
        assert result["written"] and not result["still_recording"]
        assert result["after"] == []
        assert result["backwards"] == 2


def _started_between_forward_and_backward(rank: int, world_size: int, directory: str) -> Dict[str, Any]:
    ddp = _wrap(_model())
    loss = ddp(torch.randn(8, 16)).square().mean()
    with ddp.record_timeline(directory) as timeline:
        loss.backward()
    with open(timeline.path) as f:
        trace = json.load(f)
    return {"backwards": len(_events(trace, "X", "backward")), "dropped": trace["otherData"]["dropped_events"],
            "ready": len(_events(trace, "i", "gradient ready")), "parameters": len(list(ddp.parameters()))}


def test_recording_may_start_after_the_forward():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_started_between_forward_and_backward, directory)
    for result in results:
        assert result["backwards"] == 1 and result["dropped"] == 0
        assert result["ready"] == result["parameters"]


def _under_profiler(rank: int, world_size: int, directory: str) -> List[str]:
    ddp = _wrap(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, rank, 0)
    with ddp.record_timeline(directory) as timeline:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _step(ddp, opt, rank, 1)
    with open(timeline.path) as f:
        trace = json.load(f)
    assert len(_events(trace, "X", "backward")) == 1
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("ddp_ext::")})


def test_torch_profiler_shows_the_ranges():
    with tempfile.TemporaryDirectory() as directory:
        results = shared_world(WORLD).run(_under_profiler, directory)
    for names in results:
        assert {"ddp_ext::launch_bucket", "ddp_ext::wait_for_buckets", "ddp_ext::finalize_backward"} <= set(names)


def _train(rank: int, world_size: int, directory: str, record: bool) -> List[torch.Tensor]:
    ddp = _wrap(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    timeline = ddp.record_timeline(directory) if record else None
    for step in range(4):
        _step(ddp, opt, rank, step)
    if timeline is not None:
        timeline.stop()
    return [p.detach().clone() for p in ddp.parameters()]


def test_recording_changes_no_result():
    with tempfile.TemporaryDirectory() as directory:
        on = shared_world(WORLD).run(_train, directory, True)
        off = shared_world(WORLD).run(_train, directory, False)
    for rank in range(WORLD):
        assert all(same_bits(a, b) for a, b in zip(on[rank], off[rank]))


def _late_rank(rank: int, world_size: int, directory: str) -> str:
    """The last rank sleeps before each backward: its gradients become ready
    later than the others'."""
    import time

    ddp = _wrap(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.record_timeline(directory, iterations=3):
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            loss = ddp(x).square().mean()
            if rank == world_size - 1:
                time.sleep(0.3)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return directory


def test_merged_timeline_shows_every_rank_aligned():
    from ddp_ext.timeline_merge import merge_timelines

    with tempfile.TemporaryDirectory() as directory:
        shared_world(WORLD).run(_late_rank, directory)
        path = merge_timelines(directory)
        assert os.path.basename(path) == "timeline-all.json"
        with open(path) as f:
            merged = json.load(f)
        events = merged["traceEvents"]
        assert merged["otherData"]["ranks"] == list(range(WORLD))
        assert merged["otherData"]["aligned_on"].startswith("the end of each rank's first step check")
        # Aligned: every rank's first step check ends at the same moment.
        ends = {r: min(e["ts"] + e["dur"] for e in _events(merged, "X", "step check") if e["pid"] == r)
                for r in range(WORLD)}
        assert max(ends.values()) - min(ends.values()) < 1.0, ends  # microseconds
        # On one host the clocks agree already, so the anchors were the same
        # event only if the shifts are small: the late rank is 0.3 s behind
        # in every iteration, so anchoring on another iteration's step check
        # would shift it by that much.
        assert all(abs(shift) < 50_000 for shift in merged["otherData"]["shift_us"].values()), merged["otherData"]
        # Side by side: the late rank's gradients are ready later, in every iteration.
        for iteration in (1, 2, 3):
            first_ready = {
                r: min(e["ts"] for e in events if e.get("name") == "gradient ready" and e["pid"] == r
                       and e["args"]["iteration"] == iteration)
                for r in range(WORLD)
            }
            assert first_ready[WORLD - 1] - first_ready[0] > 150_000, (iteration, first_ready)  # > 0.15 s
        # Each rank's own metadata kept: one process name per rank.
        names = [e for e in events if e.get("ph") == "M" and e["name"] == "process_name"]
        assert sorted(e["pid"] for e in names) == list(range(WORLD))


def test_merging_an_empty_folder_says_what_to_do(tmp_path):
    from ddp_ext.timeline_merge import merge_timelines

    try:
        merge_timelines(str(tmp_path))
    except FileNotFoundError as e:
        assert "record a timeline first" in str(e)
    else:
        raise AssertionError("no error for a folder without traces")
