"""Checks and resolution of torch 2.13's DistributedDataParallel constructor
arguments that need more than a line: the process group, buffer
synchronisation, placement and the bucket caps. ddp_ext/_settings.py
gathers them into the wrapper's Settings."""

import math
import numbers
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
# With the default cap, the first bucket of each dtype is smaller, so that its
# allreduce starts early in the backward pass (torch's DDP does the same).
DEFAULT_FIRST_BUCKET_CAP_MB = 1


def backend_name(process_group) -> str:
    """The group's backend ("gloo", "nccl", ...), or "" for a group
    torch.distributed does not know by name."""
    try:
        return dist.get_backend(process_group)
    except (RuntimeError, ValueError):
        return ""


def resolve_process_group(process_group, device_mesh) -> dist.ProcessGroup:
    """The group to reduce over: `process_group`, the group of a 1-D
    `device_mesh`, or the default group."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a torch.distributed.DeviceMesh, got {type(device_mesh).__name__}")
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        if device_mesh._get_root_mesh() != device_mesh:
            raise NotImplementedError(
                "ddp_ext.DistributedDataParallel takes a 1-D device_mesh that is its own "
                "root mesh; a mesh sliced out of a larger one (DDP combined with tensor "
                "parallelism) is not supported. Pass process_group=mesh.get_group() instead "
                "if the module needs no tensor-parallel transform."
            )
        return device_mesh.get_group(mesh_dim=0)
    if process_group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "Default process group has not been initialized, please make sure to "
                "call init_process_group (or pass process_group=...)."
            )
        return dist.distributed_c10d._get_default_group()
    if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError(
            f"process_group does not include this rank (rank {dist.get_rank()}): torch.distributed.new_group "
            "returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out. Wrap the model only on the "
            "group's ranks."
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}"
        )
    return process_group


# Arguments torch's DDP hands to C++ as bools. A value with no truth value of
# its own (a string such as "False", a list) is refused, where torch fails in
# pybind11 without naming the argument; numbers and None pass, as in torch.
FLAGS = (
    "broadcast_buffers",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
    "forward_sync_buffers",
)


def check_flags(**flags) -> None:
    for name, value in flags.items():
        if value is not None and not hasattr(type(value), "__bool__"):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_types(device_ids, mixed_precision, param_to_hook_all_reduce) -> None:
    """TypeErrors naming the argument where torch's DDP fails on an attribute."""
    if device_ids is not None and not hasattr(device_ids, "__len__"):
        raise TypeError(f"device_ids must be None or a list of one device, got {type(device_ids).__name__}")
    if mixed_precision is not None and not all(
        hasattr(mixed_precision, a) for a in ("param_dtype", "reduce_dtype", "buffer_dtype")
    ):
        raise TypeError(
            "mixed_precision must be a torch.nn.parallel.distributed._MixedPrecision (param_dtype, "
            f"reduce_dtype, buffer_dtype), got {type(mixed_precision).__name__}"
        )
    if param_to_hook_all_reduce is not None and not isinstance(param_to_hook_all_reduce, torch.Tensor):
        raise TypeError(f"param_to_hook_all_reduce must be a parameter, got {type(param_to_hook_all_reduce).__name__}")


def named_pairs(delay_all_reduce_named_params) -> list:
    """delay_all_reduce_named_params as a list (it may be a generator, such as
    module.named_parameters()), each item checked to be a (name, tensor) pair."""
    pairs = list(delay_all_reduce_named_params)
    for item in pairs:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                "delay_all_reduce_named_params must hold (name, parameter) pairs, as "
                f"module.named_parameters() yields, got {type(item).__name__} {item!r}"
            )
    return pairs


