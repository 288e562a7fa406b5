"""The settings of hang attribution: `hang_timeout_s` and `on_hang`, keyword
arguments of ddp_ext's DistributedDataParallel, each overridden by an
environment variable when it is set (so a job can change them without
editing its code)."""

import dataclasses
import math
import os
from typing import Optional

DEFAULT_HANG_TIMEOUT_S = 60.0
ON_HANG_MODES = ("auto", "raise", "warn")
TIMEOUT_VARIABLE = "DDP_EXT_HANG_TIMEOUT_S"
ON_HANG_VARIABLE = "DDP_EXT_ON_HANG"


@dataclasses.dataclass(frozen=True)
class HangSettings:
    # Seconds a collective of the reducer may wait before the ranks are asked
    # what they are doing; 0 turns hang attribution off.
    timeout_s: float
    # "auto": raise when the reports prove that the wait can never end (a
    # rank left parameters without a gradient, or died), else warn once and
    # wait on; "raise": always raise; "warn": always warn and wait on.
    on_hang: str

    @property
    def on(self) -> bool:
        return self.timeout_s > 0

    @property
    def window_s(self) -> float:
        """How long a rank that stopped waits for the others' reports."""
        return min(max(1.0, self.timeout_s / 2), 5.0)

    @property
    def failed_window_s(self) -> float:
        """The same after a failed wait: the other survivors' waits fail
        within milliseconds of this one, and a dead rank never reports."""
        return 0.5


def _timeout(value, source: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of seconds (0 turns hang attribution off), got {value!r}") from None
    if math.isnan(seconds) or seconds < 0 or math.isinf(seconds):
        raise ValueError(f"{source} must be a finite number of seconds >= 0 (0 turns it off), got {value!r}")
    return seconds


def resolve_hang_settings(hang_timeout_s: Optional[float], on_hang: Optional[str]) -> HangSettings:
    """The keyword arguments, overridden by DDP_EXT_HANG_TIMEOUT_S and
    DDP_EXT_ON_HANG where those are set; unset both: 60 s, "auto"."""
    if isinstance(hang_timeout_s, bool):
        raise TypeError(f"hang_timeout_s must be a number of seconds, got bool {hang_timeout_s!r}")
    timeout = DEFAULT_HANG_TIMEOUT_S if hang_timeout_s is None else _timeout(hang_timeout_s, "hang_timeout_s")
    if os.environ.get(TIMEOUT_VARIABLE, "") != "":
        timeout = _timeout(os.environ[TIMEOUT_VARIABLE], TIMEOUT_VARIABLE)
    mode = "auto" if on_hang is None else on_hang
    source = "on_hang"
    if os.environ.get(ON_HANG_VARIABLE, "") != "":
        mode, source = os.environ[ON_HANG_VARIABLE], ON_HANG_VARIABLE
    if mode not in ON_HANG_MODES:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, ON_HANG_MODES))}, got {mode!r}")
    return HangSettings(timeout_s=timeout, on_hang=mode)
