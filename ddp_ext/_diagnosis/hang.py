"""Hang attribution's Python side: the handler the reducer calls when one of
its waits passes `hang_timeout_s`, fails, or when a backward ends with
buckets never launched (Note [Hang attribution] in reducer/stall_watch.h).

Each call publishes this rank's report through the store; a rank that
stopped also reads the others' (waiting up to a short window for them) and
returns the message to raise, or warns once and returns None to wait on.
"""

import itertools
import os
import socket
import time
import warnings
from typing import Dict, Optional

from ddp_ext._diagnosis.messages import hang_message, proven
from ddp_ext._diagnosis.settings import HangSettings, resolve_hang_settings
from ddp_ext._diagnosis.side_channel import SideChannel, StoreUnreachable, store_of

MAX_NAMES = 64  # parameter names a report carries; the rest are counted
_wrappers = itertools.count()  # wrappers built in this process: the same order on every rank


class HangDiagnosis:
    """The reducer's stall handler for one wrapper. Holds no reference to the
    wrapper or its reducer (the reducer holds this)."""

    def __init__(self, settings: HangSettings, channel: Optional[SideChannel], rank: int, world_size: int):
        self.settings = settings
        self.channel = channel
        self.rank = rank
        self.world_size = world_size
        self.warned = set()
        self.messages = []  # every message formatted, for tests and post-mortems

    def __call__(self, report: dict) -> Optional[str]:
        report = dict(report)
        unready = report["unready"]
        report["unready_count"] = len(unready)
        report["unready"], report["unready_buckets"] = unready[:MAX_NAMES], report["unready_buckets"][:MAX_NAMES]
        report.update(host=socket.gethostname(), pid=os.getpid(), time=time.time())
        store_error = self._publish(report)
        if report["kind"] in ("unfinished", "resolved"):
            return None
        window = self.settings.failed_window_s if report["kind"] == "failed" else self.settings.window_s
        reports: Dict[int, Optional[dict]] = {r: None for r in range(self.world_size) if r != self.rank}
        if store_error is None:
            try:
                reports.update(self.channel.gather(lambda other: self._relevant(report, other), window))
            except StoreUnreachable as e:
                store_error = str(e)
        alive = {r: self.channel.alive(r) for r, rep in reports.items() if rep is None} if store_error is None else {}
        message = hang_message(report, reports, self.settings.timeout_s, window, alive)
        if store_error is not None:
            message += (
                f"\nThe other ranks' reports could not be read: the store is unreachable ({store_error}); the rank "
                "that hosts it (rank 0 with the env:// or tcp:// init methods) may have died."
            )
        self.messages.append(message)
        mode = self.settings.on_hang
        if report["kind"] == "failed" or mode == "raise" or (mode == "auto" and proven(report, reports)):
            # This rank leaves the reducer's collectives: the others should know.
            self._publish(dict(report, kind="raised", was=report["kind"]))
            return message
        incident = (report["step"], report["waiting_for"], report["bucket"])
        if incident not in self.warned:
            self.warned.add(incident)
            warnings.warn(message + "\nStill waiting (on_hang=" + repr(mode) + ").", RuntimeWarning, stacklevel=1)
        return None

    def _publish(self, report: dict) -> Optional[str]:
        if self.channel is None:
            return "no store: the process group was not made by torch.distributed"
        try:
            self.channel.publish(report)
        except StoreUnreachable as e:
            return str(e)
        return None

    @staticmethod
    def _relevant(own: dict, other: dict) -> bool:
        # A report of this incident: not one resolved since, nor one of an
        # earlier step than the one before this rank's.
        return other["kind"] != "resolved" and other["step"] >= own["step"] - 1


def _group_name(process_group) -> str:
    try:
        return str(process_group.group_name)
    except Exception:
        return ""


def attach(ddp, hang_timeout_s: Optional[float] = None, on_hang: Optional[str] = None, settings=None):
    """Gives `ddp.reducer` a HangDiagnosis (or none, when off or alone);
    returns it. Call again after the process group changes."""
    settings = settings if settings is not None else resolve_hang_settings(hang_timeout_s, on_hang)
    reducer, group = ddp.reducer, ddp.process_group
    if reducer is None:
        return None
    sequence = next(_wrappers)
    # On CUDA, waits only order streams (NCCL's host-side wait with a timeout
    # has other effects): hang attribution covers CPU modules only.
    if not settings.on or group.size() == 1 or getattr(ddp, "device_type", "cpu") != "cpu":
        reducer._set_stall_handler(0, None)
        return None
    store = store_of(group)
    channel = None
    if store is not None:
        channel = SideChannel(
            store, group.rank(), group.size(), f"ddp_ext/diagnosis/{_group_name(group)}/{sequence}"
        )
        channel.introduce()
    diagnosis = HangDiagnosis(settings, channel, group.rank(), group.size())
    reducer._set_stall_handler(max(1, round(settings.timeout_s * 1000)), diagnosis)
    return diagnosis
