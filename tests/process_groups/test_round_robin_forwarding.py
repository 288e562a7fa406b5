"""Single-process tests of the round-robin backend against recording fakes.

Each child is a plain ProcessGroup whose only backend is the tests' C++
RecordingBackend (tests/support/native/), which communicates nothing and records every
call. Calls made on the round-robin ProcessGroup travel the same way real ones do
(c10d op -> RoundRobinBackend -> child ProcessGroup -> c10d op -> child
backend), so the records show which child method each forwarded call reached,
with which tensors and options.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as C10D

import ddp_ext
from ddp_ext import _C
from ddp_ext import round_robin
from tests.support.native_extensions import recording_backend

CPU = torch.device("cpu")
CUSTOM = dist.ProcessGroup.BackendType.CUSTOM
RANK, SIZE = 1, 2
TIMEOUT = timedelta(seconds=7)
TIMEOUT_MS = [7000]


def _child(store, index, rank=RANK, size=SIZE, complete_immediately=True):
    doubles = recording_backend()
    options = doubles.RecordingBackendOptions()
    options.complete_immediately = complete_immediately
    fake = doubles.RecordingBackend(rank, size, options)
    group = dist.ProcessGroup(dist.PrefixStore(f"child{index}/", store), rank, size)
    group._register_backend(CPU, CUSTOM, fake)
    group._set_default_backend(CUSTOM)
    return group, fake


def _round_robin(num_children, complete_immediately=True, owns_children=False):
    """(round-robin ProcessGroup, its RoundRobinBackend, the children's fakes)."""
    store = dist.HashStore()
    children = [_child(store, i, complete_immediately=complete_immediately) for i in range(num_children)]
    options = _C.RoundRobinBackendOptions()
    options.owns_children = owns_children
    backend = _C.RoundRobinBackend([g for g, _ in children], options)
    group = round_robin._process_group(backend, store, [CPU], f"rr_test_{num_children}")
    return group, backend, [fake for _, fake in children]


def _opts(cls, **fields):
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    opts.timeout = TIMEOUT
    return opts


def _t(*shape):
    return torch.zeros(*shape)


# Each case: (name, make_args, call, expected child method, expected options).
# make_args() -> (args passed to the call, the tensor lists the child must see,
# in the order RecordedCall.tensors lists them).
def _broadcast():
    t = _t(3)
    return ([t],), [[t]]


def _list_in_out():
    o0, o1, i = _t(3), _t(3), _t(3)
    return ([[o0, o1]], [i]), [[o0, o1], [i]]


def _single_in_out():
    o, i = _t(6), _t(3)
    return (o, i), [[o], [i]]


def _scatter_like():
    o, i0, i1 = _t(3), _t(3), _t(3)
    return ([o], [[i0, i1]]), [[o], [i0, i1]]


def _coalesced():
    a, b = _t(3), _t(2)
    return ([a, b],), [[a, b]]


def _alltoall_list():
    o0, o1, i0, i1 = _t(2), _t(2), _t(2), _t(2)
    return ([o0, o1], [i0, i1]), [[o0, o1], [i0, i1]]


def _alltoall_single():
    o, i = _t(4), _t(4)
    return (o, i, [1, 3], [2, 2]), [[o], [i]]


def _nothing():
    return (), []


RED = dist.ReduceOp
FORWARDED = [
    ("broadcast", _broadcast,
     lambda pg, a: pg.broadcast(*a, _opts(C10D.BroadcastOptions, rootRank=1, rootTensor=0)),
     "broadcast", {"root_rank": [1], "root_tensor": [0]}),
    ("allreduce", _broadcast,
     lambda pg, a: pg.allreduce(*a, _opts(C10D.AllreduceOptions, reduceOp=RED.MAX)),
     "allreduce", {"reduce_op": [int(RED.RedOpType.MAX)]}),
    ("allreduce_coalesced", _coalesced,
     lambda pg, a: pg.allreduce_coalesced(*a, _opts(C10D.AllreduceCoalescedOptions, reduceOp=RED.MIN)),
     "allreduce_coalesced", {"reduce_op": [int(RED.RedOpType.MIN)]}),
    ("reduce", _broadcast,
     lambda pg, a: pg.reduce(*a, _opts(C10D.ReduceOptions, reduceOp=RED.PRODUCT, rootRank=1, rootTensor=0)),
     "reduce", {"reduce_op": [int(RED.RedOpType.PRODUCT)], "root_rank": [1], "root_tensor": [0]}),
    ("allgather", _list_in_out,
     lambda pg, a: pg.allgather(*a, _opts(C10D.AllgatherOptions)),
     "allgather", {}),
    ("all_gather_into_tensor", _single_in_out,
     lambda pg, a: pg._allgather_base(*a, _opts(C10D.AllgatherOptions)),
     "_allgather_base", {}),
    ("gather", _list_in_out,
     lambda pg, a: pg.gather(*a, _opts(C10D.GatherOptions, rootRank=1)),
     "gather", {"root_rank": [1]}),
    ("scatter", _scatter_like,
     lambda pg, a: pg.scatter(*a, _opts(C10D.ScatterOptions, rootRank=1)),
     "scatter", {"root_rank": [1]}),
    ("reduce_scatter", _scatter_like,
     lambda pg, a: pg.reduce_scatter(*a, _opts(C10D.ReduceScatterOptions, reduceOp=RED.MAX)),
     "reduce_scatter", {"reduce_op": [int(RED.RedOpType.MAX)]}),
    ("reduce_scatter_tensor", lambda: ((_t(3), _t(6)), None),
     lambda pg, a: pg._reduce_scatter_base(*a, _opts(C10D.ReduceScatterOptions, reduceOp=RED.MIN)),
     "_reduce_scatter_base", {"reduce_op": [int(RED.RedOpType.MIN)]}),
    ("all_to_all_single", _alltoall_single,
     lambda pg, a: pg.alltoall_base(*a, _opts(C10D.AllToAllOptions)),
     "alltoall_base", {"output_split_sizes": [1, 3], "input_split_sizes": [2, 2]}),
    ("alltoall", _alltoall_list,
     lambda pg, a: pg.alltoall(*a, _opts(C10D.AllToAllOptions)),
     "alltoall", {}),
    ("barrier", _nothing,
     lambda pg, a: pg.barrier(_opts(C10D.BarrierOptions, device_ids=[])),
     "barrier", {"device_ids": []}),
]


def _expected_tensors(make_args):
    args, tensors = make_args()
    if tensors is None:  # reduce_scatter_tensor: (output, input)
        tensors = [[args[0]], [args[1]]]
    return args, tensors


def _same_tensors(seen, expected):
    return [[t.data_ptr() for t in ts] for ts in seen] == [[t.data_ptr() for t in ts] for ts in expected] and [
        [tuple(t.shape) for t in ts] for ts in seen
    ] == [[tuple(t.shape) for t in ts] for ts in expected]


@pytest.mark.parametrize("name,make_args,call,method,options", FORWARDED, ids=[c[0] for c in FORWARDED])
def test_call_reaches_matching_child_method_with_its_arguments(name, make_args, call, method, options):
    group, backend, fakes = _round_robin(3)
    for turn in range(4):  # past one full rotation
        args, tensors = _expected_tensors(make_args)
        work = call(group, args)
        assert work.wait()
        target = turn % 3
        for i, fake in enumerate(fakes):
            calls = fake.calls()
            if i != target:
                assert calls == [], f"turn {turn}: child {i} got {calls}, expected only child {target}"
                continue
            assert len(calls) == 1, calls
            (seen,) = calls
            assert seen.method == method
            assert _same_tensors(seen.tensors, tensors), f"{name}: child saw other tensors than the caller passed"
            assert seen.options == {**options, "timeout_ms": TIMEOUT_MS}
            fake.clear_calls()
        assert backend.next_child_index == (turn + 1) % 3


@pytest.mark.parametrize("num_children", [1, 3, 5])
def test_successive_calls_rotate_through_children_across_kinds(num_children):
    group, backend, fakes = _round_robin(num_children)
    sequence = FORWARDED * 2
    for name, make_args, call, _, _ in sequence:
        call(group, _expected_tensors(make_args)[0]).wait()
    for i, fake in enumerate(fakes):
        expected = [method for k, (_, _, _, method, _) in enumerate(sequence) if k % num_children == i]
        assert [c.method for c in fake.calls()] == expected, f"child {i}"
    assert backend.next_child_index == len(sequence) % num_children
    assert backend.forwarded_calls == len(sequence)


def test_work_and_future_are_the_childs():
    group, _, fakes = _round_robin(3, complete_immediately=False)
    first, second = torch.full((2,), 3.0), torch.full((2,), 5.0)
    work_a = group.allreduce([first])
    work_b = group.allreduce([second])  # goes to the next child
    chained = work_a.get_future().then(lambda fut: fut.value()[0] * 2).then(lambda fut: fut.value() + 1)
    assert not work_a.is_completed() and not work_b.is_completed()
    assert not chained.done()

    assert fakes[0].complete_pending() == 1
    assert work_a.is_completed() and not work_b.is_completed()
    assert work_a.wait()
    assert torch.equal(chained.wait(), torch.full((2,), 7.0))
    assert torch.equal(work_a.get_future().value()[0], first)

    assert fakes[1].complete_pending() == 1
    assert work_b.wait() and work_b.is_completed()
    assert torch.equal(work_b.get_future().wait()[0], second)


def test_set_timeout_reaches_every_child():
    group, backend, fakes = _round_robin(3)
    group.set_timeout(timedelta(seconds=9))
    for fake in fakes:
        assert [(c.method, c.options) for c in fake.calls()] == [("setTimeout", {"timeout_ms": [9000]})]
    assert backend.timeout == timedelta(seconds=9)
    assert backend.forwarded_calls == 0


@pytest.mark.parametrize("action", ["shutdown", "abort"])
@pytest.mark.parametrize("owns_children", [True, False])
def test_shutdown_and_abort_reach_owned_children_once(action, owns_children):
    group, backend, fakes = _round_robin(3, owns_children=owns_children)
    getattr(group, action)()
    getattr(group, action)()
    expected = [action] if owns_children else []
    for i, fake in enumerate(fakes):
        assert [c.method for c in fake.calls()] == expected, f"child {i}"


REFUSED = [
    ("send", lambda pg: pg.send([_t(2)], 0, 0)),
    ("recv", lambda pg: pg.recv([_t(2)], 0, 0)),
    ("recvAnysource", lambda pg: pg.recv_anysource([_t(2)], 0)),
    ("allgather_coalesced", lambda pg: pg.allgather_coalesced([[_t(2), _t(2)]], [_t(2)])),
    ("allgather_into_tensor_coalesced", lambda pg: pg.allgather_into_tensor_coalesced([_t(4)], [_t(2)])),
    ("reduce_scatter_tensor_coalesced", lambda pg: pg.reduce_scatter_tensor_coalesced([_t(2)], [_t(4)])),
]


@pytest.mark.parametrize("op,call", REFUSED, ids=[c[0] for c in REFUSED])
def test_unsupported_calls_raise_naming_op_and_backend_and_reach_no_child(op, call):
    group, backend, fakes = _round_robin(3)
    with pytest.raises(RuntimeError) as info:
        call(group)
    message = str(info.value)
    assert "round_robin" in message and op in message, message
    assert all(fake.calls() == [] for fake in fakes)
    assert backend.next_child_index == 0 and backend.forwarded_calls == 0


def test_backend_reports_its_name_rank_size_and_children():
    group, backend, _ = _round_robin(5)
    assert isinstance(group._get_backend(CPU), _C.RoundRobinBackend)
    assert backend.name() == "round_robin"
    assert (backend.rank(), backend.size()) == (RANK, SIZE)
    assert (group.rank(), group.size()) == (RANK, SIZE)
    assert len(backend.children) == 5 and not backend.owns_children


CONSTRUCTION_ERRORS = [
    ("empty", lambda store: [], "at least one child"),
    ("rank differs", lambda store: [_child(store, 0)[0], _child(store, 1, rank=0)[0]],
     "child process group 1 has rank 0 of size 2, but child 0 has rank 1 of size 2"),
    ("size differs", lambda store: [_child(store, 0)[0], _child(store, 1, size=3)[0]],
     "child process group 1 has rank 1 of size 3, but child 0 has rank 1 of size 2"),
]


@pytest.mark.parametrize("name,children,message", CONSTRUCTION_ERRORS, ids=[c[0] for c in CONSTRUCTION_ERRORS])
def test_construction_checks_children_share_rank_and_size(name, children, message):
    with pytest.raises(RuntimeError, match=message):
        _C.RoundRobinBackend(children(dist.HashStore()))


ARGUMENT_ERRORS = [
    (lambda: ddp_ext.new_round_robin_group(num_groups=0), ValueError, "num_groups must be an integer >= 1"),
    (lambda: ddp_ext.new_round_robin_group(num_groups=2.0), ValueError, "num_groups must be an integer >= 1"),
    (lambda: ddp_ext.new_round_robin_group(num_groups=True), ValueError, "num_groups must be an integer >= 1"),
    (lambda: ddp_ext.new_round_robin_group(backend="glooo"), ValueError, "backend='glooo' is not a backend"),
    (lambda: ddp_ext.new_round_robin_group(backend="round_robin"), ValueError, "cannot themselves be round-robin"),
    (lambda: ddp_ext.new_round_robin_group(backend=None), TypeError, "backend must be a backend name"),
    (lambda: ddp_ext.RoundRobinOptions(num_groups=-1), ValueError, "num_groups must be an integer >= 1"),
    (lambda: ddp_ext.round_robin_group([]), ValueError, "needs at least one process group"),
    (lambda: ddp_ext.round_robin_group([None]), TypeError, r"groups\[0\] is None, not a torch.distributed"),
    (lambda: ddp_ext.round_robin_group(_round_robin(1)[0]), TypeError, "takes a list of process groups"),
]


@pytest.mark.parametrize("call,error,message", ARGUMENT_ERRORS)
def test_python_layer_validates_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


ENV_CASES = [
    ({}, ddp_ext.RoundRobinOptions(3, "gloo"), None),
    ({round_robin.ENV_NUM_GROUPS: "5"}, ddp_ext.RoundRobinOptions(5, "gloo"), None),
    ({round_robin.ENV_NUM_GROUPS: "2", round_robin.ENV_BACKEND: "GLOO"}, ddp_ext.RoundRobinOptions(2, "gloo"), None),
    ({round_robin.ENV_NUM_GROUPS: "three"}, None, "DDP_EXT_ROUND_ROBIN_NUM_GROUPS='three' must be an integer"),
    ({round_robin.ENV_NUM_GROUPS: "0"}, None, "DDP_EXT_ROUND_ROBIN_NUM_GROUPS must be an integer >= 1"),
    ({round_robin.ENV_BACKEND: "tcp"}, None, "DDP_EXT_ROUND_ROBIN_BACKEND='tcp' is not a backend"),
]


@pytest.mark.parametrize("env,expected,message", ENV_CASES)
def test_options_from_environment(monkeypatch, env, expected, message):
    monkeypatch.delenv(round_robin.ENV_NUM_GROUPS, raising=False)
    monkeypatch.delenv(round_robin.ENV_BACKEND, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if message is None:
        assert ddp_ext.RoundRobinOptions.from_env() == expected
    else:
        with pytest.raises(ValueError, match=message):
            ddp_ext.RoundRobinOptions.from_env()


def _creator_options(store):
    options = C10D._DistributedBackendOptions()
    options.store = store
    options.group_rank, options.group_size = 0, 2
    options.timeout = timedelta(seconds=5)
    options.group_id = "rr_creator_test"
    options.global_ranks_in_group = [0, 1]
    return options


def test_creator_builds_children_of_any_registered_backend():
    # torch's "fake" backend communicates nothing, so one process can play rank 0 of 2.
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    store = dist.HashStore()
    backend = round_robin._create_backend(_creator_options(store), ddp_ext.RoundRobinOptions(2, "fake"))
    assert backend.owns_children and backend.timeout == timedelta(seconds=5)
    assert [child._get_backend(CPU).name() for child in backend.children] == ["fake", "fake"]
    group = round_robin._process_group(backend, store, [CPU], "rr_fake")
    group.allreduce([torch.ones(2)]).wait()
    assert backend.next_child_index == 1


def test_creator_rejects_foreign_pg_options():
    with pytest.raises(TypeError, match="pg_options for the round_robin backend must be a ddp_ext.RoundRobinOptions"):
        round_robin._create_backend(_creator_options(dist.HashStore()), {"num_groups": 2})


def test_backend_is_registered_with_torch_distributed():
    assert dist.Backend("round_robin") == "round_robin"
    assert dist.Backend.backend_capability["round_robin"] == ["cpu", "cuda"]
    assert dist.Backend._plugins["ROUND_ROBIN"].extended_api
