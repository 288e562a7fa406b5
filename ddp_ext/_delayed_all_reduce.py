"""delay_all_reduce_named_params: parameters reduced in one flat allreduce,
started when the gradient of `param_to_hook_all_reduce` is ready, instead of
by the reducer.

Note [The delayed allreduce starts after accumulation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's DDP starts the allreduce from a hook on the hooked parameter's
gradient, before autograd accumulates it: when that parameter is delayed too,
its own gradient is written into the buffer while the allreduce reads it,
and the ranks can end with different parameters. ddp_ext starts it once the
hooked parameter's gradient is accumulated (a post-accumulate hook), so the
buffer holds every gradient that came before. A delayed gradient that arrives
after the allreduce started races with it in both: ddp_ext warns, once,
naming the parameters, and says to hook a parameter whose gradient comes last.

Their .grad are views into one flat buffer. When the hooked parameter's
gradient arrives, the buffer is averaged with an asynchronous allreduce, and
the end of the backward pass waits for it, so the optimizer never reads a
half-reduced gradient. It reduces over the wrapper's group of the moment:
`_update_process_group` moves it with the reducer (`rebind`).
"""

import warnings
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ddp_ext import _collectives
from ddp_ext._native import core as _C


class DelayedAllReduce:
    def __init__(self, params: List[torch.Tensor], names: List[str], hooked_param: torch.Tensor, process_group,
                 chunk_bytes: int):
        self.params = params
        self.names = names
        self.process_group = process_group
        device = params[0].device if params else torch.device("cpu")
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=device, dtype=params[0].dtype if params else torch.float32)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._work: Optional[dist.Work] = None
        # Broadcast regardless of init_sync, as torch's DDP does.
        _C.broadcast_coalesced(process_group, [p.detach() for p in params], chunk_bytes, 0)
        # Note [The delayed allreduce starts after accumulation].
        self._handle = hooked_param.register_post_accumulate_grad_hook(self._hooked_accumulated)
        self._late: List[str] = []  # delayed gradients accumulated after the allreduce started
        self._warned = False
        self._arrival_handles = [
            p.register_post_accumulate_grad_hook(lambda _, name=name: self._arrived(name))
            for p, name in zip(params, names) if p is not hooked_param
        ]

    def rebind(self, process_group) -> None:
        """Reduce over `process_group` from the next backward on."""
        self.process_group = process_group

    def start(self, grad):
        """torch's hook: averages the buffer with an asynchronous allreduce,
        waited for at the end of the backward."""
        self.buffer.div_(self.process_group.size())
        self._work = dist.all_reduce(self.buffer, group=self.process_group, async_op=True)
        Variable._execution_engine.queue_callback(self._finish)
        return grad

    def _hooked_accumulated(self, param) -> None:
        self.start(param.grad)

    def _arrived(self, name: str) -> None:
        if self._work is not None and not self._warned:
            self._late.append(name)

    def _finish(self) -> None:
        if self._work is not None:
            _collectives.wait(self._work)
            self._work = None
        if self._late and not self._warned:
            self._warned = True
            late, self._late = self._late, []
            for handle in self._arrival_handles:  # warned once: no more to watch
                handle.remove()
            warnings.warn(
                f"DistributedDataParallel on rank {dist.get_rank()}: the gradients of {', '.join(late)} "
                "(delay_all_reduce_named_params) were accumulated after the delayed allreduce had started, "
                "when param_to_hook_all_reduce's gradient was ready: their average may hold only part of "
                "this rank's gradient, and the ranks may drift apart (torch's DDP has the same race). Hook a "
                "parameter whose gradient comes last, such as one of the first layer's.",
                stacklevel=2)

    def point_grads_at_buffer(self) -> None:
        """Before each backward: every .grad that is None becomes its view
        (zeroed unless every .grad was None, then the whole buffer is)."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()
