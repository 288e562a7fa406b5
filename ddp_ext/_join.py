"""Uneven inputs: the Join hook of ddp_ext's DistributedDataParallel, and
the wrapper's Join methods (under torch's DDP names there).

A rank that runs out of data leaves its training loop and enters the Join
context's shadow loop, which calls `main_hook` once for every iteration that
the other ranks still run. The hook issues, in the same order, every
collective those ranks' forward and backward issue:

0. once, after the first synchronising backward, the broadcast of rank 0's
   gradient order for the first bucket rebuild (Note [Agreeing on the bucket
   layout] in reducer/layout/bucket_layout.h), as torch's join hook does through
   `_rebuild_buckets`; the joined rank receives the order and rebuilds as its
   peers do. A rank that joined before any backward has no order of its own;
   it learns that the first rebuild is due by shadowing a synchronising
   backward (`_push_all_rebuilt_params`, as torch's). If it is rank 0 it
   sends its current layout's order, so every rank keeps the buckets it has,
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
reducer/core/averaging.h for how the ranks with data average.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from ddp_ext import _collectives


class DistributedDataParallelJoinHook(JoinHook):
    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if not ddp._lazy_init_ran:  # the peers' first forward checks their hooks
            ddp._lazy_init()
        # Point 0: the peers' forward rebuilds here (once), after Join's notification.
        ddp.reducer._rebuild_buckets()
        # The peers' forward draws LayerDrop plans; draw the same ones.
        ddp._dropped_layers.simulate_forward()
        ddp._check_and_sync_module_buffers()
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        # The next forward syncs buffers only after a synchronising one.
        ddp.require_forward_param_sync = should_sync
        if ddp._auto_buckets is not None:
            ddp._auto_buckets.forward(ddp, synchronising=should_sync and ddp.module.training)
        if not should_sync:
            return
        ddp._match_all_reduce_for_bwd_pass()
        if ddp.find_unused_parameters and not ddp.static_graph:
            ddp._match_unused_params_allreduce()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


def join(ddp, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False):
    """Context manager for uneven inputs: ranks that run out of data shadow
    the collectives of those that have not (see above)."""
    return Join([ddp], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)


def join_hook(ddp, **kwargs) -> DistributedDataParallelJoinHook:
    return DistributedDataParallelJoinHook(ddp, kwargs.get("divide_by_initial_world_size", True))


def join_device(ddp):
    return ddp.device


def join_process_group(ddp):
    return ddp.process_group


def distributed_rank(ddp) -> int:
    return ddp.process_group.rank()


def find_common_rank(ddp, input_rank: int, rank_cond: bool) -> int:
    """The highest rank for which `rank_cond` holds, agreed by every rank."""
    candidate = torch.tensor([input_rank if rank_cond else -1], device=ddp.device)
    dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=ddp.process_group)
    rank = int(candidate.item())
    if rank == -1:
        raise ValueError("No rank met the condition to be the authoritative rank.")
    return rank


def check_global_requires_backward_grad_sync(ddp, is_joined_rank: bool):
    """Point 2 above; on a joined rank, whether its peers synchronise."""
    syncs = not is_joined_rank and ddp.require_backward_grad_sync
    flag = torch.ones(1, device=ddp.device) if syncs else torch.zeros(1, device=ddp.device)
    work = dist.all_reduce(flag, group=ddp.process_group, async_op=True)
    if not is_joined_rank:
        return None
    _collectives.wait(work)
    return flag.item() != 0


def check_and_sync_module_buffers(ddp) -> None:
    """Point 1 above."""
    if ddp._check_sync_bufs_pre_fwd():
        ddp.reducer._match_step_check_as_joined()
        authoritative_rank = ddp._find_common_rank(ddp._distributed_rank, False)
        ddp._sync_module_buffers(authoritative_rank)


def sync_final_model(ddp, is_last_joiner: bool) -> None:
    ddp._authoritative_rank = ddp._find_common_rank(ddp._distributed_rank, is_last_joiner)
    ddp._assign_modules_buffers()
    ddp._sync_module_states(ddp._authoritative_rank, include_buffers=ddp.forward_sync_buffers)


def match_all_reduce_for_bwd_pass(ddp) -> None:
    """Points 3 and 4 above."""
    ddp.reducer._match_step_check_as_joined()
    # See Note [Layer dropping]: the peers skip the buckets of layers they all dropped.
    dropped = set(ddp._dropped_layers.take_dropped()[0])
    buckets = [
        bucket
        for bucket, members in zip(ddp.reducer._get_zeros_like_grad_buckets(), ddp.reducer.bucket_indices())
        if not (dropped and all(i in dropped for i in members))
    ]
    works = [ddp.reducer._run_comm_hook(bucket) for bucket in buckets]
    for work in works:
        work.wait()
    # Point 0: the peers observed a synchronising backward, so the first
    # rebuild falls due at their next forward.
    ddp.reducer._push_all_rebuilt_params()


def match_unused_params_allreduce(ddp) -> None:
    """Point 5 above."""
    _collectives.wait(_collectives.allreduce(ddp.process_group, [ddp.reducer._get_local_used_map()]))
