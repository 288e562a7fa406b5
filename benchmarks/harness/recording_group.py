"""A process group that records every collective before forwarding it to a
real one: what a DDP puts on the wire, seen where it leaves.

The benchmarks count the bytes (outside timed runs, since a Python process
group is slower); the tests check which collectives ran, in which order, with
which dtypes and sizes. torch's PyProcessGroup trampoline lets the C++ reducer
reach these overrides."""

from typing import List, Tuple

import torch.distributed as dist

# (collective, [(dtype, numel) of each input tensor])
Call = Tuple[str, List[Tuple[str, int]]]


def _describe(tensors) -> List[Tuple[str, int]]:
    return [(str(t.dtype).replace("torch.", ""), t.numel()) for t in tensors]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class RecordingProcessGroup(dist.ProcessGroup):
    """Wraps `inner`. Records each allreduce, broadcast and allgather, and
    counts the input bytes of this rank's allreduces and allgathers (for an
    allgather, what this rank contributes)."""

    def __init__(self, inner: dist.ProcessGroup):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.calls: List[Call] = []
        self.sent_bytes = 0

    def take(self) -> List[Call]:
        """The collectives since the last take; starts a new record."""
        calls, self.calls, self.sent_bytes = self.calls, [], 0
        return calls

    def take_bytes(self) -> int:
        """Bytes allreduced and allgathered since the last take; starts a new record."""
        sent, self.calls, self.sent_bytes = self.sent_bytes, [], 0
        return sent

    def allreduce(self, tensors, *opts):
        self.calls.append(("allreduce", _describe(tensors)))
        self.sent_bytes += _nbytes(tensors)
        return self.inner.allreduce(tensors, *opts)

    def broadcast(self, tensors, *opts):
        self.calls.append(("broadcast", _describe(tensors)))
        return self.inner.broadcast(tensors, *opts)

    def allgather(self, outputs, inputs, *opts):
        self.calls.append(("allgather", _describe(inputs)))
        self.sent_bytes += _nbytes(inputs)
        return self.inner.allgather(outputs, inputs, *opts)
