"""The next forward overlapped with the tail of the backward's communication:
`ddp.overlap_optimizer(opt, overlap_forward=True)`.

Note [Stepping in the next forward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The reducer holds back the buckets of the first layers and launches them,
first layer first, when the backward ends, then returns without waiting for
them (Note [The next forward's buckets first] in
reducer/finish/step_and_defer_tail.h). Their parameters are "pending": the user's
optimizer.step() leaves them out and owes them their step, which is taken
when something first reads one of them, normally the next forward's first
layers. A parameter ends up exactly as with a plain step because:
 - every read of a pending parameter or of its .grad waits for its bucket
   first: a torch function mode sees each call that takes the parameter,
   and each read or write of its .grad or .data. It is on the stack of the
   thread that runs the loop only from the end of a forward whose backward
   will leave buckets pending until none is (Note [The mode only while
   pending]).
   The forward's layers, state_dict(), an evaluation forward, torch.save,
   an EMA update, clipping, all wait. The end of each forward finishes the
   rest (parameters the forward did not read), before the next backward
   reuses the buckets.
 - once its bucket is reduced, its gradient is written back as at the end
   of a backward; if the user's step has run, the bucket's parameters are
   stepped with the hyperparameters the groups had at that step (an LR
   scheduler's step after it changes nothing); else the user's step steps
   them as any other parameter.
 - optimizer.zero_grad() after the step does not read pending gradients:
   it is applied to each pending parameter right after its step (None with
   set_to_none, else zeros), so the next backward accumulates into what a
   plain loop would leave. optimizer.state_dict() and load_state_dict()
   finish everything first.
What the mode cannot see is refused or documented: another thread reading
parameters while a bucket is pending, and C++ code reading them directly.

Note [The mode only while pending]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every torch call on a thread whose stack holds a torch function mode pays a
Python dispatch, pending or not; so the mode is on the stack only around
the buckets a backward leaves pending. The backward learns which it leaves,
but cannot push the mode: autograd's engine restores the thread's torch
function stack as it was when the backward began, so whatever the backward
pushes is gone when it returns. So the mode is pushed at the end of each
synchronising forward once the overlap has started (its backward defers
buckets), and taken off at the end of a forward that leaves nothing
pending (an evaluation forward, a forward inside no_sync), at the start of
a forward that finds nothing pending, or as soon as finish_forward_tail,
state_dict() or load_state_dict() finish the last bucket. In a training
loop it stays from one synchronising forward to the next; everything else
(evaluation, inference, the first iteration, what follows the last
finish_forward_tail) runs without it. It goes under the modes already on
the stack, not on top: a `with` block's exit pops whatever is on top, so a
mode the user entered before the forward and leaves after it would
otherwise pop ours. A mode left by a wrapper dropped while it was on
the stack passes calls through, and goes when another wrapper pushes its
own. It comes off wherever it is in the stack, but not from
inside its own handler (torch takes a mode off the stack while its handler
runs and puts it back after), nor from another thread.
"""

import threading
import weakref
from typing import Callable, Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode

# What holding the first layers' buckets aims at: the forward is about a
# third of a step's computation (the backward about two thirds), so when
# communication takes about as long as computation, about a third of the
# gradient bytes can be reduced behind the next forward.
FORWARD_SHARE = 1 / 3

# Reads through these descriptors need the reduced, stepped values; other
# attribute reads (shape, dtype, requires_grad, ...) do not wait.
_WAITING_ATTRIBUTES = frozenset(("grad", "_grad", "data"))


def fraction(overlap_forward) -> float:
    """The fraction of gradient bytes held for the next forward: `True` is FORWARD_SHARE."""
    if overlap_forward is True:
        return FORWARD_SHARE
    if overlap_forward is False or overlap_forward is None:
        return 0.0
    if isinstance(overlap_forward, float) and 0 < overlap_forward < 1:
        return overlap_forward
    raise ValueError(f"overlap_forward must be a bool or a fraction of the gradient bytes in (0, 1), "
                     f"not {overlap_forward!r}")


def refusal(parameters, gradient_as_bucket_view: bool, layer_drop: bool, hooks: bool) -> Optional[str]:
    """Why the forward cannot be overlapped with a wrapper of these
    parameters, settings and communication hooks (any registered), or None."""
    devices = {p.device.type for p in parameters}
    if devices != {"cpu"}:
        return (f"overlaps the next forward for a module on the CPU only (this one is on {sorted(devices)}): "
                "use overlap_forward=False")
    if gradient_as_bucket_view:
        return ("cannot overlap the next forward with gradient_as_bucket_view=True: each .grad is its bucket, "
                "still being reduced when the backward returns")
    if layer_drop:
        return "cannot overlap the next forward with layer dropping"
    if hooks:
        return ("cannot overlap the next forward with a communication hook: a hook may rely on the buckets "
                "arriving in order (PowerSGD ends its iteration at the last one)")
    return None


