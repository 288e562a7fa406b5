"""The one dispatch point for communication hooks (ddp_ext/_comm_hooks.py):
the C++ hook each registration builds says whether it keeps state per
bucket, and only such a hook stops the bucket tuner. See Note
[Communication hooks] in comm_hooks/comm_hook.h."""

import warnings

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddp_ext
from ddp_ext import _C
from ddp_ext._bucket_tuner import TuningStage


def test_each_hook_says_whether_it_keeps_state_per_bucket(single_process_group):
    group = dist.distributed_c10d._get_default_group()
    assert _C.python_comm_hook(None, default_hooks.allreduce_hook).keeps_per_bucket_state
    for kind in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS):
        assert not _C.builtin_comm_hook(kind, group).keeps_per_bucket_state
    adaptive = ddp_ext.AdaptivePrecision()._bind(group)
    assert not _C.adaptive_precision_comm_hook(adaptive).keeps_per_bucket_state


REGISTRATIONS = {
    "python": (lambda ddp: ddp.register_comm_hook(None, default_hooks.allreduce_hook), True),
    "builtin": (lambda ddp: ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE), False),
    "adaptive": (lambda ddp: ddp.register_comm_hook(ddp_ext.AdaptivePrecision(), ddp_ext.adaptive_precision_hook), False),
}


@pytest.mark.parametrize("kind", sorted(REGISTRATIONS))
def test_only_a_hook_that_keeps_state_per_bucket_stops_the_tuner(single_process_group, kind):
    register, stops = REGISTRATIONS[kind]
    ddp = ddp_ext.DistributedDataParallel(nn.Linear(4, 4), bucket_cap_mb="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        register(ddp)
    assert (ddp.bucket_tuner.stage is TuningStage.FROZEN) == stops
    stopped = [w for w in caught if "stops tuning" in str(w.message)]
    assert len(stopped) == int(stops), [str(w.message) for w in caught]
    assert all(w.filename == __file__ for w in stopped), "the warning should name the registering line"
    assert ddp._comm_hooks and len(ddp._comm_hooks) == 1


def test_a_second_hook_is_refused(single_process_group):
    ddp = ddp_ext.DistributedDataParallel(nn.Linear(4, 4))
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    assert len(ddp._comm_hooks) == 1
