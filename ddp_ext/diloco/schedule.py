"""Which fragment goes on the wire at which step, and when it is merged.

Planned from the step number only, so every rank computes the same plan with
no communication and no clock. Fragment p (0-based) of F is launched at the
steps t >= 1 with t = offset(p) (mod H), offset(p) = (p + 1) * H // F: the F
fragments are spread evenly over each window of H steps, and the last one
syncs at multiples of H (with F = 1, at H, 2H, ...). A fragment launched at
step t is merged at step t + tau.

Counting every fragment's launches in order, the n-th (1-based) is fragment
(n - 1) mod F at step ((n - 1) div F) H + offset((n - 1) mod F): a
fault-tolerant DiLoCo numbers its syncs so (survival.py).
"""

from typing import List

from ddp_ext.diloco.settings import Settings


class Schedule:
    def __init__(self, settings: Settings):
        self.sync_every = settings.sync_every
        self.delay = settings.delay
        # Distinct because H >= F.
        self.offsets = [(p + 1) * settings.sync_every // settings.fragments for p in range(settings.fragments)]

    def launches_at(self, step: int) -> List[int]:
        """The fragments launched at `step` (1-based inner step), in order."""
        phase = step % self.sync_every
        return [p for p, offset in enumerate(self.offsets) if offset % self.sync_every == phase and step >= offset]

    def next_launch(self, step: int) -> int:
        """The first step after `step` that launches a fragment."""
        return min(offset if step < offset else offset + self.sync_every * ((step - offset) // self.sync_every + 1)
                   for offset in self.offsets)

    def next_event(self, step: int, merge_steps: List[int]) -> int:
        """The first step after `step` that launches a fragment or merges one
        (`merge_steps`: those of the exchanges in flight, all after `step`)."""
        return min([self.next_launch(step), *merge_steps])

    def merge_step(self, launch_step: int) -> int:
        return launch_step + self.delay

    def fragment_of(self, number: int) -> int:
        """The fragment of the `number`-th launch (1-based, every fragment's counted)."""
        return (number - 1) % len(self.offsets)

    def launch_step(self, number: int) -> int:
        """The step of the `number`-th launch; 0 for number 0 (before any)."""
        if number <= 0:
            return 0
        window, fragment = divmod(number - 1, len(self.offsets))
        return window * self.sync_every + self.offsets[fragment]

    def launches_up_to(self, step: int) -> int:
        """How many launches happen at steps 1 .. `step`."""
        window, phase = divmod(step, self.sync_every)
        return window * len(self.offsets) + sum(1 for offset in self.offsets if offset <= phase)
