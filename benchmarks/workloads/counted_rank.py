"""One rank of `instructions`, started by the experiment, under callgrind or not:

    python -m benchmarks.workloads.counted_rank RANK WORLD_SIZE STORE_PATH ITERATIONS WARMUP SEED THREADS ORDER
        TASKS_PATH COUNTER

It trains fixedcost's variants (ORDER, comma-separated; a variant may come
back) on the tiny MLP in one Gloo world, warms each up, then runs each in
turn: every rank waits at a barrier, snapshots its threads (names and context
switches, harness/task_switches.py), runs ITERATIONS iterations and snapshots
them again. With COUNTER `callgrind` it runs under callgrind, instrumented from the
end of the warm-up, and also zeroes the counters after the first snapshot and
dumps them, labelled `<turn>:<variant>`, before the second; with `none` nothing comes between the
snapshots and the iterations. The snapshots go to TASKS_PATH (JSON). The
collector is off while a variant runs, and runs between turns: where its
collections fell would otherwise decide which variant pays for them.
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from benchmarks.harness import callgrind, task_switches
from benchmarks.workloads.tiny_mlp import batch
from benchmarks.workloads.tiny_variants import make
from benchmarks.workloads.training_step import TrainingStep

COUNTERS = ("callgrind", "none")


def main(argv) -> None:
    rank, world_size, store_path, iterations, warmup, seed, threads, order, tasks_path, counter = argv
    rank, world_size, iterations, warmup = int(rank), int(world_size), int(iterations), int(warmup)
    if counter not in COUNTERS:
        raise ValueError(f"COUNTER is one of {COUNTERS}, not {counter!r}")
    counting = counter == "callgrind"
    torch.set_num_threads(int(threads))
    record = {"pid": os.getpid(), "start": task_switches.to_json(task_switches.snapshot()), "turns": []}
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    kinds = order.split(",")
    steps = {kind: TrainingStep(make(kind, int(seed)), batch(int(seed) * 1000 + rank)) for kind in dict.fromkeys(kinds)}
    for step in steps.values():
        for _ in range(warmup):
            step()
    if counting:
        callgrind.instrument()  # the imports, the set-up and the warm-up ran uninstrumented, which is faster
    for turn, kind in enumerate(kinds):
        label = f"{turn}:{kind}"
        gc.collect()
        gc.disable()
        dist.barrier()
        before = task_switches.snapshot()
        if counting:
            callgrind.zero()
        for _ in range(iterations):
            steps[kind]()
        if counting:
            callgrind.dump(label)
        after = task_switches.snapshot()
        gc.enable()
        record["turns"].append({"label": label, "before": task_switches.to_json(before),
                                "after": task_switches.to_json(after)})
    dist.barrier()
    dist.destroy_process_group()
    with open(tasks_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1:])
