"""DistributedDataParallel: torch's DDP contract over ddp_ext's C++ Reducer."""

import contextlib
import copy
import numbers
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDistributedDataParallel
from torch.nn.parallel.scatter_gather import gather as _gather, scatter_kwargs as _scatter_kwargs

from ddp_ext import _C
from ddp_ext._arguments import (
    backend_name,
    check_flags,
    check_types,
    named_pairs,
    resolve_bucket_caps,
    resolve_buffer_sync,
    resolve_process_group,
    resolve_rebuild_buckets,
)
from ddp_ext._auto_buckets import AutoBuckets
from ddp_ext._comm_hooks import check_comm_hook, hook_name
from ddp_ext.compression import AdaptivePrecision, adaptive_precision_hook
from ddp_ext._delayed_all_reduce import DelayedAllReduce
from ddp_ext._dropped_layers import DroppedLayers
from ddp_ext._join import DistributedDataParallelJoinHook
from ddp_ext._logging_data import logging_data
from ddp_ext import _mixed_precision as mixed_precision_forward
from ddp_ext._model_check import verify_same_model
from ddp_ext._output_sink import _map_tensors, find_tensors, sink_outputs
from ddp_ext._parameter_watch import ParameterWatch
from ddp_ext._timeline import Timeline, from_environment as timeline_from_environment
from ddp_ext._unsupported import UnsupportedTorchInternals

# Chunk size for broadcasting parameters and buffers, as torch's DDP uses.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def _device_index(device: Union[int, torch.device, str]) -> int:
    if isinstance(device, numbers.Integral):
        return int(device)
    device = torch.device(device)
    if device.index is None:
        raise ValueError(f"device_ids entries need an explicit index, got {device}")
    return device.index


