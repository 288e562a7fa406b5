"""The wrapper's torch names are one-line delegates (ddp_ext/_delegates.py):
each reads, calls and (where settable) writes the collaborator that owns it,
in a wrapper as built and in a copy, whose collaborators are the copy's own.
Single process, world of one."""

import copy
from operator import attrgetter

import pytest
import torch
from torch import nn

import ddp_ext
from ddp_ext._auto_buckets import AutoBuckets
from ddp_ext._delegated_names import DelegatedNames
from ddp_ext._delegates import delegate, field

DELEGATES = sorted(name for name, value in vars(DelegatedNames).items() if isinstance(value, delegate))
FIELDS = sorted(name for name, value in vars(DelegatedNames).items() if isinstance(value, field))
SETTABLE = sorted(name for name in FIELDS if vars(DelegatedNames)[name].fset is not None)


def _wrapper():
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ddp = ddp_ext.DistributedDataParallel(module)
    ddp(torch.randn(5, 3)).sum().backward()
    return ddp


def _owner(ddp, name):
    described = vars(DelegatedNames)[name]
    return attrgetter(described.part)(ddp), described.name


def test_there_are_delegates_to_check():
    assert len(DELEGATES) >= 25 and len(FIELDS) >= 20 and SETTABLE


@pytest.mark.parametrize("copied", [False, True], ids=["built", "deepcopy"])
def test_each_delegate_is_its_owners_method(single_process_group, copied):
    ddp = _wrapper()
    if copied:
        ddp = copy.deepcopy(ddp)
    for name in set(DELEGATES) - {"_delayed_all_reduce_hook"}:  # see the next test
        owner, attribute = _owner(ddp, name)
        assert getattr(ddp, name) == getattr(owner, attribute), name


def test_the_delayed_all_reduce_hook_is_its_owners(single_process_group):
    module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ddp = ddp_ext.DistributedDataParallel(
        module, delay_all_reduce_named_params=[("0.weight", module[0].weight)], param_to_hook_all_reduce=module[1].weight
    )
    assert ddp._delayed_all_reduce_hook == ddp._delayed.start


@pytest.mark.parametrize("copied", [False, True], ids=["built", "deepcopy"])
def test_each_field_reads_its_owner(single_process_group, copied):
    ddp = _wrapper()
    if copied:
        ddp = copy.deepcopy(ddp)
    for name in FIELDS:
        owner, attribute = _owner(ddp, name)
        assert getattr(ddp, name) == getattr(owner, attribute), name


def test_settable_fields_write_their_owner(single_process_group):
    ddp = _wrapper()
    for name in SETTABLE:
        owner, attribute = _owner(ddp, name)
        marker = AutoBuckets() if name == "_auto_buckets" else object()  # the tuner is bound when set
        previous = getattr(ddp, name)
        setattr(ddp, name, marker)
        assert getattr(owner, attribute) is marker, name
        setattr(ddp, name, previous)
    tuner = AutoBuckets()
    ddp._auto_buckets = tuner
    assert tuner.reducer is ddp.reducer and tuner.process_group is ddp.process_group


def test_the_copys_collaborators_are_its_own(single_process_group):
    ddp = _wrapper()
    twin = copy.deepcopy(ddp)
    for part in ("_buffer_sync", "_tuning", "_logging", "_hooks", "_join"):
        mine, theirs = getattr(ddp, part), getattr(twin, part)
        assert theirs is not mine, part
        assert theirs.reducer is twin.reducer and theirs.process_group is twin.process_group, part
    assert twin._join.buffers is twin._buffer_sync and twin._hooks.logging is twin._logging
    assert twin._buffer_sync.module is twin.module


def test_flags_are_shared_by_the_wrapper_and_its_collaborators(single_process_group):
    ddp = _wrapper()
    with ddp.no_sync():
        assert ddp._flags.backward is False and ddp._join.flags is ddp._flags
        assert ddp._join.check_global_requires_backward_grad_sync(is_joined_rank=False) is None
    ddp.require_forward_param_sync = False
    assert not ddp.will_sync_module_buffers() and not ddp._buffer_sync.flags.forward_buffers
