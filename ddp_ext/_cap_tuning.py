"""The wrapper's bucket caps: those asked for, those in use, and, with
bucket_cap_mb="auto", the tuner that changes them (ddp_ext/_auto_buckets.py,
Note [Auto-tuned bucket caps])."""

import dataclasses
from typing import List, Optional

from ddp_ext._arguments import BucketCaps
from ddp_ext._auto_buckets import AutoBuckets
from ddp_ext._bound import Bound


class CapTuning(Bound):
    """Owns the tuner (None with fixed caps), bound to the wrapper's reducer,
    group and device; a tuner set later (a test's, or the one a
    fault-tolerant replica carries to its next wrapper) is bound too."""

    def __init__(self, reducer, group, device, requested: BucketCaps):
        self.device = device
        self.requested = requested  # the caps a copy of the wrapper starts from
        self._auto: Optional[AutoBuckets] = None
        self.bind(reducer, group)
        if requested.auto and reducer is not None:
            self.auto = AutoBuckets()

    def __getstate__(self) -> dict:
        """A copy keeps the caps in use (a tuned cap included)."""
        return {**super().__getstate__(), "requested": dataclasses.replace(self.requested, caps_bytes=self.caps_bytes)}

    @property
    def auto(self) -> Optional[AutoBuckets]:
        return self._auto

    @auto.setter
    def auto(self, tuner: Optional[AutoBuckets]) -> None:
        self._auto = tuner
        self.bind(self.reducer, self.process_group)

    def bind(self, reducer, process_group) -> None:
        super().bind(reducer, process_group)
        if self._auto is not None:
            self._auto.bind(reducer, process_group)
            self._auto.device = self.device

    @property
    def caps_bytes(self) -> List[int]:
        """Cap of the 1st, 2nd, ... bucket of each kind, the last repeating:
        those the reducer's bucket layout cuts with now (tuning changes them)."""
        return self.requested.caps_bytes if self.reducer is None else list(self.reducer.bucket_caps)

    def forward(self, synchronising: bool) -> None:
        """At the start of every forward with gradients enabled (and of every
        iteration a joined rank shadows)."""
        if self._auto is not None:
            self._auto.forward(synchronising)

    def freeze(self, why: str, stacklevel: int) -> None:
        if self._auto is not None:
            self._auto.freeze(why, stacklevel=stacklevel)

    def restart(self) -> None:
        if self._auto is not None:
            self._auto.restart()