def check_arguments(module, delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction: bool) -> list:
    """What torch's DDP checks first; returns delay_all_reduce_named_params
    as a list of pairs (empty if not given)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."
        )
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
            "Please avoid using it.",
            FutureWarning,
            stacklevel=4,
        )
    return [] if delay_all_reduce_named_params is None else named_pairs(delay_all_reduce_named_params)


def check_initialized(named_params) -> None:
    for _, param in named_params:
        if isinstance(param, torch.nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                "Run a dummy forward pass to correctly initialize the modules"
            )


def _device_index(device) -> int:
    if isinstance(device, numbers.Integral):
        return int(device)
    device = torch.device(device)
    if device.index is None:
        raise ValueError(f"device_ids entries need an explicit index, got {device}")
    return device.index


@dataclass(frozen=True)
class Placement:
    devices: set  # of the parameters DDP reduces (or of the delayed ones)
    device_type: str
    device_ids: Optional[List[int]]  # torch's attribute: None, or [index] of a single-GPU module
    output_device: Optional[int]


def resolve_placement(params, delayed_params, device_ids, output_device) -> Placement:
    """Where the module lives, checked as torch's DDP checks it."""
    devices = {p.device for p in params} or {p.device for p in delayed_params}
    device_types = {d.type for d in devices}
    if len(device_types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, "
            f"but input module parameters locate in {{{', '.join(map(repr, sorted(device_types)))}}}."
        )
    device_type = next(iter(device_types))
    if device_type == "meta":
        raise RuntimeError(
            "DistributedDataParallel's input module has its parameters on the meta device, with no "
            "data to broadcast or reduce: materialize them (module.to_empty(device=...), then "
            "initialise them) before wrapping the module."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    if device_ids or output_device is not None:
        if len(devices) != 1 or device_type == "cpu":
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device GPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters "
                f"{sorted(map(str, devices))}. For CPU or multi-device modules leave both None."
            )
    if not device_ids:
        return Placement(devices, device_type, None, output_device)
    index = _device_index(device_ids[0])
    return Placement(devices, device_type, [index], _device_index(index if output_device is None else output_device))


@dataclass(frozen=True)
class BufferSyncMode:
    forward: bool  # broadcast buffers before each synchronising forward
    at_init: bool  # broadcast buffers at construction


