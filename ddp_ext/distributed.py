"""DistributedDataParallel: torch's DDP contract over ddp_ext's C++ Reducer.

The wrapper runs the forward and composes collaborators that own the rest,
each given what it needs (the reducer, the process group, the module, the
settings). torch's DDP names for their methods and state are one-line
delegates, gathered in ddp_ext/_delegated_names.py.

    _settings       Settings: the constructor arguments, resolved once
    _flags          SyncFlags: require_backward_grad_sync and the like
    _buffer_sync    BufferSync: parameter and buffer broadcasts
    _params         ReducedParameters: which parameters are reduced
    _dropped_layers DroppedLayers: LayerDrop's dropped parameters
    _tuning         CapTuning: the bucket caps and their tuner
    _hooks          CommHooks: communication hooks, the first forward's checks
    _backward_steps BackwardSteps: what steps parameters inside the backward
    _logging        LoggingData: _get_ddp_logging_data and runtime statistics
    _join           JoinShadow: uneven inputs (Join)
    _delayed        DelayedAllReduce: delay_all_reduce_named_params
    _optimizer_overlap  OptimizerOverlap: overlap_optimizer (None until called)
    _late_gradients LateGradientCheck: the warning for a second backward's gradients
"""

import contextlib
import warnings
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDistributedDataParallel

try:  # Note [Eager forwards]
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # a torch without it: every forward goes through dynamo's wrappers

    def _dynamo_callback():
        return True


from ddp_ext import _diagnosis, _exit, _mixed_precision, _parameters, _pickling, _settings
from ddp_ext._arguments import BucketCaps, check_initialized, resolve_placement
from ddp_ext._backward_steps import BackwardSteps
from ddp_ext._buffer_sync import BufferSync
from ddp_ext._cap_tuning import CapTuning
from ddp_ext._comm_hooks import CommHooks
from ddp_ext._delegated_names import DelegatedNames
from ddp_ext._diagnosis import stragglers as _stragglers
from ddp_ext._dropped_layers import DroppedLayers
from ddp_ext._join import JoinShadow
from ddp_ext._late_gradients import LateGradientCheck
from ddp_ext._logging_data import LoggingData
from ddp_ext._model_check import verify_module
from ddp_ext._output_sink import _map_tensors, at_backward_start, find_tensors, sink_outputs
from ddp_ext._parameter_watch import ParameterWatch
from ddp_ext._reducer_factory import build_reducer
from ddp_ext._sync_flags import SyncFlags
from ddp_ext._timeline import from_environment as timeline_from_environment
from ddp_ext._unsupported import UnsupportedTorchInternals


