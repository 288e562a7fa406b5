"""The decisions of bucket_cap_mb="auto": which caps to try, for how long,
which to keep, and when to try again. Pure: no torch, no communication. The
wrapper's side (timing iterations, agreeing across ranks, re-laying the
buckets) is ddp_ext/_auto_buckets.py; see Note [Auto-tuned bucket caps]
there."""

import dataclasses
import enum
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# Caps in MiB of the 1st, 2nd, ... bucket of each kind, the last repeating.
# The first is torch's default (a 1 MiB first bucket, then 25 MiB), where
# tuning starts.
DEFAULT_CANDIDATES_MB: Tuple[Tuple[float, ...], ...] = ((1, 25), (1,), (2.5,), (5,), (10,), (25,), (50,))


@dataclasses.dataclass(frozen=True)
class TunerPolicy:
    candidates_mb: Tuple[Tuple[float, ...], ...] = DEFAULT_CANDIDATES_MB
    warmup: int = 3  # synchronising iterations timed before the first trial
    discard: int = 1  # iterations left untimed after each switch of caps
    trial: int = 5  # iterations timed per candidate and round
    rounds: int = 3  # passes over the candidates, alternately in reverse order
    window: int = 20  # iterations per drift check once settled
    drift: float = 0.15  # a window this much slower than the settled figure drifts
    sustain: int = 3  # consecutive drifting windows that start tuning again

    def __post_init__(self):
        if not self.candidates_mb or any(not c or min(c) <= 0 for c in self.candidates_mb):
            raise ValueError(f"candidates_mb must be non-empty tuples of positive caps, got {self.candidates_mb!r}")
        for name in ("warmup", "trial", "rounds", "window", "sustain"):
            if getattr(self, name) < 1:
                raise ValueError(f"TunerPolicy.{name} must be at least 1, got {getattr(self, name)}")
        if self.discard < 0 or self.drift <= 0:
            raise ValueError(f"TunerPolicy needs discard >= 0 and drift > 0, got {self.discard}, {self.drift}")


class TuningStage(enum.Enum):
    WARMUP = "warmup"  # timing the starting caps, nothing decided yet
    TUNING = "tuning"  # trying the candidates in turn
    SETTLED = "settled"  # on the best candidate, watching for drift
    FROZEN = "frozen"  # tuning stopped for good (see freeze)


TunerPhase = TuningStage  # its former name, kept for callers that import it


@dataclasses.dataclass(frozen=True)
class TunerEvent:
    iteration: int  # synchronising iterations recorded when it happened
    kind: str  # "trial", "settled", "drift", "frozen"
    candidate: int  # index into the policy's candidates in use from then on
    figure: Optional[float] = None  # "settled": its score; "drift": the window's figure (s)


class BucketTuner:
    """Feed it each synchronising iteration's time with record(); when that
    returns True, agree on figure() across ranks and pass the agreed value
    to decide(), which says which candidate to switch to, if any. Every rank
    that records the same number of iterations and decides on the same
    agreed figures makes the same decisions."""

    def __init__(self, policy: TunerPolicy = TunerPolicy(), current: int = 0):
        self.policy = policy
        self.stage = TuningStage.WARMUP
        self.current = current  # index of the candidate in use
        self.iteration = 0
        self.history: List[TunerEvent] = []
        self.settled_figure: Optional[float] = None
        self._samples: List[float] = []
        self._skip = 0  # intervals still to leave untimed
        self._queue: List[int] = []  # candidates still to try in this tuning
        self._scores: Dict[int, List[float]] = {}
        self._strikes = 0

    @property
    def phase(self) -> TuningStage:
        """The former name of `stage`, kept for callers that read it."""
        return self.stage

    @phase.setter
    def phase(self, stage: TuningStage) -> None:
        self.stage = stage

    def record(self, seconds: float) -> bool:
        """One synchronising iteration took `seconds`. True: a decision is due."""
        self.iteration += 1
        if self.stage is TuningStage.FROZEN:
            return False
        if self._skip:
            self._skip -= 1
            return False
        self._samples.append(seconds)
        return len(self._samples) >= self._batch()

    def _batch(self) -> int:
        p = self.policy
        return {TuningStage.WARMUP: p.warmup, TuningStage.TUNING: p.trial, TuningStage.SETTLED: p.window}[self.stage]

    def figure(self) -> float:
        """This rank's figure for the batch just timed: its median (s)."""
        return statistics.median(self._samples)

    def decide(self, agreed: float, distinct: Callable[[], Sequence[int]]) -> Optional[int]:
        """`agreed`: the figure every rank agreed on. `distinct()`: the
        candidates worth trying (those whose bucket layouts differ), asked
        for only when a tuning starts. Returns the candidate to switch to,
        or None to keep the current one."""
        self._samples = []
        before = self.current
        if self.stage is TuningStage.WARMUP:
            self._start_tuning(agreed, distinct())
        elif self.stage is TuningStage.TUNING:
            self._scores.setdefault(self.current, []).append(agreed)
            self._next_trial()
        elif self.stage is TuningStage.SETTLED:
            drifting = agreed > self.settled_figure * (1 + self.policy.drift)
            self._strikes = self._strikes + 1 if drifting else 0
            if self._strikes >= self.policy.sustain:
                self._event("drift", agreed)
                self._start_tuning(agreed, distinct())
        if self.current == before:
            return None
        self._skip = self.policy.discard
        return self.current

    def _start_tuning(self, figure: float, distinct: Sequence[int]) -> None:
        candidates = list(dict.fromkeys(distinct))
        if not candidates:
            raise ValueError("distinct() named no candidate to try")
        if len(candidates) == 1:
            # Every candidate lays the buckets out the same: nothing to try.
            self._settle(candidates[0], figure)
            return
        # The candidate in use first (no switch); rounds alternate direction,
        # so a slow drift of the machine favours no candidate.
        if self.current in candidates:
            candidates.remove(self.current)
            candidates.insert(0, self.current)
        self._queue = []
        for r in range(self.policy.rounds):
            self._queue += candidates if r % 2 == 0 else candidates[::-1]
        self._scores = {}
        self.stage = TuningStage.TUNING
        self._next_trial()

    def _next_trial(self) -> None:
        if self._queue:
            self.current = self._queue.pop(0)
            self._event("trial")
            return
        # Lowest median of the rounds' figures; ties go to the earlier candidate.
        scores = {c: statistics.median(f) for c, f in self._scores.items()}
        best = min(scores, key=lambda c: (scores[c], c))
        self._settle(best, scores[best])

    def _settle(self, candidate: int, figure: float) -> None:
        self.current = candidate
        self.settled_figure = figure
        self._strikes = 0
        self.stage = TuningStage.SETTLED
        self._event("settled", figure)

    def freeze(self) -> None:
        """Stops tuning for good; the current candidate stays."""
        self.stage = TuningStage.FROZEN
        self._samples = []
        self._event("frozen")

    def restart(self) -> None:
        """Forgets what was timed and starts over from the warm-up, keeping
        the current candidate (a new process group, a copy of the wrapper)."""
        if self.stage is not TuningStage.FROZEN:
            self.stage = TuningStage.WARMUP
        self._samples = []
        self._skip = 0
        self._queue = []
        self._scores = {}
        self._strikes = 0

    def _event(self, kind: str, figure: Optional[float] = None) -> None:
        self.history.append(TunerEvent(self.iteration, kind, self.current, figure))
