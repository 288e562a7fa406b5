"""Over Gloo each sharded bucket is sent as an all-to-all of its ranges and
summed on its rank in the order Gloo's ring allreduce would have summed it
(Note [Ring-ordered sum] in reducer/transport/ring_order_sum.h). Checked
through the whole path: a model of one parameter of a given length (one
bucket), SGD with lr 1 from zeros, so that the parameters after step() are
exactly minus the reduced gradient, against torch's DDP's allreduced
gradient, bitwise, at 3, 4 and 5 ranks. The lengths include buckets shorter
than the world size, not a multiple of it, and cut by Gloo's ring into
chunks that straddle the shards. A plain sum in rank order differs from
torch's at these sizes (checked too), so the test sees the order."""

import pytest
import torch

from tests.support.spawn import run_ranks

LENGTHS = [1, 2, 4, 7, 1000, 2762, 4099, (1 << 16) + 3, 3 * (1 << 20) + 5]
BIG_BUCKET_MB = 64


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
    ddp.overlap_optimizer(optimizer, shard=True)
    (ddp() * gradient).sum().backward()
    optimizer.step()

    everyone = [torch.empty_like(gradient) for _ in range(world_size)]
    dist.all_gather(everyone, gradient)
    in_rank_order = everyone[0] / world_size
    for other in everyone[1:]:
        in_rank_order += other / world_size
    return {"params": module.weight.detach().clone(), "torch": averaged, "rank_order": in_rank_order}


def _job(rank, world_size, dtype):
    return [_one(rank, world_size, length, dtype) for length in LENGTHS]


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


@pytest.mark.parametrize("world_size", [3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_shards_sum_is_torch_ddps_allreduce_bit_for_bit(world_size, dtype):
    order_visible = False
    # Fresh ranks: the large buckets here must not linger in the shared worlds' ranks.
    by_rank = run_ranks(_job, world_size, dtype)
    for number, length in enumerate(LENGTHS):
        for rank, result in enumerate(r[number] for r in by_rank):
            expected = torch.zeros_like(result["torch"]).add_(result["torch"], alpha=-1.0)  # as SGD steps
            same = torch.equal(_bits(result["params"]), _bits(expected))
            assert same, (
                f"{world_size} ranks, {length} elements of {dtype}, rank {rank}: "
                f"{int((result['params'] != expected).sum())} elements differ from torch's DDP"
            )
            order_visible |= not torch.equal(result["rank_order"], result["torch"])
    assert order_visible, "a sum in rank order gave torch's result everywhere: these lengths do not test the order"
