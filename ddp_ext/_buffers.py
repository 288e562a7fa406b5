"""Broadcasting parameters and buffers: at construction, before a
synchronising forward (buffers only, paper section 4.1), and at the end of
Join. Functions of the wrapper, under torch's DDP method names there."""

import torch

from ddp_ext import _C

# Chunk size for broadcasting parameters and buffers, as torch's DDP uses.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def get_broadcast_buffers(ddp) -> bool:
    return ddp.forward_sync_buffers


def set_broadcast_buffers(ddp, value: bool) -> None:
    ddp.forward_sync_buffers = value


def assign_modules_buffers(ddp) -> None:
    """Buffers that are broadcast, re-read each time (modules may reassign them)."""
    named = [(n, b) for n, b in ddp.module.named_buffers() if n not in ddp.parameters_to_ignore]
    ddp.modules_buffers = [b for _, b in named]
    ddp.named_module_buffers = dict(named)


def will_sync_module_buffers(ddp) -> bool:
    return bool(ddp.require_forward_param_sync and ddp.forward_sync_buffers and len(ddp.modules_buffers) > 0)


def check_sync_bufs_pre_fwd(ddp) -> bool:
    return ddp.will_sync_module_buffers() and ddp.process_group.size() > 1


def check_sync_bufs_post_fwd(ddp) -> bool:
    return False  # buffers are only ever synchronised before the forward


def sync_buffers(ddp) -> None:
    with torch.no_grad():
        if ddp._join_config.enable:
            authoritative_rank = ddp._find_common_rank(ddp._distributed_rank, True)
        else:
            authoritative_rank = 0
        ddp._assign_modules_buffers()
        with torch.autograd._unsafe_preserve_version_counter(tuple(ddp.modules_buffers)):
            ddp._sync_module_buffers(authoritative_rank)


def sync_module_buffers(ddp, authoritative_rank) -> None:
    ddp._default_broadcast_coalesced(authoritative_rank=authoritative_rank)


def default_broadcast_coalesced(ddp, bufs=None, bucket_size=None, authoritative_rank=0) -> None:
    ddp._distributed_broadcast_coalesced(
        ddp.modules_buffers if bufs is None else bufs,
        ddp.broadcast_bucket_size if bucket_size is None else bucket_size,
        authoritative_rank,
    )


def distributed_broadcast_coalesced(ddp, tensors, buffer_size, authoritative_rank=0) -> None:
    if tensors:
        _C.broadcast_coalesced(ddp.process_group, list(tensors), int(buffer_size), int(authoritative_rank))


def broadcast_from_rank_0(ddp, tensor: torch.Tensor) -> None:
    """Broadcasts a small CPU tensor in place from rank 0 of the group."""
    on_device = tensor.to(ddp.device)
    ddp._distributed_broadcast_coalesced([on_device], BROADCAST_CHUNK_BYTES, 0)
    tensor.copy_(on_device)


def sync_module_states(ddp, authoritative_rank: int, include_buffers: bool) -> None:
    """Parameters (and buffers if `include_buffers`) from `authoritative_rank`."""
    params = [p.detach() for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
    buffers = ddp.modules_buffers if include_buffers else []
    with torch.no_grad():
        ddp._distributed_broadcast_coalesced(params + list(buffers), ddp.broadcast_bucket_size, authoritative_rank)
