"""One fragment's pseudo-gradient on the wire: launched asynchronously over
the outer group at the fragment's step, waited for at its merge step."""

from typing import Optional

import torch
import torch.distributed as dist

from ddp_ext.diloco.int8 import ErrorFeedback


class Exchange:
    """An averaging of a flat float32 tensor over `group`, in flight.

    `wait()` returns the mean over the group's ranks, the same bits on every
    rank. In 32 bits an all-reduce; in 8 bits (`codec` given) an all-gather
    of the payloads, decoded and summed in rank order."""

    def __init__(self, values: torch.Tensor, group: dist.ProcessGroup, codec: Optional[ErrorFeedback]):
        self._group_size = dist.get_world_size(group)
        self._codec = codec
        if codec is None:
            self._buffer = values
            self.bytes_sent = values.numel() * values.element_size()
            self._work = dist.all_reduce(values, group=group, async_op=True)
        else:
            payload = codec.encode(values)
            self._buffer = [torch.empty_like(payload) for _ in range(self._group_size)]
            self.bytes_sent = payload.numel()
            self._work = dist.all_gather(self._buffer, payload, group=group, async_op=True)
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._work.wait()
            if self._codec is None:
                self._result = self._buffer.div_(self._group_size)
            else:
                self._result = self._codec.decode_mean(self._buffer)
            self._buffer = self._work = None
        return self._result


class Arrived:
    """An exchange whose mean is already known (restored from a checkpoint)."""

    bytes_sent = 0

    def __init__(self, result: torch.Tensor):
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result
