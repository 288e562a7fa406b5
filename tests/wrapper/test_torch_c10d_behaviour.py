"""Behaviour that pytorch's own c10d DDP tests check, checked here against
stock torch DDP doing the same thing: DDP over a process group written in
Python, a backward pass outside the wrapper, sparse gradients through a
communication hook, errors and sampled iterations in
`_get_ddp_logging_data()`; and torch's own `test_ddp_logging_data_cpu`
(shipped in the wheel) run with ddp_ext in torch's place.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.spawn import run_ranks_for_each

OursDDP = ddp_ext.DistributedDataParallel
ROOT = Path(__file__).resolve().parents[2]


def _wrapper(which):
    return OursDDP if which == "ddp_ext" else TorchDDP


# --- a process group written in Python ----------------------------------------


class _RecordedWork(dist._Work):
    """A Work written in Python: only wait(timeout) and get_future(), the
    two torch's code calls, each recorded."""

    def __init__(self, inner, calls):
        super().__init__()
        self._inner = inner
        self._calls = calls

    def wait(self, timeout):
        self._calls.append(("wait", type(timeout).__name__))
        return self._inner.wait(timeout)

    def get_future(self):
        self._calls.append(("get_future", None))
        return self._inner.get_future()


class PythonGroup(dist.ProcessGroup):
    """A c10d process group written in Python that delegates every
    collective to a Gloo group and records what it was called with. Its
    methods take every argument positionally, as torch's own test groups
    do, so a caller that leaves out `opts` fails."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self._inner = inner
        self.calls = []

    def _recorded(self, name, opts, work):
        self.calls.append((name, type(opts).__name__))
        return _RecordedWork(work, self.calls)

    def allreduce(self, tensors, opts):
        return self._recorded("allreduce", opts, self._inner.allreduce(tensors, opts))

    def allgather(self, output_tensors, input_tensors, opts):
        return self._recorded("allgather", opts, self._inner.allgather(output_tensors, input_tensors, opts))

    def broadcast(self, tensors, opts):
        return self._recorded("broadcast", opts, self._inner.broadcast(tensors, opts))

    def getBackendName(self):
        return "python-over-gloo"


OPTIONS = {"allreduce": "AllreduceOptions", "allgather": "AllgatherOptions", "broadcast": "BroadcastOptions"}


def _train_over_python_group(rank, world_size, which, gradient_as_bucket_view):
    group = PythonGroup(dist.distributed_c10d._get_default_group())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    # A small cap: several buckets, so several allreduces per backward.
    ddp = _wrapper(which)(model, process_group=group, bucket_cap_mb=0.0002,
                          gradient_as_bucket_view=gradient_as_bucket_view)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        optimizer.zero_grad()
        ddp(torch.randn(6, 4)).pow(2).mean().backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, group.calls


def _check_calls(calls, which):
    assert calls, f"{which} called nothing on the Python process group"
    for name, argument in calls:
        if name in OPTIONS:
            assert argument == OPTIONS[name], f"{which}: {name} got {argument}, not torch's options object"
        elif name == "wait":
            assert argument == "timedelta", f"{which}: wait got {argument}, not a timeout"
    assert any(name == "allreduce" for name, _ in calls), calls
    assert any(name == "get_future" for name, _ in calls), f"{which} never awaited a bucket through its future"


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_python_process_group_trains_as_torch_ddp(gradient_as_bucket_view):
    ours, theirs = run_ranks_for_each(_train_over_python_group, 2, ("ddp_ext", "torch"), gradient_as_bucket_view)
    for rank, ((params, calls), (expected, torch_calls)) in enumerate(zip(ours, theirs)):
        _check_calls(torch_calls, "torch")
        _check_calls(calls, "ddp_ext")
        for name in expected:
            torch.testing.assert_close(params[name], expected[name], msg=lambda m: f"rank {rank}, {name}: {m}")
    for name in ours[0][0]:
        assert torch.equal(ours[0][0][name], ours[1][0][name]), f"{name} differs across ranks"


def test_python_process_group_of_one_rank_gets_its_collectives(single_process_group):
    """A world of one skips collectives only over torch's own backends
    (Note [A world of one rank]): a group written in Python gets them, as
    torch's DDP gives them."""
    results = {}
    for which in ("ddp_ext", "torch"):
        group = PythonGroup(single_process_group)
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        ddp = _wrapper(which)(model, process_group=group)
        ddp(torch.randn(4, 3)).sum().backward()
        _check_calls(group.calls, which)
        results[which] = [p.grad.clone() for p in model.parameters()]
    for ours, theirs in zip(results["ddp_ext"], results["torch"]):
        assert torch.equal(ours, theirs)


