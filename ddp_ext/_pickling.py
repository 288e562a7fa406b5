"""Pickling and deep-copying the wrapper, as torch's DDP allows: only over
the default process group. The copy rebuilds its reducer and starts with the
default reduction, no timeline, and a bucket tuner that times afresh."""

import copy

import torch.distributed as dist
from torch import nn

from ddp_ext import _diagnosis
from ddp_ext._diagnosis import stragglers
from ddp_ext._dropped_layers import DroppedLayers
from ddp_ext._parameter_watch import ParameterWatch


def check_default_group(ddp) -> None:
    try:
        default = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):
        default = None
    if ddp.process_group is not default:
        raise RuntimeError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default "
            "process group. That is, when you have called init_process_group and have not "
            "passed process_group argument to DDP constructor"
        )


def getstate(ddp) -> dict:
    ddp._check_default_group()
    if ddp._delay_all_reduce_params:
        raise NotImplementedError(
            "ddp_ext.DistributedDataParallel with delay_all_reduce_named_params cannot be "
            "pickled or deep-copied: wrap a copy of the module instead."
        )
    state = copy.copy(ddp.__dict__)
    for name in ("process_group", "reducer", "_delayed", "_hang_diagnosis"):
        state.pop(name, None)
    state["_timeline"] = None  # the copy records nothing
    # Hooks hold process groups and state that does not travel; the copy
    # starts with the default reduction, as after construction.
    state["_comm_hooks"] = []
    return state


def setstate(ddp, state: dict) -> None:
    ddp.process_group = dist.distributed_c10d._get_default_group()
    nn.Module.__setstate__(ddp, state)
    ddp.__dict__.setdefault("require_forward_param_sync", True)
    ddp.__dict__.setdefault("require_backward_grad_sync", True)
    ddp.__dict__.setdefault("rebuild_buckets", "continuous")
    ddp.__dict__.setdefault("_auto_buckets", None)
    if ddp._auto_buckets is not None:
        ddp._auto_buckets.restart()  # the copy times its own iterations
    ddp._delayed = None
    ddp._timeline = None
    reduced = [p for _, p in ddp._named_params_for_reducer(ddp.module)]
    ddp._delay_all_reduce_all_params = not reduced
    ddp._dropped_layers = DroppedLayers(ddp.module, reduced)
    ddp.reducer = None if ddp._delay_all_reduce_all_params else ddp._build_reducer()
    ddp._parameter_watch = ParameterWatch(ddp.module, ddp.parameters_to_ignore)
    ddp._hang_diagnosis = _diagnosis.attach(ddp, settings=ddp.__dict__.get("_hang_settings"))
    ddp._stragglers = stragglers.attach(ddp)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
