"""The paper's loss smoothing: an order-3 low-pass Butterworth filter applied
forwards and backwards with scipy.signal.filtfilt (no phase shift)."""

from typing import List

ORDER = 3
# Cutoff as a fraction of the Nyquist frequency (one sample per iteration).
# The paper does not give its cutoff; this is our choice, recorded with results.
CUTOFF = 0.05


def smooth(values: List[float], cutoff: float = CUTOFF) -> List[float]:
    """Low-passed `values`; too short a series (filtfilt needs more than
    3 * (ORDER + 1) points) comes back unchanged."""
    from scipy.signal import butter, filtfilt

    b, a = butter(ORDER, cutoff)
    if len(values) <= 3 * max(len(a), len(b)):
        return list(values)
    return [float(v) for v in filtfilt(b, a, values)]
