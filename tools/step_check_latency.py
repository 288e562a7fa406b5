"""Latency of an allreduce shaped like ddp_ext's step check (two int64 per
rank, its position and the fingerprint of the layers it dropped, plus the
rebuild vote's slot), over Gloo.

    torchrun --nproc_per_node=2 tools/step_check_latency.py

One run on a shared machine: indicative only.
"""

import time

import torch
import torch.distributed as dist

REPETITIONS = 2000


def main() -> None:
    dist.init_process_group("gloo")
    slots = torch.zeros(2 * dist.get_world_size() + 1, dtype=torch.long)
    for _ in range(100):
        dist.all_reduce(slots)
    seconds = []
    for _ in range(REPETITIONS):
        start = time.perf_counter()
        dist.all_reduce(slots)
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    if dist.get_rank() == 0:
        median = seconds[len(seconds) // 2] * 1e6
        p90 = seconds[int(len(seconds) * 0.9)] * 1e6
        print(f"allreduce of {slots.numel()} int64 over {dist.get_world_size()} ranks, {REPETITIONS} times: "
              f"median {median:.0f} us, 90th percentile {p90:.0f} us")


if __name__ == "__main__":
    main()
