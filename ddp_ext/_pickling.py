"""Pickling and deep-copying the wrapper, as torch's DDP allows: only over
the default process group. The pickle leaves out what holds a process group
or a reducer; the copy's wrapper builds a new reducer and binds its
collaborators to it (DistributedDataParallel.__setstate__). It starts with
the default reduction, no timeline, and a bucket tuner that times afresh."""

import torch.distributed as dist

# The wrapper's attributes that the copy makes anew.
LEFT_OUT = ("process_group", "reducer", "_delayed", "_hang_diagnosis", "_stragglers", "_recording",
            "_parameter_watch")


def check_default_group(process_group) -> None:
    try:
        default = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):
        default = None
    if process_group is not default:
        raise RuntimeError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default "
            "process group. That is, when you have called init_process_group and have not "
            "passed process_group argument to DDP constructor"
        )


def check_no_delayed_params(delayed_params) -> None:
    if delayed_params:
        raise NotImplementedError(
            "ddp_ext.DistributedDataParallel with delay_all_reduce_named_params cannot be "
            "pickled or deep-copied: wrap a copy of the module instead."
        )


def picklable(wrapper_state: dict) -> dict:
    """The wrapper's __dict__ as pickled."""
    return {k: v for k, v in wrapper_state.items() if k not in LEFT_OUT}
