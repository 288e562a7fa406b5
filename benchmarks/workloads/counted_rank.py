"""One rank of `instructions`, started under callgrind by the experiment:

    python -m benchmarks.workloads.counted_rank RANK WORLD_SIZE STORE_PATH ITERATIONS WARMUP SEED THREADS ORDER

It trains fixedcost's variants (ORDER, comma-separated; a variant may come
back) on the tiny MLP in one Gloo world, warms each up, then counts each in
turn: every rank waits at a barrier, zeroes the counters, runs ITERATIONS
iterations and dumps them labelled `<turn>:<variant>`. The collector is off
while a variant is counted, and runs between turns: where its collections fell
would otherwise decide which variant pays for them.
"""

import gc
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import callgrind
from benchmarks.workloads.tiny_mlp import batch
from benchmarks.workloads.tiny_variants import make
from benchmarks.workloads.training_step import TrainingStep


def main(argv) -> None:
    rank, world_size, store_path, iterations, warmup, seed, threads, order = argv
    rank, world_size, iterations, warmup = int(rank), int(world_size), int(iterations), int(warmup)
    torch.set_num_threads(int(threads))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    kinds = order.split(",")
    steps = {kind: TrainingStep(make(kind, int(seed)), batch(int(seed) * 1000 + rank)) for kind in dict.fromkeys(kinds)}
    for step in steps.values():
        for _ in range(warmup):
            step()
    for turn, kind in enumerate(kinds):
        gc.collect()
        gc.disable()
        dist.barrier()
        callgrind.zero()
        for _ in range(iterations):
            steps[kind]()
        callgrind.dump(f"{turn}:{kind}")
        gc.enable()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
