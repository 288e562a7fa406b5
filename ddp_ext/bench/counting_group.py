"""A process group that counts the bytes each allreduce and allgather carries
before forwarding it to a real one: what a DDP puts on the wire, measured where
it leaves (used outside timed runs, since a Python process group is slower)."""

import torch.distributed as dist


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CountingProcessGroup(dist.ProcessGroup):
    """Wraps `inner`; every other collective DDP issues is forwarded as is.
    Counts the input bytes of this rank: for an allgather, what it contributes."""

    def __init__(self, inner: dist.ProcessGroup):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.allreduce_bytes = 0
        self.allgather_bytes = 0

    def take(self) -> int:
        """Bytes allreduced and allgathered since the last call."""
        counted = self.allreduce_bytes + self.allgather_bytes
        self.allreduce_bytes = self.allgather_bytes = 0
        return counted

    def allreduce(self, tensors, *opts):
        self.allreduce_bytes += _nbytes(tensors)
        return self.inner.allreduce(tensors, *opts)

    def broadcast(self, tensors, *opts):
        return self.inner.broadcast(tensors, *opts)

    def allgather(self, outputs, inputs, *opts):
        self.allgather_bytes += _nbytes(inputs)
        return self.inner.allgather(outputs, inputs, *opts)
