"""The wrapper's names that belong to one of its collaborators: torch's DDP
method and attribute names (which frameworks, torch's hooks, Join and ZeRO
call on a DDP), and ddp_ext's own. Each is a one-line delegate to the
collaborator that owns it (listed in ddp_ext/distributed.py), or one of
torch's few methods that need no state of their own (scatter, gather,
train). A mixin of DistributedDataParallel only."""

import contextlib
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDistributedDataParallel
from torch.nn.parallel.scatter_gather import gather as _gather, scatter_kwargs as _scatter_kwargs

from ddp_ext import _forward_tail, _parameters, _pickling, _shard_admission, _sharded_optimizer, hierarchy
from ddp_ext._buffer_sync import BROADCAST_CHUNK_BYTES
from ddp_ext._comm_hooks import register_fused_optim
from ddp_ext._delayed_all_reduce import DelayedAllReduce
from ddp_ext._delegates import delegate, field
from ddp_ext._diagnosis import stragglers as _stragglers
from ddp_ext._output_sink import _map_tensors
from ddp_ext._timeline import Timeline, record_timeline


class DelegatedNames:
    # --- settings (ddp_ext/_settings.py) and flags (ddp_ext/_sync_flags.py) ---

    dim = field("_settings", "dim")
    find_unused_parameters = field("_settings", "find_unused_parameters")
    gradient_as_bucket_view = field("_settings", "gradient_as_bucket_view")
    skip_all_reduce_unused_params = field("_settings", "skip_all_reduce_unused_params")
    batched_grad_copy = field("_settings", "batched_grad_copy")
    rebuild_buckets = field("_settings", "rebuild_buckets")
    hierarchical_allreduce = field("_settings", "hierarchical_allreduce")  # ddp_ext/hierarchy.py
    mixed_precision = field("_settings", "mixed_precision")
    parameters_to_ignore = field("_settings", "parameters_to_ignore")
    _hang_settings = field("_settings", "hang")
    device = field("_settings", "device")
    device_type = field("_settings.placement", "device_type")
    device_ids = field("_settings.placement", "device_ids")
    output_device = field("_settings.placement", "output_device")
    require_backward_grad_sync = field("_flags", "backward", settable=True)
    require_forward_param_sync = field("_flags", "forward_buffers", settable=True)
    static_graph = field("_flags", "static_graph")

    @property
    def is_multi_device_module(self) -> bool:
        return len(self._settings.placement.devices) > 1

    def _passing_sync_batchnorm_handle(self, module) -> None:
        for layer in module.modules():
            if isinstance(layer, nn.SyncBatchNorm) and self.device_type == "cpu":
                raise ValueError("SyncBatchNorm layers only work with GPU modules")

    # --- the forward's helpers ---------------------------------------------

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
    @torch._disable_dynamo(recursive=False)
    def _inside_ddp_forward(self):
        previous = TorchDistributedDataParallel._active_ddp_module
        TorchDistributedDataParallel._active_ddp_module = self
        try:
            yield
        finally:
            TorchDistributedDataParallel._active_ddp_module = previous

    @classmethod
    def _get_active_ddp_module(cls):
        """The DDP module whose forward is running (torch.compile's DDPOptimizer
        reads it; torch's class attribute, shared with torch's DDP)."""
        return TorchDistributedDataParallel._active_ddp_module

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether outputs routed through the output sink are cloned (True by
        default; False saves memory when outputs are never modified in place)."""
        self._ddp_sink_clone = bool(val)

    # --- parameters: ddp_ext/_parameters.py ---------------------------------

    _named_params_for_reducer = delegate("_params", "named")
    _parameters_with_sparse_gradients = delegate("_params", "with_sparse_gradients")
    _build_debug_param_to_name_mapping = delegate("_params", "debug_names")
    _get_parameters = staticmethod(_parameters.get_parameters)
    _get_data_parallel_params = staticmethod(_parameters.get_data_parallel_params)
    _set_params_and_buffers_to_ignore_for_model = staticmethod(_parameters.set_params_and_buffers_to_ignore_for_model)

    def _build_params_for_reducer(self):
        self._buffer_sync.assign()
        return self._params.with_sparsity()

    # --- buffers: ddp_ext/_buffer_sync.py -----------------------------------

    broadcast_buffers = field("_buffer_sync", "forward", settable=True)
    forward_sync_buffers = field("_buffer_sync", "forward", settable=True)
    broadcast_bucket_size = field("_buffer_sync", "chunk_bytes", settable=True)
    modules_buffers = field("_buffer_sync", "modules_buffers")
    named_module_buffers = field("_buffer_sync", "named_module_buffers")
    _assign_modules_buffers = delegate("_buffer_sync", "assign")
    will_sync_module_buffers = delegate("_buffer_sync", "will_sync")
    _check_sync_bufs_pre_fwd = delegate("_buffer_sync", "sync_before_forward")
    _check_sync_bufs_post_fwd = delegate("_buffer_sync", "sync_after_forward")
    _sync_module_buffers = delegate("_buffer_sync", "sync_module_buffers")
    _default_broadcast_coalesced = delegate("_buffer_sync", "default_broadcast_coalesced")
    _distributed_broadcast_coalesced = delegate("_buffer_sync", "broadcast")
    _broadcast_from_rank_0 = delegate("_buffer_sync", "broadcast_from_rank_0")
    _sync_module_states = delegate("_buffer_sync", "sync_module_states")

    def _sync_buffers(self) -> None:
        self._buffer_sync.sync(self._join.buffer_source(self._join_config.enable))

    # --- Join: ddp_ext/_join.py ---------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Context manager for uneven inputs: ranks that run out of data
        shadow the collectives of those that have not (ddp_ext/_join.py)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        if isinstance(self._optimizer_overlap, _sharded_optimizer.ShardedOptimizer):
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.process_group.rank()} cannot join uneven inputs with "
                "overlap_optimizer(..., shard=True): a joined rank would shadow each bucket's reduce-scatter with an "
                "allreduce. Use Join without shard=True.")
        if self._optimizer_overlap is not None and self._optimizer_overlap.overlaps_forward:
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.process_group.rank()} cannot join uneven inputs with "
                "overlap_optimizer(..., overlap_forward=True): a joined rank shadows the buckets in the plain "
                "order, and the overlap launches the first layers' first. Use overlap_forward=False with Join.")
        return self._join.hook(**kwargs)
    join_device = field("_settings", "device")
    join_process_group = property(lambda self: self.process_group)
    _distributed_rank = field("_join", "rank")
    _authoritative_rank = field("_join", "authoritative_rank")
    _divide_by_initial_world_size = field("_join", "divide_by_initial_world_size", settable=True)
    _find_common_rank = delegate("_join", "find_common_rank")
    _check_global_requires_backward_grad_sync = delegate("_join", "check_global_requires_backward_grad_sync")
    _check_and_sync_module_buffers = delegate("_join", "check_and_sync_module_buffers")
    _sync_final_model = delegate("_join", "sync_final_model")
    _match_all_reduce_for_bwd_pass = delegate("_join", "match_all_reduce_for_bwd_pass")
    _match_unused_params_allreduce = delegate("_join", "match_unused_params_allreduce")

    # --- communication hooks: ddp_ext/_comm_hooks.py ------------------------

    register_comm_hook = delegate("_hooks", "register")
    _register_builtin_comm_hook = delegate("_hooks", "register_builtin")
    _check_comm_hook = delegate("_hooks", "check")
    _comm_hooks = field("_hooks", "registered")
    _lazy_init = delegate("_hooks", "first_forward")
    _lazy_init_ran = field("_hooks", "first_forward_done")

    # --- what steps parameters inside the backward: ddp_ext/_backward_steps.py ---

    _refuse_backward_steps = delegate("_backward_steps", "refuse")

    def _setup_in_backward_optimizers(self) -> None:
        """torch's name: optimizers applied in backward step from the reduced
        buckets (Note [Optimizers applied in backward] in ddp_ext/_backward_steps.py)."""
        self._backward_steps.setup_in_backward_optimizers(self._hooks.registered)
        self._backward_steps.check_no_optimizer_in_backward()

    def _register_fused_optim(self, optim: type, *args, optim_params=None, **kwargs) -> None:
        """Steps `optim` on each bucket as soon as it is reduced (torch's overlapped optimizers)."""
        register_fused_optim(self, optim, *args, optim_params=optim_params, **kwargs)

    # --- the optimizer overlapped with communication: ddp_ext/_optimizer_overlap.py ---

    _optimizer_overlap = None  # an OptimizerOverlap once overlap_optimizer is called

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, overlap_forward=False, shard: bool = False,
                          shard_min_bytes: int = _shard_admission.SHARD_MIN_BYTES) -> None:
        """ddp_ext only. From the next backward on, each bucket's parameters are
        stepped by `optimizer` as soon as the bucket is reduced, while later
        buckets are still being reduced; `optimizer.step()` then steps only
        the parameters the backward did not. With `overlap_forward` (True, or
        the fraction of gradient bytes to hold), the first layers' buckets
        go on the wire first, at the end of the backward, which returns
        without waiting for them; their parameters are stepped when the next
        forward first reads them. Results are bitwise those of a plain
        `optimizer.step()` after backward. Call between iterations, once. See
        docs/OPTIMIZER_OVERLAP.md. With `shard=True` the optimizer is sharded
        across the ranks instead (ZeRO-2): each bucket is reduce-scattered,
        `optimizer.step()` steps the rank's shard and all-gathers the
        parameters, and the optimizer's state exists for the shard only;
        with `overlap_forward=True` as well, the step returns without waiting
        for the all-gathers, and what reads a parameter (the next forward,
        first layers first) waits for its bucket. A bucket of fewer than
        `shard_min_bytes` bytes (default 64 KiB; 0 shards every bucket) is
        allreduced and stepped whole on every rank instead, its state
        replicated. See docs/SHARDING.md."""
        if shard:
            refusal = _shard_admission.settings_refusal(
                self.module, self._backward_steps.named, [name for name, _ in self._hooks.registered],
                self._layer_drop, overlap_forward, self.process_group)
            sharded = self._backward_steps.shard_optimizer(optimizer, refusal, self._settings.device, overlap_forward,
                                                           shard_min_bytes, self.reducer_group)
            self._optimizer_overlap = sharded
            return
        refusal = _forward_tail.refusal(self._module_parameters, self._settings.gradient_as_bucket_view,
                                        self._layer_drop, bool(self._hooks.registered))
        self._optimizer_overlap = self._backward_steps.overlap_optimizer(optimizer, overlap_forward, refusal)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """ddp_ext only. After backward, before optimizer.step(): clips the
        averaged gradients by their total norm, as torch.nn.utils.clip_grad_norm_
        over the module's parameters does. With overlap_optimizer(...,
        shard=True) each rank clips its shard by the norm of the whole
        gradient (one scalar all-reduce; docs/SHARDING.md). Returns the norm."""
        sharded = self._optimizer_overlap
        if isinstance(sharded, _sharded_optimizer.ShardedOptimizer):
            return sharded.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type, error_if_nonfinite)

    def sharded_optimizer_state_dict(self) -> dict:
        """ddp_ext only. With overlap_optimizer(..., shard=True), after a step:
        this rank's shard of the optimizer's state, as torch.distributed.checkpoint
        saves it without gathering (dcp.save({"optimizer": ...})); a collective,
        on every rank. See docs/SHARDING.md."""
        from ddp_ext import _sharded_checkpoint  # torch.distributed.checkpoint, imported when used

        return _sharded_checkpoint.state_dict(self._sharded_or_refuse("sharded_optimizer_state_dict()"))

    def load_sharded_optimizer_state_dict(self, checkpoint_id, key: str = "optimizer", storage_reader=None) -> None:
        """ddp_ext only. Reads what sharded_optimizer_state_dict() saved under
        `key` (a collective, on every rank); the state takes its place at the
        next optimizer.step(). See docs/SHARDING.md."""
        from ddp_ext import _sharded_checkpoint  # torch.distributed.checkpoint, imported when used

        _sharded_checkpoint.load(self._sharded_or_refuse("load_sharded_optimizer_state_dict()"), checkpoint_id,
                                 key, storage_reader)

    def _sharded_or_refuse(self, what: str):
        if not isinstance(self._optimizer_overlap, _sharded_optimizer.ShardedOptimizer):
            raise RuntimeError(f"DistributedDataParallel on rank {self.process_group.rank()}: {what} is for a sharded "
                               "optimizer: call ddp.overlap_optimizer(optimizer, shard=True) first.")
        return self._optimizer_overlap

    def finish_forward_tail(self) -> None:
        """ddp_ext only. With overlap_optimizer(..., overlap_forward=True):
        waits for the buckets the last backward left on the wire and applies
        their steps (reads of the parameters do this themselves on the
        thread that made the line; call this before reading them on another)."""
        if self._optimizer_overlap is not None:
            self._optimizer_overlap.finish_forward_tail()

    # --- delay_all_reduce_named_params: ddp_ext/_delayed_all_reduce.py ------

    def _register_delay_all_reduce_hook(self, bucket_cap_mb, param_to_hook_all_reduce, device_ids) -> None:
        names = {id(p): name for name, p in self.module.named_parameters()}
        self._delayed = DelayedAllReduce(self._delay_all_reduce_params,
                                         [names.get(id(p), "?") for p in self._delay_all_reduce_params],
                                         param_to_hook_all_reduce, self.process_group, BROADCAST_CHUNK_BYTES)

    _delayed_all_reduce_hook = delegate("_delayed", "start")

    def _clear_grad_buffer(self) -> None:
        if self._delayed is not None:
            self._delayed.point_grads_at_buffer()

    # --- logging data: ddp_ext/_logging_data.py -----------------------------

    _get_ddp_logging_data = delegate("_logging", "data")
    _set_ddp_runtime_logging_sample_rate = delegate("_logging", "set_sample_rate")
    _runtime_logging_sample_rate = field("_logging", "sample_rate")
    _log_and_throw = delegate("_logging", "log_and_throw")

    # --- bucket caps: ddp_ext/_cap_tuning.py --------------------------------

    _bucket_caps_bytes = field("_tuning", "caps_bytes")
    _auto_buckets = field("_tuning", "auto", settable=True)

    @property
    def bucket_bytes_cap(self) -> int:
        """torch's attribute: the largest bucket cap in use, in bytes."""
        return max(self._tuning.caps_bytes)

    @property
    def bucket_bytes_cap_list(self) -> List[int]:
        """torch's attribute: the caps of bucket_cap_mb_list in bytes, [] without one."""
        return self._tuning.caps_bytes if self._settings.caps.custom_list else []

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """torch's attribute: neither bucket_cap_mb nor bucket_cap_mb_list was given."""
        return self._settings.caps.default

    @property
    def bucket_tuner(self):
        """ddp_ext only. With bucket_cap_mb="auto", the tuner's state: its
        phase, the candidate in use (`current`, an index into
        `policy.candidates_mb`) and its `history` of trials and decisions.
        None with fixed caps."""
        return None if self._auto_buckets is None else self._auto_buckets.tuner

    # --- the reducer ------------------------------------------------------

    _remove_autograd_hooks = delegate("reducer", "_remove_autograd_hooks")
    _check_reducer_finalized = delegate("reducer", "_check_reducer_finalized")

    def bucket_indices(self) -> List[List[int]]:
        """ddp_ext only. Parameter indices (among those that require grad and
        are not ignored) per bucket, in launch order."""
        return self.reducer.bucket_indices()

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """torch's flag (ZeRO's DDP hooks read it): whether the buckets were
        rebuilt in the observed gradient order; true from the second
        grad-enabled forward after the first synchronising backward on, as
        with torch's DDP."""
        return self.reducer is not None and self.reducer.has_rebuilt_buckets

    @property
    def reducer_group(self) -> dist.ProcessGroup:
        """The group gradient buckets are reduced over without a hook:
        process_group, or its hierarchical twin (ddp_ext/hierarchy.py); the
        process group while the optimizer is sharded (Note [Sharding over
        several hosts] in ddp_ext/_sharded_optimizer.py)."""
        if isinstance(self._optimizer_overlap, _sharded_optimizer.ShardedOptimizer):
            return self.process_group
        return hierarchy.reducer_group(self.hierarchical_allreduce, self.process_group, self.device_type)

    def set_overlap_with_backward(self, overlap: bool) -> None:
        """ddp_ext only. With False, every allreduce waits until the backward pass
        has finished instead of overlapping with it; for measuring what overlap
        buys (paper Fig. 5). Call between iterations."""
        self.reducer.set_overlap_with_backward(bool(overlap))

    # --- timeline: ddp_ext/_timeline.py -------------------------------------

    def record_timeline(self, directory: str, iterations: Optional[int] = None) -> Timeline:
        """ddp_ext only: see ddp_ext/_timeline.py, record_timeline."""
        names = [n for n, _ in self._params.named(self.module)]
        self._recording = record_timeline(self._timeline, self.process_group.rank(), self.reducer, names,
                                          directory, iterations)
        return self._recording

    @property
    def _timeline(self) -> Optional[Timeline]:
        """The timeline being recorded, if any."""
        recording = self.__dict__.get("_recording")
        return recording if recording is not None and recording.recording else None

    # --- diagnosis: ddp_ext/_diagnosis/stragglers.py -------------------------

    def straggler_report(self) -> Optional[dict]:
        """ddp_ext only: see ddp_ext/_diagnosis/stragglers.py, Stragglers.report_now;
        None in a world of one."""
        watch = self._stragglers
        return None if watch is None else watch.report_now(self.reducer)

    def watch_stragglers(self, every: int = _stragglers.DEFAULT_EVERY, margin: float = 0.3,
                         min_excess_ms: float = 5.0, persist: int = 3) -> None:
        """ddp_ext only: see ddp_ext/_diagnosis/stragglers.py, Stragglers.configure."""
        watch = self._stragglers
        if watch is None:
            raise RuntimeError("straggler reports need more than one rank")
        watch.configure(self.reducer, every, margin, min_excess_ms, persist)

    # --- pickling: ddp_ext/_pickling.py -------------------------------------

    def _check_default_group(self) -> None:
        _pickling.check_default_group(self.process_group)
