"""The communication timeline: a Chrome trace per rank of when the wrapper's
forward, the backward, each gradient, each bucket's communication and the end
of the backward happened.

The reducer records raw events (reducer/observation/timeline.h, Note [Communication
timeline]); this module turns them into Chrome's trace event format and
writes the file, only when asked to (stop(), the end of a `with` block, after
`iterations` backward passes, or at exit). Open the file in
https://ui.perfetto.dev or chrome://tracing.
"""

import json
import multiprocessing.util
import os
import time
from typing import List, Optional

ENV_VAR = "DDP_EXT_TIMELINE"
# Optional: how many synchronising backward passes a wrapper built under
# DDP_EXT_TIMELINE records (default: every one until exit).
ITERATIONS_ENV_VAR = "DDP_EXT_TIMELINE_ITERATIONS"

# reducer/observation/timeline.h, TimelineEvent::Kind.
BACKWARD_BEGIN, GRADIENT_READY, BUCKET_LAUNCH, BUCKET_DONE, COMM_HOOK = 0, 1, 2, 3, 4
WAIT_FOR_BUCKETS, FINALIZE, STEP_CHECK_LAUNCH, STEP_CHECK_WAIT, REBUILD = 5, 6, 7, 8, 9

# Thread ids of the trace's rows; bucket k communicates on row BUCKET_ROW + k.
FORWARD_ROW, BACKWARD_ROW, HOOKS_ROW, END_ROW, STEP_CHECK_ROW, BUCKET_ROW = 1, 2, 3, 4, 5, 100
ROW_NAMES = {
    FORWARD_ROW: "forward",
    BACKWARD_ROW: "backward",
    HOOKS_ROW: "autograd/hooks",
    END_ROW: "end of backward",
    STEP_CHECK_ROW: "step check",
}
# Waiting at stop() for the completion callbacks of buckets already awaited.
COMPLETION_WAIT_MS = 1000


def file_name(rank: int) -> str:
    return f"timeline-rank{rank}.json"


def from_environment():
    """(directory, iterations) that DDP_EXT_TIMELINE and
    DDP_EXT_TIMELINE_ITERATIONS ask for, or None when the first is unset."""
    directory = os.environ.get(ENV_VAR)
    if not directory:
        return None
    iterations = os.environ.get(ITERATIONS_ENV_VAR, "").strip()
    try:
        return directory, int(iterations) if iterations else None
    except ValueError:
        raise ValueError(f"{ITERATIONS_ENV_VAR} must be a whole number of iterations, got {iterations!r}") from None


