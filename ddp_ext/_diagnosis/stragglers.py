"""Stragglers: which rank is persistently slower than the others, and in
which phase (Note [Stragglers] in reducer/observation/step_timings.h). The reducer exchanges
every rank's mean phase lengths on the step check every `every` training
steps; this module reads them, keeps `straggler_report()`, and warns when one
rank exceeds the median of the other ranks by more than `margin` (relative) and
`min_excess_ms` (absolute, so that a tiny model's microseconds of noise are
not reported) in `persist` exchanges in a row, in the same phase. A rank is
compared with the median of the other ranks."""

import os
import statistics
import warnings
from typing import Dict, List, Optional

PHASES = ("data wait", "forward", "backward")
EVERY_VARIABLE = "DDP_EXT_STRAGGLER_EVERY"
DEFAULT_EVERY = 50


def default_every() -> int:
    value = os.environ.get(EVERY_VARIABLE, "")
    try:
        return int(value) if value != "" else DEFAULT_EVERY
    except ValueError:
        raise ValueError(f"{EVERY_VARIABLE} must be a whole number of training steps (0: off), got {value!r}") from None


class Stragglers:
    """One wrapper's straggler watch. Holds no reference to the wrapper."""

    def __init__(self, every: int, margin: float = 0.3, min_excess_ms: float = 5.0, persist: int = 3):
        self._start(every, margin, min_excess_ms, persist)

    def _start(self, every: int, margin: float, min_excess_ms: float, persist: int) -> None:
        if every < 0 or margin < 0 or min_excess_ms < 0 or persist < 1:
            raise ValueError("every >= 0, margin >= 0, min_excess_ms >= 0 and persist >= 1")
        self.every, self.margin, self.min_excess_ms, self.persist = every, margin, min_excess_ms, persist
        self.forwards = 0
        self.last_step = -1
        self.report: Optional[dict] = None
        self.streaks: Dict[tuple, int] = {}
        self.warned: set = set()

    def configure(self, reducer, every: int = DEFAULT_EVERY, margin: float = 0.3, min_excess_ms: float = 5.0,
                  persist: int = 3) -> None:
        """ddp_model.watch_stragglers(): exchange every `every` training steps
        (0: off) and warn about a rank `margin` and `min_excess_ms` above the
        median in `persist` exchanges in a row. Starts over."""
        self._start(every, margin, min_excess_ms, persist)
        reducer._set_straggler_every(self.every)

    def report_now(self, reducer) -> Optional[dict]:
        """ddp_model.straggler_report(): per-rank mean phase lengths (ms) of
        the last exchange, their medians, and the ranks persistently slower;
        None before the first exchange."""
        step, figures = reducer._straggler_figures()
        if figures and step != self.last_step:
            self.last_step = step
            self.observe(step, figures)
        return self.report

    def forward(self, reducer) -> None:
        """Called at each synchronising forward; reads the reducer only every
        `every` forwards."""
        if self.every <= 0:
            return
        self.forwards += 1
        if self.forwards % self.every != 1 and self.every > 1:
            return
        step, figures = reducer._straggler_figures()
        if figures and step != self.last_step:
            self.last_step = step
            self.observe(step, figures)

    def observe(self, step: int, figures: List[int]) -> Optional[str]:
        if not all(figures):
            return None  # a rank had no whole step to publish (0): nothing to compare this time
        ranks = len(figures) // len(PHASES)
        per_rank = [[(figures[r * len(PHASES) + p] - 1) / 1000.0 for p in range(len(PHASES))] for r in range(ranks)]
        medians = [statistics.median(row[p] for row in per_rank) for p in range(len(PHASES))]
        slow = []
        for r, row in enumerate(per_rank):
            for p, phase in enumerate(PHASES):
                # Against the others only: with two ranks the median of all
                # would sit halfway to the slow one.
                others = statistics.median(other[p] for o, other in enumerate(per_rank) if o != r)
                excess = row[p] - others
                key = (r, phase)
                if excess > self.min_excess_ms and excess > self.margin * others:
                    self.streaks[key] = self.streaks.get(key, 0) + 1
                    if self.streaks[key] >= self.persist:
                        slow.append((r, phase, row[p], others))
                else:
                    self.streaks[key] = 0
        self.report = {
            "step": step,
            "every": self.every,
            "phases": list(PHASES),
            "ranks": [dict(rank=r, **{f"{phase}_ms": v for phase, v in zip(PHASES, row)}) for r, row in enumerate(per_rank)],
            "median_ms": dict(zip(PHASES, medians)),
            "stragglers": [dict(rank=r, phase=phase, ms=v, others_median_ms=m) for r, phase, v, m in slow],
        }
        fresh = [s for s in slow if s[:2] not in self.warned]
        if not fresh:
            return None
        self.warned.update(s[:2] for s in fresh)
        message = "DistributedDataParallel: " + "; ".join(
            f"rank {r} is persistently slower than the others in its {phase}: {v:.1f} ms per step against "
            f"{m:.1f} ms on the other ranks (median)" for r, phase, v, m in fresh
        ) + (
            f" (means over each {self.every} training steps, {self.persist} exchanges in a row, up to training step "
            f"{step}; the other ranks wait for it in every collective). See ddp_model.straggler_report()."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        return message


def attach(reducer, group) -> Optional[Stragglers]:
    """A Stragglers for `reducer` over `group` (None in a world of one or
    without a reducer), with the reducer told how often to exchange."""
    if reducer is None or group.size() == 1:
        return None
    watch = Stragglers(default_every())
    reducer._set_straggler_every(watch.every)
    return watch