class ForwardTail:
    """The buckets one wrapper's backward left on the wire, and the mode that
    finishes them when their parameters are read. Knows nothing of the
    optimizer: `on_finished(parameters)` is told of each bucket finished (its
    gradients written back). Holds the reducer weakly, but while buckets are
    pending (the reducer holds the overlap's bucket step)."""

    def __init__(self, reducer, params: List[torch.Tensor], fraction: float,
                 on_finished: Callable[[List[torch.Tensor]], None]):
        self._reducer = weakref.ref(reducer)
        self.params = params  # the reducer's, in its order
        self.fraction = fraction
        self.on_finished = on_finished
        self.pending: Dict[int, int] = {}  # id(parameter) -> its deferred bucket
        self.buckets: Dict[int, List[torch.Tensor]] = {}  # deferred bucket -> its parameters
        self.looked = False  # asked the reducer for deferred buckets since the last forward
        self.finishing = False
        self.finished_on_read = 0  # buckets finished by a read (the rest by finish_all)
        # Held only while buckets are pending: a wrapper dropped then still
        # lets what reads their parameters finish them.
        self.reducer = None
        self.mode = _PendingReads(weakref.ref(self))
        self.thread: Optional[int] = None  # the thread whose stack holds the mode, while it does
        self.started = False  # the reducer defers buckets

    def start(self) -> None:
        """From the next backward on, the first layers' buckets are deferred."""
        self._reducer()._set_forward_tail(self.fraction)
        self.started = True

    def after_backward_bucket(self) -> bool:
        """Called with each bucket the backward steps: the first time after a
        forward, learns which buckets the backward deferred, and says so."""
        if self.looked:
            return False
        self.looked = True
        self.reducer = self._reducer()
        for bucket, indices in self.reducer._deferred_buckets():
            members = [self.params[i] for i in indices]
            self.buckets[bucket] = members
            self.pending.update((id(p), bucket) for p in members)
        if not self.buckets:
            self.reducer = None
        return True

    def finish(self, bucket: int) -> None:
        members = self.buckets.pop(bucket, None)
        if members is None:
            return
        self.finishing = True
        try:
            for p in members:
                self.pending.pop(id(p), None)
            self._complete(bucket)
            if not self.buckets:
                self._let_go()
                self._release()
            self.on_finished(members)
        finally:
            self.finishing = False

    def _complete(self, bucket: int) -> None:
        """Waits for `bucket` and writes what it brings: its gradients, back to .grad."""
        self.reducer._finish_deferred(bucket)

    def _let_go(self) -> None:
        """Nothing is pending any more: the reducer, held while buckets were, is let go."""
        self.reducer = None

    def finish_all(self) -> None:
        for bucket in list(self.buckets):
            self.finish(bucket)

    def forward_begins(self, module) -> None:
        """A forward whose reads the mode would not see (compiled, on another
        thread, or with the mode gone from this thread's stack) finishes
        everything before it reads anything."""
        if self.pending and (_compiled(module) or threading.get_ident() != self.thread
                             or not self._mode_on_stack()):
            self.finish_all()
        if self.thread is not None and not self.pending:
            self._release()

    def _mode_on_stack(self) -> bool:
        stack = torch._C._len_torch_function_stack()
        return any(torch._C._get_function_stack_at(i) is self.mode for i in range(stack))

    def _push(self) -> None:
        """Puts the mode on this thread's stack, under the modes there: Note [The mode only while pending]."""
        if self.thread == threading.get_ident() and self._mode_on_stack():
            return
        above = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
        torch._C._push_on_torch_function_stack(self.mode)
        for mode in reversed(above):
            if not (isinstance(mode, _PendingReads) and mode.tail_ref() is None):  # a dropped wrapper's
                torch._C._push_on_torch_function_stack(mode)
        self.thread = threading.get_ident()

    def _release(self) -> None:
        """Takes the mode off its thread's stack, where it can: the same Note."""
        if self.thread != threading.get_ident() or self.pending or not self._mode_on_stack():
            return
        above = []
        while True:
            mode = torch._C._pop_torch_function_stack()
            if mode is self.mode:
                break
            above.append(mode)
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)
        self.thread = None

    def forward_done(self, synchronising: bool) -> None:
        """The end of a forward: what it did not read is finished now. Before
        a synchronising backward that defers buckets, the mode is pushed."""
        self.finish_all()
        self.looked = False
        if synchronising and self.started:
            self._push()
        else:
            self._release()

    def on_call(self, func, args, kwargs) -> None:
        if getattr(func, "__name__", None) in ("__get__", "__set__", "__delete__"):
            descriptor = getattr(func, "__self__", None)
            if func.__name__ == "__get__" and getattr(descriptor, "__name__", None) not in _WAITING_ATTRIBUTES:
                return
            args = args[:1]
        for value in (*args, *(kwargs.values() if kwargs else ())):
            for item in value if type(value) in (list, tuple) else (value,):
                bucket = self.pending.get(id(item))
                if bucket is not None:
                    self.finished_on_read += 1
                    self.finish(bucket)


class _PendingReads(TorchFunctionMode):
    """Passes every call through, after finishing the deferred buckets of
    the pending parameters it takes. See Note [Stepping in the next forward]."""

    def __init__(self, tail_ref):
        super().__init__()
        self.tail_ref = tail_ref

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tail = self.tail_ref()
        if tail is not None and tail.pending and not tail.finishing:
            tail.on_call(func, args, kwargs)
        return func(*args, **(kwargs or {}))


def _compiled(module) -> bool:
    """Whether this forward runs compiled: torch.compile of the wrapper (its
    OptimizedModule's forward is under way) or of the wrapped module."""
    from torch._dynamo import eval_frame

    return eval_frame._is_in_optimized_module() or isinstance(module, eval_frame.OptimizedModule)
