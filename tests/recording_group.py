"""A process group that records every collective before forwarding it to a
real one: lets tests see what ddp_ext communicates, in which order."""

from typing import List, Tuple

import torch.distributed as dist

# (collective, [(dtype, numel) of each input tensor])
Call = Tuple[str, List[Tuple[str, int]]]


def _describe(tensors) -> List[Tuple[str, int]]:
    return [(str(t.dtype).replace("torch.", ""), t.numel()) for t in tensors]


class RecordingProcessGroup(dist.ProcessGroup):
    """Wraps `inner` (a real process group). The C++ side reaches these
    overrides through torch's PyProcessGroup trampoline."""

    def __init__(self, inner: dist.ProcessGroup):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.calls: List[Call] = []

    def take(self) -> List[Call]:
        calls, self.calls = self.calls, []
        return calls

    def allreduce(self, tensors, *opts):
        self.calls.append(("allreduce", _describe(tensors)))
        return self.inner.allreduce(tensors, *opts)

    def broadcast(self, tensors, *opts):
        self.calls.append(("broadcast", _describe(tensors)))
        return self.inner.broadcast(tensors, *opts)

    def allgather(self, outputs, inputs, *opts):
        self.calls.append(("allgather", _describe(inputs)))
        return self.inner.allgather(outputs, inputs, *opts)
