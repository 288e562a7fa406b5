"""A wrapper that is let go frees its reducer (and with it its hold on the
process group) at once, by reference count, with the garbage collector off:
no reference cycle among the wrapper's collaborators keeps them for a later
collection. Fault tolerance relies on it (a released epoch's group goes
before the next is formed), and so does a user who re-wraps a model.
Single process, world of one."""

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join

import ddp_ext


def _module():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def _step(ddp, optimizer):
    ddp(torch.randn(2, 4)).sum().backward()
    optimizer.step()


def _hooked(ddp, optimizer):
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    _step(ddp, optimizer)


def _joined(ddp, optimizer):
    with Join([ddp]):
        _step(ddp, optimizer)


def _accumulated(ddp, optimizer):
    with ddp.no_sync():
        ddp(torch.randn(2, 4)).sum().backward()
    _step(ddp, optimizer)


def _overlapped(ddp, optimizer):
    ddp.overlap_optimizer(optimizer)
    _step(ddp, optimizer)


CASES = {
    "plain": ({}, _step),
    "find_unused_parameters": ({"find_unused_parameters": True}, _step),
    "static_graph": ({"static_graph": True}, _step),
    "auto caps": ({"bucket_cap_mb": "auto"}, _step),
    "python hook": ({}, _hooked),
    "join": ({}, _joined),
    "no_sync": ({}, _accumulated),
    "overlap_optimizer": ({}, _overlapped),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_released_wrapper_frees_its_reducer_without_a_collection(single_process_group, case):
    kwargs, use = CASES[case]
    gc.collect()
    gc.disable()
    try:
        ddp = ddp_ext.DistributedDataParallel(_module(), **kwargs)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        use(ddp, optimizer)
        wrapper, reducer = weakref.ref(ddp), weakref.ref(ddp.reducer)
        del ddp, optimizer
        assert wrapper() is None, "the wrapper is held by a reference cycle"
        assert reducer() is None, "the reducer is held by a reference cycle"
    finally:
        gc.enable()