# --- a backward pass outside the wrapper --------------------------------------


def _backward_outside(rank, world_size, which):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ddp = _wrapper(which)(model)
    x = torch.randn(4, 3) + rank
    grads = lambda: torch.cat([p.grad.flatten() for p in model.parameters()]).clone()  # noqa: E731
    out = ddp(x).sum()
    out.backward(retain_graph=True)
    averaged = grads()
    out.backward()  # a second backward over the same graph: not prepared
    second = grads()
    model.zero_grad()
    model(x).sum().backward()  # the wrapped module, outside the wrapper
    local = grads()
    model.zero_grad()
    ddp(x).sum().backward()  # the wrapper averages again
    again = grads()
    return averaged, second, local, again


def test_backward_outside_the_wrapper_stays_local_as_with_torch():
    ours, theirs = run_ranks_for_each(_backward_outside, 2, ("ddp_ext", "torch"))
    for rank in range(2):
        for what, a, b in zip(("averaged", "second backward", "outside", "again"), ours[rank], theirs[rank]):
            torch.testing.assert_close(a, b, msg=lambda m: f"rank {rank}, {what}: {m}")
        averaged, second, local, again = ours[rank]
        # The unprepared backward added this rank's own gradient, unaveraged.
        torch.testing.assert_close(second, averaged + local)
        torch.testing.assert_close(again, averaged)
    assert not torch.equal(ours[0][2], ours[1][2]), "the outside backward should not be averaged"


# --- sparse gradients through a communication hook ----------------------------


