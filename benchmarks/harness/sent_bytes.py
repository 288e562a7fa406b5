"""Bytes a rank sent, counted by the kernel: the `wchar` of /proc/self/io.

Linux adds to a process's `wchar` every byte its threads hand to write(),
writev() and their kind, sockets included: Gloo's TCP transport sends with
writev from its own threads, so the count grows by what the rank put on its
connections (payload and Gloo's small headers; not TCP/IP's), whichever
interface carries them, the loopback or a host's link. It also counts writes
to files and to the terminal: count around work that writes nothing else.
"""

from typing import Callable

import torch.distributed as dist

IO_PATH = "/proc/self/io"


def written_bytes() -> int:
    """This process's `wchar` so far; OSError where /proc/self/io does not exist (not Linux)."""
    with open(IO_PATH) as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise OSError(f"{IO_PATH} has no wchar line")


def per_iteration(step: Callable[[], object], iterations: int, settle: Callable[[], object]) -> float:
    """Bytes this rank sent per iteration of `step`, over `iterations` of
    them after one unmeasured, every rank starting together. `settle()`
    waits for what an iteration leaves on the wire for the next
    (overlap_forward's allreduces and all-gathers); it runs before each
    count, so the count holds exactly the iterations' collectives."""
    step()
    settle()
    dist.barrier()
    start = written_bytes()
    for _ in range(iterations):
        step()
    settle()
    end = written_bytes()
    return (end - start) / iterations
