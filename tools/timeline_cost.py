"""What recording the communication timeline adds to each gradient: the
backward of a model of many tiny parameters (so that the per-gradient work
of the reducer, not arithmetic, is what is timed), with the timeline off and
on, in alternating blocks, on one rank over Gloo (no collectives: the
recording points of the hooks alone).

    python tools/timeline_cost.py

One run on a shared machine: indicative only.
"""

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import ddp_ext

PARAMETERS = 2000
BLOCKS = 20
ITERATIONS_PER_BLOCK = 20


class ManyTiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.ones(4)) for _ in range(PARAMETERS))

    def forward(self, x):
        return sum((w * x).sum() for w in self.weights)


def backward_seconds(ddp, x) -> float:
    loss = ddp(x)
    start = time.perf_counter()
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        ddp = ddp_ext.DistributedDataParallel(ManyTiny())
        x = torch.ones(4)
        for _ in range(20):
            backward_seconds(ddp, x)
        times = {"off": [], "on": []}
        for block in range(BLOCKS):
            for mode in ("off", "on") if block % 2 == 0 else ("on", "off"):
                timeline = ddp.record_timeline(os.path.join(tmp, "trace")) if mode == "on" else None
                times[mode] += [backward_seconds(ddp, x) for _ in range(ITERATIONS_PER_BLOCK)]
                if timeline is not None:
                    timeline.stop()
        dist.destroy_process_group()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"backward of {PARAMETERS} parameters, {BLOCKS} blocks of {ITERATIONS_PER_BLOCK} per mode: "
          f"median {off * 1e3:.2f} ms off, {on * 1e3:.2f} ms on, "
          f"{(on - off) / PARAMETERS * 1e9:.0f} ns per gradient")


if __name__ == "__main__":
    main()