class _SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.EmbeddingBag(10, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return F.softmax(self.head(self.embedding(x)), dim=1)


def _allreduce_then_divide(state, bucket):
    """The hook of torch's test_ddp_comm_hook_sparse_gradients: allreduce on
    the bucket's own process group, then divide."""
    state["seen"].append((bucket.buffer().is_sparse, len(bucket.gradients()), len(bucket.parameters())))
    group = state["group"]
    fut = group.allreduce([bucket.buffer()]).get_future()
    return fut.then(lambda f: f.wait()[0] / group.size())


def _unchanged(state, bucket):
    state["seen"].append((bucket.buffer().is_sparse, len(bucket.gradients()), len(bucket.parameters())))
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _sparse_with_hook(rank, world_size, which, hook):
    group = dist.distributed_c10d._get_default_group()
    torch.manual_seed(1337)
    model = _SparseModel()
    ddp = _wrapper(which)(model)
    state = {"group": group, "seen": []}
    if hook == "allreduce_then_divide":
        ddp.register_comm_hook(state, _allreduce_then_divide)
    elif hook == "unchanged":
        ddp.register_comm_hook(state, _unchanged)
    else:
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    torch.manual_seed(rank)
    grads = []
    for _ in range(3):
        optimizer.zero_grad()
        x = torch.randint(0, 10, (4, 2))
        F.cross_entropy(ddp(x), torch.randint(0, 3, (4,))).backward()
        grads.append(model.embedding.weight.grad.coalesce())
        optimizer.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, state["seen"]


@pytest.mark.parametrize("hook", ["allreduce_then_divide", "unchanged", "default_hooks.allreduce_hook"])
def test_sparse_gradients_through_a_hook_match_torch(hook):
    ours, theirs = run_ranks_for_each(_sparse_with_hook, 2, ("ddp_ext", "torch"), hook)
    for rank in range(2):
        grads, params, seen = ours[rank]
        torch_grads, torch_params, torch_seen = theirs[rank]
        for step, (g, expected) in enumerate(zip(grads, torch_grads)):
            assert g.is_sparse, f"rank {rank}, step {step}: the embedding's .grad is no longer sparse"
            torch.testing.assert_close(g.to_dense(), expected.to_dense(), msg=lambda m: f"rank {rank}, step {step}: {m}")
        for name in torch_params:
            torch.testing.assert_close(params[name], torch_params[name], msg=lambda m: f"rank {rank}, {name}: {m}")
        if seen or torch_seen:
            # The hook saw a sparse bucket as torch's hands it: the sparse
            # gradient as buffer(), no per-parameter views, one parameter.
            assert (True, 0, 1) in torch_seen
            assert sorted(set(seen)) == sorted(set(torch_seen)), (seen, torch_seen)


# --- errors and sampled iterations in the logging data --------------------------


def _bad_return_annotation(state: object, bucket: dist.GradBucket) -> int:
    return torch.futures.Future()


def _logged_errors(which):
    torch.manual_seed(0)
    ddp = _wrapper(which)(nn.Linear(2, 2))
    assert "has_error" not in ddp._get_ddp_logging_data()
    for _ in range(3):
        ddp(torch.randn(4, 2)).sum().backward()
    logged = []
    with pytest.raises(ValueError, match="return annotation should be torch.futures.Future"):
        ddp.register_comm_hook(None, _bad_return_annotation)
    data = ddp._get_ddp_logging_data()
    logged.append((data.get("has_error"), data.get("error"), data.get("iteration")))
    with pytest.raises(TypeError, match="Communication hook must be callable"):
        ddp.register_comm_hook(None, 1)
    data = ddp._get_ddp_logging_data()
    logged.append((data.get("has_error"), data.get("error"), data.get("iteration")))
    ddp(torch.randn(4, 2))
    with pytest.raises(ValueError, match="sample rate should be equal or greater than 1"):
        ddp._set_ddp_runtime_logging_sample_rate(0)
    data = ddp._get_ddp_logging_data()
    logged.append((data.get("has_error"), data.get("error"), data.get("iteration")))
    return logged


def test_errors_are_recorded_in_the_logging_data_as_torch_records_them(single_process_group):
    ours, theirs = _logged_errors("ddp_ext"), _logged_errors("torch")
    assert ours == theirs
    assert ours[0] == (1, "<class 'ValueError'>: Communication hook: return annotation should be "
                          "torch.futures.Future[torch.Tensor].", 3)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_unfinished_reduction_is_recorded_in_the_logging_data(single_process_group):
    iterations = {}
    for which in ("ddp_ext", "torch"):
        ddp = _wrapper(which)(_TwoHeads())
        ddp(torch.randn(3, 2))[0].sum().backward()  # b gets no gradient
        with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
            ddp(torch.randn(3, 2))
        data = ddp._get_ddp_logging_data()
        assert data.get("has_error") == 1, which
        assert "Expected to have finished reduction in the prior iteration" in data["error"], which
        iterations[which] = data["iteration"]
    assert iterations["ddp_ext"] == iterations["torch"]


def _iterations(rank, world_size, which):
    torch.manual_seed(0)
    ddp = _wrapper(which)(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    ddp._set_ddp_runtime_logging_sample_rate(3)
    seen = []
    for step in range(26):
        x = torch.randn(4, 8) + rank
        if step % 7 == 3:
            with ddp.no_sync():
                ddp(x).sum().backward()
        elif step % 7 == 5:
            ddp(x)  # a forward without backward
        elif step % 7 == 6:
            with torch.no_grad():
                ddp(x)
        else:
            ddp(x).sum().backward()
        data = ddp._get_ddp_logging_data()
        seen.append((data["iteration"], {k: data.get(k, 0) > 0 for k in (
            "forward_compute_time", "backward_compute_time", "backward_comm_time")}))
    return seen


def test_iteration_and_runtime_figures_follow_torchs_sampling_rule():
    ours, theirs = run_ranks_for_each(_iterations, 2, ("ddp_ext", "torch"))
    for rank in range(2):
        assert [it for it, _ in ours[rank]] == [it for it, _ in theirs[rank]], (rank, ours[rank], theirs[rank])
        for step, ((_, ours_set), (_, theirs_set)) in enumerate(zip(ours[rank], theirs[rank])):
            assert ours_set == theirs_set, f"rank {rank}, step {step}: ddp_ext {ours_set}, torch {theirs_set}"


# --- torch's own test ------------------------------------------------------------


def test_torchs_own_ddp_logging_data_cpu_passes_with_ddp_ext(tmp_path):
    """torch.testing._internal.distributed.distributed_test's
    test_ddp_logging_data_cpu, its ranks spawned by
    tests/support/torch_distributed_test_driver.py with ddp_ext in torch's place."""
    pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (pip install expecttest)")
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "torch_distributed_test_driver.py"),
         "TestWithDdpExt.test_ddp_logging_data_cpu"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Ran 1 test" in output and "OK" in output, output[-6000:]
