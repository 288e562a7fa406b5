"""The lower bound on one synchronous data-parallel iteration:
max(computation, bytes on the link / link rate).

An iteration cannot be shorter than its computation alone, nor than the time
its gradients take to cross the link. A ring allreduce over n ranks sends
2 (n - 1) / n times the gradient bytes from every rank; with the ring ordered
host by host, each host's link carries one rank's share. On the loopback
nothing is shaped, so the bound is the computation alone.
"""

from typing import Optional

BITS_PER_BYTE = 8


def ring_allreduce_bytes(gradient_bytes: int, ranks: int) -> float:
    """Bytes one rank sends in a ring allreduce of `gradient_bytes` over `ranks` ranks."""
    return 2 * (ranks - 1) / ranks * gradient_bytes


def link_ms(gradient_bytes: int, ranks: int, link_gbit: Optional[float]) -> float:
    """Milliseconds the ring allreduce's bytes take on a link of `link_gbit`
    Gbit/s (10^9 bits per second, as tc counts); 0 on the loopback (None)."""
    if link_gbit is None:
        return 0.0
    return ring_allreduce_bytes(gradient_bytes, ranks) * BITS_PER_BYTE / (link_gbit * 1e9) * 1e3


def bound_ms(computation_ms: float, gradient_bytes: int, ranks: int, link_gbit: Optional[float]) -> float:
    """max(computation, bytes / bandwidth), in milliseconds."""
    return max(computation_ms, link_ms(gradient_bytes, ranks, link_gbit))