class DistributedDataParallel(UnsupportedTorchInternals, DelegatedNames, TorchDistributedDataParallel):
    """Data-parallel training across processes; a drop-in replacement for
    ``torch.nn.parallel.DistributedDataParallel`` (and an instance of it).

    Arguments, defaults and methods are torch 2.13's. At construction every
    rank's model is checked to be the same and rank 0's parameters and
    buffers are broadcast; during backward, gradients are averaged across
    ranks by ddp_ext's C++ Reducer, bucket by bucket while the backward pass
    runs. ``state_dict()`` has the same keys as torch's DDP
    (``module.<name>``). ``mixed_precision`` casts parameters for the forward
    and backward only; see ddp_ext/_mixed_precision.py.

    ``static_graph=True`` learns the used parameters in the first iteration
    (then supports reentrant activation checkpointing) and takes precedence
    over ``find_unused_parameters``.

    ddp_ext's additions (keyword only unless said; docs/TORCH_CONTRACT.md):

    - ``rebuild_buckets``: when buckets are laid out again in gradient order:
      ``"once"`` (torch's), ``"continuous"`` (default: also later, when every
      rank agrees the order costs overlap) or ``"never"``.
    - ``bucket_cap_mb="auto"`` (positional too): tunes the bucket caps while
      training (docs/AUTO_BUCKETS.md).
    - ``hang_timeout_s``, ``on_hang``: a wait that cannot end raises within
      seconds, naming the lagging or dead ranks, the step and the parameters
      without a gradient; one merely long is reported (docs/DIAGNOSIS.md).
    - ``hierarchical_allreduce`` (default ``"auto"``): reduces inside each
      host, then across hosts, where ranks share hosts (docs/HIERARCHY.md).
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
        # Not torch's DDP __init__: it would build torch's reducer (ddp_ext/_unsupported.py).
        nn.Module.__init__(self)
        Joinable.__init__(self)
        settings, process_group, delayed_named = _settings.resolve(
            module, delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, check_reduction=check_reduction,
            broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers,
            find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy, device_ids=device_ids, mixed_precision=mixed_precision,
            process_group=process_group, device_mesh=device_mesh, bucket_cap_mb=bucket_cap_mb,
            bucket_cap_mb_list=bucket_cap_mb_list, rebuild_buckets=rebuild_buckets, hang_timeout_s=hang_timeout_s,
            on_hang=on_hang, hierarchical_allreduce=hierarchical_allreduce, dim=dim,
        )
        if device_mesh is not None:
            self.device_mesh = device_mesh
        ignored = settings.parameters_to_ignore
        delayed_params = [param for _, param in delayed_named]
        self._module_parameters = [p for n, p in module.named_parameters() if n not in ignored]
        self._params = _parameters.ReducedParameters(module, ignored)
        named_params = self._params.named(module)
        check_initialized(named_params)
        agreed_number = None  # see _diagnosis.store_key
        if init_sync:
            # First of all, so that a rank with a different model (even one with
            # nothing to train) makes every rank raise the same error.
            agreed_number = verify_module(
                process_group, module, named_params, ignored, settings.buffer_sync.at_init,
                settings.to_agree(static_graph), number=_diagnosis.proposed_number(process_group),
            )
        if not named_params and not delayed_params:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        settings = settings.placed(resolve_placement(self._module_parameters, delayed_params, device_ids,
                                                     output_device))
        self._settings = settings
        self._passing_sync_batchnorm_handle(module)
        self.module = module
        self.process_group = process_group
        _exit.track(process_group)  # Note [Exit after training]
        self._flags = SyncFlags()
        self._use_python_reducer = False
        self._static_graph_delay_allreduce_enqueued = False
        self._ddp_sink_clone = True
        self._buffer_sync = BufferSync(module, ignored, self.device, self._flags, settings.buffer_sync.forward,
                                       process_group)
        if init_sync:
            self._sync_module_states(authoritative_rank=0, include_buffers=settings.buffer_sync.at_init)
        if mixed_precision is not None:
            _mixed_precision.cast_buffers(mixed_precision, module, ignored)
        self._delay_all_reduce_params = delayed_params
        self._delayed = None
        if delayed_params:
            self._register_delay_all_reduce_hook(bucket_cap_mb, param_to_hook_all_reduce, self.device_ids)
        self._delay_all_reduce_all_params = not named_params
        self._dropped_layers = DroppedLayers(module, [p for _, p in named_params])
        self._layer_drop = bool(self._dropped_layers)  # read on every forward
        if self._layer_drop and init_sync:
            self._dropped_layers.agree_with_rank_0(self._broadcast_from_rank_0)
        self.reducer = None if self._delay_all_reduce_all_params else self._build_reducer(settings.caps, static_graph)
        self._compose(_diagnosis.store_key(process_group, agreed_number))
        if static_graph:
            self._set_static_graph()
        timeline = timeline_from_environment()
        if timeline is not None:
            self.record_timeline(*timeline)

    # --- construction -----------------------------------------------------

    def _compose(self, store_key: Optional[str]) -> None:
        """The collaborators that use the reducer (see the module docstring)."""
        reducer, group, device, settings = self.reducer, self.process_group, self.device, self._settings
        self._tuning = CapTuning(reducer, group, device, settings.caps)
        self._logging = LoggingData(reducer, group, self.module, self._module_parameters, settings, self._flags,
                                    self._buffer_sync, self._tuning)
        self._backward_steps = BackwardSteps(reducer, group, self.module, self._module_parameters,
                                             self._params.named(self.module), settings.mixed_precision)
        self._hooks = CommHooks(reducer, group, device, self._logging, self._tuning, self._backward_steps)
        self._join = JoinShadow(reducer, group, self.module, device, self._flags, self._buffer_sync,
                                self._dropped_layers, self._hooks, self._tuning, settings.find_unused_parameters)
        self._attach_watchers(store_key)
        self._parameter_watch = ParameterWatch(self.module, self.parameters_to_ignore)
        self._late_gradients = LateGradientCheck([name for name, _ in self._params.named(self.module)])
        self._recording = None  # a Timeline, see record_timeline

    def _bind(self) -> None:
        """Points every collaborator at the reducer and process group in use."""
        for part in (self._buffer_sync, self._tuning, self._logging, self._hooks, self._join, self._backward_steps):
            part.bind(self.reducer, self.process_group)

    def _attach_watchers(self, store_key: Optional[str] = None) -> None:
        """Hang diagnosis and straggler reports over the group in use (a new
        store key without `store_key`)."""
        self._store_key = store_key if store_key is not None else _diagnosis.store_key(self.process_group)
        self._hang_diagnosis = _diagnosis.attach(self.reducer, self.process_group, self._store_key,
                                                 self.device_type, settings=self._settings.hang)
        self._hooks.store_key = self._store_key
        self._stragglers = _stragglers.attach(self.reducer, self.process_group)

    def _build_reducer(self, caps: BucketCaps, static_graph: bool):
        return build_reducer(self._params.named(self.module), self._params.with_sparse_gradients(), self._settings,
                             caps, static_graph, self.process_group, self.reducer_group, self._dropped_layers.units,
                             buffers_broadcast=self._buffer_sync.forward and len(self._buffer_sync.modules_buffers) > 0)

    # Note [torch.compile]
    # As with torch's DDP, the wrapper's forward runs eagerly and only the
    # wrapped module is compiled, under torch.compile(ddp) as well as in
    # DDP(torch.compile(module)). Dynamo skips the frames of forward and
    # _run_ddp_forward but not what they call (recursive=False), so the
    # module's forward is compiled while _run_ddp_forward has set the active
    # DDP module (torch's _inside_ddp_forward, written out), and DDPOptimizer
    # splits the graph at our bucket_bytes_cap. _pre_forward and
    # _post_forward, with everything they call (reducer, Join, buffer
    # broadcasts, the output sink), are never traced: traced, each reducer
    # call broke the graph, and guards on the sink's outputs recompiled every
    # step. forward and _run_ddp_forward read
    # plain attributes only: a property's getter is a frame dynamo would
    # compile. torch._disable_dynamo is the lazy torch.compiler.disable
    # torch's DDP uses: dynamo is imported at the first forward, not at
    # `import ddp_ext`. tests/frameworks/test_compile.py checks graph,
    # graph-break and recompile counts against torch's DDP, and that no frame
    # of ddp_ext is compiled. Each such wrapper costs a few Python calls per
    # forward, so the forward goes through as few as it can (four; torch's
    # DDP, whose files dynamo skips, needs one), and none when nothing
    # compiles (Note [Eager forwards]): tests/wrapper/
    # test_python_calls_per_step.py counts the rest against torch's DDP.
    #
    # Note [Eager forwards]
    # ~~~~~~~~~~~~~~~~~~~~~
    # Dynamo's wrappers matter only while its frame callback is set on this
    # thread: under torch.compile, and in what a compiled frame calls. Without
    # it no frame is traced, and the wrappers only cost time: a recursive one
    # swaps the frame callback three times per call, together some
    # microseconds of a forward whose whole iteration, on a small model, is
    # a millisecond. So forward asks for the callback (one C call) and,
    # without one, calls the undecorated bodies (the *_eager methods); with
    # one, the wrapped methods above. test_compile.py fails if the eager
    # bodies run under torch.compile.
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        timeline = self._recording  # plain attributes only here: see the Note
        if timeline is not None and not timeline.recording:
            timeline = None
        if timeline is not None:
            timeline.forward_begin()
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            if _dynamo_callback() is None:  # See Note [Eager forwards].
                pre, run, post = self._pre_forward_eager, self._run_ddp_forward_eager, self._post_forward_eager
            else:
                pre, run, post = self._pre_forward, self._run_ddp_forward, self._post_forward
            inputs, kwargs = pre(*inputs, **kwargs)
            output = (self.module if self._delay_all_reduce_all_params else run)(*inputs, **kwargs)
            output = post(output)
        if timeline is not None:
            timeline.forward_end()
        return output

    def _pre_forward_eager(self, *inputs, **kwargs):
        first = not self._hooks.first_forward_done and not torch.compiler.is_compiling()
        if self._optimizer_overlap is not None:
            self._optimizer_overlap.forward_begins(self.module)  # Note [Stepping in the next forward]
        if first:
            self._setup_in_backward_optimizers()  # before anything is armed
        if self._delay_all_reduce_all_params:
            if first:
                self._lazy_init()
            return inputs, kwargs
        # Hot path: the collaborators' fields, not torch's names for them (each
        # of those is a call), and nothing for a model without a LayerDrop.
        flags, module = self._flags, self.module
        if torch.is_grad_enabled():
            if self.reducer._has_late_gradients:  # Note [Late gradients] in reducer/core/late_gradients.h
                self._late_gradients.warn_once(self.reducer, self.process_group.rank())
            self._parameter_watch.check(module, self.process_group)
            if self._layer_drop:
                self._dropped_layers.begin_forward()
            if flags.backward:
                self._logging.sample()  # before prepare_for_forward, as torch's logger
                if self._stragglers is not None:
                    self._stragglers.forward(self.reducer)
            # See Note [Ranks out of step] in reducer/agreement/step_check.h.
            try:
                self.reducer.prepare_for_forward(training_step=flags.backward and module.training)
            except RuntimeError as error:
                self._logging.record_error(str(error))  # torch's reducer logs its checks' errors
                raise
        work = Join.notify_join_context(self)
        if work:
            self.reducer._set_forward_pass_work_handle(work, self._divide_by_initial_world_size)
        if first:
            # The hook agreement is a collective: after Join's notification,
            # where a joined rank's Join hook runs it.
            self._lazy_init()
        if torch.is_grad_enabled():
            # The first rebuild, at torch's point: see Note [Agreeing on the
            # bucket layout] in reducer/layout/bucket_layout.h.
            self.reducer._rebuild_buckets()
        if self._buffer_sync.sync_before_forward():
            self.reducer._check_step_before_forward_collectives()
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if torch.is_grad_enabled():
            # Training steps only, as the step check counts them (Note [Ranks out of step]).
            self._tuning.forward(synchronising=flags.backward and module.training)
        placement = self._settings.placement
        if placement.device_ids:
            device = torch.device(placement.device_type, placement.device_ids[0])
            inputs, kwargs = _map_tensors((inputs, kwargs), lambda t: t.to(device, non_blocking=True))
        return inputs, kwargs

    _pre_forward = torch._disable_dynamo(_pre_forward_eager)

    def _run_ddp_forward_eager(self, *inputs, **kwargs):
        settings = self._settings  # not the properties of torch's names: see the Note
        # What _inside_ddp_forward does, without a generator and a context
        # manager on every forward.
        previous = TorchDistributedDataParallel._active_ddp_module
        TorchDistributedDataParallel._active_ddp_module = self
        try:
            if settings.mixed_precision is not None:
                return _mixed_precision.run_forward(
                    settings.mixed_precision, self.module, settings.parameters_to_ignore, inputs, kwargs
                )
            return self.module(*inputs, **kwargs)
        finally:
            TorchDistributedDataParallel._active_ddp_module = previous

    _run_ddp_forward = torch._disable_dynamo(_run_ddp_forward_eager, recursive=False)

    def _post_forward_eager(self, output):
        if self._delay_all_reduce_all_params:
            self._clear_grad_buffer()
            return output
        flags = self._flags  # see _pre_forward
        grad_enabled = torch.is_grad_enabled()
        if self._optimizer_overlap is not None:  # Note [Stepping in the next forward]
            self._optimizer_overlap.forward_done(grad_enabled and flags.backward)
        search_unused = self._settings.find_unused_parameters and not flags.static_graph
        learning = False
        if grad_enabled and self._layer_drop:
            self._dropped_layers.end_forward()
        if grad_enabled and flags.backward:
            # Buffers are broadcast again only before the forward that follows a
            # synchronising one (paper section 4.1).
            flags.forward_buffers = True
            dropped, accumulated_only = self._dropped_layers.take_dropped() if self._layer_drop else ([], [])
            self.reducer.prepare_for_backward(find_tensors(output) if search_unused else [], dropped, accumulated_only)
            learning = self.reducer.learning_static_graph
        else:
            flags.forward_buffers = False
            if grad_enabled:
                # Inside no_sync: whatever the last forward expected, the next
                # backward only accumulates.
                self.reducer.prepare_for_local_backward()
        if learning:
            self._static_graph_delay_allreduce_enqueued = True
        if learning or (search_unused and grad_enabled):
            output = sink_outputs(output, on_backward=at_backward_start(self.reducer, self.process_group, learning),
                                  clone=self._ddp_sink_clone)
        self._clear_grad_buffer()
        return output

    _post_forward = torch._disable_dynamo(_post_forward_eager)

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

    # --- state and configuration -----------------------------------------

    def _set_static_graph(self) -> None:
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.reducer._set_static_graph()  # refuses a LayerDrop (reducer/participation/static_graph.h)
        self._flags.static_graph = True
        self._static_graph_delay_allreduce_enqueued = False
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
                "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be "
                "sure these unused parameters will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    def _update_process_group(self, new_process_group) -> None:
        """Reduce over `new_process_group` from now on (shrinking or growing
        the world without re-wrapping). Communication hooks keep the groups
        they were given."""
        if not dist.distributed_c10d._rank_not_in_group(new_process_group):
            self._backward_steps.check_regroup()  # before anything changes
            self.process_group = new_process_group
            if self.reducer is not None:  # None when every parameter's allreduce is delayed
                self.reducer._update_process_group(new_process_group)
            if self._delayed is not None:
                self._delayed.rebind(new_process_group)
            self._bind()
            self._attach_watchers()
            self._tuning.restart()

    # --- pickling: see ddp_ext/_pickling.py ---------------------------------

    def __getstate__(self) -> dict:
        self._check_default_group()
        _pickling.check_no_delayed_params(self._delay_all_reduce_params)
        return _pickling.picklable(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.process_group = dist.distributed_c10d._get_default_group()
        nn.Module.__setstate__(self, state)
        self._delayed = None
        self.reducer = (None if self._delay_all_reduce_all_params
                        else self._build_reducer(self._tuning.requested, self.static_graph))
        self._bind()
        self._tuning.restart()  # the copy times its own iterations
        self._attach_watchers()
        self._parameter_watch = ParameterWatch(self.module, self.parameters_to_ignore)
        self._recording = None
        if self.static_graph:
            self.reducer._set_static_graph()
