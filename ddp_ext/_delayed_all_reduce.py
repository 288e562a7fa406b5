"""delay_all_reduce_named_params: parameters reduced in one flat allreduce,
started when the gradient of `param_to_hook_all_reduce` is ready, instead of
by the reducer.

Their .grad are views into one flat buffer. When the hooked parameter's
gradient arrives, the buffer is averaged with an asynchronous allreduce, and
the end of the backward pass waits for it, so the optimizer never reads a
half-reduced gradient. It reduces over the wrapper's group of the moment:
`_update_process_group` moves it with the reducer (`rebind`).
"""

from typing import List, Optional

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ddp_ext import _collectives
from ddp_ext._native import core as _C


class DelayedAllReduce:
    def __init__(self, params: List[torch.Tensor], hooked_param: torch.Tensor, process_group, chunk_bytes: int):
        self.params = params
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
        self._handle = hooked_param.register_hook(self.start)

    def rebind(self, process_group) -> None:
        """Reduce over `process_group` from the next backward on."""
        self.process_group = process_group

    def start(self, grad):
        self.buffer.div_(self.process_group.size())
        self._work = dist.all_reduce(self.buffer, group=self.process_group, async_op=True)
        Variable._execution_engine.queue_callback(self._finish)
        return grad

    def _finish(self) -> None:
        if self._work is not None:
            _collectives.wait(self._work)
            self._work = None

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