class Timeline:
    """Records ddp_ext's communication timeline of one wrapper; made by
    DistributedDataParallel.record_timeline. Writes DIR/timeline-rank{r}.json
    when stopped: by stop(), at the end of a `with` block, after `iterations`
    synchronising backward passes (at the forward that follows the last), or
    at interpreter exit."""

    def __init__(self, rank: int, reducer, names: List[str], directory: str, iterations: Optional[int] = None):
        if iterations is not None and iterations < 1:
            raise ValueError(f"record_timeline: iterations must be at least 1, got {iterations}")
        self.rank = rank
        self.path = os.path.join(os.fspath(directory), file_name(self.rank))
        self.iterations = iterations
        self._reducer = reducer
        self._names = names  # of the reducer's parameters, by index
        self._events: List[tuple] = []
        self._forwards: List[tuple] = []
        self._forward_begin = None
        self._backwards = 0
        self._dropped = 0
        self.recording = True
        if self._reducer is not None:
            self._reducer._set_timeline(True)
        # Held until stop(): a recording outlives its wrapper until then. A
        # multiprocessing finalizer rather than atexit: it runs at the exit of
        # the main process and of multiprocessing's children (mp.spawn), which
        # skip atexit.
        self._at_exit = multiprocessing.util.Finalize(None, self._stop_at_exit, exitpriority=10)

    # --- called by the wrapper's forward ---------------------------------

    def forward_begin(self) -> None:
        self._drain(wait_ms=0)
        if self.iterations is not None and self._backwards >= self.iterations:
            self.stop()
            return
        self._forward_begin = time.monotonic_ns()

    def forward_end(self) -> None:
        if self.recording and self._forward_begin is not None:
            self._forwards.append((self._forward_begin, time.monotonic_ns()))
        self._forward_begin = None

    # --- the user's side ---------------------------------------------------

    def stop(self) -> str:
        """Stops recording and writes the file (once); returns its path."""
        if not self.recording:
            return self.path
        self.recording = False
        self._at_exit.cancel()
        if self._reducer is not None:
            self._reducer._set_timeline(False)
        self._drain(wait_ms=COMPLETION_WAIT_MS)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        partial = self.path + ".partial"
        with open(partial, "w") as f:
            json.dump(self.trace(), f)
        os.replace(partial, self.path)
        return self.path

    def __enter__(self) -> "Timeline":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _drain(self, wait_ms: int) -> None:
        if self._reducer is None:
            return
        events, dropped = self._reducer._take_timeline(wait_ms)
        self._dropped += dropped
        self._backwards += sum(1 for e in events if e[0] == FINALIZE)
        self._events.extend(events)

    # --- formatting --------------------------------------------------------

    def trace(self) -> dict:
        """The Chrome trace (JSON object format) of what was recorded so far."""
        pid = self.rank
        out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
                "args": {"name": f"ddp_ext rank {pid}"}}]
        rows = dict(ROW_NAMES)

        def us(ns: int) -> float:
            return ns / 1000.0

        def complete(name, tid, begin, end, args=None):
            out.append({"ph": "X", "name": name, "cat": "ddp_ext", "pid": pid, "tid": tid,
                        "ts": us(begin), "dur": us(max(end - begin, 0)), "args": args or {}})

        def instant(name, tid, ts, args=None):
            out.append({"ph": "i", "s": "t", "name": name, "cat": "ddp_ext", "pid": pid, "tid": tid,
                        "ts": us(ts), "args": args or {}})

        for begin, end in self._forwards:
            complete("forward", FORWARD_ROW, begin, end)
        iteration = 0
        backward_begin = None
        launches = {}  # bucket -> (begin, bytes) of a launch not yet completed
        step_check_launch = None
        for kind, index, begin, end, value in sorted(self._events, key=lambda e: (e[2], e[0] != BACKWARD_BEGIN)):
            if kind == BACKWARD_BEGIN:
                iteration += 1
                backward_begin = begin
            elif kind == GRADIENT_READY:
                name = self._names[index] if 0 <= index < len(self._names) else str(index)
                args = {"parameter": name, "index": index, "iteration": iteration}
                if value:
                    args["dropped"] = True
                instant("gradient ready", HOOKS_ROW, begin, args)
            elif kind == BUCKET_LAUNCH:
                complete(f"launch bucket {index}", HOOKS_ROW, begin, end,
                         {"bucket": index, "bytes": value, "iteration": iteration})
                launches[index] = (begin, value)
            elif kind == COMM_HOOK:
                complete(f"comm hook bucket {index}", HOOKS_ROW, begin, end,
                         {"bucket": index, "iteration": iteration})
            elif kind == BUCKET_DONE:
                launched = launches.pop(index, None)
                if launched is None:
                    continue  # launched before recording began
                rows.setdefault(BUCKET_ROW + index, f"communication (bucket {index})")
                args = {"bucket": index, "bytes": launched[1], "iteration": iteration}
                if value:
                    args["completion"] = "seen when awaited"
                complete(f"bucket {index}", BUCKET_ROW + index, launched[0], begin, args)
            elif kind == WAIT_FOR_BUCKETS:
                complete("wait for buckets", END_ROW, begin, end, {"iteration": iteration})
            elif kind == FINALIZE:
                complete("finalize backward", END_ROW, begin, end, {"iteration": iteration})
                if backward_begin is not None:
                    complete("backward", BACKWARD_ROW, backward_begin, end, {"iteration": iteration})
                backward_begin = None
            elif kind == STEP_CHECK_LAUNCH:
                step_check_launch = begin
            elif kind == STEP_CHECK_WAIT:
                complete("wait for step check", END_ROW, begin, end, {"iteration": iteration})
                if step_check_launch is not None:
                    complete("step check", STEP_CHECK_ROW, step_check_launch, end, {"iteration": iteration})
                step_check_launch = None
            elif kind == REBUILD:
                complete("rebuild buckets", END_ROW, begin, end, {"buckets": value, "iteration": iteration})
        for tid, name in sorted(rows.items()):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "ts": 0,
                        "args": {"sort_index": tid}})
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {"ddp_ext_rank": pid, "backward_passes": iteration, "dropped_events": self._dropped,
                          "clock": "CLOCK_MONOTONIC, microseconds"},
        }

    def _stop_at_exit(self) -> None:
        try:
            self.stop()
        except Exception as error:  # at exit: say so, do not mask the exit status
            print(f"ddp_ext: could not write the timeline {self.path}: {error}")


def record_timeline(current: Optional[Timeline], rank: int, reducer, names: List[str], directory: str,
                    iterations: Optional[int] = None) -> Timeline:
    """ddp_ext only (DistributedDataParallel.record_timeline). Records the
    communication timeline from now on: the forward, the backward, each
    gradient's ready time, each bucket's launch and completion, the wait at
    the end of the backward, communication hook time and bucket rebuilds.
    Writes a Chrome trace, DIRECTORY/timeline-rank{rank}.json, when the
    returned Timeline is stopped (stop(), the end of a `with` block), after
    `iterations` synchronising backward passes, or at exit. The environment
    variable DDP_EXT_TIMELINE=DIRECTORY does the same for every wrapper built
    (DDP_EXT_TIMELINE_ITERATIONS=N: for N iterations). `current`: the
    wrapper's recording timeline, if any."""
    if current is not None and current.recording:
        raise RuntimeError(
            f"record_timeline: this wrapper is already recording a timeline to {current.path}; stop() it first"
        )
    return Timeline(rank, reducer, names, directory, iterations)
