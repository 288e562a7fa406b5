"""Futures for process-group works that have none (Gloo's reduce-scatter:
Work::getFuture is not implemented there), for the sharded optimizer's
communication hook (ddp_ext/_sharded_optimizer.py)."""

import queue
import threading
from typing import Callable

import torch


class WorkWaiter:
    """One thread that waits for works in the order they were launched and
    completes each one's future with what `then()` returns once it is done.
    Started at the first work; a daemon, so it never holds the process."""

    def __init__(self):
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = None

    def future(self, work, then: Callable[[], torch.Tensor]) -> torch.futures.Future:
        future = torch.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddp_ext-shard-waiter", daemon=True)
            self._thread.start()
        self._queue.put((work, then, future))
        return future

    def _run(self) -> None:
        while True:
            work, then, future = self._queue.get()
            try:
                work.wait()
                result = then()
            except BaseException as error:  # noqa: BLE001 - handed to the future's waiter
                future.set_exception(error)
            else:
                future.set_result(result)
