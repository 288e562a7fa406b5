"""`_get_ddp_logging_data()`: the keys torch's DDP logger reports that
describe the configuration and progress, filled from ddp_ext's own state."""

import os
from typing import Any, Dict

import torch

from ddp_ext._arguments import backend_name


def logging_data(ddp) -> Dict[str, Any]:
    params = [p for p in ddp._module_parameters if p.requires_grad]
    reducer = ddp.reducer
    group = ddp.process_group
    data: Dict[str, Any] = {
        "module_name": type(ddp.module).__name__,
        "rank": group.rank(),
        "world_size": group.size(),
        "backend_name": backend_name(group) or "unknown",
        "device_ids": ", ".join(map(str, ddp.device_ids or [])),
        "output_device": -1 if ddp.output_device is None else ddp.output_device,
        "dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "is_multi_device_module": int(ddp.is_multi_device_module),
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules())),
        "has_rebuilt_buckets": 0,
        "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
        "master_port": os.environ.get("MASTER_PORT", "N/A"),
    }
    if reducer is not None:
        iterations = reducer.iterations
        data.update(
            {
                "bucket_sizes": ", ".join(map(str, reducer.bucket_sizes())),
                "num_buckets_reduced": len(reducer.bucket_sizes()),
                "iteration": iterations,
                # Static graph needs the same parameters used in every
                # iteration; ddp_ext tracks whether that held so far.
                "can_set_static_graph": int(iterations > 0 and reducer.unused_parameters_stable),
                "has_rebuilt_buckets": int(reducer.has_rebuilt_buckets),
                # ddp_ext's own: the knob, and how many rebuilds changed the layout.
                "rebuild_buckets": ddp.rebuild_buckets,
                "bucket_rebuilds": reducer.rebuilds,
            }
        )
        order = reducer.observed_order()
        if order:
            data["prev_iteration_grad_ready_order_indices"] = ", ".join(map(str, order))
            # ddp_ext's own: see Note [Gradient order prediction].
            data["overlap_fraction"] = reducer.overlap_fraction
            data["launch_delay"] = reducer.launch_delay
        if reducer.has_rebuilt_buckets:
            data["rebuilt_bucket_sizes"] = ", ".join(map(str, reducer.bucket_sizes()))
            data["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(map(str, bucket)) for bucket in reducer.bucket_indices()
            )
    if getattr(ddp, "_auto_buckets", None) is not None:
        # ddp_ext's own: bucket_cap_mb="auto", where its tuner stands (see
        # Note [Auto-tuned bucket caps]); bucket_cap_bytes is the cap in use.
        data["bucket_cap_auto"] = ddp._auto_buckets.tuner.phase.value
    if ddp._comm_hooks:
        data["comm_hook"] = ddp._comm_hooks[-1][0]
    data.update(ddp.__dict__.get("_runtime_stats", {}).get("logged", {}))
    return data


RUNTIME_TIMES = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
                 "backward_compute_comm_overlap_time")


def sample_runtime_stats(ddp) -> None:
    """Called at every synchronising forward with gradients, before the
    reducer's prepare_for_forward, as torch's logger is: on sampled
    iterations (the first ten, then every `_runtime_logging_sample_rate`-th)
    logs the last iteration's times, in nanoseconds, with torch's meaning
    (Note [Runtime statistics] in reducer/runtime_times.h) and their running
    averages (avg_*)."""
    stats = ddp.__dict__.setdefault("_runtime_stats", {"forwards": 0, "samples": 0, "logged": {}})
    forwards = stats["forwards"]
    stats["forwards"] = forwards + 1
    if forwards == 0 or not (forwards <= 10 or forwards % ddp._runtime_logging_sample_rate == 0):
        return
    forward, compute_start, comm_start, compute_end, comm_end = ddp.reducer._runtime_times()
    if not (0 < forward <= compute_start <= comm_start <= comm_end and compute_start <= compute_end <= comm_end):
        return  # the last forward had no finished synchronising backward
    times = {
        "forward_compute_time": compute_start - forward,
        "backward_compute_time": compute_end - compute_start,
        "backward_comm_time": comm_end - comm_start,
        # Negative when every bucket left after the backward (no overlap).
        "backward_compute_comm_overlap_time": max(0, compute_end - comm_start),
    }
    samples = stats["samples"] + 1
    stats["samples"] = samples
    logged = stats["logged"]
    for key, value in times.items():
        logged[key] = value
        logged[f"avg_{key}"] = (logged.get(f"avg_{key}", 0) * (samples - 1) + value) // samples
    logged.update(
        forward_compute_time_start=forward,
        backward_compute_time_start=compute_start,
        backward_compute_time_end=compute_end,
        backward_comm_time_start=comm_start,
        backward_comm_time_end=comm_end,
    )


def set_runtime_logging_sample_rate(ddp, sample_rate: int) -> None:
    """Every how many iterations, after the first ten, sample_runtime_stats
    logs the times (torch's default: 100)."""
    if sample_rate < 1:
        raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
    ddp._runtime_logging_sample_rate = sample_rate
