"""What the ranks of tests/diloco/test_diloco_quorum_exchange.py run: one
fault-tolerant sync's exchange (ddp_ext/diloco/quorum_exchange.py) over a
Gloo group made as a replica makes its quorum's, both whole and shared
within hosts, from payloads that are the same on a host's ranks."""

import datetime
import itertools

import torch
import torch.distributed as dist

from ddp_ext._gloo_group import gloo_group
from ddp_ext.diloco.int4 import Int4ErrorFeedback
from ddp_ext.diloco.int8 import ErrorFeedback
from ddp_ext.diloco.quorum_exchange import (Contribution, gather_contributions, host_shares, shared_mean,
                                            whole_mean)

NUMEL = 203  # 13 chunks of 16 and a tail: parts of whole chunks, not equal
CHUNK = 16
_groups = itertools.count()


def _payload(host: str, bits: int, trained: bool):
    """A host's payload (its ranks encode the same values with the same
    residual) and its codec; zeros where the host did not train."""
    seed = sum(ord(c) for c in host)
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    residual = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed + 100)) * 0.01
    codec = {8: ErrorFeedback, 4: Int4ErrorFeedback}[bits](NUMEL, CHUNK) if bits != 32 else None
    if not trained:
        return torch.zeros(NUMEL if codec is None else codec.payload_bytes,
                           dtype=torch.float32 if codec is None else torch.uint8), codec
    if codec is None:
        return values, None
    codec.residual.copy_(residual)
    return codec.encode(values), codec


def exchange(rank, world_size, members, bits, trained_hosts, splits=True):
    """Quorum rank `rank` is replica `members[rank]`; the hosts in
    `trained_hosts` trained. The whole and shared means, the bytes each
    sent, and whether the split held."""
    store = dist.PrefixStore(f"quorum_test/{next(_groups)}/", dist.distributed_c10d._get_default_store())
    group = gloo_group(store, rank, world_size, datetime.timedelta(seconds=60))
    host = members[rank].rsplit("/", 1)[0]
    mine = Contribution(host in trained_hosts, splits if rank == world_size - 1 else True)
    contributions = gather_contributions(group, mine, world_size)
    payload, codec = _payload(host, bits, mine.trained)
    whole, whole_bytes = whole_mean(group, contributions, payload, codec)
    shares = host_shares(members, contributions)
    shared, shared_bytes = None, None
    if shares is not None:
        shared, shared_bytes = shared_mean(group, rank, contributions, payload, codec, NUMEL, shares)
    return whole, whole_bytes, shared, shared_bytes, shares is not None
