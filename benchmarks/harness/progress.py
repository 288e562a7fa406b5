"""One-line progress messages on stderr, stamped with the time since the run began."""

import sys
import time


class Progress:
    """Prints `[experiment mm:ss] message`. Ranks get a copy with the parent's
    start time, and only rank 0's copy is enabled, so lines appear once."""

    def __init__(self, experiment: str, started: float = None, enabled: bool = True):
        self.experiment = experiment
        self.started = time.time() if started is None else started
        self.enabled = enabled

    def for_rank(self, rank: int) -> "Progress":
        return Progress(self.experiment, self.started, self.enabled and rank == 0)

    def say(self, message: str) -> None:
        if not self.enabled:
            return
        minutes, seconds = divmod(int(time.time() - self.started), 60)
        print(f"[{self.experiment} {minutes:02d}:{seconds:02d}] {message}", file=sys.stderr, flush=True)
