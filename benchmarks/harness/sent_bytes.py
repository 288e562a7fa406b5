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


def per_iteration(step: Callable[[], object], iterations: int) -> float:
    """Bytes this rank sent per iteration of `step`, over `iterations` of
    them after one unmeasured, every rank starting together: from the start
    of the second to the start of the one after the last, so that what an
    iteration leaves on the wire for the next (overlap_forward's all-gathers)
    is counted once per iteration."""
    step()
    dist.barrier()
    start = written_bytes()
    for _ in range(iterations):
        step()
    end = written_bytes()
    step()  # the last counted iteration's tail goes out before the next variant
    return (end - start) / iterations
