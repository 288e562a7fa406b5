"""The sharded optimizer's all-gathers behind the next forward:
`ddp.overlap_optimizer(opt, shard=True, overlap_forward=True)`.

Note [Gathering behind the next forward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
optimizer.step() steps the rank's shard of each bucket, launches the
buckets' all-gathers, each as soon as its shard is stepped (Note
[Pipelined steps and all-gathers] in ddp_ext/_sharded_optimizer.py), first
layers' first (by the lowest reducer index of
their parameters, which every rank agrees on, so every rank launches them
in the same order), and returns with them on the wire. A bucket whose
parameters live in its storage (Note [Parameters in the bucket's storage]
in ddp_ext/_shard_plan.py: every bucket once the layout is settled, where
re-pointing is sound) is all-gathered in place: it needs no buffer, and
every such bucket stays pending, the whole model's all-gathers behind the
next forward at no memory cost. The others take turns in GATHER_BUFFERS
(two, ddp_ext/_sharded_optimizer.py) reused buffers: launching one first
waits for the one launched two before it and writes its parameters, so a
rank holds two buckets' buffers, not the model once more, and those left
pending are the last layers', which the next forward reads last.
Every all-gather is launched inside the step, where every rank is, not at
the read that needs it: a read on one rank only (rank 0 saving a
checkpoint) would launch an all-gather that the other ranks launch at
another point, after a collective of their own (a barrier): a deadlock.
A step whose buckets were laid out anew (the first, and the one after
each rebuild) waits for all its all-gathers: its buffers are sized for
buckets that may go (the first iteration's one bucket is the whole
model), and holding them would carry them into the next iteration.
Every bucket's parameters have their version counters bumped as its
all-gather is launched, in place or not, as a plain step's in-place
writes would: a graph kept with retain_graph that saved one fails its
second backward after the step, as after a plain step, rather than
running on the old values of a parameter still pending.
A bucket's parameters are "pending" until its all-gather is waited for
(and, through a buffer, its parameters are written, all of them at once),
so no code that waits sees a bucket half-written: an in-place bucket's
parameters hold the rank's stepped range and others' old values while its
all-gather runs. Whatever reads a pending
parameter first waits for its bucket, by the torch function mode of Note
[Stepping in the next forward] in ddp_ext/_forward_tail.py, on the stack of
the thread that stepped only while a bucket is pending (Note [The mode only
while pending]): the next forward's layers, state_dict(), deepcopy,
torch.save, an EMA update, an evaluation forward, load_state_dict. Reads
and writes of .grad do not wait (the all-gather writes no gradient), so
optimizer.zero_grad() keeps the overlap. The end of each forward of the
wrapper (no_sync's and evaluation's too) writes what it did not read, and
takes the mode off; so do a second optimizer.step(), finish_forward_tail(),
and the optimizer's state_dict() and load_state_dict() (their pre-hooks).
A read outside the wrapper's forward (module.state_dict(), say) writes what
it reads from inside the mode's handler, where the mode cannot take itself
off the stack: once nothing is pending it passes calls through until one of
those takes it off. A forward on another
thread, or compiled, finishes everything first. While a bucket is pending
the tail keeps itself (and so the sharded optimizer) alive: a wrapper
dropped then still lets a read write its parameters.

Exactness: the all-gather copies the same bits whether it is waited for at
the step or at the read, in place or through a buffer, and nothing reads
the parameters in between without waiting. It is opt-in (overlap_forward=True) rather than always on
because what the mode cannot see would read the values before the step:
another thread that did not go through the wrapper's forward, and C++ code
reading the parameters directly; and because every torch call between the
step and the next forward pays a Python dispatch while the mode is on the
stack. Without it, optimizer.step() waits for every all-gather, through
the same two buffers.
"""

import weakref
from typing import Callable, Dict, List

import torch

from ddp_ext._forward_tail import ForwardTail, _PendingReads

# Gradient descriptors: reading or writing .grad of a pending parameter does not wait.
_GRADIENT_ATTRIBUTES = frozenset(("grad", "_grad"))


class GatherTail(ForwardTail):
    """The all-gathers one sharded optimizer left on the wire, and the mode
    that waits for them when their parameters are read. `write(key)` waits
    for bucket `key`'s all-gather and writes its parameters."""

    def __init__(self, write: Callable[[int], None]):  # noqa: super().__init__ takes a reducer; none here
        self.write = write
        self.pending: Dict[int, int] = {}  # id(parameter) -> its bucket's key
        self.buckets: Dict[int, List[torch.Tensor]] = {}  # key -> its parameters
        self.finishing = False
        self.finished_on_read = 0
        self.mode = _PendingReads(weakref.ref(self))
        self.thread = None
        self.started = True
        self._kept = None  # itself while a bucket is pending
        self.on_finished = lambda members: None  # nobody to tell: the write is the whole of it

    def hold(self, key: int, members: List[torch.Tensor]) -> None:
        """Bucket `key`'s all-gather is on the wire: its parameters are pending."""
        self.buckets[key] = members
        self.pending.update((id(p), key) for p in members)

    def begin(self) -> None:
        """After the step launched its all-gathers: the mode goes on this thread's stack."""
        if self.buckets:
            self._kept = self
            self._push()

    def _complete(self, key: int) -> None:
        self.write(key)

    def _let_go(self) -> None:
        self._kept = None

    def finish_all(self) -> None:
        """Writes every pending bucket, and takes the mode off (from outside its handler)."""
        super().finish_all()
        self._release()

    def forward_done(self, synchronising: bool) -> None:
        """The end of a forward: what it did not read is written, and the mode goes."""
        self.finish_all()
        self._release()

    def on_call(self, func, args, kwargs) -> None:
        if getattr(func, "__name__", None) in ("__get__", "__set__", "__delete__"):
            if getattr(getattr(func, "__self__", None), "__name__", None) in _GRADIENT_ATTRIBUTES:
                return
        super().on_call(func, args, kwargs)
