"""DiLoCo's settings, checked once: what every rank must agree on."""

import dataclasses
from typing import List, Optional

BITS = (4, 8, 32)


@dataclasses.dataclass(frozen=True)
class Settings:
    sync_every: int  # H: inner steps between two syncs of the same fragment
    fragments: int  # F: parts of the model, synced at staggered steps
    delay: int  # tau: inner steps an exchange runs beside before it is merged
    bits: int  # 4 or 8 (with error feedback) or 32 (float32)
    mix: float  # weight of the new global parameters when merging (1: replace)
    int8_chunk: int  # elements per scale in 8 and 4 bits

    def problems(self) -> List[str]:
        """What is wrong with these settings (empty if nothing), one sentence each."""
        found = []
        for name, minimum in (("sync_every", 1), ("fragments", 1), ("delay", 0), ("int8_chunk", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                found.append(f"{name} must be an integer >= {minimum}, got {value!r}")
        if found:
            return found  # the relations below need integers
        if self.sync_every < self.fragments:
            found.append(
                f"sync_every={self.sync_every} < fragments={self.fragments}: each fragment syncs once every "
                f"sync_every steps, at its own step, so sync_every must be at least the number of fragments"
            )
        elif self.delay * self.fragments >= self.sync_every:
            found.append(
                f"delay={self.delay} >= sync_every/fragments={self.sync_every}/{self.fragments}: an exchange must "
                f"be merged before the next fragment's starts; use delay < {self.sync_every / self.fragments:g}"
            )
        if self.bits not in BITS:
            found.append(f"bits must be one of {BITS}, got {self.bits!r}")
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0 < self.mix <= 1:
            found.append(f"mix must be a number in (0, 1], got {self.mix!r}")
        return found


def default_mix(delay: int, mix: Optional[float]) -> float:
    """The weight of the new global parameters when a fragment is merged:
    `mix` if given; else 1 (replace) without delay, and 0.5 with one, the
    Streaming DiLoCo paper's choice (Note [DiLoCo merge])."""
    if mix is not None:
        return mix
    return 1.0 if delay == 0 else 0.5
