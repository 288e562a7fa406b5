"""DistributedDataParallel: torch's DDP interface over ddp_ext's C++ Reducer."""

import contextlib
import numbers
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ddp_ext import _C
from ddp_ext._model_check import verify_same_model
from ddp_ext._output_sink import _map_tensors, find_tensors, sink_outputs

DEFAULT_BUCKET_CAP_MB = 25
# With the default cap, the first bucket of each dtype is smaller, so that its
# allreduce starts early in the backward pass (torch's DDP does the same).
DEFAULT_FIRST_BUCKET_CAP_MB = 1
# Chunk size for broadcasting parameters and buffers, as torch's DDP uses.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def _device_index(device: Union[int, torch.device, str]) -> int:
    if isinstance(device, numbers.Integral):
        return int(device)
    device = torch.device(device)
    if device.index is None:
        raise ValueError(f"device_ids entries need an explicit index, got {device}")
    return device.index


class DistributedDataParallel(nn.Module):
    """Data-parallel training across processes; a drop-in replacement for
    ``torch.nn.parallel.DistributedDataParallel``.

    Arguments and defaults are torch's. At construction every rank's model is
    checked to be the same and rank 0's parameters and buffers are broadcast;
    during backward, gradients are averaged across ranks by ddp_ext's C++
    Reducer, bucket by bucket while the backward pass runs. ``state_dict()``
    has the same keys as torch's DDP (``module.<name>``).

    ``static_graph=True`` learns the set of used parameters in the first
    iteration (and then supports reentrant activation checkpointing); it takes
    precedence over ``find_unused_parameters``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Union[int, torch.device]]] = None,
        output_device: Optional[Union[int, torch.device]] = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "Default process group has not been initialized, please make sure to "
                    "call init_process_group (or pass process_group=...)."
                )
            process_group = dist.distributed_c10d._get_default_group()
        elif not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup, got "
                f"{type(process_group).__name__}"
            )
        first_bucket_cap_mb = bucket_cap_mb
        if bucket_cap_mb is None:
            bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
            first_bucket_cap_mb = DEFAULT_FIRST_BUCKET_CAP_MB
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")

        named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if init_sync:
            # First of all, so that a rank with a different model (even one with
            # nothing to train) makes every rank raise the same error.
            some_param = next(module.parameters(), None)
            check_device = some_param.device if some_param is not None else torch.device("cpu")
            verify_same_model(process_group, named_params, check_device)
        if not named_params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient."
            )
        devices = {p.device for _, p in named_params}
        device_type = next(iter(devices)).type
        if device_ids is not None or output_device is not None:
            if len(devices) != 1 or device_type == "cpu":
                raise ValueError(
                    "device_ids and output_device only work with a module whose parameters "
                    f"all live on one GPU, but got device_ids={device_ids}, output_device="
                    f"{output_device} for a module on {sorted(map(str, devices))}. For CPU "
                    "or multi-device modules leave both None."
                )
        if device_ids is not None:
            if len(device_ids) != 1:
                raise ValueError(f"device_ids must hold exactly one device, got {device_ids}")
            device_ids = [_device_index(device_ids[0])]
            if output_device is None:
                output_device = device_ids[0]
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.device_type = device_type
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._module_buffers: List[torch.Tensor] = list(module.buffers())
        self._world_size = process_group.size()

        params = [p for _, p in named_params]
        if init_sync:
            _C.broadcast_coalesced(
                process_group,
                [t.detach() for t in module.parameters()] + self._module_buffers,
                BROADCAST_CHUNK_BYTES,
                0,
            )

        def to_bytes(mb):
            return max(1, int(mb * 1024 * 1024))

        specs = [(p.numel() * p.element_size(), p.dtype, p.device) for p in params]
        options = _C.ReducerOptions()
        options.find_unused_parameters = find_unused_parameters
        options.gradient_as_bucket_view = gradient_as_bucket_view
        options.static_graph = static_graph
        self._reducer = _C.Reducer(
            params,
            [n for n, _ in named_params],
            _C.assign_buckets(specs, to_bytes(bucket_cap_mb), to_bytes(first_bucket_cap_mb)),
            process_group,
            options,
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._reducer.prepare_for_forward()
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = _map_tensors((inputs, kwargs), lambda t: t.to(device, non_blocking=True))
        if self._will_sync_buffers():
            _C.broadcast_coalesced(self.process_group, self._module_buffers, BROADCAST_CHUNK_BYTES, 0)

        output = self.module(*inputs, **kwargs)

        search_unused = self.find_unused_parameters and not self.static_graph
        learning = False
        if grad_enabled and self.require_backward_grad_sync:
            # Buffers are broadcast again only before the forward that follows a
            # synchronising one (paper section 4.1).
            self.require_forward_param_sync = True
            self._reducer.prepare_for_backward(find_tensors(output) if search_unused else [])
            learning = self._reducer.learning_static_graph
        else:
            self.require_forward_param_sync = False
            if grad_enabled:
                # Inside no_sync: whatever the last forward expected, the next
                # backward only accumulates.
                self._reducer.prepare_for_local_backward()
        if learning:
            output = sink_outputs(output, on_backward=self._reducer.queue_finish_learning_iteration)
        elif search_unused and grad_enabled:
            output = sink_outputs(output)
        return output

    def _will_sync_buffers(self) -> bool:
        return (
            self.require_forward_param_sync
            and self.broadcast_buffers
            and self._world_size > 1
            and len(self._module_buffers) > 0
        )

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this context accumulate gradients locally; the
        first synchronising backward after it reduces everything accumulated."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def set_overlap_with_backward(self, overlap: bool) -> None:
        """ddp_ext only. With False, every allreduce waits until the backward pass
        has finished instead of overlapping with it; for measuring what overlap
        buys (paper Fig. 5). Call between iterations."""
        self._reducer.set_overlap_with_backward(bool(overlap))

    def bucket_indices(self) -> List[List[int]]:
        """Parameter indices (among those that require grad) per bucket, in launch order."""
        return self._reducer.bucket_indices()
