"""bucket_cap_mb="auto": the wrapper's side of self-tuning buckets.

Note [Auto-tuned bucket caps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which bucket cap is fastest depends on the model, the network and the
machine (paper section 5.2), so "auto" measures instead of guessing.

1. Timing. An iteration is timed on each rank from the start of a
   training step (a synchronising forward in training mode, as the step
   check counts them, Note [Ranks out of step] in reducer/agreement/step_check.h) to
   the start of the next forward with gradients enabled: the whole step
   without no_sync, and with no_sync the one step that communicates (its
   forward, backward and optimizer step), not the micro-batches that only
   accumulate. Forwards under torch.no_grad are not seen; an evaluation
   between steps lengthens one interval, which the medians below ignore.
2. Deciding. ddp_ext/_bucket_tuner.py holds the policy, pure: a warm-up on
   torch's default caps (1 MiB first bucket, then 25 MiB), then each
   candidate whose layout differs from the others' for a few iterations
   (the first after a switch untimed), in three rounds that alternate
   direction (a slow drift of the machine favours no candidate); the lowest
   median of a candidate's three figures wins, so one trial that a burst of
   load disturbed does not decide. Once settled, windows of iterations are
   timed; several windows in a row clearly slower than the settled figure
   start tuning again.
3. Agreeing. Decisions fall due after the same number of training steps on
   every rank; there the ranks allreduce (MAX) their figure (the slowest
   rank sets the pace) and their counts. Why this is its own allreduce,
   where it sits among the other collectives and why the rebuild vote rides
   on the step check instead: Note [Agreeing on the bucket layout] in
   reducer/layout/bucket_layout.h. The counts are compared as a backstop, and
   raise if they differ; they start from 0 when the tuner restarts (a new
   process group, a copy of the wrapper), which every rank does at the same
   point. A rank that joined under Join keeps counting and takes part from
   its shadow loop (ddp_ext/_join.py), so its buckets follow its peers'.
4. Re-laying. The reducer's bucket layout (reducer/layout/bucket_layout.h) re-cuts
   the buckets in their current, agreed order and makes later
   gradient-order rebuilds use the new caps; the wrapper's cap attributes
   read them back. It runs between iterations, where a rebuild is safe for
   the reasons Note [Gradient order prediction] gives, .grad views included. Results do not change:
   each gradient is averaged the same way in any bucket. With two ranks the
   sums are bitwise the same; with more, a gradient's place in its bucket
   can change the order a collective adds the ranks' values, so the last
   bit may differ, as with any cap or rebuild; the ranks stay equal.
5. What stops it. A Python communication hook may keep state per bucket
   (PowerSGD's error feedback), so registering one freezes the tuner on the
   caps in use, as it stops continuous rebuilds; the built-in C++ hooks keep
   no such state, and the adaptive-precision hook's error feedback follows
   parameters to any layout (comm_hooks/compression/residuals.h). rebuild_buckets="never" promises the construction layout,
   so it is refused with "auto", and so is bucket_cap_mb_list.
6. Where the caps live. The reducer's bucket layout (C++) owns the caps in
   use: the constructor hands it the requested ones once, and from then on
   the wrapper's cap attributes only read them back from it. The tuner
   (Python) owns none: it proposes, and the layout re-cuts. The policy stays
   in Python because what it measures is there: a step is timed from one
   training forward to the next, the optimizer step and the user's loop
   included, which the reducer never sees; its agreement is an allreduce
   issued from the forward, and it restarts where the wrapper changes its
   process group or is copied. So caps cross from Python to C++ once at
   construction and once per decision (a handful per run), never per
   iteration: the round trip costs nothing on the per-gradient path, and
   there is still one layout policy, in C++ (reducer/layout/bucket_assignment.h).
"""

import time
import warnings
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ddp_ext._arguments import MIB
from ddp_ext._bound import Bound
from ddp_ext._bucket_tuner import BucketTuner, TuningStage, TunerPolicy


def caps_bytes(caps_mb: Sequence[float]) -> List[int]:
    return [max(1, int(cap * MIB)) for cap in caps_mb]


class AutoBuckets(Bound):
    """Times one wrapper's iterations, agrees on decisions, and re-lays its
    buckets; see the Note. The wrapper binds it to its reducer, process
    group and device (ddp_ext/_cap_tuning.py)."""

    def __init__(self, policy: TunerPolicy = TunerPolicy(), clock: Callable[[], float] = time.perf_counter):
        self.device = torch.device("cpu")  # where the agreement's tensor lives
        self.tuner = BucketTuner(policy)
        self._clock = clock  # seconds; tests give a fake one
        self._candidates = [caps_bytes(c) for c in policy.candidates_mb]
        self._opened: Optional[float] = None  # start of the synchronising iteration timed
        self._due = False  # a decision waits for the next synchronising forward
        self._counted = 0  # intervals recorded since the last restart: equal on every rank

    @property
    def policy(self) -> TunerPolicy:
        return self.tuner.policy

    def caps_mb(self, candidate: Optional[int] = None) -> tuple:
        return self.policy.candidates_mb[self.tuner.current if candidate is None else candidate]

    def forward(self, synchronising: bool) -> None:
        """At the start of every forward with gradients enabled (and of every
        iteration a joined rank shadows), after Join's collectives;
        `synchronising`: it is a training step."""
        now = self._clock()
        if self._opened is not None:
            self._counted += 1
            self._due = self.tuner.record(now - self._opened) or self._due
        self._opened = now if synchronising else None
        if synchronising and self._due:
            self._due = False
            agreed = self._agree(self.tuner.figure())
            candidate = self.tuner.decide(agreed, self._distinct)
            if candidate is not None:
                # The wrapper's cap attributes read them back, and a copy of it is built with them.
                self.reducer._set_bucket_caps(self._candidates[candidate])
            # Deciding and re-laying are not the iteration's own time.
            self._opened = self._clock()

    def _agree(self, figure: float) -> float:
        group = self.process_group
        if group.size() == 1:
            return figure
        count = float(self._counted)
        values = torch.tensor([figure, count, -count], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        agreed, most, fewest = values.tolist()
        if most != -fewest:
            raise RuntimeError(
                f"DistributedDataParallel with bucket_cap_mb='auto' on rank {group.rank()}: the ranks "
                f"disagree on how many synchronising iterations they ran (between {int(-fewest)} and "
                f"{int(most)}; this rank {int(count)}), so they cannot agree on bucket caps. Every rank "
                "must run the same synchronising forwards (see torch.distributed.algorithms.join.Join "
                "for uneven inputs)."
            )
        return agreed

    def _distinct(self) -> List[int]:
        """Candidates whose caps lay the buckets out differently, each layout
        once (its first candidate)."""
        seen = set()
        distinct = []
        for index, caps in enumerate(self._candidates):
            layout = tuple(map(tuple, self.reducer._layout_for_caps(caps)))
            if layout not in seen:
                seen.add(layout)
                distinct.append(index)
        return distinct

    def freeze(self, why: str, stacklevel: int = 3) -> None:
        if self.tuner.stage is TuningStage.FROZEN:
            return
        self.tuner.freeze()
        warnings.warn(
            f"bucket_cap_mb='auto' stops tuning: {why}. The buckets keep their current caps "
            f"({', '.join(f'{c:g}' for c in self.caps_mb())} MiB).",
            stacklevel=stacklevel,
        )

    def restart(self) -> None:
        """Tunes again from a warm-up (a new process group; a copy)."""
        self.tuner.restart()
        self._opened = None
        self._due = False
        self._counted = 0
