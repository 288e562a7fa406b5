"""The wrapper's settings: every constructor argument resolved and checked
once, into one frozen object that the collaborators read."""

import dataclasses
from typing import Any, Optional, Union

import torch
from torch import nn

from ddp_ext import _diagnosis, _mixed_precision, hierarchy
from ddp_ext._native import core as _C
from ddp_ext._arguments import (
    BucketCaps,
    BufferSyncMode,
    Placement,
    check_arguments,
    check_flags,
    check_types,
    first_layout_caps,
    resolve_bucket_caps,
    resolve_buffer_sync,
    resolve_process_group,
    resolve_rebuild_buckets,
)
from ddp_ext._diagnosis import HangSettings


# The boolean arguments kept as passed (torch keeps the value, not its truth).
SWITCHES = ("find_unused_parameters", "gradient_as_bucket_view", "skip_all_reduce_unused_params", "batched_grad_copy")


@dataclasses.dataclass(frozen=True)
class Settings:
    dim: int  # the batch dimension scatter and gather split along
    buffer_sync: BufferSyncMode  # when buffers are broadcast (the initial forward flag; see BufferSync)
    caps: BucketCaps  # bucket caps the reducer is built with
    find_unused_parameters: Any  # as passed (torch keeps the value)
    gradient_as_bucket_view: Any
    skip_all_reduce_unused_params: Any
    batched_grad_copy: Any
    rebuild_buckets: str  # "continuous", "once" or "never"
    hierarchical_allreduce: Union[str, bool]  # ddp_ext/hierarchy.py
    mixed_precision: Any  # torch's _MixedPrecision, or None
    hang: HangSettings  # ddp_ext/_diagnosis
    parameters_to_ignore: frozenset  # names neither broadcast nor reduced
    placement: Optional[Placement] = None  # set once the model is checked (see placed)

    def placed(self, placement: Placement) -> "Settings":
        return dataclasses.replace(self, placement=placement)

    @property
    def device(self) -> torch.device:
        return next(iter(self.placement.devices))

    def to_agree(self, static_graph: bool) -> dict:
        """The arguments every rank must pass alike: they decide which
        collectives run and how buckets are cut (ddp_ext/_model_check.py
        compares them)."""
        return {
            "bucket_cap_mb": "auto" if self.caps.auto else [round(c / 2**20, 6) for c in self.caps.caps_bytes],
            "find_unused_parameters": bool(self.find_unused_parameters),
            "static_graph": bool(static_graph),
            "rebuild_buckets": self.rebuild_buckets,
            "skip_all_reduce_unused_params": bool(self.skip_all_reduce_unused_params),
            "hierarchical_allreduce": self.hierarchical_allreduce,
        }

    def reducer_options(self, caps: BucketCaps, layer_units, static_graph: bool) -> "_C.ReducerOptions":
        options = _C.ReducerOptions()
        mp = self.mixed_precision
        options.reduce_dtype = None if mp is None else _mixed_precision.reduce_dtype_of(mp)
        options.find_unused_parameters = self.find_unused_parameters
        options.gradient_as_bucket_view = self.gradient_as_bucket_view
        options.skip_all_reduce_unused_params = self.skip_all_reduce_unused_params
        options.batched_grad_copy = self.batched_grad_copy
        options.rebuild_buckets = getattr(_C.BucketRebuild, self.rebuild_buckets)
        options.bucket_caps = caps.caps_bytes  # the reducer's layout owns them from here
        options.first_layout_caps = first_layout_caps(caps, bool(self.find_unused_parameters), static_graph,
                                                      self.rebuild_buckets, any(u >= 0 for u in layer_units))
        options.layer_units = layer_units
        return options


def resolve(module: nn.Module, *, delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction,
            broadcast_buffers, forward_sync_buffers, find_unused_parameters, gradient_as_bucket_view, static_graph,
            skip_all_reduce_unused_params, batched_grad_copy, device_ids, mixed_precision, process_group,
            device_mesh, bucket_cap_mb, bucket_cap_mb_list, rebuild_buckets, hang_timeout_s, on_hang,
            hierarchical_allreduce, dim):
    """(settings without placement, process group, delayed (name, param)
    pairs), checked in torch's order."""
    delayed = check_arguments(module, delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction)
    flags = dict(
        broadcast_buffers=broadcast_buffers,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        skip_all_reduce_unused_params=skip_all_reduce_unused_params,
        batched_grad_copy=batched_grad_copy,
        forward_sync_buffers=forward_sync_buffers,
    )
    check_flags(**flags)
    check_types(device_ids, mixed_precision, param_to_hook_all_reduce)
    group = resolve_process_group(process_group, device_mesh)
    buffer_sync = resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
    caps = resolve_bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
    rebuild_mode = resolve_rebuild_buckets(rebuild_buckets)
    hang = _diagnosis.resolve_hang_settings(hang_timeout_s, on_hang)
    hierarchy.check_setting(hierarchical_allreduce)
    if caps.auto and rebuild_mode == "never":
        raise ValueError(
            "bucket_cap_mb='auto' re-lays the buckets as it tunes their caps, and "
            "rebuild_buckets='never' keeps the construction layout: use 'auto' with "
            "rebuild_buckets='once' or 'continuous' (the default), or a fixed bucket_cap_mb with 'never'"
        )
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    ignored.update(name for name, _ in delayed)
    switches = {name: flags[name] for name in SWITCHES}
    settings = Settings(dim=dim, buffer_sync=buffer_sync, caps=caps, rebuild_buckets=rebuild_mode,
                        hierarchical_allreduce=hierarchical_allreduce, mixed_precision=mixed_precision, hang=hang,
                        parameters_to_ignore=frozenset(ignored), **switches)
    return settings, group, delayed
