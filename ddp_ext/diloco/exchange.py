"""One fragment's pseudo-gradient on the wire: launched asynchronously over
the outer group at the fragment's step, waited for at its merge step.

# Note [DiLoCo groups agree bitwise]

Every rank must end a merge with the same bits, or the ranks of one host
would drift apart under DDP, which keeps them equal only by applying equal
updates. Each host has one rank in every outer group, and DDP keeps a host's
ranks equal, so all outer groups hold the same values, host by host. Each
then all-gathers them and adds them in its own rank order; the outer groups
list the hosts in the same order (checked at construction, groups.py), so
they all add the same numbers in the same order. An all-reduce would leave
the order to the backend, which may choose it per group (NCCL's rings follow
the hardware); with two hosts the all-gather moves as many bytes.
"""

import threading
from typing import List, Optional

import torch
import torch.distributed as dist

from ddp_ext.diloco.host_split import HostSplit, cut_payload
from ddp_ext.diloco.int8 import ErrorFeedback


class Exchange:
    """The mean of a flat float32 tensor over `group`'s ranks, in flight:
    float32 values (`codec` None) or 8- or 4-bit payloads, all-gathered,
    decoded and added in rank order (Note [DiLoCo groups agree bitwise]).
    With `split`, this rank exchanges only its part of the tensor, and a
    thread of the exchange's own then all-gathers the parts' means inside
    the host (Note [DiLoCo splits the exchange within a host])."""

    def __init__(self, values: torch.Tensor, group: dist.ProcessGroup, codec: Optional[ErrorFeedback],
                 split: Optional[HostSplit] = None):
        self._codec = codec
        self._split = split
        self._numel = values.numel()
        self._device = values.device
        payload = values if codec is None else codec.encode(values)
        self._bounds = None
        self._sent_numel = self._numel  # elements this rank exchanges
        if split is not None:
            self._bounds = split.bounds(self._numel, 1 if codec is None else codec.split_alignment)
            start, stop = self._bounds[split.part]
            payload = cut_payload(payload, codec, start, stop)
            self._sent_numel = stop - start
        self.bytes_sent = payload.numel() * payload.element_size()
        self._gathered: Optional[List[torch.Tensor]] = None
        self._work = None
        if payload.numel() > 0:  # an empty part is empty on every host: nothing to exchange
            self._gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
            self._work = dist.all_gather(self._gathered, payload, group=group, async_op=True)
        self._result: Optional[torch.Tensor] = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._previous: Optional[threading.Thread] = None
        if split is not None:  # the host's gather runs as soon as the part's mean is in
            self._thread = threading.Thread(target=self._finish, name="ddp_ext-diloco-parts", daemon=True)
            self._previous, split.last_thread = split.last_thread, self._thread
            self._thread.start()

    def _finish(self) -> None:
        if self._previous is not None:  # the host's gathers run in launch order on every rank
            self._previous.join()
            self._previous = None
        try:
            mine = torch.zeros(0, device=self._device)
            if self._work is not None:
                self._work.wait()
                mine = mean_of(self._gathered, self._codec, self._sent_numel)
            self._result = mine if self._split is None else self._split.gather(mine, self._numel, self._bounds)
        except BaseException as error:  # raised by wait, on the caller's thread
            self._error = error
        self._gathered = self._work = None

    def wait(self) -> torch.Tensor:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elif self._result is None and self._error is None:
            self._finish()
        if self._error is not None:
            raise self._error
        return self._result


def mean_of(gathered: List[torch.Tensor], codec: Optional[ErrorFeedback],
            numel: Optional[int] = None) -> torch.Tensor:
    """The mean of what `gathered` (one payload per rank, in rank order, of
    `numel` elements: default the codec's) stands for, added in that order."""
    if codec is not None:
        return codec.decode_mean(gathered) if numel is None else codec.decode_mean_of_part(gathered, numel)
    total = gathered[0].clone()
    for values in gathered[1:]:
        total.add_(values)
    return total.div_(len(gathered))


class Arrived:
    """An exchange whose mean is already known (restored from a checkpoint)."""

    bytes_sent = 0

    def __init__(self, result: torch.Tensor):
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result
