"""Uneven inputs: the Join hook of ddp_ext's DistributedDataParallel.

A rank that runs out of data leaves its training loop and enters the Join
context's shadow loop, which calls `main_hook` once for every iteration that
the other ranks still run. The hook issues, in the same order, every
collective those ranks' forward and backward issue:

1. the buffer broadcast of a synchronising forward (after agreeing on the
   rank to broadcast from),
2. the allreduce telling joined ranks whether this iteration synchronises
   gradients, and with bucket_cap_mb="auto" the tuner's agreement when one
   falls due (Note [Auto-tuned bucket caps] in ddp_ext/_auto_buckets.py;
   the joined rank re-lays its buckets as its peers do),
3. the step check of the backward (see Note [Ranks out of step] in
   reducer/step_check.h), as a rank with no step; it carries the vote on
   rebuilding buckets (Note [Gradient order prediction] in
   reducer/gradient_order.h), where a rank that joined votes no, so no
   rebuild happens while a rank has joined,
4. one reduction per bucket, of zeros, through the same communication hook,
   except the buckets of layers that LayerDrop dropped on every rank (the
   plans the peers drew are drawn here too; see Note [Layer dropping] in
   reducer/layer_drop.h),
5. the unused-parameter bitmap allreduce, with find_unused_parameters.

When every rank has joined, `post_hook` broadcasts the final model from the
last rank to join. See Note [Join and the divide factor] in
reducer/averaging.h for how the ranks with data average.
"""

from torch.distributed.algorithms.join import JoinHook


class DistributedDataParallelJoinHook(JoinHook):
    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
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
