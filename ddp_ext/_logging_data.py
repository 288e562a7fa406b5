"""`_get_ddp_logging_data()`: the keys torch's DDP logger reports that
describe the configuration and progress, filled from ddp_ext's own state."""

import os
import time
from typing import Any, Dict

import torch

from ddp_ext._arguments import backend_name
from ddp_ext._bound import Bound


# What torch's logger names a parameter dtype (c10's TypeMeta name).
_TYPE_META_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return _TYPE_META_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _environment(group) -> Dict[str, Any]:
    """torch's Logger::set_env_variables: the settings that shaped the run,
    "N/A" when unset; NCCL's or Gloo's only with that backend."""

    def env(name: str) -> str:
        return os.environ.get(name, "N/A")

    data: Dict[str, Any] = {
        "master_addr": env("MASTER_ADDR"),
        "master_port": env("MASTER_PORT"),
        "torch_distributed_debug": env("TORCH_DISTRIBUTED_DEBUG"),
        "cuda_visible_devices": env("CUDA_VISIBLE_DEVICES"),
    }
    backend = backend_name(group)
    if backend == "nccl":
        for name in ("SOCKET_IFNAME", "BLOCKING_WAIT", "ASYNC_ERROR_HANDLING", "DEBUG", "NTHREADS", "IB_TIMEOUT"):
            data[f"nccl_{name.lower()}"] = env(f"NCCL_{name}")
    elif backend == "gloo":
        data["gloo_socket_ifname"] = env("GLOO_SOCKET_IFNAME")
        data["gloo_device_transport"] = env("GLOO_DEVICE_TRANSPORT")
        try:
            data["gloo_num_threads"] = group._get_backend(torch.device("cpu")).options._threads
        except (AttributeError, RuntimeError):
            pass  # a group whose CPU backend is not torch's ProcessGroupGloo
    return data


RUNTIME_TIMES = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
                 "backward_compute_comm_overlap_time")
RUNTIME_INSTANTS = ("forward_compute_time_start", "backward_compute_time_start", "backward_compute_time_end",
                    "backward_comm_time_start", "backward_comm_time_end")


def is_sampled(iteration: int, sample_rate: int) -> bool:
    """torch's Reducer::should_collect_runtime_stats: the first ten
    iterations, then every `sample_rate`-th (iteration 0, the first forward,
    has nothing to report yet)."""
    return iteration > 0 and (iteration <= 10 or iteration % sample_rate == 0)