def resolve_buffer_sync(broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool]) -> BufferSyncMode:
    """torch 2.13's rules: `forward_sync_buffers` wins and always syncs at
    construction; the deprecated `broadcast_buffers` governs both."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            message = (
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided."
            )
        else:
            message = (
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` "
                "still syncs buffers at init. If you rely on buffers NOT being synced at "
                "init (e.g. rank-local buffers), keep using `broadcast_buffers=False`."
            )
        warnings.warn(message, FutureWarning, stacklevel=4)
    if forward_sync_buffers is not None:
        return BufferSyncMode(forward=bool(forward_sync_buffers), at_init=True)
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return BufferSyncMode(forward=effective, at_init=effective)


def _cap_bytes(name: str, value) -> int:
    """A cap in MiB as bytes, with torch's leniency: 0 (or anything that
    rounds to no bytes) puts every parameter in a bucket of its own;
    negatives and bools, which torch also accepts, do so with a warning."""
    if isinstance(value, bool):
        warnings.warn(f"{name}={value!r} is a bool; read as {int(value)} MiB, as torch's DDP does", stacklevel=5)
        value = int(value)
    if not isinstance(value, numbers.Real) or math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number of MiB, got {value!r}")
    if value < 0:
        warnings.warn(
            f"{name}={value!r} is negative; every parameter gets a bucket of its own, as with 0", stacklevel=5
        )
    return max(1, int(value * MIB))


@dataclass(frozen=True)
class BucketCaps:
    """The caps asked for; the reducer's bucket layout (reducer/layout/bucket_layout.h)
    cuts with them and owns them from construction on."""

    caps_bytes: List[int]  # cap of the 1st, 2nd, ... bucket of each kind; the last repeats
    custom_list: bool  # bucket_cap_mb_list was given
    auto: bool = False  # bucket_cap_mb="auto": caps_bytes is where tuning starts
    default: bool = False  # neither bucket_cap_mb nor bucket_cap_mb_list was given


# ddp_ext's bucket_cap_mb value for self-tuning buckets; see Note [Auto-tuned
# bucket caps] in ddp_ext/_auto_buckets.py.
AUTO_BUCKET_CAP = "auto"


def resolve_bucket_caps(bucket_cap_mb, bucket_cap_mb_list: Optional[Sequence[float]]) -> BucketCaps:
    """Caps per bucket, in bytes. A list caps each bucket in turn and wins over
    `bucket_cap_mb`; with neither, the first bucket is capped at 1 MiB and the
    others at 25 MiB, as in torch's DDP. See _cap_bytes for odd values.
    "auto" starts from that default and is tuned later."""
    if bucket_cap_mb_list is not None and not isinstance(bucket_cap_mb_list, Iterable):
        raise TypeError(
            f"bucket_cap_mb_list must be a list of bucket caps in MiB, got {type(bucket_cap_mb_list).__name__}"
        )
    if isinstance(bucket_cap_mb, str):
        if bucket_cap_mb != AUTO_BUCKET_CAP:
            raise ValueError(
                f"bucket_cap_mb must be a number of MiB, or {AUTO_BUCKET_CAP!r} for buckets that ddp_ext "
                f"tunes while training, got {bucket_cap_mb!r}"
            )
        if bucket_cap_mb_list:
            raise ValueError(
                f"bucket_cap_mb={AUTO_BUCKET_CAP!r} tunes the bucket caps itself, so it cannot be combined "
                f"with bucket_cap_mb_list={list(bucket_cap_mb_list)!r}: pass one or the other"
            )
        default = resolve_bucket_caps(None, None)
        return BucketCaps(default.caps_bytes, False, auto=True)
    if bucket_cap_mb_list:
        caps = [_cap_bytes(f"bucket_cap_mb_list[{i}]", cap) for i, cap in enumerate(bucket_cap_mb_list)]
        return BucketCaps(caps, True)
    if bucket_cap_mb is None:
        cap = DEFAULT_BUCKET_CAP_MB * MIB
        return BucketCaps([DEFAULT_FIRST_BUCKET_CAP_MB * MIB, cap], False, default=True)
    cap = _cap_bytes("bucket_cap_mb", bucket_cap_mb)
    return BucketCaps([cap], False)


def first_layout_caps(caps: BucketCaps, find_unused_parameters: bool, static_graph: bool, rebuild_buckets: str,
                      droppable_layers: bool) -> List[int]:
    """The caps torch's DDP cuts its first buckets with, for the reducer's
    first layout (Note [torch's first buckets] in
    reducer/layout/bucket_assignment.h): bucket_cap_mb_list as given; the
    caps with find_unused_parameters and no static_graph (torch never
    rebuilds those buckets); else one unlimited cap, one bucket per dtype
    until the first rebuild. [] (ddp_ext's own first layout, the one a rebuild
    from reverse registration order gives) where ddp_ext lays buckets out
    otherwise than torch: with rebuild_buckets="never" where torch would
    rebuild, and with droppable layers."""
    never_rebuilt_by_torch = find_unused_parameters and not static_graph
    if droppable_layers or (rebuild_buckets == "never" and not never_rebuilt_by_torch):
        return []
    if caps.custom_list or never_rebuilt_by_torch:
        return list(caps.caps_bytes)
    return [sys.maxsize]


# ddp_ext's `rebuild_buckets` keyword: when buckets are laid out again in the
# order gradients arrive (see Note [Gradient order prediction] in
# reducer/layout/gradient_order.h).
REBUILD_BUCKETS_MODES = ("continuous", "once", "never")


def resolve_rebuild_buckets(value) -> str:
    if value not in REBUILD_BUCKETS_MODES:
        raise ValueError(f"rebuild_buckets must be one of {', '.join(map(repr, REBUILD_BUCKETS_MODES))}, got {value!r}")
    return value