class DistributedDataParallel(UnsupportedTorchInternals, TorchDistributedDataParallel):
    """Data-parallel training across processes; a drop-in replacement for
    ``torch.nn.parallel.DistributedDataParallel`` (and an instance of it).

    Arguments, defaults and methods are torch 2.13's. At construction every
    rank's model is checked to be the same and rank 0's parameters and
    buffers are broadcast; during backward, gradients are averaged across
    ranks by ddp_ext's C++ Reducer, bucket by bucket while the backward pass
    runs. ``state_dict()`` has the same keys as torch's DDP
    (``module.<name>``). ``mixed_precision`` casts parameters for the forward
    and backward only; see ddp_ext/_mixed_precision.py.

    ``static_graph=True`` learns the set of used parameters, and how often
    each gets a gradient, in the first iteration (and then supports reentrant
    activation checkpointing); it takes precedence over
    ``find_unused_parameters``.

    ``rebuild_buckets`` (keyword only, ddp_ext's addition) says when buckets
    are laid out again in the order gradients become ready: ``"once"`` after
    the first iteration, as torch's DDP does; ``"continuous"`` (default) also
    later, whenever the observed order keeps costing overlap for several
    iterations and every rank agrees; ``"never"`` keeps the construction
    layout (reverse registration order). Results do not depend on it beyond
    float rounding, and ranks stay bitwise equal.

    ``bucket_cap_mb="auto"`` (ddp_ext's addition) tunes the bucket caps while
    training: after a short warm-up on the default caps it times a few
    iterations with each candidate cap, keeps the fastest (every rank the
    same), and tunes again if iterations later get persistently slower. It
    needs ``rebuild_buckets`` "once" or "continuous" and no
    ``bucket_cap_mb_list``; a Python communication hook stops it. See Note
    [Auto-tuned bucket caps] in ddp_ext/_auto_buckets.py.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Union[int, torch.device]]] = None,
        output_device: Optional[Union[int, torch.device]] = None,
        dim: int = 0,
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Union[float, str, None] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Optional[List[float]] = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: Optional[bool] = None,
        *,
        rebuild_buckets: str = "continuous",
    ):
        # torch's DDP __init__ is deliberately not called: it would build
        # torch's reducer. See ddp_ext/_unsupported.py.
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError(
                "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."
            )
        check_flags(
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
            forward_sync_buffers=forward_sync_buffers,
        )
        check_types(device_ids, mixed_precision, param_to_hook_all_reduce)
        if delay_all_reduce_named_params is not None:
            delay_all_reduce_named_params = named_pairs(delay_all_reduce_named_params)
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                "Please avoid using it.",
                FutureWarning,
                stacklevel=2,
            )
        process_group = resolve_process_group(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        buffer_sync = resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
        caps = resolve_bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        rebuild_mode = resolve_rebuild_buckets(rebuild_buckets)
        if caps.auto and rebuild_mode == "never":
            raise ValueError(
                "bucket_cap_mb='auto' re-lays the buckets as it tunes their caps, and "
                "rebuild_buckets='never' keeps the construction layout: use 'auto' with "
                "rebuild_buckets='once' or 'continuous' (the default), or a fixed bucket_cap_mb with 'never'"
            )

        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        delayed_params = []
        for name, param in delay_all_reduce_named_params or ():
            self.parameters_to_ignore.add(name)
            delayed_params.append(param)
        self._module_parameters = [p for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        named_params = self._named_params_for_reducer(module)
        for _, param in named_params:
            if isinstance(param, nn.parameter.UninitializedParameter):
                raise RuntimeError(
                    "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                    "Run a dummy forward pass to correctly initialize the modules"
                )
        if init_sync:
            # First of all, so that a rank with a different model (even one with
            # nothing to train) makes every rank raise the same error. Covers
            # all that _sync_module_states broadcasts: a frozen parameter or
            # buffer shaped differently would shift every tensor after it.
            check_device = next(
                (p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu")
            )
            named_broadcast = [
                (n, p)
                for n, p in module.named_parameters()
                if not p.requires_grad and n not in self.parameters_to_ignore
            ]
            if buffer_sync.at_init:
                named_broadcast += [(n, b) for n, b in module.named_buffers() if n not in self.parameters_to_ignore]
            verify_same_model(process_group, named_params, check_device, named_broadcast)
        if not named_params and not delayed_params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient."
            )
        devices = {p.device for p in self._module_parameters} or {p.device for p in delayed_params}
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
        if device_ids:
            device_ids = [_device_index(device_ids[0])]
            output_device = _device_index(device_ids[0] if output_device is None else output_device)
        else:
            device_ids = None
        self.device_type = device_type
        self._passing_sync_batchnorm_handle(module)

        self.module = module
        self.process_group = process_group
        self.device_ids = device_ids
        self.output_device = output_device
        self.device = next(iter(devices))
        self.is_multi_device_module = len(devices) > 1
        self.dim = dim
        self.forward_sync_buffers = buffer_sync.forward
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.rebuild_buckets = rebuild_mode
        self.mixed_precision = mixed_precision
        self.static_graph = False
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.broadcast_bucket_size = BROADCAST_CHUNK_BYTES
        self._requested_caps = caps  # what the reducer starts from; in use: the bucket_bytes_cap properties
        self._use_python_reducer = False
        self._lazy_init_ran = False
        self._static_graph_delay_allreduce_enqueued = False
        self._ddp_sink_clone = True
        self._divide_by_initial_world_size = True
        self._comm_hooks: List[tuple] = []
        self._runtime_logging_sample_rate = 100
        self._assign_modules_buffers()

        if init_sync:
            self._sync_module_states(authoritative_rank=0, include_buffers=buffer_sync.at_init)
        if mixed_precision is not None:
            mixed_precision_forward.cast_buffers(mixed_precision, module, self.parameters_to_ignore)
        self._delay_all_reduce_params = delayed_params
        self._delayed = None
        if delayed_params:
            self._register_delay_all_reduce_hook(bucket_cap_mb, param_to_hook_all_reduce, device_ids)
        self._delay_all_reduce_all_params = not named_params
        self._dropped_layers = DroppedLayers(module, [p for _, p in named_params])
        if self._dropped_layers and init_sync:
            self._dropped_layers.agree_with_rank_0(self._broadcast_from_rank_0)
        self.reducer = None if self._delay_all_reduce_all_params else self._build_reducer()
        # See Note [Auto-tuned bucket caps]; None: fixed caps.
        self._auto_buckets = AutoBuckets() if caps.auto and self.reducer is not None else None
        self._parameter_watch = ParameterWatch(module, self.parameters_to_ignore)
        if static_graph:
            self._set_static_graph()
        self._timeline = None
        timeline = timeline_from_environment()
        if timeline is not None:
            self.record_timeline(*timeline)

    # --- construction -----------------------------------------------------

    def _named_params_for_reducer(self, module: nn.Module):
        """(name, parameter) of every parameter that requires grad and is not
        ignored, each shared parameter once."""
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in self.parameters_to_ignore]

    def _build_params_for_reducer(self):
        """torch's contract: (parameters, expect_sparse_gradient)."""
        params = [p for _, p in self._named_params_for_reducer(self.module)]
        sparse = self._parameters_with_sparse_gradients()
        self._assign_modules_buffers()
        return params, [id(p) in sparse for p in params]

    def _parameters_with_sparse_gradients(self) -> set:
        """ids of the parameters whose modules produce sparse gradients."""
        return {
            id(p)
            for m in self.module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
            for p in m.parameters(recurse=False)
        }

    def _build_debug_param_to_name_mapping(self, parameters) -> Dict[int, str]:
        names = {p: n for n, p in self._named_params_for_reducer(self.module)}
        return {i: names[p] for i, p in enumerate(parameters)}

    def _build_reducer(self):
        named_params = self._named_params_for_reducer(self.module)
        params = [p for _, p in named_params]
        sparse_ids = self._parameters_with_sparse_gradients()
        sparse = [id(p) in sparse_ids for p in params]
        if any(sparse) and backend_name(self.process_group) == "nccl":
            raise ValueError(
                "NCCL cannot reduce sparse gradients, and this module has an Embedding or "
                "EmbeddingBag with sparse=True: use sparse=False, or a Gloo process group."
            )
        reduce_dtype = None
        if self.mixed_precision is not None:
            reduce_dtype = mixed_precision_forward.reduce_dtype_of(self.mixed_precision)
        options = _C.ReducerOptions()
        options.reduce_dtype = reduce_dtype
        options.find_unused_parameters = self.find_unused_parameters
        options.gradient_as_bucket_view = self.gradient_as_bucket_view
        options.skip_all_reduce_unused_params = self.skip_all_reduce_unused_params
        options.batched_grad_copy = self.batched_grad_copy
        options.rebuild_buckets = getattr(_C.BucketRebuild, self.rebuild_buckets)
        options.bucket_caps = self._requested_caps.caps_bytes  # the reducer's layout owns them from here
        options.layer_units = self._dropped_layers.units
        return _C.Reducer(params, [n for n, _ in named_params], self.process_group, options, sparse)

    def _assign_modules_buffers(self) -> None:
        """Buffers that are broadcast, re-read each time (modules may reassign them)."""
        named = [(n, b) for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]
        self.modules_buffers = [b for _, b in named]
        self.named_module_buffers = dict(named)

    def _get_parameters(self, m, recurse=True):
        for mod in m.modules() if recurse else [m]:
            former = getattr(mod, "_former_parameters", None)
            yield from former.values() if former is not None else mod.parameters(recurse=False)

    @staticmethod
    def _get_data_parallel_params(module, named_params=False):
        for param in module.named_parameters() if named_params else module.parameters():
            if not hasattr(param[1] if named_params else param, "_ddp_ignored"):
                yield param

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """Parameters and buffers (fully qualified names) that DDP neither
        broadcasts nor reduces; call before wrapping the module."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    # --- forward ----------------------------------------------------------

    # Note [torch.compile]
    # As with torch's DDP, the wrapper's forward runs eagerly and only the
    # wrapped module is compiled, under torch.compile(ddp) as well as in
    # DDP(torch.compile(module)). Dynamo skips the frames of forward and
    # _run_ddp_forward but not what they call (recursive=False), so the
    # module's forward is compiled while _inside_ddp_forward has set the
    # active DDP module, and DDPOptimizer splits the graph at our
    # bucket_bytes_cap. _pre_forward and _post_forward, with everything they
    # call (reducer, Join, buffer broadcasts, the output sink), are never
    # traced: traced, each reducer call broke the graph, and guards on the
    # sink's outputs recompiled every step. torch._disable_dynamo is the lazy
    # torch.compiler.disable torch's DDP uses: dynamo is imported at the first
    # forward, not at `import ddp_ext`. tests/test_compile.py checks graph,
    # graph-break and recompile counts against torch's DDP.
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        timeline = self._timeline
        if timeline is not None:
            timeline.forward_begin()
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            if self._delay_all_reduce_all_params:
                output = self.module(*inputs, **kwargs)
            else:
                output = self._run_ddp_forward(*inputs, **kwargs)
            output = self._post_forward(output)
        if timeline is not None:
            timeline.forward_end()
        return output

    def _lazy_init(self) -> None:
        self._setup_in_backward_optimizers()
        self._lazy_init_ran = True

    def _setup_in_backward_optimizers(self) -> None:
        if any(hasattr(p, "_in_backward_optimizers") for p in self._module_parameters):
            raise NotImplementedError(
                "ddp_ext.DistributedDataParallel does not support optimizers applied in backward "
                "(torch.distributed.optim._apply_optimizer_in_backward); step the optimizer after "
                "backward, or use _register_fused_optim."
            )

    @torch._disable_dynamo
    def _pre_forward(self, *inputs, **kwargs):
        if not self._lazy_init_ran and not torch.compiler.is_compiling():
            self._lazy_init()
        if self._delay_all_reduce_all_params:
            return inputs, kwargs
        if torch.is_grad_enabled():
            self._parameter_watch.check(self.module, self.process_group)
            self._dropped_layers.begin_forward()
            # See Note [Ranks out of step] in reducer/step_check.h.
            self.reducer.prepare_for_forward(training_step=self.require_backward_grad_sync and self.module.training)
        work = Join.notify_join_context(self)
        if work:
            self.reducer._set_forward_pass_work_handle(work, self._divide_by_initial_world_size)
        if self._check_sync_bufs_pre_fwd():
            self.reducer._check_step_before_forward_collectives()
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self._auto_buckets is not None and torch.is_grad_enabled():
            # Training steps only, as the step check counts them (Note [Ranks out of step]).
            self._auto_buckets.forward(self, synchronising=self.require_backward_grad_sync and self.module.training)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = _map_tensors((inputs, kwargs), lambda t: t.to(device, non_blocking=True))
        return inputs, kwargs

    @torch._disable_dynamo(recursive=False)
    def _run_ddp_forward(self, *inputs, **kwargs):
        with self._inside_ddp_forward():
            if self.mixed_precision is not None:
                return mixed_precision_forward.run_forward(
                    self.mixed_precision, self.module, self.parameters_to_ignore, inputs, kwargs
                )
            return self.module(*inputs, **kwargs)

    @classmethod
    def _get_active_ddp_module(cls):
        """The DDP module whose forward is running (torch.compile's DDPOptimizer
        reads it; torch's class attribute, shared with torch's DDP)."""
        return TorchDistributedDataParallel._active_ddp_module

    @contextlib.contextmanager
    @torch._disable_dynamo(recursive=False)
    def _inside_ddp_forward(self):
        previous = TorchDistributedDataParallel._active_ddp_module
        TorchDistributedDataParallel._active_ddp_module = self
        try:
            yield
        finally:
            TorchDistributedDataParallel._active_ddp_module = previous

    @torch._disable_dynamo
    def _post_forward(self, output):
        if self._delay_all_reduce_all_params:
            self._clear_grad_buffer()
            return output
        grad_enabled = torch.is_grad_enabled()
        search_unused = self.find_unused_parameters and not self.static_graph
        learning = False
        if grad_enabled:
            self._dropped_layers.end_forward()
        if grad_enabled and self.require_backward_grad_sync:
            # Buffers are broadcast again only before the forward that follows a
            # synchronising one (paper section 4.1).
            self.require_forward_param_sync = True
            dropped, accumulated_only = self._dropped_layers.take_dropped()
            self.reducer.prepare_for_backward(
                find_tensors(output) if search_unused else [], dropped, accumulated_only
            )
            learning = self.reducer.learning_static_graph
        else:
            self.require_forward_param_sync = False
            if grad_enabled:
                # Inside no_sync: whatever the last forward expected, the next
                # backward only accumulates.
                self.reducer.prepare_for_local_backward()
        if learning:
            self._static_graph_delay_allreduce_enqueued = True
        if learning or (search_unused and grad_enabled):
            output = sink_outputs(output, on_backward=self._at_backward_start(learning), clone=self._ddp_sink_clone)
        self._clear_grad_buffer()
        return output

    def _register_delay_all_reduce_hook(self, bucket_cap_mb, param_to_hook_all_reduce, device_ids) -> None:
        """delay_all_reduce_named_params: see ddp_ext/_delayed_all_reduce.py."""
        self._delayed = DelayedAllReduce(
            self._delay_all_reduce_params, param_to_hook_all_reduce, self.process_group, BROADCAST_CHUNK_BYTES
        )

    def _delayed_all_reduce_hook(self, grad):
        return self._delayed.start(grad)

    def _at_backward_start(self, learning: bool) -> Callable[[], None]:
        """What the output sink runs when the backward reaches it. It holds the
        reducer weakly: a wrapper freed after its forward makes that backward
        raise, instead of running unsynchronised (torch's DDP raises too)."""
        reducer_ref = weakref.ref(self.reducer)
        group = self.process_group

        def at_backward_start() -> None:
            reducer = reducer_ref()
            if reducer is None:
                raise RuntimeError(
                    f"DistributedDataParallel on rank {group.rank()} was destroyed after its forward pass, so "
                    "this backward pass would not average gradients across ranks. Keep the wrapper "
                    "alive until backward returns."
                )
            if learning:
                reducer.queue_finish_learning_iteration()

        return at_backward_start

    def _clear_grad_buffer(self) -> None:
        if self._delayed is not None:
            self._delayed.point_grads_at_buffer()

    def scatter(self, inputs, kwargs, device_ids):
        return _scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs, kwargs, device_id):
        device = torch.device(self.device_type, device_id)
        moved = _map_tensors((inputs, kwargs), lambda t: t.to(device, non_blocking=True))
        return (moved[0],), (moved[1],)

    def gather(self, outputs, output_device):
        return _gather(outputs, output_device, dim=self.dim)

    def train(self, mode: bool = True):
        nn.Module.train(self, mode)
        return self

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this context accumulate gradients locally; the
        first synchronising backward after it reduces everything accumulated."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        if self.reducer is not None:
            self.reducer.allow_local_accumulation()
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # --- buffers ------------------------------------------------------------

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and len(self.modules_buffers) > 0)

    def _check_sync_bufs_pre_fwd(self) -> bool:
        return self.will_sync_module_buffers() and self.process_group.size() > 1

    def _check_sync_bufs_post_fwd(self) -> bool:
        return False  # buffers are only ever synchronised before the forward

    def _sync_buffers(self) -> None:
        with torch.no_grad():
            if self._join_config.enable:
                authoritative_rank = self._find_common_rank(self._distributed_rank, True)
            else:
                authoritative_rank = 0
            self._assign_modules_buffers()
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.modules_buffers)):
                self._sync_module_buffers(authoritative_rank)

    def _sync_module_buffers(self, authoritative_rank) -> None:
        self._default_broadcast_coalesced(authoritative_rank=authoritative_rank)

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank=0) -> None:
        self._distributed_broadcast_coalesced(
            self.modules_buffers if bufs is None else bufs,
            self.broadcast_bucket_size if bucket_size is None else bucket_size,
            authoritative_rank,
        )

    def _distributed_broadcast_coalesced(self, tensors, buffer_size, authoritative_rank=0) -> None:
        if tensors:
            _C.broadcast_coalesced(self.process_group, list(tensors), int(buffer_size), int(authoritative_rank))

    def _broadcast_from_rank_0(self, tensor: torch.Tensor) -> None:
        """Broadcasts a small CPU tensor in place from rank 0 of the group."""
        on_device = tensor.to(self.device)
        self._distributed_broadcast_coalesced([on_device], BROADCAST_CHUNK_BYTES, 0)
        tensor.copy_(on_device)

    def _sync_module_states(self, authoritative_rank: int, include_buffers: bool) -> None:
        params = [p.detach() for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        buffers = self.modules_buffers if include_buffers else []
        with torch.no_grad():
            self._distributed_broadcast_coalesced(params + list(buffers), self.broadcast_bucket_size, authoritative_rank)

    def _passing_sync_batchnorm_handle(self, module) -> None:
        for layer in module.modules():
            if isinstance(layer, nn.SyncBatchNorm) and self.device_type == "cpu":
                raise ValueError("SyncBatchNorm layers only work with GPU modules")

    # --- Join ---------------------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False):
        """Context manager for uneven inputs: ranks that run out of data shadow
        the collectives of those that have not; see ddp_ext/_join.py."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs):
        return DistributedDataParallelJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    @property
    def _distributed_rank(self) -> int:
        return self.process_group.rank()

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        candidate = torch.tensor([input_rank if rank_cond else -1], device=self.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.process_group)
        rank = int(candidate.item())
        if rank == -1:
            raise ValueError("No rank met the condition to be the authoritative rank.")
        return rank

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        syncs = not is_joined_rank and self.require_backward_grad_sync
        flag = torch.ones(1, device=self.device) if syncs else torch.zeros(1, device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if not is_joined_rank:
            return None
        work.wait()
        return flag.item() != 0

    def _check_and_sync_module_buffers(self) -> None:
        if self._check_sync_bufs_pre_fwd():
            self.reducer._match_step_check_as_joined()
            authoritative_rank = self._find_common_rank(self._distributed_rank, False)
            self._sync_module_buffers(authoritative_rank)

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        self._authoritative_rank = self._find_common_rank(self._distributed_rank, is_last_joiner)
        self._assign_modules_buffers()
        self._sync_module_states(self._authoritative_rank, include_buffers=self.forward_sync_buffers)

    def _match_all_reduce_for_bwd_pass(self) -> None:
        self.reducer._match_step_check_as_joined()
        # See Note [Layer dropping]: the peers skip the buckets of layers they all dropped.
        dropped = set(self._dropped_layers.take_dropped()[0])
        buckets = [
            bucket
            for bucket, members in zip(self.reducer._get_zeros_like_grad_buckets(), self.reducer.bucket_indices())
            if not (dropped and all(i in dropped for i in members))
        ]
        works = [self.reducer._run_comm_hook(bucket) for bucket in buckets]
        for work in works:
            work.wait()

    def _match_unused_params_allreduce(self) -> None:
        self.process_group.allreduce(self.reducer._get_local_used_map()).wait()

    # --- communication hooks ---------------------------------------------

    def _check_comm_hook(self, hook) -> None:
        check_comm_hook(hook)

    def _log_and_throw(self, err_type, err_msg):
        raise err_type(err_msg)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduce each bucket with `hook(state, bucket) -> torch.futures.Future`
        instead of the default averaging allreduce (torch's contract: the bucket
        holds gradients not yet divided by the world size; the future's value
        is the reduced buffer). Once only, between iterations."""
        check_comm_hook(hook)
        if hook is adaptive_precision_hook:
            # The same hook, run in C++ without the GIL.
            if not isinstance(state, AdaptivePrecision):
                raise TypeError(
                    f"adaptive_precision_hook needs a ddp_ext.AdaptivePrecision as its state, got {type(state).__name__}"
                )
            self.reducer._register_adaptive_precision(state._bind(self.process_group))
        else:
            self.reducer._register_comm_hook(state, hook)
        self._comm_hooks.append((hook_name(hook), state))
        if self._auto_buckets is not None and hook is not adaptive_precision_hook:
            # See Note [Auto-tuned bucket caps], point 5 (the adaptive hook's
            # error feedback follows parameters to any layout).
            self._auto_buckets.freeze(f"the communication hook {hook_name(hook)} may keep state per bucket")

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """A C++ hook that runs without the GIL: ALLREDUCE or FP16_COMPRESS."""
        self.reducer._register_builtin_comm_hook(comm_hook_type, self.process_group)
        self._comm_hooks.append((str(comm_hook_type), None))

    def _register_fused_optim(self, optim: type, *args, optim_params=None, **kwargs) -> None:
        from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim

        overlapped = _as_overlapped_optim(optim, optim_params, *args, **kwargs)
        try:
            overlapped.register_ddp(self)
        except NotImplementedError as e:
            raise RuntimeError(f"{optim} does not support overlapped DDP.") from e

    # --- state and configuration -----------------------------------------

    def _set_static_graph(self) -> None:
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.reducer._set_static_graph()  # refuses a LayerDrop (reducer/static_graph.h)
        self.static_graph = True
        self._static_graph_delay_allreduce_enqueued = False
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do not "
                "need to set find_unused_parameters=true, just be sure these unused parameters "
                "will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    def _get_ddp_logging_data(self) -> Dict[str, Any]:
        return logging_data(self)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """ddp_ext records no runtime timing statistics; the rate is checked
        as torch checks it and kept, so callers work unchanged."""
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self._runtime_logging_sample_rate = sample_rate

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether outputs routed through the output sink are cloned (True by
        default; False saves memory when outputs are never modified in place)."""
        self._ddp_sink_clone = bool(val)

    def _remove_autograd_hooks(self) -> None:
        self.reducer._remove_autograd_hooks()

    def _check_reducer_finalized(self) -> None:
        self.reducer._check_reducer_finalized()

    def _update_process_group(self, new_process_group) -> None:
        """Reduce over `new_process_group` from now on (shrinking or growing
        the world without re-wrapping). Communication hooks keep the groups
        they were given."""
        if not dist.distributed_c10d._rank_not_in_group(new_process_group):
            self.process_group = new_process_group
            self.reducer._update_process_group(new_process_group)
            if self._auto_buckets is not None:
                self._auto_buckets.restart()

    def set_overlap_with_backward(self, overlap: bool) -> None:
        """ddp_ext only. With False, every allreduce waits until the backward pass
        has finished instead of overlapping with it; for measuring what overlap
        buys (paper Fig. 5). Call between iterations."""
        self.reducer.set_overlap_with_backward(bool(overlap))

    def record_timeline(self, directory: str, iterations: Optional[int] = None) -> Timeline:
        """ddp_ext only. Records the communication timeline from now on: the
        forward, the backward, each gradient's ready time, each bucket's launch
        and completion, the wait at the end of the backward, communication
        hook time and bucket rebuilds. Writes a Chrome trace,
        DIRECTORY/timeline-rank{rank}.json, when the returned Timeline is
        stopped (stop(), the end of a `with` block), after `iterations`
        synchronising backward passes, or at exit. The environment variable
        DDP_EXT_TIMELINE=DIRECTORY does the same for every wrapper built
        (DDP_EXT_TIMELINE_ITERATIONS=N: for N iterations)."""
        if self._timeline is not None and self._timeline.recording:
            raise RuntimeError(
                f"record_timeline: this wrapper is already recording a timeline to {self._timeline.path}; "
                "stop() it first"
            )
        self._timeline = Timeline(self, directory, iterations)
        return self._timeline

    @property
    def _bucket_caps_bytes(self) -> List[int]:
        """Cap of the 1st, 2nd, ... bucket of each kind, the last repeating:
        those the reducer's bucket layout cuts with now (tuning changes them)."""
        reducer = self.__dict__.get("reducer")  # none while constructing, or with every parameter delayed
        return self._requested_caps.caps_bytes if reducer is None else list(reducer.bucket_caps)

    @property
    def bucket_bytes_cap(self) -> int:
        """torch's attribute: the largest bucket cap in use, in bytes."""
        return max(self._bucket_caps_bytes)

    @property
    def bucket_bytes_cap_list(self) -> List[int]:
        """torch's attribute: the caps of bucket_cap_mb_list in bytes, [] without one."""
        return self._bucket_caps_bytes if self._requested_caps.custom_list else []

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """torch's attribute: neither bucket_cap_mb nor bucket_cap_mb_list was given."""
        return self._requested_caps.default

    def bucket_indices(self) -> List[List[int]]:
        """ddp_ext only. Parameter indices (among those that require grad and
        are not ignored) per bucket, in launch order."""
        return self.reducer.bucket_indices()

    @property
    def bucket_tuner(self):
        """ddp_ext only. With bucket_cap_mb="auto", the tuner's state: its
        phase, the candidate in use (`current`, an index into
        `policy.candidates_mb`) and its `history` of trials and decisions.
        None with fixed caps."""
        return None if self._auto_buckets is None else self._auto_buckets.tuner

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """torch's flag (ZeRO's DDP hooks read it): whether the buckets were
        rebuilt in the observed gradient order after the first iteration."""
        return self.reducer is not None and self.reducer.has_rebuilt_buckets

    # --- pickling -----------------------------------------------------------

    def _check_default_group(self) -> None:
        try:
            default = dist.distributed_c10d._get_default_group()
        except (RuntimeError, ValueError):
            default = None
        if self.process_group is not default:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default "
                "process group. That is, when you have called init_process_group and have not "
                "passed process_group argument to DDP constructor"
            )

    def __getstate__(self):
        self._check_default_group()
        if self._delay_all_reduce_params:
            raise NotImplementedError(
                "ddp_ext.DistributedDataParallel with delay_all_reduce_named_params cannot be "
                "pickled or deep-copied: wrap a copy of the module instead."
            )
        state = copy.copy(self.__dict__)
        for name in ("process_group", "reducer", "_delayed"):
            state.pop(name, None)
        state["_timeline"] = None  # the copy records nothing
        # Hooks hold process groups and state that does not travel; the copy
        # starts with the default reduction, as after construction.
        state["_comm_hooks"] = []
        return state

    def __setstate__(self, state):
        self.process_group = dist.distributed_c10d._get_default_group()
        nn.Module.__setstate__(self, state)
        self.__dict__.setdefault("require_forward_param_sync", True)
        self.__dict__.setdefault("require_backward_grad_sync", True)
        self.__dict__.setdefault("rebuild_buckets", "continuous")
        self.__dict__.setdefault("_auto_buckets", None)
        if self._auto_buckets is not None:
            self._auto_buckets.restart()  # the copy times its own iterations
        self._delayed = None
        self._timeline = None
        self._delay_all_reduce_all_params = not self._named_params_for_reducer(self.module)
        self._dropped_layers = DroppedLayers(self.module, [p for _, p in self._named_params_for_reducer(self.module)])
        self.reducer = None if self._delay_all_reduce_all_params else self._build_reducer()
        self._parameter_watch = ParameterWatch(self.module, self.parameters_to_ignore)
        if self.static_graph:
            self.reducer._set_static_graph()
