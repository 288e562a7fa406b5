"""Uneven inputs: the Join hook of ddp_ext's DistributedDataParallel, and
JoinShadow, the wrapper's Join side (under torch's DDP names there).

A rank that runs out of data leaves its training loop and enters the Join
context's shadow loop, which calls `main_hook` (JoinShadow.shadow_iteration)
once for every iteration that the other ranks still run. It issues, in the
same order, every collective those ranks' forward and backward issue:

0. once, after the first synchronising backward, the broadcast of rank 0's
   gradient order for the first bucket rebuild (Note [Agreeing on the bucket
   layout] in reducer/layout/bucket_layout.h), as torch's join hook does
   through `_rebuild_buckets`; the joined rank receives the order and
   rebuilds as its peers do. A rank that joined before any backward has no
   order of its own; it learns that the first rebuild is due by shadowing a
   synchronising backward (`_push_all_rebuilt_params`, as torch's). If it is
   rank 0 it sends its current layout's order (with torch's first buckets,
   registration order within each dtype, as torch's joined rank 0 sends;
   see Note [Gradient order prediction]),
1. the buffer broadcast of a synchronising forward (after agreeing on the
   rank to broadcast from),
2. the allreduce telling joined ranks whether this iteration synchronises
   gradients, and with bucket_cap_mb="auto" the tuner's agreement when one
   falls due (Note [Auto-tuned bucket caps] in ddp_ext/_auto_buckets.py;
   the joined rank re-lays its buckets as its peers do),
3. the step check of the backward (see Note [Ranks out of step] in
   reducer/agreement/step_check.h), as a rank with no step; it carries the vote on
   later (continuous) rebuilds (Note [Gradient order prediction] in
   reducer/layout/gradient_order.h), where a rank that joined votes no, so no
   continuous rebuild happens while a rank has joined,
4. one reduction per bucket, of zeros, through the same communication hook,
   except the buckets of layers that LayerDrop dropped on every rank (the
   plans the peers drew are drawn here too; see Note [Layer dropping] in
   reducer/participation/layer_drop.h),
5. the unused-parameter bitmap allreduce, with find_unused_parameters.

When every rank has joined, `post_hook` broadcasts the final model from the
last rank to join. See Note [Join and the divide factor] in
reducer/base/averaging.h for how the ranks with data average.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ddp_ext import _collectives
from ddp_ext._bound import Bound


class DistributedDataParallelJoinHook(JoinHook):
    """torch's JoinHook interface over the wrapper's JoinShadow."""

    def __init__(self, shadow: "JoinShadow", divide_by_initial_world_size: bool):
        self.shadow = shadow
        shadow.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.shadow.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.shadow.sync_final_model(is_last_joiner)


class JoinShadow(Bound):
    """Issues, on a rank that joined, the collectives its peers' iterations
    issue (see above). Owns the Join state torch's DDP keeps:
    `divide_by_initial_world_size` and `authoritative_rank`."""

    def __init__(self, reducer, group, module, device, flags, buffers, dropped_layers, hooks, tuning,
                 find_unused_parameters):
        self.module = module
        self.device = device
        self.flags = flags  # SyncFlags
        self.buffers = buffers  # BufferSync
        self.dropped_layers = dropped_layers  # DroppedLayers
        self.hooks = hooks  # CommHooks: the first forward's checks
        self.tuning = tuning  # CapTuning
        self.find_unused_parameters = find_unused_parameters
        self.divide_by_initial_world_size = True
        self.authoritative_rank = None  # the last rank to join, once all have
        self.bind(reducer, group)

    def hook(self, **kwargs) -> DistributedDataParallelJoinHook:
        return DistributedDataParallelJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    def shadow_iteration(self) -> None:
        """One iteration of the peers, on a rank that joined (points 0 to 5)."""
        if not self.hooks.first_forward_done:  # the peers' first forward checks their hooks
            self.hooks.first_forward()
        # Point 0: the peers' forward rebuilds here (once), after Join's notification.
        self.reducer._rebuild_buckets()
        # The peers' forward draws LayerDrop plans; draw the same ones.
        self.dropped_layers.simulate_forward()
        self.check_and_sync_module_buffers()
        should_sync = self.check_global_requires_backward_grad_sync(is_joined_rank=True)
        # The next forward syncs buffers only after a synchronising one.
        self.flags.forward_buffers = should_sync
        self.tuning.forward(synchronising=should_sync and self.module.training)
        if not should_sync:
            return
        self.match_all_reduce_for_bwd_pass()
        if self.find_unused_parameters and not self.flags.static_graph:
            self.match_unused_params_allreduce()

    @property
    def rank(self) -> int:
        return self.process_group.rank()

    def find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        """The highest rank for which `rank_cond` holds, agreed by every rank."""
        candidate = torch.tensor([input_rank if rank_cond else -1], device=self.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.process_group)
        rank = int(candidate.item())
        if rank == -1:
            raise ValueError("No rank met the condition to be the authoritative rank.")
        return rank

    def buffer_source(self, join_enabled: bool) -> int:
        """The rank a forward's buffers come from: the highest rank still
        training under Join, else rank 0."""
        return self.find_common_rank(self.rank, True) if join_enabled else 0

    def check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        """Point 2 above; on a joined rank, whether its peers synchronise."""
        syncs = not is_joined_rank and self.flags.backward
        flag = torch.ones(1, device=self.device) if syncs else torch.zeros(1, device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if not is_joined_rank:
            return None
        _collectives.wait(work)
        return flag.item() != 0

    def check_and_sync_module_buffers(self) -> None:
        """Point 1 above."""
        if self.buffers.sync_before_forward():
            self.reducer._match_step_check_as_joined()
            authoritative_rank = self.find_common_rank(self.rank, False)
            self.buffers.sync_module_buffers(authoritative_rank)

    def sync_final_model(self, is_last_joiner: bool) -> None:
        self.authoritative_rank = self.find_common_rank(self.rank, is_last_joiner)
        self.buffers.assign()
        self.buffers.sync_module_states(self.authoritative_rank, include_buffers=self.buffers.forward)

    def match_all_reduce_for_bwd_pass(self) -> None:
        """Points 3 and 4 above."""
        reducer = self.reducer
        reducer._match_step_check_as_joined()
        # See Note [Layer dropping]: the peers skip the buckets of layers they all dropped.
        dropped = set(self.dropped_layers.take_dropped()[0])
        buckets = [
            bucket
            for bucket, members in zip(reducer._get_zeros_like_grad_buckets(), reducer.bucket_indices())
            if not (dropped and all(i in dropped for i in members))
        ]
        works = [reducer._run_comm_hook(bucket) for bucket in buckets]
        for work in works:
            work.wait()
        # Point 0: the peers observed a synchronising backward, so the first
        # rebuild falls due at their next forward.
        reducer._push_all_rebuilt_params()

    def match_unused_params_allreduce(self) -> None:
        """Point 5 above."""
        _collectives.wait(_collectives.allreduce(self.process_group, [self.reducer._get_local_used_map()]))
