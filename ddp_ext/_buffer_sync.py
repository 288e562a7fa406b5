"""Broadcasting parameters and buffers: at construction, before a
synchronising forward (buffers only, paper section 4.1), and at the end of
Join."""

from typing import Sequence

import torch
from torch import nn

from ddp_ext._native import core as _C
from ddp_ext._bound import Bound
from ddp_ext._sync_flags import SyncFlags

# Chunk size for broadcasting parameters and buffers, as torch's DDP uses.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


class BufferSync(Bound):
    def __init__(self, module: nn.Module, ignored, device: torch.device, flags: SyncFlags, forward: bool, group):
        self.module = module
        self.ignored = ignored
        self.device = device
        self.flags = flags
        self.forward = forward  # forward_sync_buffers (torch's broadcast_buffers)
        self.chunk_bytes = BROADCAST_CHUNK_BYTES  # torch's broadcast_bucket_size
        self.modules_buffers = []
        self.named_module_buffers = {}
        self.bind(None, group)
        self.assign()

    def assign(self) -> None:
        """Buffers that are broadcast, re-read each time (modules may reassign them)."""
        named = [(n, b) for n, b in self.module.named_buffers() if n not in self.ignored]
        self.modules_buffers = [b for _, b in named]
        self.named_module_buffers = dict(named)

    def will_sync(self) -> bool:
        return bool(self.flags.forward_buffers and self.forward and len(self.modules_buffers) > 0)

    def sync_before_forward(self) -> bool:
        return self.will_sync() and self.process_group.size() > 1

    def sync_after_forward(self) -> bool:
        return False  # buffers are only ever synchronised before the forward

    def sync(self, authoritative_rank: int) -> None:
        """Buffers from `authoritative_rank`, before a forward."""
        with torch.no_grad():
            self.assign()
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.modules_buffers)):
                self.sync_module_buffers(authoritative_rank)

    def sync_module_buffers(self, authoritative_rank: int) -> None:
        self.default_broadcast_coalesced(authoritative_rank=authoritative_rank)

    def default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank=0) -> None:
        self.broadcast(
            self.modules_buffers if bufs is None else bufs,
            self.chunk_bytes if bucket_size is None else bucket_size,
            authoritative_rank,
        )

    def broadcast(self, tensors: Sequence[torch.Tensor], buffer_size: int, authoritative_rank: int = 0) -> None:
        if tensors:
            _C.broadcast_coalesced(self.process_group, list(tensors), int(buffer_size), int(authoritative_rank))

    def broadcast_from_rank_0(self, tensor: torch.Tensor) -> None:
        """Broadcasts a small CPU tensor in place from rank 0 of the group."""
        on_device = tensor.to(self.device)
        self.broadcast([on_device], BROADCAST_CHUNK_BYTES, 0)
        tensor.copy_(on_device)

    def sync_module_states(self, authoritative_rank: int, include_buffers: bool) -> None:
        """Parameters (and buffers if `include_buffers`) from `authoritative_rank`."""
        params = [p.detach() for n, p in self.module.named_parameters() if n not in self.ignored]
        buffers = self.modules_buffers if include_buffers else []
        with torch.no_grad():
            self.broadcast(params + list(buffers), self.chunk_bytes, authoritative_rank)
