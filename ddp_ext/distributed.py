"""DistributedDataParallel: torch's DDP contract over ddp_ext's C++ Reducer."""

import contextlib
import warnings
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDistributedDataParallel
from torch.nn.parallel.scatter_gather import gather as _gather, scatter_kwargs as _scatter_kwargs

from ddp_ext import _C, _arguments, _buffers, _comm_hooks, _delayed_all_reduce, _diagnosis, _join, _logging_data
from ddp_ext import _exit, _parameters, _pickling, _timeline, hierarchy
from ddp_ext._diagnosis import stragglers as _stragglers
from ddp_ext._arguments import (
    backend_name,
    check_arguments,
    check_flags,
    check_initialized,
    check_types,
    resolve_bucket_caps,
    resolve_buffer_sync,
    resolve_placement,
    resolve_process_group,
    resolve_rebuild_buckets,
)
from ddp_ext._auto_buckets import AutoBuckets
from ddp_ext._buffers import BROADCAST_CHUNK_BYTES
from ddp_ext._dropped_layers import DroppedLayers
from ddp_ext import _mixed_precision as mixed_precision_forward
from ddp_ext._model_check import verify_module
from ddp_ext._output_sink import _map_tensors, at_backward_start, find_tensors, sink_outputs
from ddp_ext._parameter_watch import ParameterWatch
from ddp_ext._unsupported import UnsupportedTorchInternals


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

    ``hang_timeout_s`` and ``on_hang`` (keyword only, ddp_ext's additions;
    environment variables DDP_EXT_HANG_TIMEOUT_S and DDP_EXT_ON_HANG override
    them): a rank whose peer's report proves that a wait of the reducer can
    never end (the peer left parameters without a gradient, died, or raised
    and left the collectives) raises within seconds; a collective that has
    merely waited ``hang_timeout_s`` seconds (default 60; 0: off) makes every
    rank report what it is doing through the store. The message names the
    lagging or dead ranks, the training step and the parameters that got no
    gradient. ``on_hang="auto"`` (default) raises when the reports prove the
    wait cannot end, else warns once and waits on; ``"raise"`` and ``"warn"``
    always do that. See docs/DIAGNOSIS.md.
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
        hang_timeout_s: Optional[float] = None,
        on_hang: Optional[str] = None,
        hierarchical_allreduce: Union[str, bool] = "auto",
    ):
        # torch's DDP __init__ is deliberately not called: it would build
        # torch's reducer. See ddp_ext/_unsupported.py.
        nn.Module.__init__(self)
        Joinable.__init__(self)
        delay_all_reduce_named_params = check_arguments(
            module, delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction
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
        process_group = resolve_process_group(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        buffer_sync = resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
        caps = resolve_bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        rebuild_mode = resolve_rebuild_buckets(rebuild_buckets)
        hang_settings = _diagnosis.resolve_hang_settings(hang_timeout_s, on_hang)
        hierarchy.check_setting(hierarchical_allreduce)
        if caps.auto and rebuild_mode == "never":
            raise ValueError(
                "bucket_cap_mb='auto' re-lays the buckets as it tunes their caps, and "
                "rebuild_buckets='never' keeps the construction layout: use 'auto' with "
                "rebuild_buckets='once' or 'continuous' (the default), or a fixed bucket_cap_mb with 'never'"
            )

        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore.update(name for name, _ in delay_all_reduce_named_params)
        delayed_params = [param for _, param in delay_all_reduce_named_params]
        self._module_parameters = [p for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        named_params = self._named_params_for_reducer(module)
        check_initialized(named_params)
        agreed_number = None  # see _diagnosis.store_key
        if init_sync:
            # First of all, so that a rank with a different model (even one with
            # nothing to train) makes every rank raise the same error.
            agreed_number = verify_module(
                process_group, module, named_params, self.parameters_to_ignore, buffer_sync.at_init,
                _arguments.settings_to_agree(caps, find_unused_parameters, static_graph, rebuild_mode,
                                             skip_all_reduce_unused_params, hierarchical_allreduce),
                number=_diagnosis.proposed_number(process_group),
            )
        if not named_params and not delayed_params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient."
            )
        placement = resolve_placement(self._module_parameters, delayed_params, device_ids, output_device)
        self.device_type = placement.device_type
        self._passing_sync_batchnorm_handle(module)

        self.module = module
        self.process_group = process_group
        _exit.track(process_group)  # Note [Exit after training]
        self.device_ids = placement.device_ids
        self.output_device = placement.output_device
        self.device = next(iter(placement.devices))
        self.is_multi_device_module = len(placement.devices) > 1
        self.dim = dim
        self.forward_sync_buffers = buffer_sync.forward
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.rebuild_buckets = rebuild_mode
        self.hierarchical_allreduce = hierarchical_allreduce  # ddp_ext/hierarchy.py
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
            self._register_delay_all_reduce_hook(bucket_cap_mb, param_to_hook_all_reduce, self.device_ids)
        self._delay_all_reduce_all_params = not named_params
        self._dropped_layers = DroppedLayers(module, [p for _, p in named_params])
        if self._dropped_layers and init_sync:
            self._dropped_layers.agree_with_rank_0(self._broadcast_from_rank_0)
        self.reducer = None if self._delay_all_reduce_all_params else self._build_reducer()
        self._hang_settings = hang_settings
        self._hang_diagnosis = _diagnosis.attach(
            self, settings=hang_settings, key=_diagnosis.store_key(process_group, agreed_number)
        )
        self._stragglers = _stragglers.attach(self)
        # See Note [Auto-tuned bucket caps]; None: fixed caps.
        self._auto_buckets = AutoBuckets() if caps.auto and self.reducer is not None else None
        self._parameter_watch = ParameterWatch(module, self.parameters_to_ignore)
        if static_graph:
            self._set_static_graph()
        self._timeline = None
        timeline = _timeline.from_environment()
        if timeline is not None:
            self.record_timeline(*timeline)

    # --- construction -----------------------------------------------------

    _named_params_for_reducer = _parameters.named_params_for_reducer
    _build_params_for_reducer = _parameters.build_params_for_reducer
    _parameters_with_sparse_gradients = _parameters.parameters_with_sparse_gradients
    _build_debug_param_to_name_mapping = _parameters.build_debug_param_to_name_mapping
    _get_parameters = _parameters.get_parameters
    _get_data_parallel_params = staticmethod(_parameters.get_data_parallel_params)
    _set_params_and_buffers_to_ignore_for_model = staticmethod(_parameters.set_params_and_buffers_to_ignore_for_model)

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
        # See Note [The step check on bucket 0] in reducer/agreement/step_check.h.
        options.buffers_broadcast = bool(self.forward_sync_buffers and self.modules_buffers)
        options.rebuild_buckets = getattr(_C.BucketRebuild, self.rebuild_buckets)
        options.bucket_caps = self._requested_caps.caps_bytes  # the reducer's layout owns them from here
        options.layer_units = self._dropped_layers.units
        return _C.Reducer(params, [n for n, _ in named_params], self.reducer_group, options, sparse)

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
    # forward, not at `import ddp_ext`. tests/frameworks/test_compile.py checks graph,
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
        """At the first forward, which every rank runs (a rank that joins
        before it runs it from its Join hook), after Join's notification:
        the hook agreement is a collective, which a joined rank runs after
        the notification's allreduce."""
        self._setup_in_backward_optimizers()
        _comm_hooks.agree_on_hooks(self)
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
        first = not self._lazy_init_ran and not torch.compiler.is_compiling()
        if first:
            self._setup_in_backward_optimizers()  # refuses before anything is armed
        if self._delay_all_reduce_all_params:
            if first:
                self._lazy_init()
            return inputs, kwargs
        if torch.is_grad_enabled():
            self._parameter_watch.check(self.module, self.process_group)
            self._dropped_layers.begin_forward()
            if self.require_backward_grad_sync:
                _logging_data.sample_runtime_stats(self)  # before prepare_for_forward, as torch's logger
                if self._stragglers is not None:
                    self._stragglers.forward(self.reducer)
            # See Note [Ranks out of step] in reducer/agreement/step_check.h.
            try:
                self.reducer.prepare_for_forward(training_step=self.require_backward_grad_sync and self.module.training)
            except RuntimeError as error:
                _logging_data.record_error(self, str(error))  # torch's reducer logs its checks' errors
                raise
        work = Join.notify_join_context(self)
        if work:
            self.reducer._set_forward_pass_work_handle(work, self._divide_by_initial_world_size)
        if first:
            self._lazy_init()
        if torch.is_grad_enabled():
            # The first rebuild, at torch's point: see Note [Agreeing on the
            # bucket layout] in reducer/layout/bucket_layout.h.
            self.reducer._rebuild_buckets()
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

    _register_delay_all_reduce_hook = _delayed_all_reduce.register_delay_all_reduce_hook
    _delayed_all_reduce_hook = _delayed_all_reduce.delayed_all_reduce_hook
    _clear_grad_buffer = _delayed_all_reduce.clear_grad_buffer

    def _at_backward_start(self, learning: bool) -> Callable[[], None]:
        return at_backward_start(self.reducer, self.process_group, learning)

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

    # --- buffers: see ddp_ext/_buffers.py ------------------------------------

    broadcast_buffers = property(_buffers.get_broadcast_buffers, _buffers.set_broadcast_buffers)
    _assign_modules_buffers = _buffers.assign_modules_buffers
    will_sync_module_buffers = _buffers.will_sync_module_buffers
    _check_sync_bufs_pre_fwd = _buffers.check_sync_bufs_pre_fwd
    _check_sync_bufs_post_fwd = _buffers.check_sync_bufs_post_fwd
    _sync_buffers = _buffers.sync_buffers
    _sync_module_buffers = _buffers.sync_module_buffers
    _default_broadcast_coalesced = _buffers.default_broadcast_coalesced
    _distributed_broadcast_coalesced = _buffers.distributed_broadcast_coalesced
    _broadcast_from_rank_0 = _buffers.broadcast_from_rank_0
    _sync_module_states = _buffers.sync_module_states

    def _passing_sync_batchnorm_handle(self, module) -> None:
        for layer in module.modules():
            if isinstance(layer, nn.SyncBatchNorm) and self.device_type == "cpu":
                raise ValueError("SyncBatchNorm layers only work with GPU modules")

    # --- Join: see ddp_ext/_join.py -----------------------------------------

    join = _join.join
    join_hook = _join.join_hook
    join_device = property(_join.join_device)
    join_process_group = property(_join.join_process_group)
    _distributed_rank = property(_join.distributed_rank)
    _find_common_rank = _join.find_common_rank
    _check_global_requires_backward_grad_sync = _join.check_global_requires_backward_grad_sync
    _check_and_sync_module_buffers = _join.check_and_sync_module_buffers
    _sync_final_model = _join.sync_final_model
    _match_all_reduce_for_bwd_pass = _join.match_all_reduce_for_bwd_pass
    _match_unused_params_allreduce = _join.match_unused_params_allreduce

    # --- communication hooks: see ddp_ext/_comm_hooks.py --------------------

    register_comm_hook = _comm_hooks.register_comm_hook
    _register_builtin_comm_hook = _comm_hooks.register_builtin_comm_hook

    _register_fused_optim = _comm_hooks.register_fused_optim

    def _check_comm_hook(self, hook) -> None:
        try:
            _comm_hooks.check_comm_hook(hook)
        except (TypeError, ValueError) as error:
            _logging_data.record_error(self, f"{type(error)}: {error}")  # as _log_and_throw
            raise

    def _log_and_throw(self, err_type, err_msg):
        """torch's: records the error in _get_ddp_logging_data() (`has_error`,
        `error`), then raises it."""
        _logging_data.record_error(self, f"{err_type}: {err_msg}")
        raise err_type(err_msg)

    # --- state and configuration -----------------------------------------

    def _set_static_graph(self) -> None:
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.reducer._set_static_graph()  # refuses a LayerDrop (reducer/participation/static_graph.h)
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

    _get_ddp_logging_data = _logging_data.logging_data
    _set_ddp_runtime_logging_sample_rate = _logging_data.set_runtime_logging_sample_rate

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
            self._hang_diagnosis = _diagnosis.attach(self, settings=self._hang_settings)
            self._stragglers = _stragglers.attach(self)
            if self._auto_buckets is not None:
                self._auto_buckets.restart()

    def set_overlap_with_backward(self, overlap: bool) -> None:
        """ddp_ext only. With False, every allreduce waits until the backward pass
        has finished instead of overlapping with it; for measuring what overlap
        buys (paper Fig. 5). Call between iterations."""
        self.reducer.set_overlap_with_backward(bool(overlap))

    record_timeline = _timeline.record_timeline
    straggler_report = _stragglers.report
    watch_stragglers = _stragglers.configure

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

    @property
    def reducer_group(self) -> dist.ProcessGroup:
        """The group gradient buckets are reduced over without a hook:
        process_group, or its hierarchical twin (ddp_ext/hierarchy.py)."""
        device = self.__dict__.get("device", torch.device("cpu"))
        return hierarchy.reducer_group(self.__dict__.get("hierarchical_allreduce", False), self.process_group,
                                       device.type)

    def bucket_indices(self) -> List[List[int]]:
        """ddp_ext only. Parameter indices (among those that require grad and
        are not ignored) per bucket, in launch order."""
        return self.reducer.bucket_indices()

    @property
    def bucket_tuner(self):
        """ddp_ext only. With bucket_cap_mb="auto", the tuner's state: its
        stage, the candidate in use (`current`, an index into
        `policy.candidates_mb`) and its `history` of trials and decisions.
        None with fixed caps."""
        return None if self._auto_buckets is None else self._auto_buckets.tuner

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """torch's flag (ZeRO's DDP hooks read it): whether the buckets were
        rebuilt in the observed gradient order; true from the second
        grad-enabled forward after the first synchronising backward on, as
        with torch's DDP."""
        return self.reducer is not None and self.reducer.has_rebuilt_buckets

    # --- pickling: see ddp_ext/_pickling.py ---------------------------------

    _check_default_group = _pickling.check_default_group
    __getstate__ = _pickling.getstate
    __setstate__ = _pickling.setstate
