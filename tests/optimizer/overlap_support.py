"""What the overlap_optimizer tests share: a plain wrapper with several
buckets, one backward of its model, and snapshots of its parameters."""

import torch

from tests.support import models
from tests.support.harness import assert_states_bitwise, assert_states_close

# Tiny buckets: several per model, so that later buckets are still being
# reduced while the first are stepped.
SMALL_BUCKETS = 0.0001


def plain_wrapper(seed=models.MODEL_SEED, **kwargs):
    import ddp_ext

    module = models.build("deep", seed)
    return module, ddp_ext.DistributedDataParallel(module, bucket_cap_mb=SMALL_BUCKETS, **kwargs)


def backward(ddp, rank, world_size, step=0):
    args, target = models.rank_batch("deep", step, 0, rank, world_size, per_rank=4)
    models.MODELS["deep"].loss(ddp(*args), target).backward()


def raised(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def unchanged(module, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def trained_three_ways(train, rank, world_size, c):
    """`train(rank, world_size, c, wrapper, overlap)` with the line, with
    ddp_ext without it, and with torch's DDP."""
    return {
        "overlap": train(rank, world_size, c, "ext", overlap=True),
        "ext": train(rank, world_size, c, "ext", overlap=False),
        "torch": train(rank, world_size, c, "torch", overlap=False),
    }


def assert_trained_alike(r, what: str, torch_bitwise: bool, **tolerance) -> None:
    """Parameters, buffers and optimizer state with the line are bitwise
    those of ddp_ext without it, and bitwise (or close, within `tolerance`)
    those of torch's DDP."""
    for kind in ("params", "buffers", "optimizer"):
        assert_states_bitwise(r["overlap"][kind], r["ext"][kind], f"{what}: {kind}, overlap vs ddp_ext without")
        if torch_bitwise:
            assert_states_bitwise(r["overlap"][kind], r["torch"][kind], f"{what}: {kind}, overlap vs torch DDP")
        else:
            assert_states_close(r["overlap"][kind], r["torch"][kind], f"{what}: {kind}, overlap vs torch DDP",
                                **tolerance)
