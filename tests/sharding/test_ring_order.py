"""Over Gloo each sharded bucket is sent as an all-to-all of its ranges and
summed on its rank in the order Gloo's ring allreduce would have summed it
(Note [Ring-ordered sum] in reducer/transport/ring_order_sum.h). Checked
through the whole path: a model of one parameter of a given length (one
bucket), SGD with lr 1 from zeros, so that the parameters after step() are
exactly minus the reduced gradient, against torch's DDP's allreduced
gradient, bitwise, at 3, 4 and 5 ranks, in float32 and float64 (both on
one start of ranks per world size). The lengths include buckets shorter
than the world size, not a multiple of it, and cut by Gloo's ring into
chunks that straddle the shards. A plain sum in rank order differs from
torch's at these sizes (checked too), so the test sees the order."""

import pytest
import torch

from tests.support.spawn import run_ranks_for_each

LENGTHS = [1, 2, 4, 7, 1000, 2762, 4099, (1 << 16) + 3, 3 * (1 << 20) + 5]
BIG_BUCKET_MB = 64
DTYPES = [torch.float32, torch.float64]


class _Vector(torch.nn.Module):
    def __init__(self, length, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(length, dtype=dtype))

    def forward(self):
        return self.weight


def _gradient(rank, length, dtype):
    g = torch.Generator().manual_seed(7919 * rank + length)
    # Magnitudes over many binades: the order of the additions shows in the bits.
    return (torch.randn(length, generator=g) * torch.exp(3 * torch.randn(length, generator=g))).to(dtype)


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def _one(rank, world_size, length, dtype):
    import torch.distributed as dist

    import ddp_ext

    gradient = _gradient(rank, length, dtype)
    reference = _Vector(length, dtype)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(reference, bucket_cap_mb=BIG_BUCKET_MB)
    (torch_ddp() * gradient).sum().backward()
    averaged = reference.weight.grad.detach().clone()

    module = _Vector(length, dtype)
    ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=BIG_BUCKET_MB)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    ddp.overlap_optimizer(optimizer, shard=True, shard_min_bytes=0)
    (ddp() * gradient).sum().backward()
    optimizer.step()

    everyone = [torch.empty_like(gradient) for _ in range(world_size)]
    dist.all_gather(everyone, gradient)
    in_rank_order = everyone[0] / world_size
    for other in everyone[1:]:
        in_rank_order += other / world_size
    # Compared here, so that only the verdicts travel back, not three copies of
    # every buffer from every rank.
    expected = torch.zeros_like(averaged).add_(averaged, alpha=-1.0)  # as SGD steps
    params = module.weight.detach()
    return {"same": torch.equal(_bits(params), _bits(expected)), "differ": int((params != expected).sum()),
            "order_visible": not torch.equal(in_rank_order, averaged)}


def _job(rank, world_size, dtype):
    return [_one(rank, world_size, length, dtype) for length in LENGTHS]


@pytest.mark.parametrize("world_size", [3, 4, 5])
def test_the_shards_sum_is_torch_ddps_allreduce_bit_for_bit(world_size):
    # Fresh ranks, one start for both dtypes: the large buckets here must not
    # linger in the shared worlds' ranks.
    for dtype, by_rank in zip(DTYPES, run_ranks_for_each(_job, world_size, DTYPES)):
        order_visible = False
        for number, length in enumerate(LENGTHS):
            for rank, result in enumerate(r[number] for r in by_rank):
                assert result["same"], (
                    f"{world_size} ranks, {length} elements of {dtype}, rank {rank}: "
                    f"{result['differ']} elements differ from torch's DDP"
                )
                order_visible |= result["order_visible"]
        assert order_visible, (
            f"{dtype}: a sum in rank order gave torch's result everywhere: these lengths do not test the order")
