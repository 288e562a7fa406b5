"""Runs a communication hook on one bucket at a time, in bucket order.

torch's PowerSGD hook issues its later allreduces from the callbacks of its
first ones. With several buckets in flight, those callbacks (on Gloo's
threads) and the next bucket's hook (on the backward's thread) race to issue
collectives, so ranks can issue them in different orders, which Gloo rejects
as a size mismatch. Wrapped here, a bucket's hook starts only once the
previous bucket's result is ready: every rank then issues the same
collectives in the same order. The backward pass is not blocked; the
buckets' communication runs one after another.
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist


class InOrder:
    """State of `in_order_hook`: the wrapped hook and its own state."""

    def __init__(self, hook: Callable, state):
        self.hook = hook
        self.state = state
        self.previous: Optional[torch.futures.Future] = None


def in_order_hook(chain: InOrder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    result = torch.futures.Future()

    def start(_=None):
        try:
            chain.hook(chain.state, bucket).add_done_callback(lambda done: _forward(done, result))
        except Exception as error:  # noqa: BLE001 - handed to DDP through the future
            result.set_exception(error)

    previous, chain.previous = chain.previous, result
    if previous is None or previous.done():
        start()
    else:
        previous.add_done_callback(start)
    return result


def _forward(done: torch.futures.Future, result: torch.futures.Future) -> None:
    try:
        result.set_result(done.value())
    except Exception as error:  # noqa: BLE001
        result.set_exception(error)
