"""What each format costs on this machine, one step at a time, for one
tensor the size of a model's gradients: the encoding and decoding the
adaptive hook adds against the communication it saves.

Every rank runs the same steps together (a barrier before each); the
medians over `repeats` are the slowest rank's when merged by the caller.
"""

import time

import torch
import torch.distributed as dist

from benchmarks.harness import product

CHUNK = 1024  # elements per 8-bit scale, the hook's default
STEPS = ("fp32 allreduce", "fp16 casts", "fp16 allreduce", "int8 encode", "int8 allgather", "int8 decode and sum")


def _timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def measure(numel: int, repeats: int, seed: int) -> dict:
    """Median milliseconds per step for `numel` float32 values on this rank."""
    world = dist.get_world_size()
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    payload = product.int8_encode(values.clone(), CHUNK)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    out = torch.empty(numel)
    # Scratch copies for the in-place steps (what they leave there is not used).
    summed, residual = values.clone(), values.clone()

    half = values.to(torch.float16)

    def casts():  # to float16 and back
        out.copy_(values.to(torch.float16))

    steps = {
        STEPS[0]: lambda: dist.all_reduce(summed),
        STEPS[1]: casts,
        STEPS[2]: lambda: dist.all_reduce(half),
        STEPS[3]: lambda: product.int8_encode(residual, CHUNK),
        STEPS[4]: lambda: dist.all_gather(gathered, payload),
        STEPS[5]: lambda: product.int8_decode_sum(gathered, out, CHUNK),
    }
    costs = {name: _timed(fn, repeats) for name, fn in steps.items()}
    return {"numel": numel, "ms": costs, "int8_payload_bytes": payload.numel()}