class LoggingData(Bound):
    """What `_get_ddp_logging_data()` reports, and the runtime statistics it
    samples. Owns torch's reducer counters and its logger's figures
    (`stats`) and the sample rate; reads the rest from the collaborators it
    is given."""

    def __init__(self, reducer, group, module, module_parameters, settings, flags, buffers, tuning):
        self.module = module
        self.module_parameters = module_parameters
        self.settings = settings
        self.flags = flags  # SyncFlags: static_graph
        self.buffers = buffers  # BufferSync: forward_sync_buffers
        self.tuning = tuning  # CapTuning: the caps in use
        self.comm_hook = None  # the last registered hook's name, told by CommHooks
        self.sample_rate = 100  # torch's _runtime_logging_sample_rate
        # `forwards`: torch's reducer num_iterations_, the synchronising
        # forwards with gradients so far; `samples`: its logger's
        # num_iterations_stats_recorded_; `logged`: what the logger last set.
        self.stats: Dict[str, Any] = {"forwards": 0, "samples": 0, "logged": {}}
        self.bind(reducer, group)

    def bind(self, reducer, process_group) -> None:
        if reducer is not None and reducer is not self.reducer:
            # torch's bucket_sizes: the layout the reducer was built with
            # (Note [torch's first buckets] in reducer/layout/bucket_assignment.h).
            self.first_bucket_sizes = ", ".join(map(str, reducer.bucket_sizes()))
        super().bind(reducer, process_group)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "comm_hook": None}  # a copy starts without hooks

    def hook_registered(self, name: str) -> None:
        self.comm_hook = name

    def data(self) -> Dict[str, Any]:
        params = [p for p in self.module_parameters if p.requires_grad]
        reducer = self.reducer
        group = self.process_group
        settings = self.settings
        placement = settings.placement
        data: Dict[str, Any] = {
            "module_name": type(self.module).__name__,
            "rank": group.rank(),
            "world_size": group.size(),
            "backend_name": backend_name(group) or "unknown",
            "device_ids": ", ".join(map(str, placement.device_ids or [])),
            "output_device": -1 if placement.output_device is None else placement.output_device,
            "dtypes": ", ".join(sorted({_dtype_name(p.dtype) for p in params})),
            "broadcast_buffers": int(self.buffers.forward),
            "bucket_cap_bytes": max(self.tuning.caps_bytes),
            "find_unused_parameters": int(settings.find_unused_parameters),
            "gradient_as_bucket_view": int(settings.gradient_as_bucket_view),
            "static_graph": int(self.flags.static_graph),
            "is_multi_device_module": int(len(placement.devices) > 1),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.module.modules())),
            "has_rebuilt_buckets": 0,
            # torch's: the iteration of the last sample or error, see
            # sample; 0 before.
            "iteration": 0,
            **_environment(group),
        }
        if reducer is not None:
            iterations = reducer.iterations
            data.update(
                {
                    "bucket_sizes": self.first_bucket_sizes,
                    "num_buckets_reduced": len(reducer.bucket_sizes()),
                    # Static graph needs the same parameters used in every
                    # iteration; ddp_ext tracks whether that held so far.
                    "can_set_static_graph": int(iterations > 0 and reducer.unused_parameters_stable),
                    "has_rebuilt_buckets": int(reducer.has_rebuilt_buckets),
                    # ddp_ext's own: the knob, and how many rebuilds changed the layout.
                    "rebuild_buckets": settings.rebuild_buckets,
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
        if self.tuning.auto is not None:
            # ddp_ext's own: bucket_cap_mb="auto", where its tuner stands (see
            # Note [Auto-tuned bucket caps]); bucket_cap_bytes is the cap in use.
            data["bucket_cap_auto"] = self.tuning.auto.tuner.stage.value
        if self.comm_hook is not None:
            data["comm_hook"] = self.comm_hook
        data.update(self.stats["logged"])
        return data

    def sample(self) -> None:
        """Called at every synchronising forward with gradients, before the
        reducer's prepare_for_forward, as torch's
        Logger::set_runtime_stats_and_log is. On a sampled iteration
        (`is_sampled`, counting this forward's predecessors) it sets
        `iteration` to that count and logs the last iteration's times, in
        nanoseconds, with torch's meaning (Note [Runtime statistics] in
        reducer/observation/runtime_times.h), and their running averages (avg_*). As
        torch does, every figure is first reset to 0 and a time whose end
        precedes its start (the iteration had no such phase, e.g. a forward
        without backward came in between) stays 0 and leaves its average
        alone; between samples every key keeps its value."""
        stats = self.stats
        iteration = stats["forwards"]
        stats["forwards"] = iteration + 1
        # torch's timer starts the forward at synchronising forwards only; the
        # reducer's forward_start also moves at a forward inside no_sync.
        forward = stats.get("forward_start", 0)
        stats["forward_start"] = time.monotonic_ns()  # the reducer's clock
        if not is_sampled(iteration, self.sample_rate):
            return
        samples = stats["samples"] + 1
        stats["samples"] = samples
        logged = stats["logged"]
        logged["iteration"] = iteration
        logged.update(dict.fromkeys(RUNTIME_TIMES + RUNTIME_INSTANTS, 0))
        # torch's timer keeps an instant until it is recorded again; the reducer
        # clears the backward's instants when it arms the next backward.
        kept = stats.setdefault("instants", [0, 0, 0, 0])
        kept[:] = [now or before for now, before in zip(self.reducer._runtime_times()[1:], kept)]
        compute_start, comm_start, compute_end, comm_end = kept
        spans = {
            "forward_compute_time": (forward, compute_start),
            "backward_compute_time": (compute_start, compute_end),
            "backward_comm_time": (comm_start, comm_end),
            # Not measured when every bucket left after the backward (no overlap).
            "backward_compute_comm_overlap_time": (comm_start, compute_end),
        }
        for key, (start, end) in spans.items():
            average = logged.get(f"avg_{key}", 0)
            if 0 < start <= end:  # 0: not recorded yet
                logged[key] = end - start
                average = (end - start + average * (samples - 1)) // samples
            logged[f"avg_{key}"] = average
        instants = (forward, compute_start, compute_end, comm_start, comm_end)
        for key, instant in zip(RUNTIME_INSTANTS, instants):
            logged[key] = instant

    def record_error(self, message: str) -> None:
        """torch's Logger::set_error_and_log: `has_error` and `error` in the
        logging data, and `iteration` at the error."""
        self.stats["logged"].update(has_error=1, error=message, iteration=self.stats["forwards"])

    def log_and_throw(self, err_type, err_msg):
        """torch's _log_and_throw: records the error, then raises it."""
        self.record_error(f"{err_type}: {err_msg}")
        raise err_type(err_msg)

    def set_sample_rate(self, sample_rate: int) -> None:
        """Every how many iterations, after the first ten, sample logs the
        times (torch's default: 100)."""
        if sample_rate < 1:
            self.log_and_throw(ValueError, "DDP runtime logging sample rate should be equal or greater than 1")
        self.sample_rate = sample_rate
